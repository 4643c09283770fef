// The attention kernel's softmax pass on one core: e^(score - top) over a block of 128 keys x 32
// queries (4 vectors a key), the exponential one vector at a time (mode 0: conversions to round
// n, a blend for tiny x; mode 1: rounding by adding 1.5 x 2^23, x raised to -88), or each step
// over 4 or 8 vectors before the next (modes 2 and 3: attend.cc's exp_many).
//   g++ -O3 -march=native -o /tmp/probe scripts/probes/exp_chains.cc && /tmp/probe
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
static inline f32x8 splat(float f) { return f32x8{} + f; }
static inline f32x8 ld(const float* p) { f32x8 v; memcpy(&v, p, 32); return v; }
static inline f32x8 pow2(i32x8 bits) { f32x8 f; bits = (bits + 127) << 23; memcpy(&f, &bits, 32); return f; }
static inline f32x8 poly(f32x8 r) {
  f32x8 p = r * (1.0f / 5040) + 1.0f / 720;
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  return p;
}
f32x8 exp_convert(f32x8 x) {
  const f32x8 zero{};
  i32x8 tiny = x < -87.0f;
  x = tiny ? zero - 87.0f : x;
  i32x8 n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32x8);
  f32x8 nf = __builtin_convertvector(n, f32x8);
  f32x8 p = poly(x - nf * 0.693145752f - nf * 1.42860677e-6f);
  f32x8 two_n; i32x8 bits = (n + 127) << 23; memcpy(&two_n, &bits, 32);
  return tiny ? zero : p * two_n;
}
template <int M>
inline void exp_magic(f32x8 (&x)[M]) {
  const f32x8 magic = splat(12582912.0f), lowest = splat(-88.0f);
  f32x8 t[M], r[M], p[M];
  for (int v = 0; v < M; ++v) { x[v] = x[v] > lowest ? x[v] : lowest; t[v] = x[v] * 1.44269504f + magic; }
  for (int v = 0; v < M; ++v) { f32x8 n = t[v] - magic; r[v] = x[v] - n * 0.693145752f - n * 1.42860677e-6f; p[v] = r[v] * (1.0f / 5040) + 1.0f / 720; }
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    for (int v = 0; v < M; ++v) p[v] = p[v] * r[v] + c;
  for (int v = 0; v < M; ++v) { i32x8 bits; memcpy(&bits, &t[v], 32); x[v] = p[v] * pow2(bits); }
}
constexpr int NR = 4;
template <int MODE>
__attribute__((noinline)) void pass(float* s, long cols, const f32x8* shift, f32x8* sum) {
  constexpr int M = MODE == 3 ? 2 * NR : NR;  // vectors at a time (mode 3: two keys)
  for (long c = 0; c < cols; c += M / NR) {
    f32x8 x[M];
    for (int v = 0; v < M; ++v) x[v] = ld(s + c * NR * 8 + v * 8) - shift[v % NR];
    if (MODE == 0) for (int v = 0; v < M; ++v) x[v] = exp_convert(x[v]);
    if (MODE == 1) for (int v = 0; v < M; ++v) { f32x8 one[1] = {x[v]}; exp_magic(one); x[v] = one[0]; }
    if (MODE >= 2) exp_magic(x);
    for (int v = 0; v < M; ++v) { memcpy(s + c * NR * 8 + v * 8, &x[v], 32); sum[v % NR] += x[v]; }
  }
}
int main() {
  const long cols = 128;
  std::vector<float> base(cols * NR * 8), s(base.size());
  for (size_t i = 0; i < base.size(); ++i) base[i] = -float((i * 7919) % 3000) / 100.0f;
  base[5] = -INFINITY;
  f32x8 shift[NR] = {}, sum[NR] = {};
  void (*modes[])(float*, long, const f32x8*, f32x8*) = {pass<0>, pass<1>, pass<2>, pass<3>};
  for (int mode = 0; mode < 4; ++mode) {
    s = base;
    f32x8 sums[NR] = {};
    modes[mode](s.data(), cols, shift, sums);
    double worst = 0;
    for (size_t i = 0; i < s.size(); ++i)
      if (base[i] > -87) worst = std::max(worst, std::fabs(s[i] - std::exp((double)base[i])) / std::exp((double)base[i]));
    printf("mode %d: worst relative error %.3g, e^-inf = %g\n", mode, worst, s[5]);
  }
  for (int round = 0; round < 2; ++round)
    for (int mode = 0; mode < 4; ++mode) {
      long reps = 20000;
      auto t0 = std::chrono::steady_clock::now();
      for (long k = 0; k < reps; ++k) {
        memcpy(s.data(), base.data(), s.size() * 4);
        modes[mode](s.data(), cols, shift, sum);
      }
      double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      printf("mode %d: %.2f ns a vector\n", mode, ns / (reps * cols * NR));
    }
  printf("(%g)\n", sum[0][0]);
}
