// GGUF blocks -> the quantized kernel's panel layout (quant.py's docstring), done once at load.
//
// quant.py's numpy path (`pack_values(*unpack_blocks(raw, type))`) makes about ten passes
// over every weight, with int16 and float32 copies of a whole tensor between them: 15 s and
// gigabytes of transients for a 1.5B model. This makes one pass a panel of PANEL output rows,
// from the file's bytes straight into the packed array, and computes the same floats in the
// same order (one float32 product each), so its output equals the numpy path's byte for byte
// (tests/pallas_kernels/test_cpu_matmul_quant.py). Called through ctypes, which releases the
// GIL: quant.pack_gguf_stack packs a parameter's layers on threads.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t PANEL = 32;  // reference.py: PANEL

// Source types in quant.TYPES order.
enum Type { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, kTypes };
// bytes a block, values a block, values a scale (and min) covers
constexpr int kBlockBytes[kTypes] = {34, 18, 20, 22, 24, 144, 176, 210};
constexpr int kBlockValues[kTypes] = {32, 32, 32, 32, 32, 256, 256, 256};
constexpr int kSub[kTypes] = {32, 32, 32, 32, 32, 32, 32, 16};

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);  // zero or subnormal: exact
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13)
                                          : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, 4);
  return f;
}

// A float that is exactly a half -> its bits; false when it is not (the layout would round).
bool float_to_half_exact(float f, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = (bits >> 16) & 0x8000;
  const float a = std::fabs(f);
  uint16_t h;
  if (a == 0.f) {
    h = sign;
  } else if (!std::isfinite(a)) {
    return false;
  } else if (a < 6.103515625e-05f) {  // below 2^-14: a subnormal half, k * 2^-24
    const float k = std::ldexp(a, 24);
    if (k != std::floor(k)) return false;
    h = sign | uint16_t(k);
  } else {
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    const int exp = e - 1 + 15;
    if (exp >= 31) return false;
    const float man = (m * 2.f - 1.f) * 1024.f;
    if (man != std::floor(man)) return false;
    h = sign | uint16_t(exp << 10) | uint16_t(man);
  }
  if (half_to_float(h) != f) return false;
  *out = h;
  return true;
}

uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One block -> q[kBlockValues] and, per sub-block, scale and min (quant.unpack_blocks).
void decode_block(int type, const uint8_t* b, int16_t* q, float* scale, float* mn) {
  switch (type) {
    case Q8_0: {
      const float d = half_to_float(load16(b));
      for (int e = 0; e < 32; ++e) q[e] = int8_t(b[2 + e]);
      scale[0] = d, mn[0] = 0.f;
      break;
    }
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const float d = half_to_float(load16(b));
      const bool one = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
      const int start = one ? 4 : 2;
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + start, 4);
      const uint8_t* qs = b + start + (five ? 4 : 0);
      for (int e = 0; e < 32; ++e) {
        int v = e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
        if (five) v |= ((qh >> e) & 1) << 4;
        q[e] = int16_t(v);
      }
      scale[0] = d;
      mn[0] = one ? half_to_float(load16(b + 2)) : (five ? -16 * d : -8 * d);
      break;
    }
    case Q4_K: case Q5_K: {
      const float d = half_to_float(load16(b)), dmin = half_to_float(load16(b + 2));
      const uint8_t* s = b + 4;  // 12 bytes: d[4], m[4], md[4]
      for (int j = 0; j < 8; ++j) {
        const int sc = j < 4 ? s[j] & 0x3F : (s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        const int m = j < 4 ? s[4 + j] & 0x3F : (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
        scale[j] = d * float(sc);
        mn[j] = -(dmin * float(m));
      }
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int c = 0; c < 4; ++c)      // four chunks of 64: low nibbles, then high ones
        for (int i = 0; i < 32; ++i) {
          q[c * 64 + i] = qs[c * 32 + i] & 0x0F;
          q[c * 64 + 32 + i] = qs[c * 32 + i] >> 4;
        }
      if (type == Q5_K)  // element e's fifth bit: bit e / 32 of qh[e % 32]
        for (int e = 0; e < 256; ++e) q[e] |= ((qh[e % 32] >> (e / 32)) & 1) << 4;
      break;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const float d = half_to_float(load16(b + 208));
      for (int j = 0; j < 16; ++j) scale[j] = d * float(int8_t(b[192 + j])), mn[j] = 0.f;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 128; ++i) {
          const int low = i < 64 ? ql[h * 64 + i] & 0x0F : ql[h * 64 + i - 64] >> 4;
          const int high = (qh[h * 32 + i % 32] >> (2 * (i / 32))) & 3;
          q[h * 128 + i] = int16_t((low | (high << 4)) - 32);
        }
      break;
    }
  }
}

}  // namespace

// `rows` outputs of `row_bytes` GGUF bytes each (type `type`, quant.TYPES order) -> `out`, the
// packed [rows / PANEL, K / qk, R] layout of the target format (bits 4 or 8, qk 32 or 16,
// half: float16 scales and mins). Returns 0, or: 1 arguments that do not fit together, 2 a
// scale or min that is not a float16 for a half layout, 3 a value out of the target's range.
extern "C" int specjax_pack_gguf(const uint8_t* raw, int64_t rows, int64_t row_bytes, int type,
                                 int bits, int qk, int half, uint8_t* out) {
  if (type < 0 || type >= kTypes || rows % PANEL || row_bytes % kBlockBytes[type] ||
      (bits != 4 && bits != 8) || (qk != 32 && qk != 16) || (half && qk != 32) ||
      qk > kSub[type])
    return 1;
  const int64_t blocks = row_bytes / kBlockBytes[type], K = blocks * kBlockValues[type];
  const int64_t nb = K / qk, width = PANEL * bits / 8, value_bytes = qk * width;
  const int64_t float_bytes = half ? 2 : 4, R = value_bytes + 2 * PANEL * float_bytes;
  const int lo = bits == 4 ? 0 : -128, hi = bits == 4 ? 15 : 127;
  const int64_t subs = K / kSub[type];
  std::vector<int16_t> q(PANEL * K);
  std::vector<float> scale(PANEL * subs), mn(PANEL * subs);
  for (int64_t p = 0; p < rows / PANEL; ++p) {
    for (int64_t j = 0; j < PANEL; ++j) {
      const uint8_t* row = raw + (p * PANEL + j) * row_bytes;
      const int per_block = kBlockValues[type] / kSub[type];
      for (int64_t b = 0; b < blocks; ++b)
        decode_block(type, row + b * kBlockBytes[type], &q[j * K + b * kBlockValues[type]],
                     &scale[j * subs + b * per_block], &mn[j * subs + b * per_block]);
    }
    uint8_t* panel = out + p * nb * R;
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* dst = panel + blk * R;
      std::memset(dst, 0, value_bytes);
      for (int64_t k = 0; k < qk; ++k) {
        uint8_t* pair = dst + (k / 2) * 2 * width + k % 2;  // a pair's bytes interleaved
        for (int64_t j = 0; j < PANEL; ++j) {
          const int v = q[j * K + blk * qk + k];
          if (v < lo || v > hi) return 3;
          if (bits == 4)
            pair[2 * (j % (PANEL / 2))] |= uint8_t(v << (4 * (j / (PANEL / 2))));
          else
            pair[2 * j] = uint8_t(int8_t(v));
        }
      }
      // the sub-block this block lies in (a block of 16 repeats its sub-block of 32's floats)
      const int64_t sub = blk * qk / kSub[type];
      uint8_t* floats = dst + value_bytes;
      for (int what = 0; what < 2; ++what)
        for (int64_t j = 0; j < PANEL; ++j) {
          const float f = (what ? mn : scale)[j * subs + sub];
          uint8_t* at = floats + (what * PANEL + j) * float_bytes;
          if (half) {
            uint16_t h;
            if (!float_to_half_exact(f, &h)) return 2;
            std::memcpy(at, &h, 2);
          } else {
            std::memcpy(at, &f, 4);
          }
        }
    }
  }
  return 0;
}
