// Low-bit KIVI codes (ops/kv_quant.h): asymmetric quantization with a zero point, packed rows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvsparse/status.h"
#include "ops/kv_quant.h"

namespace kvsparse::ops {

namespace {

void CheckBits(int bits, int row_len) {
  KVS_CHECK_MSG(bits == 2 || bits == 4 || bits == 8, "KIVI codes are 2, 4 or 8 bits");
  KVS_CHECK_MSG(row_len * bits % 8 == 0, "a packed KV row must fill whole bytes");
}

void CheckGroup(int bits, int row_len, int group) {
  KVS_CHECK_MSG(group > 0 && row_len % group == 0 && group * bits % 8 == 0,
                "a KIVI V group must divide the row and fill whole bytes");
}

uint8_t Code(float x, float min, float scale, int max_code) {
  if (scale == 0.f) return 0;
  // Division, as the int8 quantizers: the group's min and max code 0 and max_code (up to the
  // f16 rounding of scale and min).
  const float q = std::nearbyint((x - min) / scale);
  if (!(q > 0.f)) return 0;  // (NaN too: a non-finite input never reaches the integer cast)
  return static_cast<uint8_t>(std::min(q, static_cast<float>(max_code)));
}

constexpr float kMaxF16 = 65504.f;

// A group's [lo, hi] as the f16 (scale, min) pair it is stored with, and their f32 values.
struct GroupScale {
  f16_bits scale16, min16;
  float scale, min;
};
GroupScale MakeGroupScale(float lo, float hi, int max_code) {
  // Values past f16's range are stored at its ends, so min and scale stay finite.
  lo = std::clamp(lo, -kMaxF16, kMaxF16);
  hi = std::clamp(hi, -kMaxF16, kMaxF16);
  GroupScale g;
  g.min16 = F32ToF16(lo);
  g.min = F16ToF32(g.min16);
  g.scale16 = F32ToF16(std::min((hi - g.min) / static_cast<float>(max_code), kMaxF16));
  g.scale = F16ToF32(g.scale16);
  return g;
}

void Put(int bits, uint8_t* packed, int64_t i, uint8_t code) {
  const int64_t bit = i * bits;
  packed[bit / 8] |= static_cast<uint8_t>(code << (bit % 8));
}

uint8_t Get(int bits, const uint8_t* packed, int64_t i) {
  const int64_t bit = i * bits;
  return static_cast<uint8_t>((packed[bit / 8] >> (bit % 8)) & ((1 << bits) - 1));
}

}  // namespace

void QuantizeKvRowsAsym(int bits, const float* x, int64_t n_rows, int row_len, int group, uint8_t* packed,
                        f16_bits* scales, f16_bits* mins) {
  CheckBits(bits, row_len);
  CheckGroup(bits, row_len, group);
  const int max_code = (1 << bits) - 1;
  const int groups = row_len / group;
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    std::memset(packed, 0, row_bytes);
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + g * group;
      const auto [lo, hi] = std::minmax_element(xg, xg + group);
      const GroupScale s = MakeGroupScale(*lo, *hi, max_code);
      scales[r * groups + g] = s.scale16;
      mins[r * groups + g] = s.min16;
      for (int i = g * group; i < (g + 1) * group; ++i) Put(bits, packed, i, Code(x[i], s.min, s.scale, max_code));
    }
  }
}

void DequantizeKvRowsAsym(int bits, const uint8_t* packed, const f16_bits* scales, const f16_bits* mins,
                          int64_t n_rows, int row_len, int group, float* x) {
  CheckBits(bits, row_len);
  CheckGroup(bits, row_len, group);
  const int groups = row_len / group;
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    for (int i = 0; i < row_len; ++i) {
      const size_t g = static_cast<size_t>(r) * groups + i / group;
      x[i] = std::fma(static_cast<float>(Get(bits, packed, i)), F16ToF32(scales[g]), F16ToF32(mins[g]));
    }
  }
}

void QuantizeKvColumnsAsym(int bits, const float* x, int64_t n_rows, int row_len, uint8_t* packed, f16_bits* scales,
                           f16_bits* mins) {
  CheckBits(bits, row_len);
  const int max_code = (1 << bits) - 1;
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  std::vector<float> scale(row_len), min(row_len);  // the f16 pair as f32, per column
  for (int c = 0; c < row_len; ++c) {
    float lo = 0.f, hi = 0.f;
    if (n_rows > 0) {
      lo = hi = x[c];
      for (int64_t r = 1; r < n_rows; ++r) {
        lo = std::min(lo, x[r * row_len + c]);
        hi = std::max(hi, x[r * row_len + c]);
      }
    }
    const GroupScale s = MakeGroupScale(lo, hi, max_code);
    scales[c] = s.scale16;
    mins[c] = s.min16;
    scale[c] = s.scale;
    min[c] = s.min;
  }
  if (n_rows == 0) return;  // (packed may be null: no memset on it)
  std::memset(packed, 0, static_cast<size_t>(n_rows) * row_bytes);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int c = 0; c < row_len; ++c) {
      Put(bits, packed + r * row_bytes, c, Code(x[r * row_len + c], min[c], scale[c], max_code));
    }
  }
}

void DequantizeKvColumnsAsym(int bits, const uint8_t* packed, const f16_bits* scales, const f16_bits* mins,
                             int64_t n_rows, int row_len, float* x) {
  CheckBits(bits, row_len);
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    for (int c = 0; c < row_len; ++c) {
      x[c] = std::fma(static_cast<float>(Get(bits, packed, c)), F16ToF32(scales[c]), F16ToF32(mins[c]));
    }
  }
}

void UnpackCodes(int bits, const uint8_t* packed, int n, uint8_t* codes) {
  switch (bits) {
    case 4:
      for (int i = 0; i + 1 < n; i += 2) {
        const uint8_t b = packed[i / 2];
        codes[i] = b & 0x0F;
        codes[i + 1] = b >> 4;
      }
      if (n % 2) codes[n - 1] = packed[n / 2] & 0x0F;
      return;
    case 2:
      for (int i = 0; i < n; ++i) codes[i] = Get(2, packed, i);
      return;
    default:
      std::memcpy(codes, packed, n);
  }
}

}  // namespace kvsparse::ops
