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
// Quantized weights (quant.py: each GGUF type's own fields regrouped into the same panels, a
// super-block row at a time: 4-bit low planes, 1- or 2-bit high planes, integer sub-block scales
// and mins, half-precision d and dmin; about the file's bytes) stream the same way, and the
// products are integer ones: each row of x is quantized per sub-block of qs to about 16 bits
// (v = x / dx, dx = max |x| / 32258, held as two signed bytes v = 254 hi + lo: 8-bit x, as
// llama.cpp's Q8 activations, moves a 135M model's logits by 2.7 where its dequantized weights
// keep them within 0.05), and a sub-block's sum_k v_k q_k is exact in int32 (vpmaddubsw on each
// byte, vpmaddwd by 254 and by 1). Then, in float, per sub-block: y += (s * dx) * sum + m * dx *
// sum_k v_k, s = d * sc and m = -dmin * mn formed exactly from the fields. Every step of that is exact or
// rounded the same way whatever M, the row group, the thread split or the instruction set: a
// row's result is the same bit for bit alone or in a verify step, on any of them.
//
// A weight whose bytes arrive as int8 (quant.with_8bit_x) asks for x in 8 bits instead, as
// llama.cpp's Q8 activations: v = 254 round(127 x / max |x|), the same dx, so lo = 0 and every
// path computes the same integers; the AVX2 and VNNI kernels skip the zero low bytes (half the
// vpmaddubsw, which bounds them on AVX2-only cores; half the vpdpbusd). Still row by row:
// exact speculation holds.
//
// ISA chosen at run time (AVX-512 VNNI, AVX-512F, AVX2+FMA, portable C++); threads from XLA's
// intra-op pool. AVX-512 machines without VNNI run the AVX2 path's quantized kernels.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

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
// A quantized panel is prefetched this many bytes ahead of the super-block row being read
// (as the float path's 8 KiB).
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes) {
#ifdef SPECJAX_X86
  for (int64_t off = 0; off < row_bytes; off += 64)
    _mm_prefetch((const char*)(row + kPrefetchBytes + off), _MM_HINT_T1);
#endif
}

// A quantized weight's type (quant.py: FORMATS, the same fields): inputs a super-block row
// covers (sb) and a sub-block scale covers (qs, the block x is rounded in), value bits above
// the low nibble, integer fields a column and sub-block, half fields a column and super-block.
struct QuantType {
  int sb, qs, high, ints, halves;
  bool int8;
  int subs() const { return sb / qs; }
  int64_t sub_bytes() const { return int8 ? qs * PANEL : qs * PANEL / 2 + qs * 4 * high; }
  int64_t ints_at() const { return subs() * sub_bytes(); }
  int64_t halves_at() const { return ints_at() + subs() * PANEL * ints; }
  int64_t row_bytes() const { return halves_at() + 2 * PANEL * halves; }
};

// quant.TYPES order.
enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, kTypes };
constexpr QuantType kTypeOf[kTypes] = {
    {32, 32, 0, 0, 1, true}, {32, 32, 0, 0, 1, false}, {32, 32, 0, 0, 2, false},
    {32, 32, 1, 0, 1, false}, {32, 32, 1, 0, 2, false}, {256, 32, 0, 2, 2, false},
    {256, 32, 1, 2, 2, false}, {256, 16, 2, 1, 1, false}};

// The type whose packed super-block row is `row_bytes` long (quant.format_of), or -1.
int type_of_row(int64_t row_bytes) {
  for (int t = 0; t < kTypes; ++t)
    if (kTypeOf[t].row_bytes() == row_bytes) return t;
  return -1;
}

struct QuantLayout {
  const uint8_t* q = nullptr;  // [P, nsb, row_bytes]; null: the weight is float (Problem::w)
  // Per call (QuantizedRows): x in 8 bits [M, K]; per block of qs: its scale, its float sum
  // and its sum of the 8-bit values [M, nb].
  const int8_t* xq = nullptr;
  const float *dx = nullptr, *xsum = nullptr;
  const int32_t* xqsum = nullptr;
  int type = 0;
  int64_t nsb = 0, nb = 0, row_bytes = 0;
  bool x8 = false;  // x rounded to 8 bits: its low bytes are zero (QuantizedRows)
};

// A run of consecutive rows of x, none of them zero, at most the ISA's row count.
struct RowGroup {
  int64_t m0, rows;
};

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [P, K, PANEL]
  float* y;        // [M, N]
  int64_t M, K, N, P;
  QuantLayout quant;
  const RowGroup* groups = nullptr;  // RowGroups: the rows to compute
  int64_t ngroups = 0;
};

// A step's padding rows reach the kernel as zeros (specjax.core.forward zeroes them, and a
// zero row stays zero through norms and bias-free projections): a zero row's product is +0
// in every column, in the kernel's arithmetic too (fma(+-0, w, +0) = +0 for finite w), so it
// is written once and skipped. A 16-token prompt in a 64-wide prefill chunk multiplies 16
// rows, not 64; an idle slot of a batch bucket costs nothing.
struct RowGroups {
  std::vector<RowGroup> list;
  int64_t live = 0;

  RowGroups(const float* x, int64_t M, int64_t K, int64_t max_rows, float* y, int64_t N) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      bool zero = true;
      for (int64_t k = 0; k < K && zero; ++k) zero = xr[k] == 0.f;
      if (zero) {
        std::memset(y + m * N, 0, sizeof(float) * N);
        continue;
      }
      ++live;
      if (!list.empty() && list.back().m0 + list.back().rows == m &&
          list.back().rows < max_rows)
        ++list.back().rows;
      else
        list.push_back({m, 1});
    }
  }
  void into(Problem* pr) const {
    pr->groups = list.data();
    pr->ngroups = (int64_t)list.size();
  }
};

// Rows of x (R of them: the template's; xq, dx, xsum, xqsum at their first) times one
// quantized panel -> y (its first column).
using QuantFn = void (*)(const QuantLayout& ql, int64_t K, const int8_t* xq, const float* dx,
                         const float* xsum, const int32_t* xqsum, const uint8_t* panel,
                         float* y, int64_t ldy);

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
  QuantFn quant[kTypes][4];  // [type][rows - 1]
  // The same products where x's low bytes are all zero (8-bit x: QuantizedRows), free to skip
  // them: the integers, and so every result, are the ones `quant` computes.
  QuantFn quant8[kTypes][4];
};

// One row's quad xq[k..k + 3] as the 32-bit word the integer dot instructions take.
inline int32_t quad(const int8_t* xq) {
  int32_t v;
  std::memcpy(&v, xq, 4);
  return v;
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

// Types with a min term (m * sum_k x_k): all but Q8_0 and Q6_K (whose -32 offset is summed in
// integers: sum q x - 32 sum xq).
constexpr bool has_min(int T) { return T != Q8_0 && T != Q6_K; }

// ---- portable, the reference for the vector paths below -----------------------------------
// Column j's value at k of a sub-block (quant.py's planes).
template <int T>
inline int32_t value_at(const uint8_t* sub, int k, int64_t j) {
  constexpr QuantType t = kTypeOf[T];
  const int e = k % 4, g = k / 4;
  if (t.int8) return (int8_t)sub[g * 4 * PANEL + 4 * j + e];
  const int64_t v = j / 16, h = (j / 8) % 2, c = j % 8;
  int32_t q = (sub[g * 2 * PANEL + PANEL * v + 4 * c + e] >> (4 * h)) & 15;
  if (t.high) {
    constexpr int per = t.high ? 2 / t.high : 1;
    const uint8_t* chunk = sub + t.qs * PANEL / 2 + (g / per) * PANEL;
    q |= ((chunk[4 * c + e] >> ((((g % per) * 2 + v) * 2 + h) * t.high)) &
          ((1 << t.high) - 1)) << 4;
  }
  return q;
}

// Column j's scale and min for sub-block s of a super-block row (quant.py's _scale_min, the
// same products in the same order).
template <int T>
inline void scale_min_at(const uint8_t* row, int s, int64_t j, float* scale, float* mn) {
  constexpr QuantType t = kTypeOf[T];
  uint16_t h;
  std::memcpy(&h, row + t.halves_at() + 2 * j, 2);
  const float d = half_to_float(h);
  float d2 = 0.f;
  if (t.halves == 2) {
    std::memcpy(&h, row + t.halves_at() + 2 * PANEL + 2 * j, 2);
    d2 = half_to_float(h);
  }
  const uint8_t* ints = row + t.ints_at();
  if (T == Q6_K) {
    *scale = d * (float)(int8_t)ints[s * PANEL + j];
  } else if (t.ints == 2) {
    *scale = d * (float)ints[s * PANEL + j];
    *mn = -(d2 * (float)ints[(t.subs() + s) * PANEL + j]);
  } else {
    *scale = d;
    *mn = t.halves == 2 ? d2 : (float)(-(8 << t.high)) * d;
  }
}

template <int T, int R>
void quant_portable(const QuantLayout& ql, int64_t K, const int8_t* xq, const float* dx,
                    const float* xsum, const int32_t* xqsum, const uint8_t* panel, float* y,
                    int64_t ldy) {
  constexpr QuantType t = kTypeOf[T];
  float acc[R][PANEL] = {};
  for (int64_t sb = 0; sb < ql.nsb; ++sb) {
    const uint8_t* row = panel + sb * ql.row_bytes;
    for (int s = 0; s < t.subs(); ++s) {
      const uint8_t* sub = row + s * t.sub_bytes();
      const int64_t b = sb * t.subs() + s;  // x's block
      int32_t c[R][PANEL] = {};
      for (int k = 0; k < t.qs; ++k)
        for (int64_t j = 0; j < PANEL; ++j) {
          const int32_t q = value_at<T>(sub, k, j);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xq + 2 * r * K + b * t.qs + k;
            c[r][j] += q * (254 * xr[0] + xr[K]);
          }
        }
      for (int64_t j = 0; j < PANEL; ++j) {
        float scale, mn = 0.f;
        scale_min_at<T>(row, s, j, &scale, &mn);
        for (int r = 0; r < R; ++r) {
          const int32_t sum = T == Q6_K ? c[r][j] - 32 * xqsum[r * ql.nb + b] : c[r][j];
          float v = __builtin_fmaf((float)sum, scale * dx[r * ql.nb + b], acc[r][j]);
          if (has_min(T)) v = __builtin_fmaf(xsum[r * ql.nb + b], mn, v);
          acc[r][j] = v;
        }
      }
    }
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

// 8 half fields from column c as floats.
__attribute__((target("avx2,f16c"))) inline __m256 halves8(const uint8_t* at, int c) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(at + 2 * c)));
}

// 8 integer fields (one byte each, signed for Q6_K) from column c as floats.
template <bool SIGNED>
__attribute__((target("avx2"))) inline __m256 ints8(const uint8_t* at, int c) {
  const __m128i b = _mm_loadl_epi64((const __m128i*)(at + c));
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// Quad g of a sub-block, half v of the panel (columns 16 v .. 16 v + 15) as bytes, four k's
// a lane: columns 16 v + 0..7 in w0, 16 v + 8..15 in w1 (unsigned; Q8_0's signed).
template <int T>
__attribute__((target("avx2"))) inline void quad_values(const uint8_t* sub, int g, int v,
                                                       __m256i* w0, __m256i* w1) {
  constexpr QuantType t = kTypeOf[T];
  if (t.int8) {
    *w0 = _mm256_loadu_si256((const __m256i*)(sub + g * 4 * PANEL + 2 * PANEL * v));
    *w1 = _mm256_loadu_si256((const __m256i*)(sub + g * 4 * PANEL + 2 * PANEL * v + PANEL));
    return;
  }
  const __m256i n = _mm256_loadu_si256((const __m256i*)(sub + g * 2 * PANEL + PANEL * v));
  const __m256i low = _mm256_set1_epi8(15);
  *w0 = _mm256_and_si256(n, low);
  *w1 = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
  if (t.high) {
    // bits ((2 (g % per) + v) 2 + h) high (and the next, for 2) of each byte -> bits 4 (, 5):
    // a 16-bit shift moves both bytes' bits alike; the mask drops what crossed between them
    constexpr int per = t.high ? 2 / t.high : 1;
    const __m256i chunk = _mm256_loadu_si256(
        (const __m256i*)(sub + t.qs * PANEL / 2 + (g / per) * PANEL));
    const __m256i mask = _mm256_set1_epi8(t.high == 1 ? 0x10 : 0x30);
    __m256i* w[2] = {w0, w1};
    for (int h = 0; h < 2; ++h) {
      const int at = (((g % per) * 2 + v) * 2 + h) * t.high;
      const __m256i b = at <= 4 ? _mm256_sll_epi16(chunk, _mm_cvtsi32_si128(4 - at))
                                : _mm256_srl_epi16(chunk, _mm_cvtsi32_si128(at - 4));
      *w[h] = _mm256_or_si256(*w[h], _mm256_and_si256(b, mask));
    }
  }
}

// Up to 3 rows, a half panel (16 columns: 2 ymm of y and 2 of integer sums a row) at a time.
// vpmaddubsw multiplies unsigned values by x's signed bytes, two products a 16-bit lane (at
// most 2 x 128 x 127: no saturation), vpmaddwd by 254 (hi bytes) and by 1 (lo bytes) sums a
// column's four into int32; Q8_0's signed values go in as their magnitudes, their signs moved
// onto x (vpsignb).
template <int T, int R, bool LO = true>
__attribute__((target("avx2,fma,f16c"))) void quant_avx2(
    const QuantLayout& ql, int64_t K, const int8_t* xq, const float* dx, const float* xsum,
    const int32_t* xqsum, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr QuantType t = kTypeOf[T];
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i ones = _mm256_set1_epi16(1), w254 = _mm256_set1_epi16(254);
  for (int v = 0; v < 2; ++v) {
    __m256 y0[R], y1[R];
    for (int r = 0; r < R; ++r) y0[r] = y1[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < ql.nsb; ++sb) {
      const uint8_t* row = panel + sb * ql.row_bytes;
      if (v == 0) prefetch_ahead(row, ql.row_bytes);
      const uint8_t* halves = row + t.halves_at();
      const __m256 d0 = halves8(halves, 16 * v), d1 = halves8(halves, 16 * v + 8);
      __m256 e0 = d0, e1 = d1;  // the second half field (dmin, m), else d
      if (t.halves == 2) {
        e0 = halves8(halves + 2 * PANEL, 16 * v);
        e1 = halves8(halves + 2 * PANEL, 16 * v + 8);
      }
      for (int s = 0; s < t.subs(); ++s) {
        const uint8_t* sub = row + s * t.sub_bytes();
        const int64_t b = sb * t.subs() + s;
        const int8_t* xb = xq + b * t.qs;
        __m256i c0[R], c1[R];
        for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
        // F quads' byte products add up in int16 before one vpmaddwd each (F x 2 x 127 x the
        // largest value fits: 8 quads of 4-bit values, 4 of 5-bit, 2 of 6-bit, 1 of Q8_0's).
        constexpr int F = t.int8 ? 1 : t.high == 0 ? 8 : t.high == 1 ? 4 : 2;
        for (int g0 = 0; g0 < t.qs / 4; g0 += F) {
          __m256i h0[R], h1[R], l0[R], l1[R];
          for (int r = 0; r < R; ++r)
            h0[r] = h1[r] = l0[r] = l1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int g = g0; g < g0 + F; ++g) {
            __m256i w0, w1;
            quad_values<T>(sub, g, v, &w0, &w1);
            __m256i a0 = w0, a1 = w1;
            if (t.int8) a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = xb + 2 * r * K + 4 * g;
              const __m256i bh = _mm256_set1_epi32(quad(xr)), bl = _mm256_set1_epi32(quad(xr + K));
              h0[r] = _mm256_add_epi16(h0[r], _mm256_maddubs_epi16(a0, t.int8 ? _mm256_sign_epi8(bh, w0) : bh));
              h1[r] = _mm256_add_epi16(h1[r], _mm256_maddubs_epi16(a1, t.int8 ? _mm256_sign_epi8(bh, w1) : bh));
              if (LO) {
                l0[r] = _mm256_add_epi16(l0[r], _mm256_maddubs_epi16(a0, t.int8 ? _mm256_sign_epi8(bl, w0) : bl));
                l1[r] = _mm256_add_epi16(l1[r], _mm256_maddubs_epi16(a1, t.int8 ? _mm256_sign_epi8(bl, w1) : bl));
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            if (LO) {
              c0[r] = _mm256_add_epi32(c0[r], _mm256_add_epi32(_mm256_madd_epi16(h0[r], w254),
                                                               _mm256_madd_epi16(l0[r], ones)));
              c1[r] = _mm256_add_epi32(c1[r], _mm256_add_epi32(_mm256_madd_epi16(h1[r], w254),
                                                               _mm256_madd_epi16(l1[r], ones)));
            } else {
              c0[r] = _mm256_add_epi32(c0[r], _mm256_madd_epi16(h0[r], w254));
              c1[r] = _mm256_add_epi32(c1[r], _mm256_madd_epi16(h1[r], w254));
            }
          }
        }
        __m256 s0 = d0, s1 = d1, m0 = d0, m1 = d1;
        const uint8_t* ints = row + t.ints_at() + s * PANEL + 16 * v;
        if (T == Q6_K) {
          s0 = _mm256_mul_ps(d0, ints8<true>(ints, 0));
          s1 = _mm256_mul_ps(d1, ints8<true>(ints, 8));
        } else if (t.ints == 2) {
          s0 = _mm256_mul_ps(d0, ints8<false>(ints, 0));
          s1 = _mm256_mul_ps(d1, ints8<false>(ints, 8));
          const uint8_t* mins = ints + t.subs() * PANEL;
          m0 = _mm256_xor_ps(sign, _mm256_mul_ps(e0, ints8<false>(mins, 0)));
          m1 = _mm256_xor_ps(sign, _mm256_mul_ps(e1, ints8<false>(mins, 8)));
        } else if (t.halves == 2) {
          m0 = e0, m1 = e1;
        } else {
          const __m256 off = _mm256_set1_ps((float)(-(8 << t.high)));
          m0 = _mm256_mul_ps(off, d0), m1 = _mm256_mul_ps(off, d1);
        }
        for (int r = 0; r < R; ++r) {
          if (T == Q6_K) {
            const __m256i o = _mm256_set1_epi32(32 * xqsum[r * ql.nb + b]);
            c0[r] = _mm256_sub_epi32(c0[r], o);
            c1[r] = _mm256_sub_epi32(c1[r], o);
          }
          const __m256 d = _mm256_set1_ps(dx[r * ql.nb + b]);
          y0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0[r]), _mm256_mul_ps(s0, d), y0[r]);
          y1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1[r]), _mm256_mul_ps(s1, d), y1[r]);
          if (has_min(T)) {
            const __m256 xs = _mm256_set1_ps(xsum[r * ql.nb + b]);
            y0[r] = _mm256_fmadd_ps(xs, m0, y0[r]);
            y1[r] = _mm256_fmadd_ps(xs, m1, y1[r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ldy + 16 * v, y0[r]);
      _mm256_storeu_ps(y + r * ldy + 16 * v + 8, y1[r]);
    }
  }
}

// ---- AVX-512 VNNI: a whole panel (two zmm of y a row) a super-block row at a time -----------
#define SPECJAX_VNNI "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c"

// Columns in a zmm's two halves (8 lanes each): the nibble types' bytes hold columns c and
// 8 + c of each half panel, so a quad's 64 bytes give [0..7, 16..23] in their low nibbles (a)
// and [8..15, 24..31] in their high ones (b); Q8_0's four k's a column run in column order.
template <int T> constexpr int lane_col(int which, int half) {
  return kTypeOf[T].int8 ? 16 * which + 8 * half : 8 * which + 16 * half;
}

// 16 half fields (columns lane_col(which, 0) + 0..7, lane_col(which, 1) + 0..7) as floats.
template <int T>
__attribute__((target(SPECJAX_VNNI))) inline __m512 halves16(const uint8_t* at, int which) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)(at + 2 * lane_col<T>(which, 0)));
  const __m128i hi = _mm_loadu_si128((const __m128i*)(at + 2 * lane_col<T>(which, 1)));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// 16 integer fields (a byte each, signed for Q6_K) in the same lane order, as floats.
template <int T, bool SIGNED>
__attribute__((target(SPECJAX_VNNI))) inline __m512 ints16(const uint8_t* at, int which) {
  const __m128i b = _mm_unpacklo_epi64(
      _mm_loadl_epi64((const __m128i*)(at + lane_col<T>(which, 0))),
      _mm_loadl_epi64((const __m128i*)(at + lane_col<T>(which, 1))));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// Quad g of a sub-block as unsigned bytes, four k's a lane, in lane_col's order. Q8_0's signed
// values go in offset by 128 (vpdpbusd multiplies unsigned by signed bytes; the kernel takes
// 128 sum_k v_k back off, as Q6_K's 32).
template <int T>
__attribute__((target(SPECJAX_VNNI))) inline void quad_values16(const uint8_t* sub, int g,
                                                               __m512i* a, __m512i* b) {
  constexpr QuantType t = kTypeOf[T];
  if (t.int8) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    *a = _mm512_xor_si512(_mm512_loadu_si512(sub + g * 4 * PANEL), flip);
    *b = _mm512_xor_si512(_mm512_loadu_si512(sub + g * 4 * PANEL + 2 * PANEL), flip);
    return;
  }
  const __m512i n = _mm512_loadu_si512(sub + g * 2 * PANEL), low = _mm512_set1_epi8(15);
  *a = _mm512_and_si512(n, low);
  *b = _mm512_and_si512(_mm512_srli_epi16(n, 4), low);
  if (t.high) {
    // quad_values' bits, the two half panels' positions at once: the chunk in both 256-bit
    // halves, each half shifted by its own count (a count of 16 clears a 16-bit lane)
    constexpr int per = t.high ? 2 / t.high : 1;
    const __m512i chunk = _mm512_broadcast_i64x4(
        _mm256_loadu_si256((const __m256i*)(sub + t.qs * PANEL / 2 + (g / per) * PANEL)));
    const __m512i mask = _mm512_set1_epi8(t.high == 1 ? 0x10 : 0x30);
    __m512i* w[2] = {a, b};
    for (int h = 0; h < 2; ++h) {
      int left[2], right[2];
      for (int v = 0; v < 2; ++v) {
        const int at = (((g % per) * 2 + v) * 2 + h) * t.high;
        left[v] = at <= 4 ? 4 - at : 16;
        right[v] = at > 4 ? at - 4 : 16;
      }
      const __m512i l = _mm512_inserti64x4(_mm512_set1_epi16((short)left[0]),
                                           _mm256_set1_epi16((short)left[1]), 1);
      const __m512i r = _mm512_inserti64x4(_mm512_set1_epi16((short)right[0]),
                                           _mm256_set1_epi16((short)right[1]), 1);
      const __m512i bits = _mm512_or_si512(_mm512_sllv_epi16(chunk, l), _mm512_srlv_epi16(chunk, r));
      *w[h] = _mm512_or_si512(*w[h], _mm512_and_si512(bits, mask));
    }
  }
}

// Up to 4 rows, the whole panel at once: vpdpbusd sums four byte products into an int32 lane,
// one accumulator a row for x's hi bytes and one for its lo bytes (exact: at most 16 quads x
// 4 x 255 x 127), then c = 254 hi + lo and the float terms in quant_portable's order. 8-bit x
// (LO false) has no lo bytes: half the vpdpbusd, the same integers.
template <int T, int R, bool LO = true>
__attribute__((target(SPECJAX_VNNI))) void quant_vnni(
    const QuantLayout& ql, int64_t K, const int8_t* xq, const float* dx, const float* xsum,
    const int32_t* xqsum, const uint8_t* panel, float* y, int64_t ldy) {
  constexpr QuantType t = kTypeOf[T];
  constexpr int offset = T == Q6_K ? 32 : T == Q8_0 ? 128 : 0;
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512i w254 = _mm512_set1_epi32(254);
  __m512 ya[R], yb[R];
  for (int r = 0; r < R; ++r) ya[r] = yb[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < ql.nsb; ++sb) {
    const uint8_t* row = panel + sb * ql.row_bytes;
    prefetch_ahead(row, ql.row_bytes);
    const uint8_t* halves = row + t.halves_at();
    const __m512 da = halves16<T>(halves, 0), db = halves16<T>(halves, 1);
    __m512 ea = da, eb = db;
    if (t.halves == 2) ea = halves16<T>(halves + 2 * PANEL, 0), eb = halves16<T>(halves + 2 * PANEL, 1);
    for (int s = 0; s < t.subs(); ++s) {
      const uint8_t* sub = row + s * t.sub_bytes();
      const int64_t b = sb * t.subs() + s;
      const int8_t* xb = xq + b * t.qs;
      __m512i ha[R], hb[R], la[R], lb[R];
      for (int r = 0; r < R; ++r)
        ha[r] = hb[r] = la[r] = lb[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < t.qs / 4; ++g) {
        __m512i wa, wb;
        quad_values16<T>(sub, g, &wa, &wb);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + 2 * r * K + 4 * g;
          const __m512i bh = _mm512_set1_epi32(quad(xr));
          ha[r] = _mm512_dpbusd_epi32(ha[r], wa, bh);
          hb[r] = _mm512_dpbusd_epi32(hb[r], wb, bh);
          if (LO) {
            const __m512i bl = _mm512_set1_epi32(quad(xr + K));
            la[r] = _mm512_dpbusd_epi32(la[r], wa, bl);
            lb[r] = _mm512_dpbusd_epi32(lb[r], wb, bl);
          }
        }
      }
      __m512 sa = da, sb2 = db, ma = da, mb = db;
      const uint8_t* ints = row + t.ints_at() + s * PANEL;
      if (T == Q6_K) {
        sa = _mm512_mul_ps(da, ints16<T, true>(ints, 0));
        sb2 = _mm512_mul_ps(db, ints16<T, true>(ints, 1));
      } else if (t.ints == 2) {
        sa = _mm512_mul_ps(da, ints16<T, false>(ints, 0));
        sb2 = _mm512_mul_ps(db, ints16<T, false>(ints, 1));
        const uint8_t* mins = ints + t.subs() * PANEL;
        ma = _mm512_xor_ps(sign, _mm512_mul_ps(ea, ints16<T, false>(mins, 0)));
        mb = _mm512_xor_ps(sign, _mm512_mul_ps(eb, ints16<T, false>(mins, 1)));
      } else if (t.halves == 2) {
        ma = ea, mb = eb;
      } else {
        const __m512 off = _mm512_set1_ps((float)(-(8 << t.high)));
        ma = _mm512_mul_ps(off, da), mb = _mm512_mul_ps(off, db);
      }
      for (int r = 0; r < R; ++r) {
        __m512i ca = _mm512_add_epi32(_mm512_mullo_epi32(ha[r], w254), la[r]);
        __m512i cb = _mm512_add_epi32(_mm512_mullo_epi32(hb[r], w254), lb[r]);
        if (offset) {
          const __m512i o = _mm512_set1_epi32(offset * xqsum[r * ql.nb + b]);
          ca = _mm512_sub_epi32(ca, o);
          cb = _mm512_sub_epi32(cb, o);
        }
        const __m512 d = _mm512_set1_ps(dx[r * ql.nb + b]);
        ya[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ca), _mm512_mul_ps(sa, d), ya[r]);
        yb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(cb), _mm512_mul_ps(sb2, d), yb[r]);
        if (has_min(T)) {
          const __m512 xs = _mm512_set1_ps(xsum[r * ql.nb + b]);
          ya[r] = _mm512_fmadd_ps(xs, ma, ya[r]);
          yb[r] = _mm512_fmadd_ps(xs, mb, yb[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    _mm256_storeu_ps(yr + lane_col<T>(0, 0), _mm512_castps512_ps256(ya[r]));
    _mm256_storeu_ps(yr + lane_col<T>(0, 1), _mm512_extractf32x8_ps(ya[r], 1));
    _mm256_storeu_ps(yr + lane_col<T>(1, 0), _mm512_castps512_ps256(yb[r]));
    _mm256_storeu_ps(yr + lane_col<T>(1, 1), _mm512_extractf32x8_ps(yb[r], 1));
  }
}
#endif

#define SPECJAX_TABLE(FN)                                                          \
  {FN<1>, FN<2>, FN<3>, FN<4>, FN<5>, FN<6>, FN<7>, FN<8>, FN<9>, FN<10>, FN<11>, \
   FN<12>, nullptr, nullptr, nullptr, nullptr}

#define SPECJAX_QUANT4(FN, T) {FN<T, 1>, FN<T, 2>, FN<T, 3>, FN<T, 4>}
#define SPECJAX_QUANT3(FN, T) {FN<T, 1>, FN<T, 2>, FN<T, 3>, nullptr}
#define SPECJAX_QUANT3_HI(FN, T) {FN<T, 1, false>, FN<T, 2, false>, FN<T, 3, false>, nullptr}
#define SPECJAX_QUANT4_HI(FN, T) \
  {FN<T, 1, false>, FN<T, 2, false>, FN<T, 3, false>, FN<T, 4, false>}
// Isa::quant's rows, one a type (quant.TYPES order).
#define SPECJAX_TYPES(Q, FN)                                                           \
  {Q(FN, Q8_0), Q(FN, Q4_0), Q(FN, Q4_1), Q(FN, Q5_0), Q(FN, Q5_1), Q(FN, Q4_K),   \
   Q(FN, Q5_K), Q(FN, Q6_K)}

const Isa kPortable{"portable", 4, {micro_portable<1>, micro_portable<2>, micro_portable<3>,
                                    micro_portable<4>}, 4,
                    SPECJAX_TYPES(SPECJAX_QUANT4, quant_portable),
                    SPECJAX_TYPES(SPECJAX_QUANT4, quant_portable)};
#ifdef SPECJAX_X86
const Isa kAvx512{"avx512", 12, SPECJAX_TABLE(micro_avx512), 3,
                  SPECJAX_TYPES(SPECJAX_QUANT3, quant_avx2),
                  SPECJAX_TYPES(SPECJAX_QUANT3_HI, quant_avx2)};
const Isa kAvx512Vnni{"avx512vnni", 12, SPECJAX_TABLE(micro_avx512), 4,
                      SPECJAX_TYPES(SPECJAX_QUANT4, quant_vnni),
                      SPECJAX_TYPES(SPECJAX_QUANT4_HI, quant_vnni)};
const Isa kAvx2{"avx2", 3, {micro_avx2<1>, micro_avx2<2>, micro_avx2<3>}, 3,
                SPECJAX_TYPES(SPECJAX_QUANT3, quant_avx2),
                SPECJAX_TYPES(SPECJAX_QUANT3_HI, quant_avx2)};
#endif

#ifdef SPECJAX_X86
bool has_vnni() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif


const Isa* detect() {
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  const char* forced = std::getenv("SPECJAX_MATMUL_ISA");
  const bool want = forced == nullptr || forced[0] == '\0';
  if ((want || std::strcmp(forced, "avx512vnni") == 0) && __builtin_cpu_supports("avx512f") &&
      has_vnni())
    return &kAvx512Vnni;
  if ((want || std::strcmp(forced, "avx512") == 0) && __builtin_cpu_supports("avx512f"))
    return &kAvx512;
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
      for (int64_t g = 0; g < pr.ngroups; ++g) {
        const int64_t m0 = pr.groups[g].m0, rows = pr.groups[g].rows;
        const QuantFn fn = (ql.x8 ? is.quant8 : is.quant)[ql.type][rows - 1];
        fn(ql, pr.K, ql.xq + 2 * m0 * pr.K, ql.dx + m0 * ql.nb, ql.xsum + m0 * ql.nb,
           ql.xqsum + m0 * ql.nb, ql.q + p * ql.nsb * ql.row_bytes,
           pr.y + m0 * pr.N + p * PANEL, pr.N);
      }
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = pr.w + p * pr.K * PANEL;
    const int64_t cols = pr.N - p * PANEL < PANEL ? pr.N - p * PANEL : PANEL;
    for (int64_t k0 = 0; k0 < pr.K; k0 += KB) {
      const int64_t kc = pr.K - k0 < KB ? pr.K - k0 : KB;
      for (int64_t g = 0; g < pr.ngroups; ++g) {
        const int64_t m0 = pr.groups[g].m0, rows = pr.groups[g].rows;
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

ffi::Error run(ffi::ThreadPool& pool, Problem pr);

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

// The quantized weight `row_bytes` names, `nsb` super-block rows a panel, for K inputs.
bool quant_layout(int64_t row_bytes, int64_t nsb, int64_t K, QuantLayout* ql) {
  const int t = type_of_row(row_bytes);
  if (t < 0 || nsb * kTypeOf[t].sb != K) return false;
  ql->type = t;
  ql->row_bytes = row_bytes;
  ql->nsb = nsb;
  ql->nb = K / kTypeOf[t].qs;
  return true;
}

// x per call, for the quantized kernels: each row's blocks of qs as v = x / dx rounded to
// nearest even, dx = max |x| / 32258, v = 254 hi + lo (|hi|, |lo| <= 127: a row's K hi bytes,
// then its K lo bytes), each block's sum of v and that sum times dx
// (the min and offset terms take the rounded x's sum, as llama.cpp's: with x's own sum the
// rounding error meets the weights' uncentred quants, q * e instead of (q - 8) * e, and a
// Q4_1 or Q5_0 layer errs three times as much). Row by row, so a row's are the same alone
// or among others.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> xq;
  std::unique_ptr<float[]> dx, xsum;
  std::unique_ptr<int32_t[]> xqsum;

  QuantizedRows(const float* x, int64_t M, int64_t K, QuantLayout* ql, int x_bits)
      : xq(new int8_t[2 * M * K + 4]), dx(new float[M * ql->nb + 1]),
        xsum(new float[M * ql->nb + 1]), xqsum(new int32_t[M * ql->nb + 1]) {
    const int64_t qs = kTypeOf[ql->type].qs, nb = ql->nb;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * qs;
        float amax = 0.f;
        for (int64_t k = 0; k < qs; ++k) {
          const float a = xb[k] < 0 ? -xb[k] : xb[k];
          amax = a > amax ? a : amax;
        }
        // 8 bits: v = 254 round(x 127 / amax), the same dx (32258 = 254 x 127), lo = 0
        const float top = x_bits == 8 ? 127.f : 32258.f;
        const float d = amax / 32258.f, inv = amax > 0 ? top / amax : 0.f;
        int32_t qsum = 0;
        for (int64_t k = 0; k < qs; ++k) {
          float f = __builtin_nearbyintf(xb[k] * inv);
          f = f > top ? top : f < -top ? -top : f;
          const int32_t v = x_bits == 8 ? 254 * (int32_t)f : (int32_t)f;
          const int32_t hi = (v + (v < 0 ? -127 : 127)) / 254;
          xq[2 * r * K + b * qs + k] = (int8_t)hi;
          xq[2 * r * K + K + b * qs + k] = (int8_t)(v - 254 * hi);
          qsum += v;
        }
        dx[r * nb + b] = d;
        xsum[r * nb + b] = d * (float)qsum;
        xqsum[r * nb + b] = qsum;
      }
    ql->xq = xq.get();
    ql->dx = dx.get();
    ql->xsum = xsum.get();
    ql->xqsum = xqsum.get();
    ql->x8 = x_bits == 8;
  }
};

ffi::Error matmul_quant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "specjax_matmul_quant: expects x [M, K], w [P, K / sb, R], y [M, N]");
  // The weight's bytes as int8 ask for x in 8 bits (quant.py: with_8bit_x), as uint8 in 16.
  if (w.element_type() != ffi::DataType::U8 && w.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("specjax_matmul_quant: w is uint8 (or int8)");
  const int x_bits = w.element_type() == ffi::DataType::S8 ? 8 : 16;
  Problem pr{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], yd[1], wd[0], {}};
  if (!quant_layout(wd[2], wd[1], pr.K, &pr.quant))
    return ffi::Error::InvalidArgument("specjax_matmul_quant: no type has this row size, or "
                                       "its blocks do not cover K");
  pr.quant.q = static_cast<const uint8_t*>(w.untyped_data());
  if (yd[0] != pr.M || pr.P * PANEL != pr.N)
    return ffi::Error::InvalidArgument("specjax_matmul_quant: shapes do not match the weight");
  const QuantizedRows rows(pr.x, pr.M, pr.K, &pr.quant, x_bits);
  return run(pool, pr);  // returns once every panel is done: `rows` outlives the work
}

ffi::Error run(ffi::ThreadPool& pool, Problem pr) {
  if (pr.M == 0 || pr.N == 0) return ffi::Error::Success();
  if (pr.K == 0) {
    std::memset(pr.y, 0, sizeof(float) * pr.M * pr.N);
    return ffi::Error::Success();
  }
  const RowGroups groups(pr.x, pr.M, pr.K,
                         pr.quant.q != nullptr ? isa().quant_rows : isa().max_rows, pr.y, pr.N);
  groups.into(&pr);
  if (groups.live == 0) return ffi::Error::Success();
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || groups.live * pr.K * pr.N < kParallelMin || pr.P < 2) {
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
  if (std::strcmp(name, "avx512vnni") == 0 && __builtin_cpu_supports("avx512f") && has_vnni())
    is = &kAvx512Vnni;
  if (std::strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) is = &kAvx512;
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
  Problem pr{x, w, y, M, K, N, (N + PANEL - 1) / PANEL, {}};
  if (K == 0) {
    std::memset(y, 0, sizeof(float) * M * N);
    return 0;
  }
  const RowGroups groups(x, M, K, is->max_rows, y, N);
  groups.into(&pr);
  run_panels(pr, 0, pr.P, *is);
  return 0;
}

extern "C" int specjax_matmul_run_quant(const char* name, const float* x, const uint8_t* q,
                                        int64_t row_bytes, float* y, int64_t M, int64_t K,
                                        int64_t N, int32_t x_bits) {
  if (x_bits != 8 && x_bits != 16) return -2;
  const Isa* is = named(name);
  if (is == nullptr) return -1;
  Problem pr{x, nullptr, y, M, K, N, N / PANEL, {}};
  const int t = type_of_row(row_bytes);
  if (t < 0 || K % kTypeOf[t].sb || !quant_layout(row_bytes, K / kTypeOf[t].sb, K, &pr.quant))
    return -2;
  pr.quant.q = q;
  const QuantizedRows rows(x, M, K, &pr.quant, x_bits);
  const RowGroups groups(x, M, K, is->quant_rows, y, N);
  groups.into(&pr);
  run_panels(pr, 0, pr.P, *is);
  return 0;
}
