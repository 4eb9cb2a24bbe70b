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
// Quantized weights (quant.py: GGUF's blocks repacked into the same panels, 4- or 8-bit integers
// q with a scale s and min m per column and block of qk inputs, W = q * s + m, in float32, or in
// half precision where GGUF's own are (the _0 and _1 types: 5 and 9 bits a weight, not 6 and 10);
// the k's interleaved in pairs) stream the same way at a quarter or an eighth of the bytes, and the
// products are integer ones: each row of x is quantized per block to 16 bits (xq = x / dx,
// dx = max |x| / 32767: a relative error of 2^-16 of the block's largest entry, where the
// weights' own is 2^-4..2^-8), and a block's sum_k xq_k q_k is exact in int32 (VNNI's
// vpdpwssd, 32 products an instruction: twice a float FMA's). Then, in float, per block:
// y += (s * dx) * sum + m * sum_k x_k. Every step of that is exact or rounded the same way
// whatever M, the row group, the thread split or the instruction set: a row's result is the
// same bit for bit alone or in a verify step, on any of them.
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

// A quantized weight's layout (quant.py): per panel nb block rows of row_bytes, each qk k's
// of values (bits 4: PANEL / 2 bytes a k, column j in byte j % 16's low (j < 16) or high
// nibble; 8: PANEL int8; the two k's of a pair interleaved byte by byte) then PANEL scales and
// PANEL mins, float32 or (half) float16. A half is widened exactly: the products that follow
// are the float32 layout's to the bit.
struct QuantLayout {
  const uint8_t* q = nullptr;  // [P, nb, row_bytes]; null: the weight is float (Problem::w)
  // Per call (QuantizedRows): x in 16 bits [M, K], its scales and block sums [M, nb].
  const int16_t* xq = nullptr;
  const float *dx = nullptr, *xsum = nullptr;
  int bits = 0;
  bool half = false;
  int64_t qk = 0, nb = 0, row_bytes = 0;
  int kind() const {  // Isa::quant's first index
    return (half ? 3 : 0) + (bits == 4 ? 0 : qk == 32 ? 1 : 2);
  }
};

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [P, K, PANEL]
  float* y;        // [M, N]
  int64_t M, K, N, P;
  QuantLayout quant;
};

// Block rows this far ahead of the one being read are prefetched into L2 (6..10 KiB, as the
// float path's kPrefetchRows).
constexpr int64_t kPrefetchBlocks = 8;

inline void prefetch_block(const uint8_t* row, int64_t row_bytes) {
#ifdef SPECJAX_X86
  for (int64_t off = 0; off < row_bytes; off += 64)
    _mm_prefetch((const char*)(row + kPrefetchBlocks * row_bytes + off), _MM_HINT_T1);
#endif
}

// Rows of x (R of them: the template's; xq, dx and xsum at their first) times one quantized
// panel -> y (its first column).
using QuantFn = void (*)(const int16_t* xq, const float* dx, const float* xsum, int64_t K,
                         const uint8_t* panel, const QuantLayout& ql, float* y, int64_t ldy);

// One row chunk (rows rows of x) times one block of one panel: kc panel rows from w (already
// offset to the block), accumulating into y (first: start from zero). cols <= PANEL valid
// output columns.
using MicroFn = void (*)(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                         int64_t ldy, bool first, int64_t cols);

struct Isa {
  const char* name;
  int64_t max_rows;
  MicroFn micro[16];  // by rows - 1
  int64_t quant_rows;
  // [4 bits; 8 bits, qk 32; 8 bits, qk 16; the first two with half scales][rows - 1]
  QuantFn quant[5][16];
};

// One row's 16-bit pair (xq[k], xq[k + 1]) as the 32-bit word the integer dot instructions take.
inline int32_t pair(const int16_t* xq) {
  int32_t v;
  std::memcpy(&v, xq, 4);
  return v;
}

// The float end of a block, the same on every path: y += (s * dx) * float(sum) + m * xsum.
inline float block_end(float y, int32_t sum, float s, float dx, float m, float xsum) {
  return __builtin_fmaf(xsum, m, __builtin_fmaf((float)sum, s * dx, y));
}

// A half-precision value as float32 (exact: every half is a float).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float f = (float)m * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Column j's scale (what = 0) or min (what = 1) in a block row's tail.
template <bool HALF>
inline float tail_at(const uint8_t* tail, int what, int64_t j) {
  if (HALF) {
    uint16_t h;
    std::memcpy(&h, tail + 2 * (what * PANEL + j), 2);
    return half_to_float(h);
  }
  float f;
  std::memcpy(&f, tail + 4 * (what * PANEL + j), 4);
  return f;
}

// ---- portable, the reference for the vector paths below -----------------------------------
template <int BITS, int QK, bool HALF, int R>
void quant_portable(const int16_t* xq, const float* dx, const float* xsum, int64_t K,
                    const uint8_t* panel, const QuantLayout& ql, float* y, int64_t ldy) {
  float acc[R][PANEL] = {};
  for (int64_t b = 0; b < ql.nb; ++b) {
    const uint8_t* v = panel + b * ql.row_bytes;
    const uint8_t* tail = v + QK * PANEL * BITS / 8;
    int32_t c[R][PANEL] = {};
    for (int k = 0; k < QK; ++k)
      for (int64_t j = 0; j < PANEL; ++j) {
        // k's of a pair side by side: byte 2i + k % 2 of the pair's run
        const uint8_t* run = v + (k / 2) * PANEL * BITS / 4;
        const int32_t q = BITS == 4 ? (run[2 * (j % 16) + k % 2] >> (4 * (j / 16))) & 15
                                    : (int8_t)run[2 * j + k % 2];
        for (int r = 0; r < R; ++r) c[r][j] += q * xq[r * K + b * QK + k];
      }
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < PANEL; ++j)
        acc[r][j] = block_end(acc[r][j], c[r][j], tail_at<HALF>(tail, 0, j),
                              dx[r * ql.nb + b], tail_at<HALF>(tail, 1, j), xsum[r * ql.nb + b]);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < PANEL; ++j) y[r * ldy + j] = acc[r][j];
}

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

// A pair of k's 32 integers as int16 pairs: columns 0..15 and 16..31, (q[k], q[k + 1]) a lane.
template <int BITS>
__attribute__((target("avx512f,avx512bw"))) inline void q_avx512(const uint8_t* v, __m512i* a0,
                                                                 __m512i* a1) {
  if (BITS == 4) {
    const __m256i n = _mm256_loadu_si256((const __m256i*)v), low = _mm256_set1_epi8(15);
    *a0 = _mm512_cvtepu8_epi16(_mm256_and_si256(n, low));
    *a1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(n, 4), low));
  } else {
    *a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)v));
    *a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(v + 32)));
  }
}

// Up to 6 rows: 2 zmm of y and 2 of the block's integer sums a row, one vpdpwssd a 16
// columns x 2 k's. (A CPU with AVX-512 but not VNNI runs the AVX2 path's.)
// 16 of a block row's scales (what = 0) or mins (1) from column c, as floats.
template <bool HALF>
__attribute__((target("avx512f"))) inline __m512 tail16_avx512(const uint8_t* tail, int what,
                                                              int c) {
  if (HALF)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(tail + 2 * (what * PANEL + c))));
  return _mm512_loadu_ps((const float*)(tail + 4 * (what * PANEL + c)));
}

template <int BITS, int QK, bool HALF, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void quant_avx512(
    const int16_t* xq, const float* dx, const float* xsum, int64_t K, const uint8_t* panel,
    const QuantLayout& ql, float* y, int64_t ldy) {
  __m512 y0[R], y1[R];
  for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < ql.nb; ++b) {
    const uint8_t* v = panel + b * ql.row_bytes;
    prefetch_block(v, ql.row_bytes);
    const uint8_t* tail = v + QK * PANEL * BITS / 8;
    const int16_t* xb = xq + b * QK;
    __m512i c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_si512();
    for (int k = 0; k < QK; k += 2, v += PANEL * BITS / 4) {
      __m512i a0, a1;
      q_avx512<BITS>(v, &a0, &a1);
      for (int r = 0; r < R; ++r) {
        const __m512i bx = _mm512_set1_epi32(pair(xb + r * K + k));
        c0[r] = _mm512_dpwssd_epi32(c0[r], a0, bx);
        c1[r] = _mm512_dpwssd_epi32(c1[r], a1, bx);
      }
    }
    const __m512 s0 = tail16_avx512<HALF>(tail, 0, 0), s1 = tail16_avx512<HALF>(tail, 0, 16);
    const __m512 m0 = tail16_avx512<HALF>(tail, 1, 0), m1 = tail16_avx512<HALF>(tail, 1, 16);
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * ql.nb + b]);
      const __m512 xs = _mm512_set1_ps(xsum[r * ql.nb + b]);
      y0[r] = _mm512_fmadd_ps(xs, m0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0[r]),
                                                      _mm512_mul_ps(s0, d), y0[r]));
      y1[r] = _mm512_fmadd_ps(xs, m1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1[r]),
                                                      _mm512_mul_ps(s1, d), y1[r]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, y0[r]);
    _mm512_storeu_ps(y + r * ldy + 16, y1[r]);
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

// 8 of a block row's scales (what = 0) or mins (1) from column c, as floats.
template <bool HALF>
__attribute__((target("avx2,f16c"))) inline __m256 tail8_avx2(const uint8_t* tail, int what,
                                                             int c) {
  if (HALF)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tail + 2 * (what * PANEL + c))));
  return _mm256_loadu_ps((const float*)(tail + 4 * (what * PANEL + c)));
}

// Up to 3 rows, a half panel (16 columns: 2 ymm of y and 2 of integer sums a row) at a time.
template <int BITS, int QK, bool HALF, int R>
__attribute__((target("avx2,fma,f16c"))) void quant_avx2(const int16_t* xq, const float* dx,
                                                    const float* xsum, int64_t K,
                                                    const uint8_t* panel, const QuantLayout& ql,
                                                    float* y, int64_t ldy) {
  for (int h = 0; h < 2; ++h) {
    __m256 y0[R], y1[R];
    for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < ql.nb; ++b) {
      const uint8_t* v = panel + b * ql.row_bytes;
      if (h == 0) prefetch_block(v, ql.row_bytes);
      const uint8_t* tail = v + QK * PANEL * BITS / 8;
      const int16_t* xb = xq + b * QK;
      __m256i c0[R], c1[R];
      for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
      for (int k = 0; k < QK; k += 2, v += PANEL * BITS / 4) {
        __m256i a0, a1;
        if (BITS == 4) {
          __m256i n = _mm256_loadu_si256((const __m256i*)v);
          if (h == 1) n = _mm256_srli_epi16(n, 4);
          n = _mm256_and_si256(n, _mm256_set1_epi8(15));
          a0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(n));
          a1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(n, 1));
        } else {
          a0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(v + 32 * h)));
          a1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(v + 32 * h + 16)));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i bx = _mm256_set1_epi32(pair(xb + r * K + k));
          c0[r] = _mm256_add_epi32(c0[r], _mm256_madd_epi16(a0, bx));
          c1[r] = _mm256_add_epi32(c1[r], _mm256_madd_epi16(a1, bx));
        }
      }
      const __m256 s0 = tail8_avx2<HALF>(tail, 0, 16 * h);
      const __m256 s1 = tail8_avx2<HALF>(tail, 0, 16 * h + 8);
      const __m256 m0 = tail8_avx2<HALF>(tail, 1, 16 * h);
      const __m256 m1 = tail8_avx2<HALF>(tail, 1, 16 * h + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(dx[r * ql.nb + b]);
        const __m256 xs = _mm256_set1_ps(xsum[r * ql.nb + b]);
        y0[r] = _mm256_fmadd_ps(xs, m0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0[r]),
                                                        _mm256_mul_ps(s0, d), y0[r]));
        y1[r] = _mm256_fmadd_ps(xs, m1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1[r]),
                                                        _mm256_mul_ps(s1, d), y1[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ldy + 16 * h, y0[r]);
      _mm256_storeu_ps(y + r * ldy + 16 * h + 8, y1[r]);
    }
  }
}
#endif

#define SPECJAX_TABLE(FN)                                                          \
  {FN<1>, FN<2>, FN<3>, FN<4>, FN<5>, FN<6>, FN<7>, FN<8>, FN<9>, FN<10>, FN<11>, \
   FN<12>, nullptr, nullptr, nullptr, nullptr}

#define SPECJAX_QUANT(FN, B, QK, H) {FN<B, QK, H, 1>, FN<B, QK, H, 2>, FN<B, QK, H, 3>, \
                                     FN<B, QK, H, 4>}
#define SPECJAX_QUANT6(FN, B, QK, H) {FN<B, QK, H, 1>, FN<B, QK, H, 2>, FN<B, QK, H, 3>, \
                                      FN<B, QK, H, 4>, FN<B, QK, H, 5>, FN<B, QK, H, 6>}
#define SPECJAX_QUANT3(FN, B, QK, H) {FN<B, QK, H, 1>, FN<B, QK, H, 2>, FN<B, QK, H, 3>}
// Isa::quant's five kinds (QuantLayout::kind).
#define SPECJAX_KINDS(Q, FN)                                                      \
  {Q(FN, 4, 32, false), Q(FN, 8, 32, false), Q(FN, 8, 16, false), Q(FN, 4, 32, true), \
   Q(FN, 8, 32, true)}

const Isa kPortable{"portable", 4, {micro_portable<1>, micro_portable<2>, micro_portable<3>,
                                    micro_portable<4>}, 4,
                    SPECJAX_KINDS(SPECJAX_QUANT, quant_portable)};
#ifdef SPECJAX_X86
const Isa kAvx512{"avx512", 12, SPECJAX_TABLE(micro_avx512), 6,
                  SPECJAX_KINDS(SPECJAX_QUANT6, quant_avx512)};
const Isa kAvx512NoVnni{"avx512", 12, SPECJAX_TABLE(micro_avx512), 3,
                        SPECJAX_KINDS(SPECJAX_QUANT3, quant_avx2)};
const Isa kAvx2{"avx2", 3, {micro_avx2<1>, micro_avx2<2>, micro_avx2<3>}, 3,
                SPECJAX_KINDS(SPECJAX_QUANT3, quant_avx2)};
#endif

#ifdef SPECJAX_X86
const Isa* avx512() {
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")
             ? &kAvx512 : &kAvx512NoVnni;
}
#endif

const Isa* detect() {
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  const char* forced = std::getenv("SPECJAX_MATMUL_ISA");
  const bool want = forced == nullptr || forced[0] == '\0';
  if ((want || std::strcmp(forced, "avx512") == 0) && __builtin_cpu_supports("avx512f"))
    return avx512();
  if ((want || std::strcmp(forced, "avx2") == 0) && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
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
  const QuantLayout& ql = pr.quant;
  if (ql.q != nullptr) {  // every row group of each panel, the panel in L2 after the first
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < pr.M; m0 += is.quant_rows) {
        const int64_t rows = pr.M - m0 < is.quant_rows ? pr.M - m0 : is.quant_rows;
        is.quant[ql.kind()][rows - 1](ql.xq + m0 * pr.K, ql.dx + m0 * ql.nb,
                                      ql.xsum + m0 * ql.nb, pr.K,
                                      ql.q + p * ql.nb * ql.row_bytes, ql,
                                      pr.y + m0 * pr.N + p * PANEL, pr.N);
      }
    return;
  }
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

ffi::Error run(ffi::ThreadPool& pool, const Problem& pr);

ffi::Error matmul_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_matmul: expects x [M, K], w [P, K, 32], y [M, N]");
  Problem pr{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], yd[1], wd[0], {}};
  if (wd[2] != PANEL || wd[1] != pr.K || yd[0] != pr.M || pr.P * PANEL < pr.N ||
      pr.P * PANEL >= pr.N + PANEL)
    return ffi::Error::InvalidArgument("specjax_matmul: shapes do not match the packed weight");
  return run(pool, pr);
}

// The layout a quantized weight's value width and block row size name (quant.py: format_of):
// blocks of 32 with float32 or half tails, blocks of 16 (8 bits) with float32 ones.
bool quant_layout(int bits, int64_t row_bytes, QuantLayout* ql) {
  for (const bool half : {false, true})
    for (const int64_t qk : {32, 16}) {
      if ((bits == 8 || qk == 32) && (!half || qk == 32) &&
          qk * PANEL * bits / 8 + 2 * PANEL * (half ? 2 : 4) == row_bytes) {
        ql->bits = bits;
        ql->half = half;
        ql->qk = qk;
        ql->row_bytes = row_bytes;
        return true;
      }
    }
  return false;
}

// x per call, for the quantized kernels: each row's blocks of qk in 16 bits (xq = x / dx,
// rounded to nearest even, dx = max |x| / 32767) and each block's sum of x in order. Row by
// row, so a row's are the same alone or among others.
struct QuantizedRows {
  std::unique_ptr<int16_t[]> xq;
  std::unique_ptr<float[]> dx, xsum;

  QuantizedRows(const float* x, int64_t M, int64_t K, QuantLayout* ql)
      : xq(new int16_t[M * K + 2]), dx(new float[M * ql->nb + 1]),
        xsum(new float[M * ql->nb + 1]) {
    const int64_t qk = ql->qk, nb = ql->nb;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * qk;
        float amax = 0.f, sum = 0.f;
        for (int64_t k = 0; k < qk; ++k) {
          const float a = xb[k] < 0 ? -xb[k] : xb[k];
          amax = a > amax ? a : amax;
          sum += xb[k];
        }
        const float d = amax / 32767.f, inv = amax > 0 ? 32767.f / amax : 0.f;
        for (int64_t k = 0; k < qk; ++k)
          xq[r * K + b * qk + k] = (int16_t)__builtin_nearbyintf(xb[k] * inv);
        dx[r * nb + b] = d;
        xsum[r * nb + b] = sum;
      }
    ql->xq = xq.get();
    ql->dx = dx.get();
    ql->xsum = xsum.get();
  }
};

ffi::Error matmul_quant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "specjax_matmul_quant: expects x [M, K], w [P, K / qk, R], y [M, N]");
  const auto type = w.element_type();
  if (type != ffi::DataType::U8 && type != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("specjax_matmul_quant: w is uint8 (4 bits) or int8");
  Problem pr{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], yd[1], wd[0], {}};
  if (!quant_layout(type == ffi::DataType::U8 ? 4 : 8, wd[2], &pr.quant))
    return ffi::Error::InvalidArgument("specjax_matmul_quant: no layout has this row size");
  pr.quant.q = static_cast<const uint8_t*>(w.untyped_data());
  pr.quant.nb = wd[1];
  if (pr.quant.nb * pr.quant.qk != pr.K || yd[0] != pr.M || pr.P * PANEL != pr.N)
    return ffi::Error::InvalidArgument("specjax_matmul_quant: shapes do not match the weight");
  const QuantizedRows rows(pr.x, pr.M, pr.K, &pr.quant);
  return run(pool, pr);  // returns once every panel is done: `rows` outlives the work
}

ffi::Error run(ffi::ThreadPool& pool, const Problem& pr) {
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulQuant, matmul_quant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" const char* specjax_matmul_isa() { return isa().name; }

namespace {
const Isa* named(const char* name) {
  const Isa* is = std::strcmp(name, "portable") == 0 ? &kPortable : nullptr;
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  if (std::strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) is = avx512();
  if (std::strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    is = &kAvx2;
#endif
  return is;
}
}  // namespace

// The same products on the calling thread with a named instruction set, for the tests (every
// path this CPU supports, without XLA): 0, or -1 when this CPU lacks `name` (-2: a quantized
// row size no layout has).
extern "C" int specjax_matmul_run(const char* name, const float* x, const float* w, float* y,
                                  int64_t M, int64_t K, int64_t N) {
  const Isa* is = named(name);
  if (is == nullptr) return -1;
  const Problem pr{x, w, y, M, K, N, (N + PANEL - 1) / PANEL, {}};
  if (K == 0) std::memset(y, 0, sizeof(float) * M * N);
  else run_panels(pr, 0, pr.P, *is);
  return 0;
}

extern "C" int specjax_matmul_run_quant(const char* name, const float* x, const uint8_t* q,
                                        int bits, int64_t row_bytes, float* y, int64_t M,
                                        int64_t K, int64_t N) {
  const Isa* is = named(name);
  if (is == nullptr) return -1;
  Problem pr{x, nullptr, y, M, K, N, N / PANEL, {}};
  if (!quant_layout(bits, row_bytes, &pr.quant)) return -2;
  pr.quant.q = q;
  pr.quant.nb = K / pr.quant.qk;
  const QuantizedRows rows(x, M, K, &pr.quant);
  run_panels(pr, 0, pr.P, *is);
  return 0;
}
