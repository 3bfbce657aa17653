// fp8 KV codes (ops/kv_quant.h): scalar encoding, once per stored value.
#include <algorithm>
#include <bit>
#include <cmath>

#include "ops/kv_quant.h"

namespace kvsparse::ops {

uint8_t EncodeFp8(KvStorage format, float y) {
  const bool e4m3 = format == KvStorage::kFp8E4M3;
  const int mantissa_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  if (std::isnan(y)) return 0;
  const float a = std::min(std::fabs(y), Fp8Max(format));
  const float min_normal = std::ldexp(1.f, 1 - bias);
  uint32_t code;
  if (a < min_normal) {
    // Subnormal: a multiple of the step 2^(1-bias-M); rounding up to 2^M codes the smallest normal.
    code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, bias - 1 + mantissa_bits)));
  } else {
    // Round the f32 mantissa to M bits, ties to even; a carry moves into the exponent, as it should.
    const int dropped = 23 - mantissa_bits;
    uint32_t bits = std::bit_cast<uint32_t>(a);
    bits += ((1u << (dropped - 1)) - 1) + ((bits >> dropped) & 1u);
    const uint32_t exponent = (bits >> 23) - 127 + bias;
    code = (exponent << mantissa_bits) | ((bits >> dropped) & ((1u << mantissa_bits) - 1));
  }
  return static_cast<uint8_t>(sign | code);
}

void QuantizeKvRowsFp8(KvStorage format, const float* x, int64_t n_rows, int row_len, uint8_t* codes,
                       float* scales) {
  const float max_code = Fp8Max(format);
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, codes += row_len) {
    float amax = 0.f;
    for (int i = 0; i < row_len; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / max_code;
    scales[r] = scale;
    // Division, as int8 does: the row's largest value codes exactly +-max.
    for (int i = 0; i < row_len; ++i) codes[i] = scale != 0.f ? EncodeFp8(format, x[i] / scale) : 0;
  }
}

void DequantizeKvRowsFp8(KvStorage format, const uint8_t* codes, const float* scales, int64_t n_rows,
                         int row_len, float* x) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, codes += row_len) {
    for (int i = 0; i < row_len; ++i) x[i] = scales[r] * DecodeFp8(format, codes[i]);
  }
}

}  // namespace kvsparse::ops
