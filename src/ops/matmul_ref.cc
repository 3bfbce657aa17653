// Scalar reference MatMul: dequantize each weight row to f32, accumulate in double.
#include <vector>

#include "kvsparse/ops.h"
#include "kvsparse/status.h"

namespace kvsparse::ref {

void MatMul(const WeightView& w, const float* x, int64_t n_tokens, float* y) {
  KVS_CHECK(w.rows >= 0 && w.cols >= 0 && n_tokens >= 0);
  const size_t row_bytes = DTypeRowBytes(w.type, w.cols);
  std::vector<float> row(static_cast<size_t>(w.cols));  // [cols]
  for (int64_t r = 0; r < w.rows; ++r) {
    DequantizeRow(w.type, static_cast<const uint8_t*>(w.data) + r * row_bytes, row.data(), w.cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * w.cols;
      double sum = 0.0;
      for (int64_t c = 0; c < w.cols; ++c) sum += static_cast<double>(row[c]) * xt[c];
      y[t * w.rows + r] = static_cast<float>(sum);
    }
  }
}

}  // namespace kvsparse::ref
