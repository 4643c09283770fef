// What the CPU kernels share: vectors of kLanes floats (GCC's vector extensions, one register
// of the widest vector unit the build targets), and work split over XLA's intra-op pool.
// The measurements behind the choices here are in docs/kernels.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// One slot, shared by every kernel of the library (dense.cc and attend.cc), through which a
// call hands its chunks to a pool task still waiting after the last call (Linger below).
namespace jaxkv_pool {
enum : int { kIdle, kWaiting, kPosting, kPosted, kTaking, kTaken };
struct Slot {
  alignas(64) std::atomic<int> state{kIdle};
  void (*take)(void*) = nullptr;  // written between kPosting and kPosted
  void* call = nullptr;
};
inline Slot slot;
}  // namespace jaxkv_pool

namespace {

// Floats per vector, and vector registers: a vector is exactly one register, never wider. A
// vector wider than the registers GCC 12 keeps in memory, moving halves through general
// registers, several times slower.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
#elif defined(__aarch64__)
constexpr int64_t kLanes = 4;  // NEON: 32 registers of 4 floats
constexpr int kRegisters = 32;
#else
constexpr int64_t kLanes = 4;  // SSE2
constexpr int kRegisters = 16;
#endif
typedef float f32xL __attribute__((vector_size(kLanes * 4)));

// IEEE float16 (int8 blocks' scales): GCC 12 has _Float16 in C++ on x86 only, __fp16 on ARM.
#if defined(__aarch64__) || defined(__arm__)
typedef __fp16 Half;
#else
typedef _Float16 Half;
#endif

inline f32xL load_f32(const float* p) {
  f32xL v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// kLanes int8 -> float32 (GCC's generic vector conversion goes element by element: a load,
// a conversion and a lane insert per weight on ARM as on x86).
inline f32xL int8_lanes(const int8_t* p) {
  f32xL v;
#if defined(__AVX512F__)
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  std::memcpy(&v, &f, sizeof v);
#elif defined(__aarch64__)
  int32_t four;  // exactly kLanes bytes: the last lanes of a row may end its buffer
  std::memcpy(&four, p, sizeof four);
  int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
  float32x4_t f = vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
  std::memcpy(&v, &f, sizeof v);
#else
  for (int64_t i = 0; i < kLanes; ++i) v[i] = p[i];
#endif
  return v;
}

// kLanes bfloat16 -> float32: one widening load and a shift, written out with intrinsics
// because GCC's generic vector conversion widens each half on its own and joins them (5
// instructions), which slowed bfloat16 decode attention noticeably.
inline f32xL load_bf16(const uint16_t* p) {
  f32xL v;
#if defined(__AVX512F__)
  __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)),
                                   16);
  std::memcpy(&v, &bits, sizeof v);
#elif defined(__AVX2__)
  __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  std::memcpy(&v, &bits, sizeof v);
#else
  typedef uint16_t u16xL __attribute__((vector_size(kLanes * 2)));
  typedef uint32_t u32xL __attribute__((vector_size(kLanes * 4)));
  u16xL half;
  std::memcpy(&half, p, sizeof half);
  u32xL bits = __builtin_convertvector(half, u32xL) << 16;
  std::memcpy(&v, &bits, sizeof v);
#endif
  return v;
}

// s in every lane: one broadcast. (A loop over the lanes, which GCC 12 turned into a broadcast
// with AVX-512, became a chain of lane inserts with AVX2: 2-3 shuffles per multiply-add in the
// attention kernel's loops.)
inline f32xL splat(float s) {
  f32xL v;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(s);
  std::memcpy(&v, &m, sizeof v);
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(s);
  std::memcpy(&v, &m, sizeof v);
#elif defined(__aarch64__)
  float32x4_t m = vdupq_n_f32(s);
  std::memcpy(&v, &m, sizeof v);
#else
  for (int64_t i = 0; i < kLanes; ++i) v[i] = s;
#endif
  return v;
}

// The sum of v's lanes: pairwise where the instruction set has it (a loop over the lanes is a
// chain of scalar adds: 3 a sum on ARM, which GCC 12 left as 3 extractions and 3 adds).
inline float sum_lanes(f32xL v) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof m);
  return _mm512_reduce_add_ps(m);
#elif defined(__aarch64__)
  float32x4_t m;
  std::memcpy(&m, &v, sizeof m);
  return vaddvq_f32(m);
#else
  float s = 0;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// Chunks of work claimed from one counter by the calling thread and by tasks on XLA's
// intra-op pool. A task that starts after every chunk is claimed returns without touching the
// buffers, so the call may return while it is still queued.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n;
  explicit Claims(int64_t n_chunks) : n(n_chunks) {}
  template <typename F>
  void Run(const F& work) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      work(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// How long a pool task that has done its chunks waits for the next call's work. Returned to
// XLA's pool, its thread spins only a few microseconds before it sleeps, and waking it costs
// the next call's caller several more (a futex in a VM). Waiting this long lets a decode step's
// many short calls hand their chunks to a thread still awake; it helps most where hand-offs
// between cores are slow. Much shorter gained little; much longer slowed a loop of decode
// steps.
constexpr std::chrono::microseconds kLinger{100};

// Runs the calls posted to the slot, if no other task waits there, until kLinger passes with
// none.
inline void Linger() {
  using namespace jaxkv_pool;
  int state = kIdle;
  if (!slot.state.compare_exchange_strong(state, kWaiting)) return;
  for (auto since = std::chrono::steady_clock::now();;) {
    state = slot.state.load(std::memory_order_acquire);
    if (state == kPosted && slot.state.compare_exchange_strong(state, kTaking)) {
      slot.take(slot.call);  // copies what it needs, marks kTaken, runs the call's chunks
      slot.state.store(kWaiting, std::memory_order_release);
      since = std::chrono::steady_clock::now();
    } else if (state == kWaiting && std::chrono::steady_clock::now() - since > kLinger &&
               slot.state.compare_exchange_strong(state, kIdle)) {
      return;
    }
    Pause();
  }
}

// A call as posted to the slot: its claims and work, in the caller's frame until taken.
template <typename Work>
struct Posted {
  std::shared_ptr<Claims> claims;
  const Work* work;
  static void Take(void* p) {
    auto* posted = static_cast<Posted*>(p);
    std::shared_ptr<Claims> claims = posted->claims;
    const Work* work = posted->work;
    jaxkv_pool::slot.state.store(jaxkv_pool::kTaken, std::memory_order_release);
    claims->Run(*work);
  }
};

// work(c) for c in [0, n), claimed by the calling thread and up to threads - 1 helpers: a pool
// task waiting in the slot, then new tasks on the pool, each of which lingers, once it has run
// a chunk, where the caller says `linger`: short calls, as a decode step makes. After a long
// call (a prefill's attention) lingering tasks would only slow XLA's products that follow.
template <typename Work>
void RunTasks(ffi::ThreadPool pool, int64_t n, const Work& work, bool linger) {
  using namespace jaxkv_pool;
  auto claims = std::make_shared<Claims>(n);
  int64_t helpers = std::min(std::max<int64_t>(1, pool.num_threads()), n) - 1;
  Posted<Work> posted{claims, &work};
  int state = kWaiting;
  bool in_slot = helpers > 0 && slot.state.load(std::memory_order_relaxed) == kWaiting &&
                 slot.state.compare_exchange_strong(state, kPosting);
  if (in_slot) {
    slot.take = &Posted<Work>::Take;
    slot.call = &posted;
    slot.state.store(kPosted, std::memory_order_release);
  }
  // Tasks must not reference this frame once every chunk is claimed: they only reach `work`
  // through a claim, and the caller waits for every claimed chunk to be done.
  for (int64_t t = in_slot; t < helpers; ++t) {
    pool.Schedule([claims, &work, linger] {
      bool ran = claims->next.load(std::memory_order_relaxed) < claims->n;
      claims->Run(work);
      if (ran && linger) Linger();
    });
  }
  claims->Run(work);
  state = kPosted;  // withdraw the post if no task took it; else wait until it has copied it
  if (in_slot && !slot.state.compare_exchange_strong(state, kWaiting)) {
    while (slot.state.load(std::memory_order_acquire) == kTaking) Pause();
  }
  while (claims->done.load(std::memory_order_acquire) < n) Pause();
}

}  // namespace
