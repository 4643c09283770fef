// y = x @ w.T for a few rows of x, streaming w once: the matrix products of a decode step on
// the CPU (jaxkv/ops/cpu/kernels.py compiles this file for the machine at hand and registers
// its handlers with XLA's FFI). The measurements behind its choices are in docs/kernels.md.
//
// x [R, I] float32 (or bfloat16, for bfloat16 w), w [O, I] float32 / bfloat16 / int8 with
// scales [O, NB] (each scale covers I / NB consecutive inputs of its row), y [R, O] float32.
// Output rows are split into chunks that XLA's own intra-op threads and the calling thread
// claim from one counter, so every core streams its share of w and nothing waits on a thread
// that is busy elsewhere.

#include <vector>

#include "common.h"

namespace {

constexpr int64_t kTileO = 4;    // output rows that share each load of x
// Rows of x that share each load of w: 24 sums, 3/4 of AVX-512's vector registers. The same 6
// with AVX2's 16 registers: 3 rows (12 sums, within them) ran slower, each load of w shared by
// half as many rows.
constexpr int64_t kTileR = 6;
// Sums an outer-form tile keeps (TileT): 3/4 of the vector registers.
constexpr int64_t kTileSums = kRegisters * 3 / 4;
constexpr int64_t kAhead = 4096;  // bytes fetched ahead per byte of a weight (tuned by measurement)
// int8 weights fetch 16 KiB ahead, not 4: a tile of 4 rows of 2,048 inputs (Llama 1B's width)
// is 8 KiB, read as 4 streams side by side: 4 KiB ahead of its first row falls inside the tile
// itself. Narrow rows (SmolLM2's 576 inputs) neither gain nor lose.
constexpr int64_t kAheadInt8 = 16 << 10;
typedef uint32_t u32xL __attribute__((vector_size(kLanes * 4)));

// kLanes pairs of bfloat16 (32-bit words) -> the float32 of the low one of each pair (part 0:
// word << 16) or of the high one (part 1: word & 0xffff0000), exactly.
inline f32xL PairHalf(u32xL pairs, int part) {
  pairs = part == 0 ? pairs << 16 : pairs & 0xffff0000u;
  f32xL v;
  std::memcpy(&v, &pairs, sizeof v);
  return v;
}

// One weight format: Lanes(o, i, p) gives kLanes weights of row o, part p < kParts of the
// kParts * kLanes inputs from i (i a multiple of that), in the order x is given to the kernel
// in: consecutive, or interleaved where kInterleaved (see Interleave). At(o, i) is one weight,
// and RowScale(o) a factor applied to row o's sums.
struct F32Rows {
  static constexpr int kParts = 1;
  static constexpr bool kInterleaved = false;
  static constexpr bool kStepScaled = false;  // see Int8PairBlocks
  const float* w;
  int64_t I;
  const float* Row(int64_t o) const { return w + o * I; }
  f32xL Lanes(int64_t o, int64_t i, int) const { return load_f32(w + o * I + i); }
  float At(int64_t o, int64_t i) const { return w[o * I + i]; }
  float RowScale(int64_t) const { return 1.0f; }
};

// bfloat16 rows, read either of two ways (BF16Rows, BF16Widen).
struct BF16Base {
  static constexpr bool kInterleaved = false;
  static constexpr bool kStepScaled = false;
  const uint16_t* w;
  int64_t I;
  const uint16_t* Row(int64_t o) const { return w + o * I; }
  float At(int64_t o, int64_t i) const { return bf16_to_f32(w[o * I + i]); }
  float RowScale(int64_t) const { return 1.0f; }
};

// bfloat16 is the top half of a float32. Read as kLanes 32-bit words, 2 kLanes weights hold the
// even-numbered ones in their low halves (word << 16 is their float32) and the odd-numbered in
// their high halves (word & 0xffff0000): one integer op per kLanes weights and no widening
// shuffle, with x de-interleaved to match (Interleave). Faster than widening kLanes weights at
// a time at one row of x and at many, slower at 3-6 rows, which keep the widening form
// (BF16Widen).
struct BF16Rows : BF16Base {
  static constexpr int kParts = 2;
  static constexpr bool kInterleaved = true;
  f32xL Lanes(int64_t o, int64_t i, int part) const {
    u32xL words;
    std::memcpy(&words, w + o * I + i, sizeof words);
    return PairHalf(words, part);
  }
};

// bfloat16 widened kLanes weights at a time (the faster form at 3-6 rows of x).
struct BF16Widen : BF16Base {
  static constexpr int kParts = 1;
  f32xL Lanes(int64_t o, int64_t i, int) const { return load_bf16(w + o * I + i); }
};

// int8 with one float scale per block of 2^log2K inputs. A whole-row block (kBlocks false) is
// applied to the row's sums; smaller blocks scale each group of lanes (K >= kLanes there).
template <typename Scale, bool kBlocks>
struct Int8Rows {
  static constexpr int kParts = 1;
  static constexpr bool kInterleaved = false;
  static constexpr bool kStepScaled = false;
  const int8_t* q;
  const Scale* scale;
  int64_t I, NB, log2K;
  float ScaleAt(int64_t o, int64_t b) const {
    if constexpr (sizeof(Scale) == 4) return scale[o * NB + b];
    else if constexpr (std::is_same_v<Scale, Half>) return float(scale[o * NB + b]);
    else return bf16_to_f32(scale[o * NB + b]);
  }
  const int8_t* Row(int64_t o) const { return q + o * I; }
  f32xL Lanes(int64_t o, int64_t i, int) const {
    f32xL v = int8_lanes(q + o * I + i);
    return kBlocks ? v * ScaleAt(o, i >> log2K) : v;
  }
  float At(int64_t o, int64_t i) const {
    return kBlocks ? q[o * I + i] * ScaleAt(o, i >> log2K) : q[o * I + i];
  }
  float RowScale(int64_t o) const { return kBlocks ? 1.0f : ScaleAt(o, 0); }
};

// int8 for one row of x: each 2 kLanes inputs as two parts of consecutive kLanes, summed in two
// chains of multiply-adds. With one chain a row, widening int8 to float32 and adding into that
// one chain was the bound; two chains help from cache, and from memory once the weights are
// fetched further ahead (kAheadInt8).
template <typename Scale, bool kBlocks>
struct Int8Pairs : Int8Rows<Scale, kBlocks> {
  static constexpr int kParts = 2;
  f32xL Lanes(int64_t o, int64_t i, int part) const {
    return Int8Rows<Scale, kBlocks>::Lanes(o, i + part * kLanes, 0);
  }
};

// Blocks of 32 inputs or more (GGUF's Q8_0), one row of x: a step's 32 products summed as they
// are, then scaled once (StepScale), where Int8Pairs multiplies each 16 weights by their scale:
// one scaling per step and output instead of one per kLanes weights.
template <typename Scale>
struct Int8PairBlocks : Int8Rows<Scale, true> {
  static constexpr int kParts = 2;
  static constexpr bool kStepScaled = true;
  f32xL Lanes(int64_t o, int64_t i, int part) const {
    return int8_lanes(this->q + o * this->I + i + part * kLanes);
  }
  float StepScale(int64_t o, int64_t i) const { return this->ScaleAt(o, i >> this->log2K); }
};

// y[r, o] for rows r0 <= r < r0 + NR and o0 <= o < o0 + kTileO, vectorised over the first
// I_vec inputs and finished one by one. NR is a constant so the accumulators stay in registers.
// Every loop over k and r is unrolled (the pragmas): with one left rolled GCC keeps acc in
// memory, a load and a store around every multiply-add.
// With few rows of x, each part of a step adds into its own accumulators: one chain of
// dependent multiply-adds per output is what bounded bfloat16 at 1 row.
template <int NR, typename Rows>
void Tile(const Rows& w, const float* x, float* y, int64_t I, int64_t I_vec, int64_t O,
          int64_t o0, int64_t r0) {
  constexpr int kChains = NR <= 3 ? Rows::kParts : 1;
  f32xL acc[kChains][kTileO][NR];
#pragma GCC unroll 2
  for (int c = 0; c < kChains; ++c)
#pragma GCC unroll 8
    for (int64_t k = 0; k < kTileO; ++k)
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[c][k][r] = f32xL{};
  // The tile's rows are one contiguous run of memory; fetch ahead of it, as many bytes per step
  // as the step reads (rows of a few cache lines are too short for the hardware prefetchers to
  // follow on their own).
  constexpr int64_t kWidth = Rows::kParts * kLanes;  // inputs per step
  constexpr int64_t kStep = kTileO * kWidth * sizeof(*w.Row(0));
  constexpr int64_t kBytes = sizeof(*w.Row(0));
  const char* ahead = reinterpret_cast<const char*>(w.Row(o0)) +
                      (kBytes == 1 ? kAheadInt8 : kAhead * kBytes);
  for (int64_t i = 0; i < I_vec; i += kWidth, ahead += kStep) {
    for (int64_t b = 0; b < kStep; b += 64) __builtin_prefetch(ahead + b);
    f32xL step[kTileO][NR];  // the step's sums before its scale, for a format scaled per step
    if constexpr (Rows::kStepScaled) {
#pragma GCC unroll 8
      for (int64_t k = 0; k < kTileO; ++k)
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) step[k][r] = f32xL{};
    }
#pragma GCC unroll 2
    for (int part = 0; part < Rows::kParts; ++part) {
      f32xL w_lanes[kTileO];
#pragma GCC unroll 8
      for (int64_t k = 0; k < kTileO; ++k) w_lanes[k] = w.Lanes(o0 + k, i, part);
      auto& sums = Rows::kStepScaled ? step : acc[part % kChains];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        f32xL x_lanes = load_f32(x + (r0 + r) * I + i + part * kLanes);
#pragma GCC unroll 8
        for (int64_t k = 0; k < kTileO; ++k) sums[k][r] += w_lanes[k] * x_lanes;
      }
    }
    if constexpr (Rows::kStepScaled) {
#pragma GCC unroll 8
      for (int64_t k = 0; k < kTileO; ++k) {
        f32xL scale = splat(w.StepScale(o0 + k, i));
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[0][k][r] += step[k][r] * scale;
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t k = 0; k < kTileO; ++k) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      float s = sum_lanes(kChains == 1 ? acc[0][k][r] : acc[0][k][r] + acc[kChains - 1][k][r]);
      for (int64_t i = I_vec; i < I; ++i) s += w.At(o0 + k, i) * x[(r0 + r) * I + i];
      y[(r0 + r) * O + o0 + k] = s * w.RowScale(o0 + k);
    }
  }
}

// Where input i sits in a row of x as BF16Rows reads it: each block of 2 kLanes inputs holds
// its even-numbered inputs, then its odd-numbered ones; inputs from I_vec on stay where they are.
inline int64_t InterleavedAt(int64_t i, int64_t I_vec) {
  if (i >= I_vec) return i;
  int64_t j = i % (2 * kLanes);
  return i - j + (j & 1) * kLanes + j / 2;
}

// Where input i sits in a row of x as the kernel is given it.
template <typename Rows>
int64_t XAt(const Rows&, int64_t i, int64_t I_vec) {
  return Rows::kInterleaved ? InterleavedAt(i, I_vec) : i;
}

// Output rows [o_begin, o_end) for rows r_begin <= r < R of x.
template <typename Rows>
void Chunk(const Rows& w, const float* x, float* y, int64_t R, int64_t I, int64_t I_vec,
           int64_t O, int64_t o_begin, int64_t o_end, int64_t r_begin = 0) {
  int64_t o = o_begin;
  for (; o + kTileO <= o_end; o += kTileO)
    for (int64_t r = r_begin; r < R; r += kTileR) {
      switch (std::min(kTileR, R - r)) {
        case 1: Tile<1>(w, x, y, I, I_vec, O, o, r); break;
        case 2: Tile<2>(w, x, y, I, I_vec, O, o, r); break;
        case 3: Tile<3>(w, x, y, I, I_vec, O, o, r); break;
        case 4: Tile<4>(w, x, y, I, I_vec, O, o, r); break;
        case 5: Tile<5>(w, x, y, I, I_vec, O, o, r); break;
        default: Tile<6>(w, x, y, I, I_vec, O, o, r);
      }
    }
  for (; o < o_end; ++o) {  // fewer than kTileO rows left: one at a time
    for (int64_t r = r_begin; r < R; ++r) {
      float s = 0;
      for (int64_t i = 0; i < I; ++i) s += w.At(o, i) * x[r * I + XAt(w, i, I_vec)];
      y[r * O + o] = s * w.RowScale(o);
    }
  }
}

struct Free {
  void operator()(float* p) const { std::free(p); }
};
using Floats = std::unique_ptr<float[], Free>;

// n float32s, 64-byte aligned as XLA's buffers are: a vector load never splits a cache line.
Floats Aligned(int64_t n) {
  return Floats(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64)));
}

// The outer-product form, for many rows of x (a tree pass) and float32 weights: x comes
// transposed, xT [I, Rp] with its R rows padded to Rp = NV kLanes, and a tile of NO output rows
// keeps NO x NV accumulators, each kLanes rows of x for one output. Per input, NV loads of xT
// and NO weights broadcast from memory feed NO NV multiply-adds, and no sum across lanes is
// left at the end (the dot form's 4 x 6 tile loads once per 2.4 multiply-adds and sums 24 sets
// of lanes per tile). It is the faster form from about 16 rows of x on (kernels.py's
// OUTER_ROWS). bfloat16 and int8 weights stay in the dot form: converted a block at a time for
// this one, they ran slower in it.
// The outer form computes while it streams w, and fetches ahead further, into L2 only (x's
// rows and the tile's weights stay in L1). The dot form ran no faster fetching into L2.
constexpr int64_t kAheadT = 32 << 10;

// Output rows of an outer-form tile, whose NV vectors of x each keeps a sum for.
constexpr int TileRowsT(int NV) { return kTileSums / NV; }

template <int NV, int NO>
void TileT(const float* w, const float* xT, float* y, int64_t R, int64_t I, int64_t O,
           int64_t o0) {
  constexpr int64_t Rp = NV * kLanes;
  f32xL acc[NO][NV];
#pragma GCC unroll 24
  for (int k = 0; k < NO; ++k)
#pragma GCC unroll 6
    for (int v = 0; v < NV; ++v) acc[k][v] = f32xL{};
  const float* tile = w + o0 * I;  // NO contiguous rows
  constexpr int64_t kStep = NO * kLanes * sizeof(float);  // bytes of the tile per kLanes inputs
  const char* ahead = reinterpret_cast<const char*>(tile) + kAheadT;
  int64_t i = 0;
  for (; i + kLanes <= I; i += kLanes, ahead += kStep) {
    for (int64_t b = 0; b < kStep; b += 64) __builtin_prefetch(ahead + b, 0, 1);  // to L2
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      f32xL x_lanes[NV];
#pragma GCC unroll 6
      for (int v = 0; v < NV; ++v) x_lanes[v] = load_f32(xT + (i + j) * Rp + v * kLanes);
#pragma GCC unroll 24
      for (int k = 0; k < NO; ++k) {
        f32xL w_k = splat(tile[k * I + i + j]);
#pragma GCC unroll 6
        for (int v = 0; v < NV; ++v) acc[k][v] += w_k * x_lanes[v];
      }
    }
  }
  for (; i < I; ++i)
    for (int k = 0; k < NO; ++k)
      for (int v = 0; v < NV; ++v)
        acc[k][v] += splat(tile[k * I + i]) * load_f32(xT + i * Rp + v * kLanes);
  // Out through L1, row by row: stored element by element from the registers, the lane
  // extractions took a noticeable share of a tile.
  alignas(64) float out[NO][Rp];
#pragma GCC unroll 24
  for (int k = 0; k < NO; ++k)
#pragma GCC unroll 6
    for (int v = 0; v < NV; ++v) std::memcpy(&out[k][v * kLanes], &acc[k][v], sizeof acc[k][v]);
  for (int64_t r = 0; r < R; ++r)
    for (int k = 0; k < NO; ++k) y[r * O + o0 + k] = out[k][r];
}

// Rows of x in the outer-product form: blocks of NV vectors of rows (the last one of `last`
// vectors), each transposed on its own (xT's block b at b NV kLanes I, [I, its rows padded]).
struct Blocks {
  int64_t rows;  // R_outer: the rows in them
  int64_t count;
  int last;      // vectors in the last block, 1 .. NV
  int Vectors(int64_t b, int NV) const { return b + 1 < count ? NV : last; }
  int64_t Rows(int64_t b, int64_t Rb) const { return std::min(Rb, rows - b * Rb); }
};

// f(std::integral_constant<int, v>) for v in 1 .. V, given at run time.
template <int V, typename F>
void WithVectors(int v, const F& f) {
  if constexpr (V > 1)
    if (v < V) return WithVectors<V - 1>(v, f);
  f(std::integral_constant<int, V>{});
}

// Output rows [o_begin, o_end): every block of rows of x in the outer-product form, a tile of
// w's rows at a time (each block reads it from L1), then rows R_outer <= r < R in the dot
// form, tile by tile while w's rows are in L1.
template <int NV>
void ChunkT(const float* w, const float* xT, const float* x, float* y, const Blocks& blocks,
            int64_t R, int64_t I, int64_t O, int64_t o_begin, int64_t o_end) {
  constexpr int NO = TileRowsT(NV);
  constexpr int64_t Rb = NV * kLanes;
  for (int64_t o = o_begin, n; o < o_end; o += n) {
    n = o + NO <= o_end ? NO : 1;
    for (int64_t b = 0; b < blocks.count; ++b) {
      const float* xT_b = xT + b * Rb * I;
      float* y_b = y + b * Rb * O;
      int64_t rows = blocks.Rows(b, Rb);
      auto tile = [&](auto nv) {
        constexpr int V = decltype(nv)::value;
        if (n == NO) TileT<V, NO>(w, xT_b, y_b, rows, I, O, o);
        else TileT<V, 1>(w, xT_b, y_b, rows, I, O, o);
      };
      WithVectors<NV>(blocks.Vectors(b, NV), tile);
    }
    if (blocks.rows < R)
      Chunk(F32Rows{w, I}, x, y, R, I, I - I % kLanes, O, o, o + n, blocks.rows);
  }
}

constexpr int64_t kChunkBytes = 64 << 10;  // below this much of w per chunk, fewer chunks

// chunk(o_begin, o_end) over every output row, in chunks of a multiple of `tile` rows split
// over the calling thread and XLA's pool: one chunk a thread for one row of x (a decode step's
// products read memory and do little else, and every chunk starts its stream cold), four for
// more rows (compute, which a thread held up elsewhere would leave unbalanced).
template <typename Work>
void Parallel(ffi::ThreadPool pool, int64_t R, int64_t O, int64_t w_bytes, int64_t tile,
              const Work& chunk) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t per_thread = R == 1 ? 1 : 4;
  int64_t n = std::min<int64_t>(per_thread * threads, std::max<int64_t>(1, w_bytes / kChunkBytes));
  int64_t rows_per = (O + n - 1) / n;
  rows_per = (rows_per + tile - 1) / tile * tile;
  n = (O + rows_per - 1) / rows_per;
  // Every product the kernel takes is a decode step's (at most ROWS rows): a short call.
  RunTasks(pool, n, [&](int64_t c) { chunk(c * rows_per, std::min(O, (c + 1) * rows_per)); },
           true);
}

// bfloat16 weights and one row of bfloat16 x (a bfloat16 model's activations, passed as they
// are, not as a float32 copy to be scanned back to bfloat16 here): one vdpbf16ps multiplies 32
// pairs exactly and adds them into float32 lanes, where BF16Rows takes two integer ops and two
// multiply-adds (and holds for any float32 x). The instruction flushes subnormal numbers (below
// 1.2e-38) to zero. Only one row of x takes this form: at 2 rows it is no faster.
// Builds without it (AVX-512 before Cooper Lake and Zen 4, AVX2, plain loops) take the same
// front-to-back form with the pairs widened, still a little faster than BF16Rows.
constexpr int64_t kPairs = 2 * kLanes;  // bfloat16 inputs per DotPairs

// acc + the kPairs products of bfloat16 w and x, in kLanes sums of two: one vdpbf16ps where
// the CPU has it, elsewhere each half of the pairs widened exactly (PairHalf) and
// multiplied-added.
inline f32xL DotPairs(f32xL acc, const uint16_t* w, const uint16_t* x) {
#if defined(__AVX512BF16__)
  __m512 sums;
  std::memcpy(&sums, &acc, sizeof sums);
  sums = _mm512_dpbf16_ps(sums, (__m512bh)_mm512_loadu_si512(w),
                          (__m512bh)_mm512_loadu_si512(x));
  std::memcpy(&acc, &sums, sizeof acc);
#else
  u32xL w2, x2;
  std::memcpy(&w2, w, sizeof w2);
  std::memcpy(&x2, x, sizeof x2);
  acc += PairHalf(w2, 0) * PairHalf(x2, 0);
  acc += PairHalf(w2, 1) * PairHalf(x2, 1);
#endif
  return acc;
}

// One row of w times xb, the row read front to back with kC running sums. Rows read one after
// another stream faster than kTileO rows read side by side (Tile's order); more running sums
// are no better. A chunk is then one stream that the hardware prefetchers follow, so nothing is
// fetched ahead in software here: doing so as well (as Tile does), into L1 or L2, was slower.
constexpr int kC = 4;

float RowDP(const uint16_t* row, const uint16_t* xb, int64_t I, int64_t I_vec) {
  f32xL acc[kC] = {};
  int64_t i = 0;
  for (; i + kC * kPairs <= I_vec; i += kC * kPairs) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c)
      acc[c] = DotPairs(acc[c], row + i + c * kPairs, xb + i + c * kPairs);
  }
  for (; i < I_vec; i += kPairs) acc[0] = DotPairs(acc[0], row + i, xb + i);
  float s = sum_lanes((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (i = I_vec; i < I; ++i) s += bf16_to_f32(row[i]) * bf16_to_f32(xb[i]);
  return s;
}

// y [1, O] from bfloat16 w and the row of x given as bfloat16 xb [I].
void DenseDP(ffi::ThreadPool pool, const uint16_t* w, const uint16_t* xb, float* y, int64_t I,
             int64_t O) {
  int64_t I_vec = I - I % kPairs;
  Parallel(pool, 1, O, O * I * 2, kTileO, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) y[o] = RowDP(w + o * I, xb, I, I_vec);
  });
}

template <typename Rows>
void Dense(ffi::ThreadPool pool, const Rows& w, const float* x, float* y, int64_t R, int64_t I,
           int64_t O) {
  int64_t I_vec = I - I % (Rows::kParts * kLanes);
  Parallel(pool, R, O, O * I * int64_t(sizeof(*w.Row(0))), kTileO,
           [&](int64_t begin, int64_t end) {
    Chunk(w, x, y, R, I, I_vec, O, begin, end);
  });
}

// Rows of x past the last whole vector of them that go to the dot form (Chunk, tile by tile
// while the outer form has w's rows in cache); more are padded to a whole vector. x is
// transposed here, not by XLA (its transposes added a visible cost to a tree pass). The dot
// form costs per row, padding a whole vector of zero rows: a few rows past a vector go to the
// dot form, more are padded.
constexpr int64_t kDotRest = 4;

constexpr int64_t kMaxRowsT = 96;  // rows of x dense_t takes
// Vectors of rows in a block of the outer form: 6 with AVX-512 (96 rows in one), 3 with 16
// registers (a tile of fewer than kTileO outputs would leave the dot form its rows one at a
// time), so AVX2 takes 96 rows as 4 blocks of 24.
constexpr int64_t kMaxVectorsT = kTileSums / kTileO;

// x's first R rows [R, I] transposed block by block (see Blocks), the rows past R zero.
Floats Transpose(const float* x, const Blocks& blocks, int64_t NV, int64_t I) {
  int64_t Rb = NV * kLanes;
  Floats xT = Aligned(blocks.count * Rb * I);
  std::fill(xT.get(), xT.get() + blocks.count * Rb * I, 0.0f);
  for (int64_t b = 0; b < blocks.count; ++b) {
    int64_t Rp = blocks.Vectors(b, int(NV)) * kLanes;
    int64_t r0 = b * Rb, rows = blocks.Rows(b, Rb);
    float* xT_b = xT.get() + r0 * I;
    for (int64_t i = 0; i < I; ++i)  // the block's lines of x stay in L1 while xT is written
      for (int64_t r = 0; r < rows; ++r) xT_b[i * Rp + r] = x[(r0 + r) * I + i];
  }
  return xT;
}

// y [R, O] from float32 w and x [R, I], R <= 96: the outer-product form for the whole vectors
// of rows (and a last part vector of more than kDotRest rows), in blocks of at most
// kMaxVectorsT vectors; the dot form for the rest.
void DenseT(ffi::ThreadPool pool, const float* w, const float* x, float* y, int64_t R,
            int64_t I, int64_t O) {
  int64_t vectors = std::max<int64_t>(1, R / kLanes + (R % kLanes > kDotRest));
  int64_t NV = std::min(vectors, kMaxVectorsT);
  Blocks blocks{std::min(R, vectors * kLanes), (vectors + NV - 1) / NV, 0};
  blocks.last = int(vectors - (blocks.count - 1) * NV);
  Floats xT = Transpose(x, blocks, NV, I);
  auto run = [&](auto nv) {
    constexpr int V = decltype(nv)::value;
    int64_t tile = TileRowsT(V);
    Parallel(pool, R, O, O * I * int64_t(sizeof(float)), tile, [&](int64_t begin, int64_t end) {
      ChunkT<V>(w, xT.get(), x, y, blocks, R, I, O, begin, end);
    });
  };
  WithVectors<int(kMaxVectorsT)>(int(NV), run);
}

// x [R, I] in BF16Rows' order (InterleavedAt).
Floats Interleave(const float* x, int64_t R, int64_t I) {
  Floats out = Aligned(R * I);
  int64_t I_vec = I - I % (2 * kLanes);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) out[r * I + InterleavedAt(i, I_vec)] = x[r * I + i];
  return out;
}

// x bfloat16 (dense's x may be when w is) widened to float32.
Floats Widen(const uint16_t* xb, int64_t n) {
  Floats out = Aligned(n);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(xb[i]);
  return out;
}

// x float32, or bfloat16 with bfloat16 w (dense_t and dense_int8 refuse such w themselves).
ffi::Error CheckShapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, int64_t* R, int64_t* I,
                       int64_t* O) {
  auto xd = x.dimensions(), wd = w.dimensions();
  auto xt = x.element_type();
  if (xt != ffi::F32 && !(xt == ffi::BF16 && w.element_type() == ffi::BF16))
    return ffi::Error::InvalidArgument("jaxkv dense: x must be float32, or bfloat16 with "
                                       "bfloat16 w");
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("jaxkv dense: x must be [R, I] and w [O, I]");
  *R = xd[0], *I = xd[1], *O = wd[0];
  return ffi::Error::Success();
}

// y [R, O] = x [R, I] @ w.T for w float32 or bfloat16 [O, I] at w, x float32 (or bfloat16
// with bfloat16 w) at x: the dot form.
ffi::Error DenseAt(ffi::ThreadPool pool, ffi::DataType w_type, const void* w,
                   ffi::DataType x_type, const void* x, float* y, int64_t R, int64_t I,
                   int64_t O) {
  const float* xp = static_cast<const float*>(x);
  switch (w_type) {
    case ffi::F32:
      Dense(pool, F32Rows{static_cast<const float*>(w), I}, xp, y, R, I, O);
      return ffi::Error::Success();
    case ffi::BF16: {
      BF16Base rows{static_cast<const uint16_t*>(w), I};
      Floats wide;
      if (x_type == ffi::BF16) {
        const uint16_t* xb = static_cast<const uint16_t*>(x);
        if (R == 1) {
          DenseDP(pool, rows.w, xb, y, I, O);
          return ffi::Error::Success();
        }
        wide = Widen(xb, R * I);
        xp = wide.get();
      }
      if (R >= 3 && R <= 6) {
        Dense(pool, BF16Widen{rows}, xp, y, R, I, O);
      } else {
        Dense(pool, BF16Rows{rows}, Interleave(xp, R, I).get(), y, R, I, O);
      }
      return ffi::Error::Success();
    }
    default:
      return ffi::Error::InvalidArgument("jaxkv dense: w must be float32 or bfloat16");
  }
}

ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t R, I, O;
  if (auto err = CheckShapes(x, w, &R, &I, &O); err.failure()) return err;
  return DenseAt(pool, w.element_type(), w.untyped_data(), x.element_type(), x.untyped_data(),
                 y->typed_data(), R, I, O);
}

// x float32 [R, I] (R <= 96), w float32 [O, I], y [R, O].
ffi::Error DenseTImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t R, I, O;
  if (auto err = CheckShapes(x, w, &R, &I, &O); err.failure()) return err;
  if (w.element_type() != ffi::F32 || R > kMaxRowsT)
    return ffi::Error::InvalidArgument("jaxkv dense_t: w must be float32, x at most 96 rows");
  DenseT(pool, static_cast<const float*>(w.untyped_data()),
         static_cast<const float*>(x.untyped_data()), y->typed_data(), R, I, O);
  return ffi::Error::Success();
}

// One row of x in two chains of multiply-adds (Int8Pairs; Int8PairBlocks for blocks of 32
// inputs or more), more rows as they are.
template <typename Scale, bool kBlocks>
void DenseInt8Rows(ffi::ThreadPool pool, const Int8Rows<Scale, kBlocks>& rows, const float* x,
                   float* y, int64_t R, int64_t I, int64_t O) {
  if constexpr (kBlocks) {
    if (R == 1 && rows.log2K >= 5) return Dense(pool, Int8PairBlocks<Scale>{rows}, x, y, R, I, O);
  }
  if (R == 1) Dense(pool, Int8Pairs<Scale, kBlocks>{rows}, x, y, R, I, O);
  else Dense(pool, rows, x, y, R, I, O);
}

template <typename Scale>
void DenseInt8Typed(ffi::ThreadPool pool, const int8_t* q, const void* scale, const float* x,
                    float* y, int64_t R, int64_t I, int64_t O, int64_t NB) {
  const auto* s = static_cast<const Scale*>(scale);
  if (NB == 1) DenseInt8Rows(pool, Int8Rows<Scale, false>{q, s, I, NB, 0}, x, y, R, I, O);
  else DenseInt8Rows(pool, Int8Rows<Scale, true>{q, s, I, NB, __builtin_ctzll(I / NB)}, x, y, R,
                     I, O);
}

// y [R, O] = x [R, I] @ (q * scale).T for int8 q [O, I] with scales [O, NB] of scale_type.
ffi::Error DenseInt8At(ffi::ThreadPool pool, const int8_t* q, ffi::DataType scale_type,
                       const void* scale, int64_t NB, const float* x, float* y, int64_t R,
                       int64_t I, int64_t O) {
  switch (scale_type) {
    case ffi::F32:
      DenseInt8Typed<float>(pool, q, scale, x, y, R, I, O, NB);
      return ffi::Error::Success();
    case ffi::F16:
      DenseInt8Typed<Half>(pool, q, scale, x, y, R, I, O, NB);
      return ffi::Error::Success();
    case ffi::BF16:
      DenseInt8Typed<uint16_t>(pool, q, scale, x, y, R, I, O, NB);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jaxkv dense_int8: scale must be a float type");
  }
}

// Whether scales [.., O, NB] suit int8 rows of I inputs: NB == 1, or blocks of I / NB inputs,
// a power of two of at least a vector.
bool ScalesFit(int64_t I, int64_t NB) {
  int64_t K = NB > 0 ? I / NB : 0;
  return NB >= 1 && I % NB == 0 && (NB == 1 || (K >= kLanes && (K & (K - 1)) == 0));
}

ffi::Error DenseInt8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q,
                         ffi::AnyBuffer scale, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t R, I, O;
  if (auto err = CheckShapes(x, q, &R, &I, &O); err.failure()) return err;
  auto sd = scale.dimensions();
  if (q.element_type() != ffi::S8 || sd.size() != 2 || sd[0] != O || !ScalesFit(I, sd[1]))
    return ffi::Error::InvalidArgument(
        "jaxkv dense_int8: q must be int8 [O, I], scale [O, NB] with NB == 1 or I / NB a "
        "power of two >= 16");
  return DenseInt8At(pool, static_cast<const int8_t*>(q.untyped_data()), scale.element_type(),
                     scale.untyped_data(), sd[1], static_cast<const float*>(x.untyped_data()),
                     y->typed_data(), R, I, O);
}

// The products of a mixture's chosen experts: row j of x [X, I] times expert e[j]'s matrix of
// a stack w [E, O, I], read where it lies (XLA's form copies it out first). Rows are sorted by
// expert, so rows that chose the same expert sit together and share one read of its weights:
// run(expert, x rows, y rows, n) on each expert's n rows in turn (each split over the pool),
// results scattered back to y [X, O].
template <typename Run>
ffi::Error ByExpert(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& e, int64_t E,
                    int64_t O, float* y, const Run& run) {
  int64_t X = x.dimensions()[0];
  size_t row = x.dimensions()[1] * ffi::ByteWidth(x.element_type());
  const int32_t* ep = e.typed_data();
  for (int64_t j = 0; j < X; ++j)
    if (ep[j] < 0 || ep[j] >= E)
      return ffi::Error::InvalidArgument("jaxkv dense_experts: an expert index is out of range");
  std::vector<int64_t> order(X), starts;
  for (int64_t j = 0; j < X; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ep[a] < ep[b]; });
  Floats xs = Aligned((X * row + 3) / 4), ys = Aligned(X * O);
  char* xb = reinterpret_cast<char*>(xs.get());
  const char* x_in = static_cast<const char*>(x.untyped_data());
  for (int64_t k = 0; k < X; ++k) {
    std::memcpy(xb + k * row, x_in + order[k] * row, row);
    if (k == 0 || ep[order[k]] != ep[order[k - 1]]) starts.push_back(k);
  }
  starts.push_back(X);
  for (size_t g = 0; g + 1 < starts.size(); ++g) {
    int64_t a = starts[g];
    if (auto err = run(ep[order[a]], xb + a * row, ys.get() + a * O, starts[g + 1] - a);
        err.failure())
      return err;
  }
  for (int64_t k = 0; k < X; ++k)
    std::memcpy(y + order[k] * O, ys.get() + k * O, O * sizeof(float));
  return ffi::Error::Success();
}

// x [X, I] (as dense's), w float32 or bfloat16 [E, O, I], e int32 [X], y [X, O]; an expert's
// rows go in pieces of at most kMaxRowsT, float32 pieces of outer_rows or more (kernels.py's
// OUTER_ROWS) in the outer-product form.
ffi::Error DenseExpertsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> e, ffi::Result<ffi::Buffer<ffi::F32>> y,
                            int64_t outer_rows) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2] || e.element_count() != xd[0])
    return ffi::Error::InvalidArgument("jaxkv dense_experts: x must be [X, I], w [E, O, I] and "
                                       "e [X]");
  int64_t O = wd[1], I = wd[2];
  size_t matrix = O * I * ffi::ByteWidth(w.element_type());
  const char* w_in = static_cast<const char*>(w.untyped_data());
  size_t row = I * ffi::ByteWidth(x.element_type());
  auto run = [&](int64_t ex, const void* xs, float* ys, int64_t n) {
    for (int64_t r = 0, m; r < n; r += m) {  // as dense products of at most kMaxRowsT rows
      m = std::min(kMaxRowsT, n - r);
      const void* x_r = static_cast<const char*>(xs) + r * row;
      if (w.element_type() == ffi::F32 && x.element_type() == ffi::F32 && m >= outer_rows) {
        DenseT(pool, reinterpret_cast<const float*>(w_in + ex * matrix),
               static_cast<const float*>(x_r), ys + r * O, m, I, O);
      } else if (auto err = DenseAt(pool, w.element_type(), w_in + ex * matrix,
                                    x.element_type(), x_r, ys + r * O, m, I, O);
                 err.failure()) {
        return err;
      }
    }
    return ffi::Error::Success();
  };
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxkv dense_experts: w must be float32 or bfloat16");
  return ByExpert(x, e, wd[0], O, y->typed_data(), run);
}

// x float32 [X, I], q int8 [E, O, I] with scale [E, O, NB], e int32 [X], y [X, O].
ffi::Error DenseInt8ExpertsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q,
                                ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> e,
                                ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (x.element_type() != ffi::F32 || q.element_type() != ffi::S8 || xd.size() != 2 ||
      qd.size() != 3 || xd[1] != qd[2] || e.element_count() != xd[0] || sd.size() != 3 ||
      sd[0] != qd[0] || sd[1] != qd[1] || !ScalesFit(qd[2], sd[2]))
    return ffi::Error::InvalidArgument(
        "jaxkv dense_int8_experts: x must be float32 [X, I], q int8 [E, O, I], scale "
        "[E, O, NB] with NB == 1 or I / NB a power of two >= 16, e [X]");
  int64_t O = qd[1], I = qd[2], NB = sd[2];
  const int8_t* q_in = static_cast<const int8_t*>(q.untyped_data());
  const char* s_in = static_cast<const char*>(scale.untyped_data());
  size_t scales = O * NB * ffi::ByteWidth(scale.element_type());
  auto run = [&](int64_t ex, const void* xs, float* ys, int64_t n) {
    for (int64_t r = 0, m; r < n; r += m) {  // as dense products of at most kMaxRowsT rows
      m = std::min(kMaxRowsT, n - r);
      if (auto err = DenseInt8At(pool, q_in + ex * O * I, scale.element_type(),
                                 s_in + ex * scales, NB, static_cast<const float*>(xs) + r * I,
                                 ys + r * O, m, I, O);
          err.failure())
        return err;
    }
    return ffi::Error::Success();
  };
  return ByExpert(x, e, qd[0], O, y->typed_data(), run);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDense, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDenseT, DenseTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDenseInt8, DenseInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDenseExperts, DenseExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("outer_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDenseInt8Experts, DenseInt8ExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Rows of x one block of the outer-product form takes in this build (96 with AVX-512, 24 with
// AVX2 and NEON, 12 with SSE2): kernels.py reads it to choose one row's prefill passes.
extern "C" int64_t JaxkvOuterBlockRows() { return kMaxVectorsT * kLanes; }
