// Attention of a call's queries over a cache and their own keys on the CPU (decode steps, tree
// passes, prefill chunks): jaxkv/ops/cpu/kernels.py calls it where XLA:CPU's batched products
// run far below the machine's speed (attention's small products per kv head, such as a tree
// pass's [27 x 64] x [64 x 400]).
//
// q [B, T, N, H] float32; the cache's keys and values k, v [B, K, S, H] (float32, bfloat16 or
// int8 with a scale per key), read where mask [B, T, S] allows and below kv_len (int32 scalar);
// or, paged (a table [B, M] of M > 0 pages; else [B, 0]), pools [K, NB, P, H] of pages of P
// slots (a multiple of 16), row b's key s in slot s % P of page table[b, s / P] (S = M P; see
// KeySet). The call's own keys and values [B, K, U, H] where own_mask [B, T, U] allows; one
// softmax over both. Scores are scaled by `scale`, then soft-capped (cap tanh(s / cap)) where
// softcap > 0. Out: the output [B, T, N, H] and its log-sum-exp [B, T, N] (output 0 and -inf
// where a query sees no key).
// Each (row, kv head, tile of tokens) is a task: the tile's tokens x the G = N / K query heads
// (at most 64 queries; see Lanes for their layout) score the keys the tile reads, in float32 as
// XLA's path does, with a running softmax over blocks of kBlock keys, so a tile early in a
// prefill chunk stops where its tokens' keys end. A decode step's few queries take DecodeTask
// instead (keys across lanes).
// The measurements behind these choices, and against XLA's path, are in docs/kernels.md.

#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

typedef int32_t i32xL __attribute__((vector_size(kLanes * 4)));

// e^x of M vectors in place, for x <= 0 (scores minus their maximum): 2^n e^r with
// n = round(x log2 e) (rounded by adding 1.5 x 2^23, whose float's low bits are then n) and
// r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], e^r by its Taylor series to r^7 (relative error
// below 1e-7, a float32's 6e-8 ulp). x is raised to -88 first: from about -87.7 down (masked
// scores' -inf among them) n is -127, whose 2^n has exponent bits 0, so e^x is exactly 0;
// above that to -87.3, a subnormal. Each step runs over all M vectors before the next: the
// polynomial's chain of dependent multiply-adds is long, and M chains side by side keep the
// FMA units busy where one vector's at a time left them waiting (a Zen 1 core: 4 vectors side
// by side 9.8-10.5 ns a vector against 13.8-15.1 one at a time; scripts/probes/exp_chains.cc).
template <int M>
inline void exp_many(f32xL (&x)[M]) {
  const f32xL magic = splat(12582912.0f), lowest = splat(-88.0f);
  f32xL t[M], r[M], p[M];
#pragma GCC unroll 16
  for (int v = 0; v < M; ++v) {
    x[v] = x[v] > lowest ? x[v] : lowest;
    t[v] = x[v] * 1.44269504f + magic;
  }
#pragma GCC unroll 16
  for (int v = 0; v < M; ++v) {
    f32xL n = t[v] - magic;
    r[v] = x[v] - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 in two parts
    p[v] = r[v] * (1.0f / 5040) + 1.0f / 720;
  }
#pragma GCC unroll 8
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
#pragma GCC unroll 16
    for (int v = 0; v < M; ++v) p[v] = p[v] * r[v] + c;
#pragma GCC unroll 16
  for (int v = 0; v < M; ++v) {
    i32xL bits;
    std::memcpy(&bits, &t[v], sizeof bits);
    bits = (bits + 127) << 23;
    f32xL two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    x[v] = p[v] * two_n;
  }
}

inline f32xL exp_lanes(f32xL x) {
  f32xL one[1] = {x};
  exp_many<1>(one);
  return one[0];
}

// Keys or values of one dtype: a layer [B, K, S, H], or (table given) a pool of pages
// [K, NB, P, H] that each row reads through its block table [B, M]: row b's key s is slot s % P
// of page table[b, s / P] (S = M P). Every key is found through Key; a page holds whole blocks
// of kLanes keys (P a multiple of 16), so a block read as one is stored as one.
struct KeySet {
  const void* data;
  int bytes;             // per number: 4 float32, 2 bfloat16 (their bits), 1 int8
  const float* scale;    // int8: one scale per stored key ([B, K, S] or [K, NB, P]); else null
  int64_t S, H;
  int64_t K = 1;         // kv heads
  const int32_t* table = nullptr;  // paged: [B, M] (NB or more, or below 0: none); else null
  int64_t NB = 0, P = 0, M = 0;
  int64_t first = 0;     // this set's key 0 is the layer's key `first` (From)

  // Key s's place among the stored keys (in rows of H; the scales' index too). A page of
  // "none" reads the last page: its slots lie past what the mask and kv_len let a query see,
  // but blocks of kLanes keys are read whole, so they must be real memory.
  int64_t Key(int64_t bk, int64_t s) const {
    s += first;
    if (!table) return bk * S + s;
    int64_t page = table[bk / K * M + s / P];
    if (page < 0 || page >= NB) page = NB - 1;
    return (bk % K * NB + page) * P + s % P;
  }
  // Keys stored one after another from key s: to the end of its page, or of the layer.
  int64_t Run(int64_t s) const { return table ? P - (s + first) % P : S - first - s; }
  // The first n keys of (row, kv head) bk as n x H float32s: in place (float32 stored as one),
  // or converted into buf (int8 ones times their scales).
  const float* Rows(int64_t bk, int64_t n, std::vector<float>& buf) const {
    if (bytes == 4 && Run(0) >= n) return static_cast<const float*>(data) + Key(bk, 0) * H;
    buf.resize(n * H);
    for (int64_t j = 0, run; j < n; j += run) {
      run = std::min(n - j, Run(j));
      Convert(Key(bk, j), run, buf.data() + j * H);
    }
    return buf.data();
  }
  // n stored keys from index at (rows of H) as float32s into out.
  void Convert(int64_t at, int64_t n, float* out) const {
    if (bytes == 4) {
      std::memcpy(out, static_cast<const float*>(data) + at * H, n * H * sizeof(float));
    } else if (bytes == 2) {
      const uint16_t* src = static_cast<const uint16_t*>(data) + at * H;
      for (int64_t i = 0; i < n * H; ++i) out[i] = bf16_to_f32(src[i]);
    } else {
      const int8_t* src = static_cast<const int8_t*>(data) + at * H;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) out[j * H + h] = src[j * H + h] * scale[at + j];
    }
  }
  // The same keys from key s0 on.
  KeySet From(int64_t s0) const {
    KeySet rest = *this;
    rest.first += s0;
    return rest;
  }
  // kLanes keys from key s of (row, kv head) bk (s a multiple of kLanes), of which the first
  // m = min(kLanes, n - s) are real, as float32 [kLanes, H] (H a multiple of kLanes; int8 ones
  // unscaled): in place when float32 and whole, else converted or copied into buf, the rows
  // past m zero.
  const float* Block(int64_t bk, int64_t s, int64_t n, float* buf) const;
  // f(those keys): a whole block of bfloat16 or int8 keys read in place (bfloat16 as their
  // bits); else Block's.
  template <typename F>
  void With(int64_t bk, int64_t s, int64_t n, float* buf, const F& f) const {
    if (n - s < kLanes || bytes == 4) f(Block(bk, s, n, buf));
    else if (bytes == 2) f(static_cast<const uint16_t*>(data) + Key(bk, s) * H);
    else f(static_cast<const int8_t*>(data) + Key(bk, s) * H);
  }
  // The scales of kLanes keys from key s of bk (s a multiple of kLanes), 0 past key n (int8
  // keys only).
  f32xL Scales(int64_t bk, int64_t s, int64_t n) const {
    const float* at = scale + Key(bk, s);
    if (n - s >= kLanes) return load_f32(at);
    f32xL out{};
    for (int64_t j = 0; j < n - s; ++j) out[j] = at[j];
    return out;
  }
  // Starts fetching keys [s, e) of (row, kv head) bk: into every cache level (kLevel 3) or L2
  // (2).
  template <int kLevel>
  void Fetch(int64_t bk, int64_t s, int64_t e) const {
    for (int64_t run; s < e; s += run) {
      run = std::min(e - s, Run(s));
      const char* at = static_cast<const char*>(data) + Key(bk, s) * H * bytes;
      for (int64_t b = 0; b < run * H * bytes; b += 64) __builtin_prefetch(at + b, 0, kLevel);
    }
  }
};

struct Shapes {
  int64_t B, T, N, K, S, U, H, G, S_read;
  float scale, softcap;
};

// Whether a query sees all n <= 16 keys of its mask `seen` (a bool true is the byte 1): a key
// loop's 4 or 8 keys as one integer compare, not a call to memcmp.
static_assert(kLanes <= 16);
const bool kAllSeen[16] = {true, true, true, true, true, true, true, true,
                           true, true, true, true, true, true, true, true};
inline bool AllSeen(const bool* seen, int64_t n) {
  if (n == 4) {
    uint32_t bytes;
    std::memcpy(&bytes, seen, 4);
    return bytes == 0x01010101u;
  }
  if (n == 8) {
    uint64_t bytes;
    std::memcpy(&bytes, seen, 8);
    return bytes == 0x0101010101010101ull;
  }
  return !std::memcmp(seen, kAllSeen, n);
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
// scores and weights in lanes: [key, RP], query r in lane r of NR vectors, RP = NR kLanes; q
// lies across lanes too ([H, RP]): a key's scores for all of them are H multiply-adds of whole
// vectors with no sum across lanes. The output is [rows, H], each query's weight broadcast
// over its value's vectors (Values). (A decode step's few queries take DecodeTask's path
// instead, keys across lanes.)
template <int NR>
struct Lanes {
  static constexpr int64_t kRP = NR * kLanes;
  static constexpr int64_t Index(int64_t r, int64_t h) { return h * kRP + r; }
};

// Scores of the n keys from `key` on (rows of scoresT) soft-capped, and -inf where the mask
// (the tile's [T, stride] at `key`) hides a key from a query's token. (A token's mask is read a
// group of keys at a time: a prefill chunk's tokens see every key of the cache.)
template <int NR>
void Finish(const Shapes& d, float* scoresT, int64_t key, int64_t n, const bool* mask,
            int64_t stride) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float* rows = scoresT + key * RP;
  if (d.softcap > 0)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < d.G * d.T; ++r)
        rows[j * RP + r] = d.softcap * std::tanh(rows[j * RP + r] / d.softcap);
  for (int64_t t = 0; t < d.T; ++t) {
    const bool* seen = mask + t * stride + key;
    if (n <= 16 && AllSeen(seen, n)) continue;
    for (int64_t j = 0; j < n; ++j)
      if (!seen[j]) std::fill_n(rows + j * RP + t * d.G, d.G, minus_inf);
  }
}

// Scores of the queries against n keys (rows of H) into scoresT [n, RP]; KB keys x two vectors
// of queries at a time keep kSums sums going at once. The keys come from (row, kv head) bk of
// the key set `ks` (converted to float32 in `keys`) and the values that follow them are those
// of `vs`: both are fetched ahead here, keys kKeysAhead ahead into L1 and each key's value into
// L2 (the cache is in memory, not in cache, when a pass reaches a layer). Fetching keys further
// ahead was no better.
constexpr int64_t kKeysAhead = 16;
// Vectors of sums a key loop keeps going at once: half the vector registers (32 with AVX-512,
// 16 with AVX2). Half as many left a prefill chunk's attention no faster than XLA's.
constexpr int kSums = kRegisters / 2;

template <int NR>
void Scores(const Shapes& d, const float* qs, const float* keys, int64_t n,
            const bool* mask, int64_t stride, float* scoresT, const KeySet& ks,
            const KeySet& vs, int64_t bk) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  constexpr int KB = kSums / 2;
  for (int64_t s = 0; s < n; s += KB) {
    for (int64_t j = s; j < std::min(s + KB, n); ++j) {
      int64_t ahead = std::min(j + kKeysAhead, n - 1);
      ks.Fetch<3>(bk, ahead, ahead + 1);
      vs.Fetch<2>(bk, j, j + 1);
    }
    const float* key[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) key[j] = keys + std::min(s + j, n - 1) * d.H;
    // Two vectors of queries at a time (one when NR is odd, last), KB keys broadcast.
    auto pass = [&](int v, auto width) {
      constexpr int P = decltype(width)::value;
      f32xL acc[KB][P] = {};
      for (int64_t h = 0; h < d.H; ++h) {
        f32xL q[P];
#pragma GCC unroll 2
        for (int p = 0; p < P; ++p) q[p] = load_f32(qs + h * RP + (v + p) * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < KB; ++j) {
          f32xL k_h = splat(key[j][h]);
#pragma GCC unroll 2
          for (int p = 0; p < P; ++p) acc[j][p] += k_h * q[p];
        }
      }
      for (int j = 0; j < KB && s + j < n; ++j)
        std::memcpy(scoresT + (s + j) * RP + v * kLanes, acc[j], sizeof acc[j]);
    };
    for (int v = 0; v + 1 < NR; v += 2) pass(v, std::integral_constant<int, 2>{});
    if (NR % 2) pass(NR - 1, std::integral_constant<int, 1>{});
    Finish<NR>(d, scoresT, s, std::min<int64_t>(KB, n - s), mask, stride);
  }
}

// Each lane's running softmax over `columns` more rows of scoresT, in place: their weights
// e^(score - top) against the lane's new top (its largest score so far; -inf while it has seen
// no key), total (the sum of all its weights so far) brought to that top, and rescale: what
// the lane's output summed so far must be multiplied by to match it.
template <int NR>
void Softmax(float* scoresT, int64_t columns, float* top, float* total, float* rescale) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  const f32xL minus_inf = splat(-std::numeric_limits<float>::infinity()), zero{};
  f32xL m[NR], old[NR], shift[NR], sum[NR];
#pragma GCC unroll 16
  for (int v = 0; v < NR; ++v) m[v] = old[v] = load_f32(top + v * kLanes), sum[v] = zero;
  for (int64_t c = 0; c < columns; ++c)
#pragma GCC unroll 16
    for (int v = 0; v < NR; ++v) {
      f32xL x = load_f32(scoresT + c * RP + v * kLanes);
      m[v] = x > m[v] ? x : m[v];
    }
#pragma GCC unroll 16
  for (int v = 0; v < NR; ++v) shift[v] = m[v] == minus_inf ? zero : m[v];  // e^-inf: 0
  // C columns' exponentials at a time: 4 vectors or more (exp_many).
  constexpr int C = NR >= 4 ? 1 : 4 / NR;
  auto columns_exp = [&](int64_t c0, auto width) {
    constexpr int W = decltype(width)::value;
    f32xL e[W * NR];
#pragma GCC unroll 16
    for (int i = 0; i < W * NR; ++i) e[i] = load_f32(scoresT + c0 * RP + i * kLanes) - shift[i % NR];
    exp_many(e);
#pragma GCC unroll 16
    for (int i = 0; i < W * NR; ++i) {
      std::memcpy(scoresT + c0 * RP + i * kLanes, &e[i], sizeof e[i]);
      sum[i % NR] += e[i];
    }
  };
  int64_t c = 0;
  for (; c + C <= columns; c += C) columns_exp(c, std::integral_constant<int, C>{});
  for (; c < columns; ++c) columns_exp(c, std::integral_constant<int, 1>{});
#pragma GCC unroll 16
  for (int v = 0; v < NR; ++v) {
    f32xL scale = exp_lanes(old[v] - shift[v]), t = load_f32(total + v * kLanes) * scale + sum[v];
    std::memcpy(top + v * kLanes, &m[v], sizeof m[v]);
    std::memcpy(total + v * kLanes, &t, sizeof t);
    std::memcpy(rescale + v * kLanes, &scale, sizeof scale);
  }
}

// The output summed so far (acc [rows, H]) times each query's rescale.
inline void Rescale(int64_t rows, int64_t H, const float* rescale, float* acc) {
  for (int64_t r = 0; r < rows; ++r)
    if (rescale[r] != 1.0f)
      for (int64_t h = 0; h < H; ++h) acc[r * H + h] *= rescale[r];
}

// acc [QN rows from r0, VN vectors from h0] += the weights of those rows (weightsT [n, RP])
// times n values (rows of H): each weight broadcast over VN vectors of its value (a broadcast
// per VN multiply-adds; see docs/kernels.md). QN and VN are constants, so the loop has no
// branches and every sum stays in a register.
template <int QN, int VN>
inline void ValuesBlock(const float* weightsT, int64_t RP, const float* values, int64_t n,
                        int64_t H, int64_t r0, int64_t h0, float* acc) {
  f32xL sums[QN][VN];
#pragma GCC unroll 8
  for (int q = 0; q < QN; ++q)
#pragma GCC unroll 4
    for (int c = 0; c < VN; ++c) sums[q][c] = load_f32(acc + (r0 + q) * H + h0 + c * kLanes);
  for (int64_t s = 0; s < n; ++s) {
    f32xL v[VN];
#pragma GCC unroll 4
    for (int c = 0; c < VN; ++c) v[c] = load_f32(values + s * H + h0 + c * kLanes);
#pragma GCC unroll 8
    for (int q = 0; q < QN; ++q) {
      f32xL w = splat(weightsT[s * RP + r0 + q]);
#pragma GCC unroll 4
      for (int c = 0; c < VN; ++c) sums[q][c] += w * v[c];
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < QN; ++q)
#pragma GCC unroll 4
    for (int c = 0; c < VN; ++c)
      std::memcpy(acc + (r0 + q) * H + h0 + c * kLanes, &sums[q][c], sizeof sums[q][c]);
}

// The output acc [rows, H] += the weights (weightsT [n, RP]) times n values (rows of H): QB
// queries x VB vectors of numbers at a time (their sums and a value's vectors fill the
// registers: each block of queries reads all n values again, 32 KiB at kBlock keys of 64
// numbers, so the more queries a block the less it reads), then the rows and vectors left one at
// a time, and numbers past whole vectors one by one.
template <int NR>
void Values(const Shapes& d, const float* weightsT, const float* values, int64_t n,
            int64_t rows, float* acc) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  constexpr int VB = 4, QB = kRegisters / VB - 1;
  int64_t H = d.H, H_vec = H - H % kLanes;
  auto columns = [&](int64_t r0, auto queries) {
    constexpr int QN = decltype(queries)::value;
    int64_t h0 = 0;
    for (; h0 + VB * kLanes <= H_vec; h0 += VB * kLanes)
      ValuesBlock<QN, VB>(weightsT, RP, values, n, H, r0, h0, acc);
    for (; h0 < H_vec; h0 += kLanes) ValuesBlock<QN, 1>(weightsT, RP, values, n, H, r0, h0, acc);
  };
  int64_t r0 = 0;
  for (; r0 + QB <= rows; r0 += QB) columns(r0, std::integral_constant<int, QB>{});
  for (; r0 < rows; ++r0) columns(r0, std::integral_constant<int, 1>{});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = H_vec; h < H; ++h)
      for (int64_t s = 0; s < n; ++s) acc[r * H + h] += weightsT[s * RP + r] * values[s * H + h];
}

// Where a row's reading of keys [lo, n) ends: after the last one any of its T tokens sees, or
// at lo when it sees none of them (a part's keys are not scanned below its own).
int64_t Read(const bool* mask, int64_t T, int64_t S, int64_t lo, int64_t n) {
  for (; n > lo; --n)
    for (int64_t t = 0; t < T; ++t)
      if (mask[t * S + n - 1]) return n;
  return lo;
}

// Keys a running softmax takes at a time: scores [kBlock, RP], 32 KiB at 64 lanes. Half or
// twice as many were slower.
constexpr int64_t kBlock = 128;

// One (row b, kv head kv) and a tile of the call's tokens, [t0, t0 + d.T) of T_all (d holds the
// tile's T): a running softmax over the cache's keys [lo, hi) that the tile reads, then (if
// `own`) its own keys, kBlock keys at a time.
template <int NR>
void Task(const Shapes& d, int64_t T_all, int64_t t0, const float* q, const KeySet& k,
          const KeySet& v, const bool* mask, int64_t lo, int64_t hi, const KeySet& k_own,
          const KeySet& v_own, const bool* own_mask, bool own, int64_t b, int64_t kv, float* out,
          float* lse) {
  constexpr int64_t RP = Lanes<NR>::kRP;
  int64_t rows = d.G * d.T, bk = b * d.K + kv;
  std::vector<float> qs(d.H * RP, 0.0f), scoresT(kBlock * RP), acc(d.H * RP, 0.0f), buf;
  auto at = [&](int64_t r) { return (b * T_all + t0 + r / d.G) * d.N + kv * d.G + r % d.G; };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < d.H; ++h)
      qs[Lanes<NR>::Index(r, h)] = q[at(r) * d.H + h] * d.scale;
  alignas(64) float top[RP], total[RP] = {}, rescale[RP];
  std::fill(top, top + RP, -std::numeric_limits<float>::infinity());
  auto run = [&](const KeySet& ks, const KeySet& vs, const bool* keys_mask, int64_t stride,
                 int64_t lo, int64_t hi) {
    const bool* tile_mask = keys_mask + (b * T_all + t0) * stride;
    int64_t n = Read(tile_mask, d.T, stride, lo, hi);
    for (int64_t s0 = lo; s0 < n; s0 += kBlock) {
      int64_t m = std::min(kBlock, n - s0);
      KeySet kb = ks.From(s0), vb = vs.From(s0);
      Scores<NR>(d, qs.data(), kb.Rows(bk, m, buf), m, tile_mask + s0, stride,
                 scoresT.data(), kb, vb, bk);
      Softmax<NR>(scoresT.data(), m, top, total, rescale);
      Rescale(rows, d.H, rescale, acc.data());
      Values<NR>(d, scoresT.data(), vb.Rows(bk, m, buf), m, rows, acc.data());
    }
  };
  run(k, v, mask, d.S, lo, hi);
  if (own) run(k_own, v_own, own_mask, d.U, 0, d.U);
  for (int64_t r = 0; r < rows; ++r) {
    float inv = total[r] > 0 ? 1.0f / total[r] : 0.0f;
    for (int64_t h = 0; h < d.H; ++h)
      out[at(r) * d.H + h] = acc[r * d.H + h] * inv;
    lse[at(r)] = total[r] > 0 ? top[r] + std::log(total[r])
                              : -std::numeric_limits<float>::infinity();
  }
}

// ---- Decode steps: keys across lanes ----------------------------------------------------------
// A decode step's queries (G T <= kFew of them, H a multiple of kLanes) score kLanes keys at a
// time into one vector each, a key's products summed across lanes by SumAcross. Its running
// softmax, mask and exponentials then take kLanes keys at once, and each value adds into every
// query's output held in registers. (The form this replaced, one key at a time, each score
// summed across lanes on its own and the softmax a key at a time, was slower.)
// Up to 8 queries: at 7 (a Qwen2.5-0.5B-shaped kv head, head size 64) this path still beat the
// general one.
constexpr int64_t kFew = 8;

inline f32xL load_lanes(const float* p) { return load_f32(p); }
inline f32xL load_lanes(const uint16_t* p) { return load_bf16(p); }
inline f32xL load_lanes(const int8_t* p) { return int8_lanes(p); }

const float* KeySet::Block(int64_t bk, int64_t s, int64_t n, float* buf) const {
  int64_t m = std::min(kLanes, n - s), at = Key(bk, s) * H;
  if (bytes == 4 && m == kLanes) return static_cast<const float*>(data) + at;
  for (int64_t i = 0; i < m * H; i += kLanes) {
    f32xL v = bytes == 4 ? load_f32(static_cast<const float*>(data) + at + i)
              : bytes == 2 ? load_bf16(static_cast<const uint16_t*>(data) + at + i)
                           : int8_lanes(static_cast<const int8_t*>(data) + at + i);
    std::memcpy(buf + i, &v, sizeof v);
  }
  std::fill(buf + m * H, buf + kLanes * H, 0.0f);
  return buf;
}

// Lane j of the shuffle mask that takes runs of W lanes, alternately from the first and the
// second of two vectors (J: 0 .. kLanes - 1; + W takes the runs after those).
template <int W, int... J>
constexpr i32xL RunsOf(std::integer_sequence<int, J...>) {
  return i32xL{(J / W * 2 * W + J % W)...};
}

// Pairs of the 2 W vectors at p halve their lanes: p[i] holds, in runs of W lanes, the sums of
// p[2 i]'s and p[2 i + 1]'s runs. Then the W vectors left, down to one.
template <int W>
inline void Halve(f32xL* p) {
  constexpr i32xL lo = RunsOf<W>(std::make_integer_sequence<int, kLanes>{});
  for (int i = 0; i < W; ++i)
    p[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo) +
           __builtin_shuffle(p[2 * i], p[2 * i + 1], lo + W);
  if constexpr (W > 1) Halve<W / 2>(p);
}

// kLanes vectors -> one whose lane j is the sum of p[j]'s lanes, log2(kLanes) halvings (45
// instructions for 16 lanes, against ~8 a vector summed alone).
inline f32xL SumAcross(f32xL* p) {
  Halve<kLanes / 2>(p);
  return p[0];
}

template <int... J>
constexpr i32xL Iota(std::integer_sequence<int, J...>) {
  return i32xL{J...};
}

// The largest of v's lanes: each lane against the lane kLanes / 2, ..., 2 and 1 away.
inline float max_lanes(f32xL v) {
  constexpr i32xL lane = Iota(std::make_integer_sequence<int, kLanes>{});
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    f32xL other = __builtin_shuffle(v, lane ^ width);
    v = v > other ? v : other;
  }
  return v[0];
}

// A running softmax's step: kSub vectors of kLanes keys (a block of kKeys): their keys are
// scored, each vector's keys fetched into L1 while the vector before is scored and their values
// into L2, for the block's pass over its values after the softmax.
constexpr int kSub = 8;
constexpr int64_t kKeys = kSub * kLanes;

// Query r's scores of the kLanes keys [kLanes, H] (rows past m or hidden by `seen`: -inf),
// times the keys' scales where given (int8 keys), soft-capped where softcap > 0.
// (Inlined: GCC called it, reloading SumAcross's shuffle patterns and spilling its sums on
// every call, which slowed bfloat16 and int8 decode attention.)
template <typename Key>
__attribute__((always_inline)) inline f32xL ScoreLanes(const Shapes& d, const float* q_r,
                                                       const Key* keys, const f32xL* scales,
                                                       int64_t m, const bool* seen) {
  f32xL p[kLanes] = {};
  for (int64_t h = 0; h < d.H; h += kLanes) {
    f32xL q_h = load_f32(q_r + h);
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) p[j] += q_h * load_lanes(keys + j * d.H + h);
  }
  f32xL score = SumAcross(p);
  if (scales) score *= *scales;
  if (d.softcap > 0)
    for (int j = 0; j < kLanes; ++j) score[j] = d.softcap * std::tanh(score[j] / d.softcap);
  if (m < kLanes || !AllSeen(seen, kLanes))
    for (int j = 0; j < kLanes; ++j)
      if (j >= m || !seen[j]) score[j] = -std::numeric_limits<float>::infinity();
  return score;
}

// The outputs acc [R, H] += the weights [R, kKeys] (from key column j0) times m values
// [m, H]: every query's sums for G of the H / kLanes vectors of numbers in registers at once.
template <int R, typename Value>
void AddValues(int64_t H, const float (*weights)[kKeys], int64_t j0, const Value* values,
               int64_t m, float* acc) {
  constexpr int kGroup = R == 1 ? 8 : 12 / R;
  for (int64_t h0 = 0; h0 < H; h0 += kGroup * kLanes) {
    int g = std::min<int64_t>(kGroup, (H - h0) / kLanes);
    f32xL sums[R][kGroup];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 12
      for (int c = 0; c < kGroup; ++c)
        if (c < g) sums[r][c] = load_f32(acc + r * H + h0 + c * kLanes);
    for (int64_t j = 0; j < m; ++j) {
      const Value* value = values + j * H + h0;
#pragma GCC unroll 12
      for (int c = 0; c < kGroup; ++c) {
        if (c >= g) break;
        f32xL v = load_lanes(value + c * kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sums[r][c] += splat(weights[r][j0 + j]) * v;
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 12
      for (int c = 0; c < kGroup; ++c)
        if (c < g) std::memcpy(acc + r * H + h0 + c * kLanes, &sums[r][c], sizeof sums[r][c]);
  }
}

// One (row b, kv head kv) of a decode step, its R = G T queries in one tile: a running softmax
// over the cache's keys [lo, hi) that they read and then (if `own`) the call's own keys, kKeys
// keys at a time.
template <int R>
void DecodeTask(const Shapes& d, const float* q, const KeySet& k, const KeySet& v,
                const bool* mask, int64_t lo, int64_t hi, const KeySet& k_own,
                const KeySet& v_own, const bool* own_mask, bool own, int64_t b, int64_t kv,
                float* out, float* lse) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  int64_t H = d.H, bk = b * d.K + kv;
  auto at = [&](int64_t r) { return (b * d.T + r / d.G) * d.N + kv * d.G + r % d.G; };
  std::vector<float> qs(R * H), acc(R * H, 0.0f), kbuf(kLanes * H), vbuf(kLanes * H);
  for (int r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) qs[r * H + h] = q[at(r) * H + h] * d.scale;
  alignas(64) float weights[R][kKeys];
  float top[R], total[R] = {};
  std::fill_n(top, R, minus_inf);
  auto run = [&](const KeySet& ks, const KeySet& vs, const bool* keys_mask, int64_t stride,
                 int64_t lo, int64_t hi) {
    const bool* seen = keys_mask + b * d.T * stride;  // query r's: seen + r / G * stride
    int64_t n = Read(seen, d.T, stride, lo, hi);
    for (int64_t s = lo; s < n; s += kKeys) {
      if (s == lo) ks.Fetch<3>(bk, s, std::min(n, s + kLanes));
      int subs = int((std::min(kKeys, n - s) + kLanes - 1) / kLanes);
      f32xL score[R][kSub];
      for (int i = 0; i < subs; ++i) {
        int64_t s_i = s + i * kLanes;
        ks.Fetch<3>(bk, std::min(n, s_i + kLanes), std::min(n, s_i + 2 * kLanes));
        vs.Fetch<2>(bk, s_i, std::min(n, s_i + kLanes));
        f32xL scales = ks.scale ? ks.Scales(bk, s_i, n) : f32xL{};
        ks.With(bk, s_i, n, kbuf.data(), [&](const auto* keys) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            score[r][i] = ScoreLanes(d, qs.data() + r * H, keys, ks.scale ? &scales : nullptr,
                                     std::min(kLanes, n - s_i), seen + r / d.G * stride + s_i);
        });
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        f32xL most = score[r][0], sum{};
        for (int i = 1; i < subs; ++i) most = score[r][i] > most ? score[r][i] : most;
        float new_top = std::max(top[r], max_lanes(most));
        if (new_top > top[r] && top[r] > minus_inf) {
          float rescale = std::exp(top[r] - new_top);
          total[r] *= rescale;
          for (int64_t h = 0; h < H; ++h) acc[r * H + h] *= rescale;
        }
        top[r] = new_top;
        for (int i = 0; i < subs; ++i) {
          f32xL w = new_top > minus_inf ? exp_lanes(score[r][i] - new_top) : f32xL{};
          sum += w;
          std::memcpy(weights[r] + i * kLanes, &w, sizeof w);
        }
        total[r] += sum_lanes(sum);
      }
      for (int i = 0; i < subs; ++i) {
        int64_t s_i = s + i * kLanes;
        if (vs.scale) {  // int8 values: their scales multiply the weights
          f32xL scales = vs.Scales(bk, s_i, n);
          for (int r = 0; r < R; ++r) {
            f32xL w = load_f32(weights[r] + i * kLanes) * scales;
            std::memcpy(weights[r] + i * kLanes, &w, sizeof w);
          }
        }
        vs.With(bk, s_i, n, vbuf.data(), [&](const auto* values) {
          AddValues<R>(H, weights, i * kLanes, values, std::min(kLanes, n - s_i), acc.data());
        });
      }
    }
  };
  run(k, v, mask, d.S, lo, hi);
  if (own) run(k_own, v_own, own_mask, d.U, 0, d.U);
  for (int r = 0; r < R; ++r) {
    float inv = total[r] > 0 ? 1.0f / total[r] : 0.0f;
    for (int64_t h = 0; h < H; ++h) out[at(r) * H + h] = acc[r * H + h] * inv;
    lse[at(r)] = total[r] > 0 ? top[r] + std::log(total[r]) : minus_inf;
  }
}

// Parts each task's cache keys are split into: with fewer tasks than twice the threads (a
// decode step: a row's kv heads) and keys to spare, enough parts of at least kPartKeys keys to
// give every thread work (3 tasks on 2 threads leave one idle a third of the time). Split so,
// whole decode steps ran faster, float32 and bfloat16, at short and long positions alike.
constexpr int64_t kPartKeys = 256;

int64_t Parts(int64_t tasks, int64_t threads, int64_t keys) {
  threads = std::max<int64_t>(1, threads);
  if (tasks >= 2 * threads) return 1;
  int64_t wanted = (4 * threads + tasks - 1) / std::max<int64_t>(1, tasks);
  return std::max<int64_t>(1, std::min(wanted, keys / kPartKeys));
}

// out, lse [n, H], [n] from each part's (normalised) output and log-sum-exp: the parts'
// outputs weighted by e^(their lse - the total's).
void Merge(int64_t parts, int64_t n, int64_t H, const float* part_out, const float* part_lse,
           float* out, float* lse) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    float top = minus_inf;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_lse[p * n + i]);
    std::fill_n(out + i * H, H, 0.0f);
    if (top == minus_inf) {
      lse[i] = minus_inf;
      continue;
    }
    float total = 0;
    for (int64_t p = 0; p < parts; ++p) {
      float w = std::exp(part_lse[p * n + i] - top);
      total += w;
      if (w > 0) AddScaled(w, part_out + (p * n + i) * H, out + i * H, H);
    }
    for (int64_t h = 0; h < H; ++h) out[i * H + h] /= total;
    lse[i] = top + std::log(total);
  }
}

// Keys or values [B, K, S, H], or given a table [B, M] of M > 0 pages a pool [K, NB, P, H] read
// through it (a PagedKV's): float32, bfloat16 (or uint16: a bfloat16 cache's bits, HalfKV) or
// int8 (with `scale`, Int8KV's); 0 bytes a number for anything else.
KeySet Keys(const ffi::AnyBuffer& x, const float* scale = nullptr,
            const ffi::Buffer<ffi::S32>* table = nullptr) {
  auto dims = x.dimensions();
  auto type = x.element_type();
  int bytes = type == ffi::F32 ? 4 : type == ffi::BF16 || type == ffi::U16 ? 2
              : type == ffi::S8 ? 1 : 0;
  if (dims.size() != 4) return KeySet{nullptr, 0, nullptr, 0, 0};
  KeySet keys{x.untyped_data(), bytes, scale, dims[2], dims[3], dims[1]};
  if (table && table->dimensions().size() == 2 && table->dimensions()[1] > 0) {
    keys.K = dims[0], keys.NB = dims[1], keys.P = dims[2], keys.M = table->dimensions()[1];
    keys.S = keys.M * keys.P, keys.table = table->typed_data();
  }
  return keys;
}

// A page's slots are a multiple of this many (kernels.py's PAGE_SLOTS): whole blocks of kLanes
// keys at any instruction set.
constexpr int64_t kPageSlots = 16;

// Whether the queries' shapes take DecodeTask: at most kFew per kv head, whole vectors of H.
bool DecodeShapes(const Shapes& d) { return d.G * d.T <= kFew && d.H % kLanes == 0; }

ffi::Error Attend(ffi::ThreadPool pool, const ffi::Buffer<ffi::F32>& q, const KeySet& ks,
                  const KeySet& vs, const ffi::Buffer<ffi::PRED>& mask, const KeySet& ko,
                  const KeySet& vo, const ffi::Buffer<ffi::PRED>& own_mask,
                  const ffi::Buffer<ffi::S32>& table, int64_t kv_len, float scale, float softcap,
                  float* out, float* lse) {
  auto qd = q.dimensions();
  if (qd.size() != 4)
    return ffi::Error::InvalidArgument("jaxkv attend: q must be [B, T, N, H]");
  Shapes d;
  d.B = qd[0], d.T = qd[1], d.N = qd[2], d.H = qd[3];
  d.K = ks.K, d.S = ks.S, d.U = ko.S;
  if (d.K < 1 || d.N % d.K || ks.H != d.H || vs.H != d.H || ko.H != d.H || vo.H != d.H ||
      vs.S != d.S || vs.K != d.K || vo.S != d.U || mask.dimensions()[2] != d.S ||
      own_mask.dimensions()[2] != d.U)
    return ffi::Error::InvalidArgument("jaxkv attend: shapes do not agree");
  if (table.dimensions().size() != 2 || (ks.table && table.dimensions()[0] != d.B) ||
      (ks.table && (ks.NB < 1 || ks.P % kPageSlots || vs.P != ks.P || vs.NB != ks.NB)))
    return ffi::Error::InvalidArgument(
        "jaxkv attend: a paged cache needs a table [B, M] and pools [K, NB, P, H] of pages of "
        "a multiple of 16 slots");
  d.G = d.N / d.K;
  if (d.G > 4 * kLanes)
    return ffi::Error::InvalidArgument("jaxkv attend: at most 64 query heads per kv head");
  d.S_read = std::max<int64_t>(0, std::min<int64_t>(d.S, kv_len));
  d.scale = scale, d.softcap = softcap;
  // Tiles of up to 64 queries per kv head: a tile's tokens x the kv head's G query heads.
  int64_t T_all = d.T, per_tile = 4 * kLanes / std::max<int64_t>(1, d.G);
  int64_t tile = std::max<int64_t>(1, std::min(T_all, per_tile)), tiles = (T_all + tile - 1) / tile;
  int64_t tasks = d.B * d.K * tiles;
  int64_t parts = Parts(tasks, pool.num_threads(), d.S_read);
  int64_t span = (d.S_read + parts - 1) / parts;
  span = (span + kBlock - 1) / kBlock * kBlock;
  // Each part's output and log-sum-exp (parts > 1), merged below.
  int64_t n_out = d.B * d.T * d.N;
  std::vector<float> part_out(parts > 1 ? parts * n_out * d.H : 0);
  std::vector<float> part_lse(parts > 1 ? parts * n_out : 0);
  // task(lo, hi, own, b, kv, t0, out, lse) for every (row, kv head, tile of tokens) and part
  // of the keys: part p reads keys [lo, hi), the last one the own keys too, into its own output
  // where there are several parts.
  auto each = [&](const auto& task) {
    RunTasks(pool, tasks * parts, [&](int64_t c) {
      int64_t p = c % parts, bk = c / parts / tiles, t0 = c / parts % tiles * tile;
      task(p * span, std::min(d.S_read, (p + 1) * span), p == parts - 1, bk / d.K, bk % d.K, t0,
           parts > 1 ? part_out.data() + p * n_out * d.H : out,
           parts > 1 ? part_lse.data() + p * n_out : lse);
    }, tiles == 1);  // one tile of queries: a decode step's (or a small tree's) short call
  };
  auto decode = [&](auto r) {  // one tile: t0 is 0
    each([&](int64_t lo, int64_t hi, bool own, int64_t b, int64_t kv, int64_t, float* o,
             float* l) {
      DecodeTask<decltype(r)::value>(d, q.typed_data(), ks, vs, mask.typed_data(), lo, hi, ko,
                                     vo, own_mask.typed_data(), own, b, kv, o, l);
    });
  };
  auto run = [&](auto nr) {
    each([&](int64_t lo, int64_t hi, bool own, int64_t b, int64_t kv, int64_t t0, float* o,
             float* l) {
      Shapes tile_d = d;
      tile_d.T = std::min(tile, T_all - t0);
      Task<decltype(nr)::value>(tile_d, T_all, t0, q.typed_data(), ks, vs, mask.typed_data(), lo,
                                hi, ko, vo, own_mask.typed_data(), own, b, kv, o, l);
    });
  };
  if (DecodeShapes(d)) {
    switch (d.G * d.T) {
      case 1: decode(std::integral_constant<int, 1>{}); break;
      case 2: decode(std::integral_constant<int, 2>{}); break;
      case 3: decode(std::integral_constant<int, 3>{}); break;
      case 4: decode(std::integral_constant<int, 4>{}); break;
      case 5: decode(std::integral_constant<int, 5>{}); break;
      case 6: decode(std::integral_constant<int, 6>{}); break;
      case 7: decode(std::integral_constant<int, 7>{}); break;
      default: decode(std::integral_constant<int, 8>{});
    }
  } else {
    switch ((d.G * tile + kLanes - 1) / kLanes) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{});
    }
  }
  if (parts > 1)
    Merge(parts, n_out, d.H, part_out.data(), part_lse.data(), out, lse);
  return ffi::Error::Success();
}

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask, ffi::AnyBuffer k_own,
                      ffi::AnyBuffer v_own, ffi::Buffer<ffi::PRED> own_mask,
                      ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> table, float scale,
                      float softcap, ffi::Result<ffi::Buffer<ffi::F32>> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  KeySet ks = Keys(k, nullptr, &table), vs = Keys(v, nullptr, &table);
  KeySet ko = Keys(k_own), vo = Keys(v_own);
  for (const KeySet* x : {&ks, &vs, &ko, &vo})
    if (x->bytes < 2)
      return ffi::Error::InvalidArgument(
          "jaxkv attend: keys and values must be float32 or bfloat16 [B, K, S, H] (or pools)");
  return Attend(pool, q, ks, vs, mask, ko, vo, own_mask, table, kv_len.typed_data()[0], scale,
                softcap, out->typed_data(), lse->typed_data());
}

// The same with int8 keys and values (Int8KV: int8 [B, K, S, H] and a float32 scale per key
// [B, K, S]; paged, a pool [K, NB, P, H] and its scales [K, NB, P]).
ffi::Error AttendInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::Buffer<ffi::F32> k_scale, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::PRED> mask,
                          ffi::AnyBuffer k_own, ffi::Buffer<ffi::F32> k_own_scale,
                          ffi::AnyBuffer v_own, ffi::Buffer<ffi::F32> v_own_scale,
                          ffi::Buffer<ffi::PRED> own_mask, ffi::Buffer<ffi::S32> kv_len,
                          ffi::Buffer<ffi::S32> table, float scale, float softcap,
                          ffi::Result<ffi::Buffer<ffi::F32>> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  KeySet ks = Keys(k, k_scale.typed_data(), &table), vs = Keys(v, v_scale.typed_data(), &table);
  KeySet ko = Keys(k_own, k_own_scale.typed_data()), vo = Keys(v_own, v_own_scale.typed_data());
  const ffi::Buffer<ffi::F32>* scales[] = {&k_scale, &v_scale, &k_own_scale, &v_own_scale};
  const ffi::AnyBuffer* numbers[] = {&k, &v, &k_own, &v_own};
  const KeySet* sets[] = {&ks, &vs, &ko, &vo};
  for (int i = 0; i < 4; ++i)  // a scale per stored key
    if (sets[i]->bytes != 1 || int64_t(scales[i]->element_count()) * sets[i]->H !=
                                   int64_t(numbers[i]->element_count()))
      return ffi::Error::InvalidArgument(
          "jaxkv attend_int8: keys and values must be int8 [B, K, S, H] with scales [B, K, S] "
          "(or pools [K, NB, P, H] with scales [K, NB, P])");
  return Attend(pool, q, ks, vs, mask, ko, vo, own_mask, table, kv_len.typed_data()[0], scale,
                softcap, out->typed_data(), lse->typed_data());
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvAttendInt8, AttendInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
