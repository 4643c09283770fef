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
// Each (row, kv head) is a task: its G = N / K query heads x T tokens (at most 64) score every
// key the row reads, in float32, as XLA's path does (see Lanes for how the queries are laid out).
// A 4 x 9-node tree pass of SmolLM2 at position 250, same process: 404 -> 139-170 us a call (30
// calls a pass, 78.5 -> 73.2 ms the pass), a one-row decode step even (25-29 us against 28).

#include <cmath>
#include <limits>
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

// Keys or values [B, K, S, H] of one dtype.
struct KeySet {
  const void* data;
  bool bf16;
  int64_t S, H;
  // The first n keys of (row, kv head) bk as n x H float32s: in place, or converted into buf.
  const float* Rows(int64_t bk, int64_t n, std::vector<float>& buf) const {
    int64_t at = bk * S * H;
    if (!bf16) return static_cast<const float*>(data) + at;
    const uint16_t* src = static_cast<const uint16_t*>(data) + at;
    buf.resize(n * H);
    for (int64_t i = 0; i < n * H; ++i) buf[i] = bf16_to_f32(src[i]);
    return buf.data();
  }
  // Starts fetching key j of (row, kv head) bk: into every cache level (kLevel 3) or L2 (2).
  template <int kLevel>
  void Fetch(int64_t bk, int64_t j) const {
    int64_t bytes = H * (bf16 ? 2 : 4);
    const char* at = static_cast<const char*>(data) + (bk * S + j) * bytes;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, kLevel);
  }
};

struct Shapes {
  int64_t B, T, N, K, S, U, H, G, S_read;
  float scale, softcap;
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

// A task's G T queries (query r = t G + g: token t, head g of the kv head's group) have their
// scores and weights in lanes: [key, RP], query r in lane r of NR vectors, RP = NR kLanes. Up to
// kFew queries (a decode step) score a key one query at a time with a sum across lanes: q and
// the output are [query, H]. More lie across lanes in q and the output too ([H, RP]): a key's
// scores for all of them are H multiply-adds of whole vectors with no sum across lanes, and a
// value adds into all of them the same way.
constexpr int64_t kFew = 4;

template <int NR>
struct Lanes {
  static constexpr int64_t kRP = NR * kLanes;
  static constexpr int64_t Index(bool few, int64_t r, int64_t h, int64_t H) {
    return few ? r * H + h : h * kRP + r;
  }
};

// One key's raw scores (row, RP lanes) scaled, soft-capped, and -inf where mask (the row's
// [T, stride] at this key) hides the key from the query's token or the lane holds no query
// (live: lanes that hold one).
template <int NR>
void Finish(const Shapes& d, const i32xL* live, float* row, const bool* mask, int64_t stride) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int v = 0; v < NR; ++v) {
    f32xL x = live[v] ? load_f32(row + v * kLanes) * d.scale : splat(minus_inf);
    std::memcpy(row + v * kLanes, &x, sizeof x);
  }
  if (d.softcap > 0)
    for (int64_t r = 0; r < d.G * d.T; ++r) row[r] = d.softcap * std::tanh(row[r] / d.softcap);
  for (int64_t t = 0; t < d.T; ++t)
    if (!mask[t * stride]) std::fill(row + t * d.G, row + (t + 1) * d.G, minus_inf);
}

// Scores of the queries against n keys (rows of H) into scoresT [n, RP]; KB keys at a time keep
// KB NR sums going at once. The keys come from (row, kv head) bk of the key set `ks` (converted
// to float32 in `keys`) and the values that follow them are those of `vs`: both are fetched
// ahead here, keys 16 ahead into L1 and each key's value into L2 (the cache is in memory, not
// in cache, when a pass reaches a layer: a 4 x 9-node tree pass of SmolLM2 at position 250,
// 296 -> 208 us a call, 8.9 -> 6.2 ms the pass; values alone 231-241 us; keys 32 or 64 ahead
// no better).
constexpr int64_t kKeysAhead = 16;

template <int NR>
void Scores(const Shapes& d, bool few, const float* qs, const float* keys, int64_t n,
            const bool* mask, int64_t stride, float* scoresT, const KeySet& ks,
            const KeySet& vs, int64_t bk) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  constexpr int KB = 8 / NR;
  i32xL live[NR];
  for (int v = 0; v < NR; ++v)
    for (int l = 0; l < kLanes; ++l) live[v][l] = v * kLanes + l < d.G * d.T ? -1 : 0;
  for (int64_t s = 0; s < n; s += KB) {
    for (int64_t j = s; j < std::min(s + KB, n); ++j) {
      ks.Fetch<3>(bk, std::min(j + kKeysAhead, n - 1));
      vs.Fetch<2>(bk, j);
    }
    if (few) {
      for (int64_t j = s; j < std::min(s + KB, n); ++j)
        for (int64_t r = 0; r < d.G * d.T; ++r)
          scoresT[j * RP + r] = Dot(qs + r * d.H, keys + j * d.H, d.H);
    } else {
      const float* key[KB];
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) key[j] = keys + std::min(s + j, n - 1) * d.H;
      f32xL acc[KB][NR] = {};
      for (int64_t h = 0; h < d.H; ++h) {
        f32xL q[NR];
#pragma GCC unroll 16
        for (int v = 0; v < NR; ++v) q[v] = load_f32(qs + h * RP + v * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < KB; ++j) {
          f32xL k_h = splat(key[j][h]);
#pragma GCC unroll 16
          for (int v = 0; v < NR; ++v) acc[j][v] += k_h * q[v];
        }
      }
      for (int j = 0; j < KB && s + j < n; ++j)
        std::memcpy(scoresT + (s + j) * RP, acc[j], RP * 4);
    }
    for (int64_t j = s; j < std::min(s + KB, n); ++j)
      Finish<NR>(d, live, scoresT + j * RP, mask + j, stride);
  }
}

// Each lane's softmax down the `columns` rows of scoresT, in place: weights e^(score - top);
// top (the lane's largest score, -inf where it sees no key) and total (the weights' sum, 0 there).
template <int NR>
void Softmax(float* scoresT, int64_t columns, float* top, float* total) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  const f32xL minus_inf = splat(-std::numeric_limits<float>::infinity()), zero{};
  f32xL m[NR], shift[NR], sum[NR];
#pragma GCC unroll 16
  for (int v = 0; v < NR; ++v) m[v] = minus_inf, sum[v] = zero;
  for (int64_t c = 0; c < columns; ++c)
#pragma GCC unroll 16
    for (int v = 0; v < NR; ++v) {
      f32xL x = load_f32(scoresT + c * RP + v * kLanes);
      m[v] = x > m[v] ? x : m[v];
    }
#pragma GCC unroll 16
  for (int v = 0; v < NR; ++v) shift[v] = m[v] == minus_inf ? zero : m[v];  // e^-inf: 0
  for (int64_t c = 0; c < columns; ++c)
#pragma GCC unroll 16
    for (int v = 0; v < NR; ++v) {
      float* at = scoresT + c * RP + v * kLanes;
      f32xL e = exp_lanes(load_f32(at) - shift[v]);
      std::memcpy(at, &e, sizeof e);
      sum[v] += e;
    }
  std::memcpy(top, m, sizeof m);
  std::memcpy(total, sum, sizeof sum);
}

// The output (see Lanes) += the weights (weightsT [n, RP]) times n values (rows of H); across
// lanes, HB numbers of each value at a time.
template <int NR>
void Values(const Shapes& d, bool few, const float* weightsT, const float* values, int64_t n,
            float* acc_out) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  int64_t H = d.H;
  if (few) {
    for (int64_t s = 0; s < n; ++s)
      for (int64_t r = 0; r < d.G * d.T; ++r)
        if (float w = weightsT[s * RP + r]) AddScaled(w, values + s * H, acc_out + r * H, H);
    return;
  }
  constexpr int HB = 16 / NR;
  for (int64_t h0 = 0; h0 < H; h0 += HB) {
    int hb = std::min<int64_t>(HB, H - h0);  // the last block's numbers past H repeat its last
    f32xL acc[HB][NR];
#pragma GCC unroll 16
    for (int j = 0; j < HB; ++j)
      std::memcpy(acc[j], acc_out + (h0 + std::min(j, hb - 1)) * RP, RP * 4);
    for (int64_t s = 0; s < n; ++s) {
      f32xL w[NR];
#pragma GCC unroll 16
      for (int v = 0; v < NR; ++v) w[v] = load_f32(weightsT + s * RP + v * kLanes);
      const float* value = values + s * H + h0;
#pragma GCC unroll 16
      for (int j = 0; j < HB; ++j) {
        f32xL x = splat(value[std::min(j, hb - 1)]);
#pragma GCC unroll 16
        for (int v = 0; v < NR; ++v) acc[j][v] += x * w[v];
      }
    }
    for (int j = 0; j < hb; ++j) std::memcpy(acc_out + (h0 + j) * RP, acc[j], RP * 4);
  }
}

// How many of the first n keys a row reads: up to the last one any of its T tokens sees.
int64_t Read(const bool* mask, int64_t T, int64_t S, int64_t n) {
  for (; n > 0; --n)
    for (int64_t t = 0; t < T; ++t)
      if (mask[t * S + n - 1]) return n;
  return 0;
}

// One (row b, kv head kv): softmax over the cache's keys the row reads and the own U keys.
template <int NR>
void Task(const Shapes& d, const float* q, const KeySet& k, const KeySet& v, const bool* mask,
          const KeySet& k_own, const KeySet& v_own, const bool* own_mask, int64_t b, int64_t kv,
          float* out, float* lse) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  int64_t rows = d.G * d.T, bk = b * d.K + kv;
  bool few = rows <= kFew;
  const bool* row_mask = mask + b * d.T * d.S;
  const bool* row_own = own_mask + b * d.T * d.U;
  int64_t n = Read(row_mask, d.T, d.S, d.S_read);
  std::vector<float> qs(d.H * RP, 0.0f), scoresT((n + d.U) * RP), acc(d.H * RP, 0.0f), buf;
  for (int64_t r = 0; r < rows; ++r) {
    const float* q_row = q + ((b * d.T + r / d.G) * d.N + kv * d.G + r % d.G) * d.H;
    for (int64_t h = 0; h < d.H; ++h) qs[Lanes<NR>::Index(few, r, h, d.H)] = q_row[h];
  }
  Scores<NR>(d, few, qs.data(), k.Rows(bk, n, buf), n, row_mask, d.S, scoresT.data(), k, v, bk);
  Scores<NR>(d, few, qs.data(), k_own.Rows(bk, d.U, buf), d.U, row_own, d.U, &scoresT[n * RP],
             k_own, v_own, bk);
  alignas(64) float top[RP], total[RP];
  Softmax<NR>(scoresT.data(), n + d.U, top, total);
  Values<NR>(d, few, scoresT.data(), v.Rows(bk, n, buf), n, acc.data());
  Values<NR>(d, few, &scoresT[n * RP], v_own.Rows(bk, d.U, buf), d.U, acc.data());
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = (b * d.T + r / d.G) * d.N + kv * d.G + r % d.G;
    float inv = total[r] > 0 ? 1.0f / total[r] : 0.0f;
    for (int64_t h = 0; h < d.H; ++h)
      out[at * d.H + h] = acc[Lanes<NR>::Index(few, r, h, d.H)] * inv;
    lse[at] = total[r] > 0 ? top[r] + std::log(total[r])
                           : -std::numeric_limits<float>::infinity();
  }
}

// uint16 keys or values are bfloat16 numbers' bits, as a bfloat16 cache holds them (HalfKV).
bool BF16Keys(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::BF16 || x.element_type() == ffi::U16;
}

KeySet Keys(const ffi::AnyBuffer& x) {
  auto dims = x.dimensions();
  return KeySet{x.untyped_data(), BF16Keys(x), dims[2], dims[3]};
}

bool FloatKeys(const ffi::AnyBuffer& x) {
  return x.dimensions().size() == 4 && (x.element_type() == ffi::F32 || BF16Keys(x));
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
  if (d.G * d.T > 4 * kLanes)
    return ffi::Error::InvalidArgument("jaxkv attend: at most 64 queries per kv head (T N / K)");
  d.S_read = std::max<int64_t>(0, std::min<int64_t>(d.S, kv_len.typed_data()[0]));
  d.scale = scale, d.softcap = softcap;
  KeySet ks = Keys(k), vs = Keys(v), ko = Keys(k_own), vo = Keys(v_own);
  auto run = [&](auto nr) {
    RunTasks(pool, d.B * d.K, [&](int64_t c) {
      Task<decltype(nr)::value>(d, q.typed_data(), ks, vs, mask.typed_data(), ko, vo,
                                own_mask.typed_data(), c / d.K, c % d.K, out->typed_data(),
                                lse->typed_data());
    });
  };
  switch ((d.G * d.T + kLanes - 1) / kLanes) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{});
  }
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
