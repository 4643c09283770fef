// int8 -> float32 widening on one core, the bound of an int8 decode step on AVX2: 4 rows of
// 2,048 int8 weights (in L1) against one row of x, two chains a row, as dense.cc's Int8Pairs.
//   g++ -O2 -march=native -o /tmp/probe scripts/probes/int8_widen.cc && /tmp/probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
// Mode 0: vpmovsxbd + vcvtdq2ps (common.h's int8_lanes); mode 1: vpmovsxbd, the integers added
// to the bits of 1.5 * 2^23 and that number subtracted as a float (exact for |q| < 2^22).
template <int mode>
inline __m256 widen(const int8_t* p) {
  __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
  if (mode == 0) return _mm256_cvtepi32_ps(i);
  __m256i m = _mm256_add_epi32(i, _mm256_set1_epi32(0x4B400000));
  return _mm256_sub_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(12582912.0f));
}
template <int mode>
__attribute__((noinline)) float run(const int8_t* q, const float* x, long reps, long I) {
  __m256 a[4][2] = {};
  for (long r = 0; r < reps; ++r)
    for (long i = 0; i < I; i += 16) {
      __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
      for (int k = 0; k < 4; ++k) {
        a[k][0] = _mm256_fmadd_ps(widen<mode>(q + k * I + i), x0, a[k][0]);
        a[k][1] = _mm256_fmadd_ps(widen<mode>(q + k * I + i + 8), x1, a[k][1]);
      }
    }
  float o[8], s = 0;
  for (int k = 0; k < 4; ++k) { _mm256_storeu_ps(o, _mm256_add_ps(a[k][0], a[k][1])); s += o[0]; }
  return s;
}
int main() {
  long I = 2048;
  std::vector<int8_t> q(4 * I + 64); std::vector<float> x(I + 16, 1e-3f);
  for (size_t i = 0; i < q.size(); ++i) q[i] = int8_t(i * 37);
  long reps = 100000;
  for (int rep = 0; rep < 2; ++rep)
    for (int mode = 0; mode < 2; ++mode) {
      auto t = std::chrono::steady_clock::now();
      float r = mode ? run<1>(q.data(), x.data(), reps, I) : run<0>(q.data(), x.data(), reps, I);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      printf("mode %d: %.2f G weights/s one core (%g)\n", mode, reps * 4.0 * I / s / 1e9, r);
    }
}
