// Scalar reference for gathering from raw scores: each probability in double from the raw
// score (log2 domain) and the row's natural-log max and sum, then the fold over each KV
// head's query heads and the sums over queries, as ref::AttentionScores does.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvsparse/attention_scores.h"
#include "kvsparse/status.h"

namespace kvsparse::ref {

void GatherScoresFromRaw(const AttentionShape& shape, const int32_t* q_pos, int32_t n_q, int64_t n_tokens,
                         const float* raw_scores, const float* row_max_sum, const ScoreGathering& gathering,
                         const ScoreOutputs& outputs) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0);
  KVS_CHECK(shape.n_heads % shape.n_kv_heads == 0);
  const int group = shape.n_heads / shape.n_kv_heads;
  const double ln2 = std::log(2.0);
  const size_t n_out = static_cast<size_t>(shape.n_kv_heads) * n_tokens;
  std::vector<double> sum_all(n_out, 0.0), sum_window(n_out, 0.0), last(n_out, 0.0);  // each [n_kv_heads, n_tokens]
  std::vector<double> folded(static_cast<size_t>(n_tokens));                         // [n_tokens]
  for (int32_t i = 0; i < n_q; ++i) {
    for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
      std::fill(folded.begin(), folded.end(), 0.0);
      for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        const size_t row = static_cast<size_t>(i) * shape.n_heads + h;
        const double max_score = row_max_sum[2 * row], sum = row_max_sum[2 * row + 1];
        if (!(sum > 0)) continue;  // the row sees nothing
        const float* raw = raw_scores + row * n_tokens;
        for (int64_t t = 0; t < n_tokens; ++t) {
          const double p = std::isinf(raw[t]) ? 0.0 : std::exp(raw[t] * ln2 - max_score) / sum;
          folded[t] = gathering.aggregation == GqaAggregation::kMax ? std::max(folded[t], p) : folded[t] + p;
        }
      }
      if (gathering.aggregation == GqaAggregation::kMean) {
        for (double& x : folded) x /= group;
      }
      const size_t base = static_cast<size_t>(kv_head) * n_tokens;
      const bool in_window = q_pos[i] >= gathering.window_start;
      for (int64_t t = 0; t < n_tokens; ++t) {
        sum_all[base + t] += folded[t];
        if (in_window) sum_window[base + t] += folded[t];
        if (i == n_q - 1) last[base + t] = folded[t];
      }
    }
  }
  auto store = [](const std::vector<double>& from, float* to) {
    if (to == nullptr) return;
    for (size_t e = 0; e < from.size(); ++e) to[e] = static_cast<float>(from[e]);
  };
  store(sum_all, outputs.sum_all);
  store(sum_window, outputs.sum_window);
  store(last, outputs.last);
}

}  // namespace kvsparse::ref
