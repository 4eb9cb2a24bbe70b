// GGUF blocks -> the quantized kernel's panel layout (quant.py's docstring), done once at load.
//
// A block's fields (values, high bits, sub-block scales and mins, its half-precision d and
// dmin) are only regrouped: PANEL outputs' blocks at one position become one super-block row,
// the values interleaved by column. One pass a panel, from the file's bytes straight into the
// packed array, the same bytes as quant.py's numpy path (`pack_numpy`, tested byte for byte).
// Called through ctypes, which releases the GIL: quant.pack_gguf_stack packs a parameter's
// layers on threads.
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PANEL = 32;  // reference.py: PANEL

// Source types in quant.TYPES order, with quant.FORMATS' fields.
enum Type { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, kTypes };
constexpr int kBlockBytes[kTypes] = {34, 18, 20, 22, 24, 144, 176, 210};
constexpr int kSb[kTypes] = {32, 32, 32, 32, 32, 256, 256, 256};      // inputs a block
constexpr int kQs[kTypes] = {32, 32, 32, 32, 32, 32, 32, 16};         // inputs a sub-block
constexpr int kHigh[kTypes] = {0, 0, 0, 1, 1, 0, 1, 2};               // value bits above 4
constexpr int kInts[kTypes] = {0, 0, 0, 0, 0, 2, 2, 1};               // sc (and m) a sub-block
constexpr int kHalves[kTypes] = {1, 1, 2, 1, 2, 2, 2, 1};             // d (and dmin / m)

uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One block's fields: low[sb] (4 bits, or Q8_0's int8 as a byte), high[sb], sc/mn per
// sub-block, d and d2 as half bits (quant.gguf_fields).
struct Fields {
  uint8_t low[256], high[256], sc[16], mn[16];
  uint16_t d, d2;
};

void decode(int type, const uint8_t* b, Fields* f) {
  std::memset(f->high, 0, sizeof f->high);
  f->d2 = 0;
  switch (type) {
    case Q8_0:
      f->d = load16(b);
      std::memcpy(f->low, b + 2, 32);
      break;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      const bool one = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
      const int start = one ? 4 : 2;
      f->d = load16(b);
      if (one) f->d2 = load16(b + 2);
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + start, 4);
      const uint8_t* qs = b + start + (five ? 4 : 0);
      for (int e = 0; e < 32; ++e) {
        f->low[e] = e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
        f->high[e] = (qh >> e) & 1;
      }
      break;
    }
    case Q4_K: case Q5_K: {
      f->d = load16(b);
      f->d2 = load16(b + 2);
      const uint8_t* s = b + 4;  // 12 bytes: d[4], m[4], md[4]
      for (int j = 0; j < 8; ++j) {
        f->sc[j] = j < 4 ? s[j] & 0x3F : (s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        f->mn[j] = j < 4 ? s[4 + j] & 0x3F : (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
      }
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int c = 0; c < 4; ++c)  // four chunks of 64: low nibbles, then high ones
        for (int i = 0; i < 32; ++i) {
          f->low[c * 64 + i] = qs[c * 32 + i] & 0x0F;
          f->low[c * 64 + 32 + i] = qs[c * 32 + i] >> 4;
        }
      if (type == Q5_K)  // element e's fifth bit: bit e / 32 of qh[e % 32]
        for (int e = 0; e < 256; ++e) f->high[e] = (qh[e % 32] >> (e / 32)) & 1;
      break;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      f->d = load16(b + 208);
      std::memcpy(f->sc, b + 192, 16);
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 128; ++i) {
          f->low[h * 128 + i] = i < 64 ? ql[h * 64 + i] & 0x0F : ql[h * 64 + i - 64] >> 4;
          f->high[h * 128 + i] = (qh[h * 32 + i % 32] >> (2 * (i / 32))) & 3;
        }
      break;
    }
  }
}

}  // namespace

// `rows` outputs of `row_bytes` GGUF bytes each (type `type`, quant.TYPES order) -> `out`, the
// packed [rows / PANEL, blocks, R] layout. Returns 0, or 1 for arguments that do not fit.
extern "C" int specjax_pack_gguf(const uint8_t* raw, int64_t rows, int64_t row_bytes, int type,
                                 uint8_t* out) {
  if (type < 0 || type >= kTypes || rows % PANEL || row_bytes % kBlockBytes[type]) return 1;
  const int sb = kSb[type], qs = kQs[type], high = kHigh[type], subs = sb / qs;
  const bool int8 = type == Q8_0;
  const int64_t sub_bytes = int8 ? qs * PANEL : qs * PANEL / 2 + qs * 4 * high;
  const int64_t ints_at = subs * sub_bytes, halves_at = ints_at + subs * PANEL * kInts[type];
  const int64_t R = halves_at + 2 * PANEL * kHalves[type];
  const int64_t blocks = row_bytes / kBlockBytes[type];
  static thread_local Fields f[PANEL];
  for (int64_t p = 0; p < rows / PANEL; ++p)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int64_t j = 0; j < PANEL; ++j)
        decode(type, raw + (p * PANEL + j) * row_bytes + blk * kBlockBytes[type], &f[j]);
      uint8_t* dst = out + (p * blocks + blk) * R;
      std::memset(dst, 0, R);
      for (int s = 0; s < subs; ++s) {
        uint8_t* sub = dst + s * sub_bytes;
        for (int k = 0; k < qs; ++k) {
          const int e = k % 4, g = k / 4, at = s * qs + k;
          for (int64_t j = 0; j < PANEL; ++j) {
            if (int8) {  // quad g, byte 4 j + e: column j at k
              sub[g * 4 * PANEL + 4 * j + e] = f[j].low[at];
              continue;
            }
            // vector v, nibble h of byte 4 c + e: column 16 v + 8 h + c
            const int v = j / 16, h = (j / 8) % 2, c = j % 8;
            sub[g * 2 * PANEL + PANEL * v + 4 * c + e] |= uint8_t(f[j].low[at] << (4 * h));
            if (high) {  // chunk g / per, from bit ((2 (g % per) + v) 2 + h) high
              const int per = 2 / high;
              uint8_t* chunk = sub + qs * PANEL / 2 + (g / per) * PANEL;
              chunk[4 * c + e] |= uint8_t(f[j].high[at] << ((((g % per) * 2 + v) * 2 + h) * high));
            }
          }
        }
      }
      for (int s = 0; s < subs && kInts[type]; ++s)
        for (int64_t j = 0; j < PANEL; ++j) {
          dst[ints_at + s * PANEL + j] = f[j].sc[s];
          if (kInts[type] == 2) dst[ints_at + (subs + s) * PANEL + j] = f[j].mn[s];
        }
      for (int64_t j = 0; j < PANEL; ++j) {
        std::memcpy(dst + halves_at + 2 * j, &f[j].d, 2);
        if (kHalves[type] == 2) std::memcpy(dst + halves_at + 2 * PANEL + 2 * j, &f[j].d2, 2);
      }
    }
  return 0;
}
