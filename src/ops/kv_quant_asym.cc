// Low-bit KIVI codes (ops/kv_quant.h): asymmetric quantization with a zero point, packed rows.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvsparse/status.h"
#include "ops/kv_quant.h"

namespace kvsparse::ops {

namespace {

void CheckBits(int bits, int row_len) {
  KVS_CHECK_MSG(bits == 2 || bits == 4 || bits == 8, "KIVI codes are 2, 4 or 8 bits");
  KVS_CHECK_MSG(row_len * bits % 8 == 0, "a packed KV row must fill whole bytes");
}

uint8_t Code(float x, float min, float scale, int max_code) {
  if (scale == 0.f) return 0;
  // Division, as the int8 quantizers: the group's min and max code exactly 0 and max_code.
  const float q = std::nearbyint((x - min) / scale);
  return static_cast<uint8_t>(std::clamp(q, 0.f, static_cast<float>(max_code)));
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

void QuantizeKvRowsAsym(int bits, const float* x, int64_t n_rows, int row_len, uint8_t* packed, float* scales,
                        float* mins) {
  CheckBits(bits, row_len);
  const int max_code = (1 << bits) - 1;
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    const auto [lo, hi] = std::minmax_element(x, x + row_len);
    const float min = *lo, scale = (*hi - *lo) / static_cast<float>(max_code);
    scales[r] = scale;
    mins[r] = min;
    std::memset(packed, 0, row_bytes);
    for (int i = 0; i < row_len; ++i) Put(bits, packed, i, Code(x[i], min, scale, max_code));
  }
}

void DequantizeKvRowsAsym(int bits, const uint8_t* packed, const float* scales, const float* mins, int64_t n_rows,
                          int row_len, float* x) {
  CheckBits(bits, row_len);
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    for (int i = 0; i < row_len; ++i) x[i] = std::fma(static_cast<float>(Get(bits, packed, i)), scales[r], mins[r]);
  }
}

void QuantizeKvColumnsAsym(int bits, const float* x, int64_t n_rows, int row_len, uint8_t* packed, float* scales,
                           float* mins) {
  CheckBits(bits, row_len);
  const int max_code = (1 << bits) - 1;
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int c = 0; c < row_len; ++c) {
    if (n_rows == 0) {
      mins[c] = scales[c] = 0.f;
      continue;
    }
    float lo = x[c], hi = x[c];
    for (int64_t r = 1; r < n_rows; ++r) {
      lo = std::min(lo, x[r * row_len + c]);
      hi = std::max(hi, x[r * row_len + c]);
    }
    mins[c] = lo;
    scales[c] = (hi - lo) / static_cast<float>(max_code);
  }
  if (n_rows == 0) return;  // (packed may be null: no memset on it)
  std::memset(packed, 0, static_cast<size_t>(n_rows) * row_bytes);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int c = 0; c < row_len; ++c) {
      Put(bits, packed + r * row_bytes, c, Code(x[r * row_len + c], mins[c], scales[c], max_code));
    }
  }
}

void DequantizeKvColumnsAsym(int bits, const uint8_t* packed, const float* scales, const float* mins,
                             int64_t n_rows, int row_len, float* x) {
  CheckBits(bits, row_len);
  const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, packed += row_bytes) {
    for (int c = 0; c < row_len; ++c) x[c] = std::fma(static_cast<float>(Get(bits, packed, c)), scales[c], mins[c]);
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
