// The attention kernel's value loop on one core: 8 sums, each multiply-add with its own
// broadcast (mode 0, attend.cc's Values), or 2 broadcasts shared by 8 multiply-adds (mode 1, 4 each).
//   g++ -O2 -march=native -o /tmp/probe scripts/probes/broadcast_fma.cc && /tmp/probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <vector>
__attribute__((noinline)) float run(const float* v, const float* w, long n, int mode) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (long s = 0; s < n; ++s) {
    const float* vs = v + (s & 1023) * 16;
    __m256 x = _mm256_loadu_ps(w + (s & 1023) * 8);
    if (mode == 0) {
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 0), x, a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 1), x, a1);
      a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 2), x, a2);
      a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 3), x, a3);
      a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 4), x, a4);
      a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 5), x, a5);
      a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 6), x, a6);
      a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(vs + 7), x, a7);
    } else {
      __m256 b0 = _mm256_broadcast_ss(vs), b1 = _mm256_broadcast_ss(vs + 1);
      __m256 y0 = _mm256_loadu_ps(vs), y1 = _mm256_loadu_ps(vs + 8);
      __m256 y2 = x, y3 = _mm256_loadu_ps(w + (s & 1023) * 8 + 8);
      a0 = _mm256_fmadd_ps(b0, y0, a0); a1 = _mm256_fmadd_ps(b0, y1, a1);
      a2 = _mm256_fmadd_ps(b0, y2, a2); a3 = _mm256_fmadd_ps(b0, y3, a3);
      a4 = _mm256_fmadd_ps(b1, y0, a4); a5 = _mm256_fmadd_ps(b1, y1, a5);
      a6 = _mm256_fmadd_ps(b1, y2, a6); a7 = _mm256_fmadd_ps(b1, y3, a7);
    }
  }
  __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  float o[8]; _mm256_storeu_ps(o, t); return o[0];
}
int main() {
  std::vector<float> v(1024 * 16 + 16, 1e-3f), w(1024 * 8 + 16, 1e-3f);
  long n = 200000000;
  for (int rep = 0; rep < 2; ++rep)
    for (int mode = 0; mode < 2; ++mode) {
      auto t = std::chrono::steady_clock::now();
      float r = run(v.data(), w.data(), n, mode);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      printf("mode %d: %.2f GFLOP/s one core (%g)\n", mode, n * 8 * 16 / s / 1e9, r);
    }
}
