// y[M, N] = x[M, K] @ W[K, N] for the shapes decoding makes on a CPU: a few rows (batch x
// query tokens) against a weight read from memory once per call.
//
// W arrives packed at load (reference.py: pack_weight) as panels of PANEL columns,
// w[p, k, j] = W[k, p * PANEL + j], so each thread streams whole panels front to back. A
// panel's rows are walked a block of KB at a time while that block sits in L1, and every row
// chunk of x reuses it there: the weight crosses the memory bus once whatever M is, which is
// what XLA:CPU's multi-row dot does not do (issue 61: a 5-row dot cost 2.17x a 1-row one).
//
// Every output element is one FMA chain over k in increasing order, whatever M, the row chunk
// or the thread split: a row's result is bit-identical alone or among many, so a verify step's
// logits equal the plain step's exactly (greedy speculative output equals plain greedy).
//
// ISA chosen at run time (AVX-512F, AVX2+FMA, portable C++); threads from XLA's intra-op pool.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t PANEL = 32;  // columns per packed panel (reference.py: PANEL)
constexpr int64_t KB = 128;    // panel rows per L1 block: 128 x 32 x 4 B = 16 KiB
// Prefetch into L2 this many panel rows (8 KiB) ahead. The hardware prefetcher stops at every
// 4 KiB page (32 panel rows), and once a few rows' FMAs stand between two loads the core no
// longer keeps enough misses in flight on its own: without it, 5 rows streamed the LM head at
// half the rate of 1 (2-core Xeon). Into L1 instead, the core's few line-fill buffers cap the
// stream; 64..512 rows ahead measured alike, 16..32 worse.
constexpr int64_t kPrefetchRows = 64;

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [P, K, PANEL]
  float* y;        // [M, N]
  int64_t M, K, N, P;
};

// One row chunk (rows rows of x) times one block of one panel: kc panel rows from w (already
// offset to the block), accumulating into y (first: start from zero). cols <= PANEL valid
// output columns.
using MicroFn = void (*)(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                         int64_t ldy, bool first, int64_t cols);

struct Isa {
  const char* name;
  int64_t max_rows;
  MicroFn micro[16];  // by rows - 1
};

// ---- portable ---------------------------------------------------------------------------
template <int R>
void micro_portable(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                    int64_t ldy, bool first, int64_t cols) {
  float acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < PANEL; ++j) acc[r][j] = (first || j >= cols) ? 0.f : y[r * ldy + j];
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = w + k * PANEL;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t j = 0; j < PANEL; ++j) acc[r][j] = __builtin_fmaf(xv, wk[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[r][j];
}

#ifdef SPECJAX_X86
// ---- AVX-512: a panel is two zmm; up to 12 rows = 24 accumulators -----------------------
template <int R>
__attribute__((target("avx512f"))) void micro_avx512(const float* x, int64_t ldx,
                                                     const float* w, int64_t kc, float* y,
                                                     int64_t ldy, bool first, int64_t cols) {
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    if (first) {
      a0[r] = _mm512_setzero_ps();
      a1[r] = _mm512_setzero_ps();
    } else {
      a0[r] = _mm512_maskz_loadu_ps(m0, y + r * ldy);
      a1[r] = _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    _mm_prefetch((const char*)(w + (k + kPrefetchRows) * PANEL), _MM_HINT_T1);
    _mm_prefetch((const char*)(w + (k + kPrefetchRows) * PANEL + 16), _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(w + k * PANEL);
    const __m512 w1 = _mm512_loadu_ps(w + k * PANEL + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1[r]);
  }
}

// ---- AVX2 + FMA: a panel is four ymm; up to 3 rows = 12 accumulators --------------------
__attribute__((target("avx2"))) inline __m256i lane_mask(int64_t valid) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 0 ? 0 : valid > 8 ? 8 : valid)),
                            idx);
}

template <int R>
__attribute__((target("avx2,fma"))) void micro_avx2(const float* x, int64_t ldx,
                                                    const float* w, int64_t kc, float* y,
                                                    int64_t ldy, bool first, int64_t cols) {
  __m256i m[4];
  for (int v = 0; v < 4; ++v) m[v] = lane_mask(cols - 8 * v);
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      a[r][v] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(y + r * ldy + 8 * v, m[v]);
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = w + k * PANEL;
    _mm_prefetch((const char*)(wk + kPrefetchRows * PANEL), _MM_HINT_T1);
    _mm_prefetch((const char*)(wk + kPrefetchRows * PANEL + 16), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
    const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      a[r][0] = _mm256_fmadd_ps(b, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(b, w1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(b, w2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(b, w3, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_maskstore_ps(y + r * ldy + 8 * v, m[v], a[r][v]);
}
#endif

#define SPECJAX_TABLE(FN)                                                          \
  {FN<1>, FN<2>, FN<3>, FN<4>, FN<5>, FN<6>, FN<7>, FN<8>, FN<9>, FN<10>, FN<11>, \
   FN<12>, nullptr, nullptr, nullptr, nullptr}

const Isa kPortable{"portable", 4, {micro_portable<1>, micro_portable<2>, micro_portable<3>,
                                    micro_portable<4>}};
#ifdef SPECJAX_X86
const Isa kAvx512{"avx512", 12, SPECJAX_TABLE(micro_avx512)};
const Isa kAvx2{"avx2", 3, {micro_avx2<1>, micro_avx2<2>, micro_avx2<3>}};
#endif

const Isa* detect() {
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  const char* forced = std::getenv("SPECJAX_MATMUL_ISA");
  const bool want = forced == nullptr || forced[0] == '\0';
  if ((want || std::strcmp(forced, "avx512") == 0) && __builtin_cpu_supports("avx512f"))
    return &kAvx512;
  if ((want || std::strcmp(forced, "avx2") == 0) && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma"))
    return &kAvx2;
#endif
  return &kPortable;
}

const Isa& isa() {
  static const Isa* chosen = detect();
  return *chosen;
}

// Panels [p0, p1) of the problem: every row chunk of every block of each panel.
void run_panels(const Problem& pr, int64_t p0, int64_t p1, const Isa& is = isa()) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = pr.w + p * pr.K * PANEL;
    const int64_t cols = pr.N - p * PANEL < PANEL ? pr.N - p * PANEL : PANEL;
    for (int64_t k0 = 0; k0 < pr.K; k0 += KB) {
      const int64_t kc = pr.K - k0 < KB ? pr.K - k0 : KB;
      for (int64_t m0 = 0; m0 < pr.M; m0 += is.max_rows) {
        const int64_t rows = pr.M - m0 < is.max_rows ? pr.M - m0 : is.max_rows;
        is.micro[rows - 1](pr.x + m0 * pr.K + k0, pr.K, wp + k0 * PANEL, kc,
                           pr.y + m0 * pr.N + p * PANEL, pr.N, k0 == 0, cols);
      }
    }
  }
}

// Panels are dealt out in contiguous chunks, claimed from a shared counter by the calling
// thread and the pool's tasks alike: a task that starts late finds nothing left and returns,
// so a busy pool never makes the call wait for work it has not begun.
struct Job {
  Problem pr;
  int64_t chunks, per_chunk;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t p0 = c * per_chunk;
      const int64_t p1 = p0 + per_chunk < pr.P ? p0 + per_chunk : pr.P;
      run_panels(pr, p0, p1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Below this many multiply-adds a call runs on the calling thread alone: waking a worker
// costs more than it saves.
constexpr int64_t kParallelMin = 1 << 18;

ffi::Error matmul_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_matmul: expects x [M, K], w [P, K, 32], y [M, N]");
  Problem pr{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], yd[1], wd[0]};
  if (wd[2] != PANEL || wd[1] != pr.K || yd[0] != pr.M || pr.P * PANEL < pr.N ||
      pr.P * PANEL >= pr.N + PANEL)
    return ffi::Error::InvalidArgument("specjax_matmul: shapes do not match the packed weight");
  if (pr.M == 0 || pr.N == 0) return ffi::Error::Success();
  if (pr.K == 0) {
    std::memset(pr.y, 0, sizeof(float) * pr.M * pr.N);
    return ffi::Error::Success();
  }
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || pr.M * pr.K * pr.N < kParallelMin || pr.P < 2) {
    run_panels(pr, 0, pr.P);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->pr = pr;
  // A few chunks per thread: a late or slower thread leaves its tail to the others.
  const int64_t want = threads * 4 < pr.P ? threads * 4 : pr.P;
  job->per_chunk = (pr.P + want - 1) / want;
  job->chunks = (pr.P + job->per_chunk - 1) / job->per_chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
#ifdef SPECJAX_X86
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulF32, matmul_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" const char* specjax_matmul_isa() { return isa().name; }

// The same product on the calling thread with a named instruction set, for the tests (every
// path this CPU supports, without XLA): 0, or -1 when this CPU lacks `name`.
extern "C" int specjax_matmul_run(const char* name, const float* x, const float* w, float* y,
                                  int64_t M, int64_t K, int64_t N) {
  const Isa* is = std::strcmp(name, "portable") == 0 ? &kPortable : nullptr;
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) is = &kAvx512;
  if (std::strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma"))
    is = &kAvx2;
#endif
  if (is == nullptr) return -1;
  const Problem pr{x, w, y, M, K, N, (N + PANEL - 1) / PANEL};
  if (K == 0) std::memset(y, 0, sizeof(float) * M * N);
  else run_panels(pr, 0, pr.P, *is);
  return 0;
}
