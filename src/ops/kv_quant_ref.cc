// Scalar reference twins of the KV quantizers (ops/kv_quant.h).
#include <algorithm>
#include <cmath>

#include "ops/kv_quant.h"

namespace kvsparse {

namespace ref {

void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    float amax = 0.f;
    for (int i = 0; i < row_len; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f;
    scales[r] = scale;
    for (int i = 0; i < row_len; ++i) {
      // Division (not multiplication by 1/scale) keeps q exactly round(x / scale).
      const float t = scale != 0.f ? std::nearbyint(x[i] / scale) : 0.f;
      q[i] = static_cast<int8_t>(std::clamp(t, -127.f, 127.f));
    }
  }
}

void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    for (int i = 0; i < row_len; ++i) x[i] = static_cast<float>(q[i]) * scales[r];
  }
}

void QuantizeKvColumnsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales) {
  for (int c = 0; c < row_len; ++c) {
    float amax = 0.f;
    for (int64_t r = 0; r < n_rows; ++r) amax = std::max(amax, std::fabs(x[r * row_len + c]));
    channel_scales[c] = amax / 127.f;
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int c = 0; c < row_len; ++c) {
      const float scale = channel_scales[c];
      const float t = scale != 0.f ? std::nearbyint(x[r * row_len + c] / scale) : 0.f;
      q[r * row_len + c] = static_cast<int8_t>(std::clamp(t, -127.f, 127.f));
    }
  }
}

void DequantizeKvColumnsInt8(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    for (int c = 0; c < row_len; ++c) x[c] = static_cast<float>(q[c]) * channel_scales[c];
  }
}

}  // namespace ref

}  // namespace kvsparse
