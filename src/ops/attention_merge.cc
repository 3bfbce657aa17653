// ops::MergeWeightedToken (attention.h): one more, weighted token folded into rows that
// Attention computed, from their softmax statistics (the split-K merge with a one-token chunk).
#include <algorithm>
#include <cmath>

#include "kvsparse/attention.h"
#include "kvsparse/status.h"

namespace kvsparse::ops {

void MergeWeightedToken(const AttentionShape& shape, const float* q, int32_t n_rows, const float* row_max_sum,
                        const float* k, const float* v, double weight, float* out) {
  KVS_CHECK(weight > 0.0 && shape.head_dim > 0);
  const int d = shape.head_dim;
  const double scale = shape.scale;  // as Attention scores: scale * q.k
  const double log_weight = std::log(weight);
  for (int32_t r = 0; r < n_rows; ++r) {
    const float* qr = q + static_cast<size_t>(r) * d;
    float* o = out + static_cast<size_t>(r) * d;
    double dot = 0.0;
    for (int c = 0; c < d; ++c) dot += static_cast<double>(qr[c]) * k[c];
    double s = scale * dot;
    if (shape.softcap > 0.f) s = shape.softcap * std::tanh(s / shape.softcap);
    s += log_weight;  // weight e^s = e^(s + ln weight)
    const double m = row_max_sum[2 * r], l = row_max_sum[2 * r + 1];
    if (!(l > 0.0)) {  // the row saw no token: the compensation token is all it attends to
      std::copy(v, v + d, o);
      continue;
    }
    const double top = std::max(m, s);
    const double a = l * std::exp(m - top), b = std::exp(s - top);
    const double inv = 1.0 / (a + b);
    for (int c = 0; c < d; ++c) o[c] = static_cast<float>((a * o[c] + b * v[c]) * inv);
  }
}

}  // namespace kvsparse::ops
