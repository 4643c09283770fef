// Attention of a few queries per row over a cache (decode steps, tree passes) on the CPU:
// jaxkv/attention.py calls it where XLA:CPU's batched products of a few rows run far below the
// machine's speed (a 4 x 9-node tree pass of SmolLM2: [27 x 64] x [64 x 400] per kv head at
// ~55 GFLOP/s).
//
// q [B, T, N, H] float32; the cache's keys and values k, v [B, K, S, H] (float32 or bfloat16),
// read where mask [B, T, S] allows and below kv_len (int32 scalar); the call's own keys and
// values [B, K, U, H] where own_mask [B, T, U] allows; one softmax over both. Scores are
// scaled by `scale`, then soft-capped (cap tanh(s / cap)) where softcap > 0. Out: the output
// [B, T, N, H] and its log-sum-exp [B, T, N] (output 0 and -inf where a query sees no key).
// Each (row, kv head) is a task: its G = N / K query heads x T tokens score every key the row
// reads, in float32, as XLA's path does.

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace {

typedef int32_t i32xL __attribute__((vector_size(kLanes * 4)));

// e^x, kLanes at a time, for x <= 0 (scores minus their maximum): 2^n e^r with
// n = round(x log2 e) and r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], e^r by its Taylor series to
// r^7 (relative error below 1e-7, a float32's 6e-8 ulp); 0 below -87 (under float32's normal
// range), so masked scores (-inf) weigh nothing.
inline f32xL exp_lanes(f32xL x) {
  const f32xL zero{};
  i32xL tiny = x < -87.0f;
  x = tiny ? zero - 87.0f : x;
  i32xL n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32xL);  // x <= 0: truncation rounds
  f32xL nf = __builtin_convertvector(n, f32xL);
  f32xL r = x - nf * 0.693145752f - nf * 1.42860677e-6f;  // ln 2 in two parts
  f32xL p = zero + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  i32xL bits = (n + 127) << 23;
  f32xL two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return tiny ? zero : p * two_n;
}

// Keys or values [B, K, S, H] of one dtype; Row gives one key's H numbers as float32.
struct KeySet {
  const void* data;
  bool bf16;
  int64_t S, H;
  const float* Row(int64_t bk, int64_t s, float* buf) const {
    int64_t at = (bk * S + s) * H;
    if (!bf16) return static_cast<const float*>(data) + at;
    const uint16_t* row = static_cast<const uint16_t*>(data) + at;
    for (int64_t h = 0; h < H; ++h) buf[h] = bf16_to_f32(row[h]);
    return buf;
  }
};

inline float Dot(const float* a, const float* b, int64_t H) {
  f32xL acc{};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes) acc += load_f32(a + h) * load_f32(b + h);
  float s = sum_lanes(acc);
  for (; h < H; ++h) s += a[h] * b[h];
  return s;
}

// out += w v over H numbers.
inline void AddScaled(float w, const float* v, float* out, int64_t H) {
  f32xL w_lanes = splat(w);
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes) {
    f32xL o = load_f32(out + h) + w_lanes * load_f32(v + h);
    std::memcpy(out + h, &o, sizeof o);
  }
  for (; h < H; ++h) out[h] += w * v[h];
}

struct Shapes {
  int64_t B, T, N, K, S, U, H, G, S_read;
  float scale, softcap;
};

// The first n keys of one key set scored into columns [c0, c0 + n) of scores [G T, columns]
// (row t G + g); -inf where mask (rows of `stride` keys) says the token may not read the key.
void Scores(const Shapes& d, const float* q, const KeySet& k, const bool* mask, int64_t stride,
            int64_t n, int64_t b, int64_t kv, int64_t c0, int64_t columns, float* scores,
            float* buf) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < n; ++s) {
    const float* key = nullptr;
    for (int64_t t = 0; t < d.T; ++t) {
      bool sees = mask[(b * d.T + t) * stride + s];
      if (sees && !key) key = k.Row(b * d.K + kv, s, buf);
      for (int64_t g = 0; g < d.G; ++g) {
        const float* q_row = q + ((b * d.T + t) * d.N + kv * d.G + g) * d.H;
        float score = sees ? Dot(q_row, key, d.H) * d.scale : minus_inf;
        if (sees && d.softcap > 0) score = d.softcap * std::tanh(score / d.softcap);
        scores[(t * d.G + g) * columns + c0 + s] = score;
      }
    }
  }
}

// Weighted sum of one key set's values, columns [c0, c0 + n) of weights [G T, columns].
void Values(const Shapes& d, const KeySet& v, int64_t n, int64_t b, int64_t kv, int64_t c0,
            int64_t columns, const float* weights, float* acc, float* buf) {
  for (int64_t s = 0; s < n; ++s) {
    const float* value = nullptr;
    for (int64_t r = 0; r < d.G * d.T; ++r) {
      float w = weights[r * columns + c0 + s];
      if (w == 0) continue;
      if (!value) value = v.Row(b * d.K + kv, s, buf);
      AddScaled(w, value, acc + r * d.H, d.H);
    }
  }
}

// Scores row[0, n) -> e^(score - max) in place; returns (max, sum of the weights). A row with
// no visible key (all -inf) becomes 0 with max -inf and sum 0.
std::pair<float, float> Softmax(float* row, int64_t n) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float m = minus_inf;
  for (int64_t c = 0; c < n; ++c) m = std::max(m, row[c]);
  if (m == minus_inf) {
    std::fill(row, row + n, 0.0f);
    return {m, 0.0f};
  }
  f32xL sum{};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    f32xL e = exp_lanes(load_f32(row + c) - m);
    std::memcpy(row + c, &e, sizeof e);
    sum += e;
  }
  float s = sum_lanes(sum);
  alignas(64) float tail[kLanes];  // the last n - c scores, padded with -inf (weight 0)
  std::fill(tail, tail + kLanes, minus_inf);
  std::copy(row + c, row + n, tail);
  f32xL e = exp_lanes(load_f32(tail) - m);
  for (int64_t l = 0; c + l < n; ++l) s += (row[c + l] = e[l]);
  return {m, s};
}

// One (row b, kv head kv): softmax over the cache's first S_read keys and the own U keys.
void Task(const Shapes& d, const float* q, const KeySet& k, const KeySet& v, const bool* mask,
          const KeySet& k_own, const KeySet& v_own, const bool* own_mask, int64_t b, int64_t kv,
          float* out, float* lse) {
  int64_t rows = d.G * d.T, columns = d.S_read + d.U;
  std::vector<float> scores(rows * columns), acc(rows * d.H, 0.0f), buf(d.H);
  Scores(d, q, k, mask, d.S, d.S_read, b, kv, 0, columns, scores.data(), buf.data());
  Scores(d, q, k_own, own_mask, d.U, d.U, b, kv, d.S_read, columns, scores.data(), buf.data());
  std::vector<float> total(rows), top(rows);
  for (int64_t r = 0; r < rows; ++r)
    std::tie(top[r], total[r]) = Softmax(scores.data() + r * columns, columns);
  Values(d, v, d.S_read, b, kv, 0, columns, scores.data(), acc.data(), buf.data());
  Values(d, v_own, d.U, b, kv, d.S_read, columns, scores.data(), acc.data(), buf.data());
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t g = 0; g < d.G; ++g) {
      int64_t r = t * d.G + g, n = kv * d.G + g;
      float* o = out + ((b * d.T + t) * d.N + n) * d.H;
      float inv = total[r] > 0 ? 1.0f / total[r] : 0.0f;
      for (int64_t h = 0; h < d.H; ++h) o[h] = acc[r * d.H + h] * inv;
      lse[(b * d.T + t) * d.N + n] = total[r] > 0 ? top[r] + std::log(total[r])
                                                  : -std::numeric_limits<float>::infinity();
    }
}

KeySet Keys(const ffi::AnyBuffer& x) {
  auto dims = x.dimensions();
  return KeySet{x.untyped_data(), x.element_type() == ffi::BF16, dims[2], dims[3]};
}

bool FloatKeys(const ffi::AnyBuffer& x) {
  return x.dimensions().size() == 4 &&
         (x.element_type() == ffi::F32 || x.element_type() == ffi::BF16);
}

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask, ffi::AnyBuffer k_own,
                      ffi::AnyBuffer v_own, ffi::Buffer<ffi::PRED> own_mask,
                      ffi::Buffer<ffi::S32> kv_len, float scale, float softcap,
                      ffi::Result<ffi::Buffer<ffi::F32>> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  auto qd = q.dimensions();
  if (qd.size() != 4 || !FloatKeys(k) || !FloatKeys(v) || !FloatKeys(k_own) || !FloatKeys(v_own))
    return ffi::Error::InvalidArgument(
        "jaxkv attend: q must be [B, T, N, H], keys and values float32 or bfloat16 [B, K, S, H]");
  Shapes d;
  d.B = qd[0], d.T = qd[1], d.N = qd[2], d.H = qd[3];
  d.K = k.dimensions()[1], d.S = k.dimensions()[2], d.U = k_own.dimensions()[2];
  if (d.K < 1 || d.N % d.K || k.dimensions()[3] != d.H || k_own.dimensions()[3] != d.H ||
      mask.dimensions()[2] != d.S || own_mask.dimensions()[2] != d.U)
    return ffi::Error::InvalidArgument("jaxkv attend: shapes do not agree");
  d.G = d.N / d.K;
  d.S_read = std::max<int64_t>(0, std::min<int64_t>(d.S, kv_len.typed_data()[0]));
  d.scale = scale, d.softcap = softcap;
  KeySet ks = Keys(k), vs = Keys(v), ko = Keys(k_own), vo = Keys(v_own);
  RunTasks(pool, d.B * d.K, [&](int64_t c) {
    Task(d, q.typed_data(), ks, vs, mask.typed_data(), ko, vo, own_mask.typed_data(),
         c / d.K, c % d.K, out->typed_data(), lse->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvAttend, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
