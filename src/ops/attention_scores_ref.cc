// Scalar reference for score gathering: per (query, head), every score and a two-pass
// softmax in double; then the fold over each KV head's query heads and the sums over queries.
// Scores are masked (sliding window) and capped as in ref::Attention.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvsparse/attention_scores.h"
#include "ops/attention_ref_util.h"

namespace kvsparse::ref {

void AttentionScores(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos,
                     int32_t n_q, const KvSpan* spans, int32_t n_spans, const ScoreGathering& gathering,
                     const ScoreOutputs& outputs) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0);
  KVS_CHECK(shape.n_heads % shape.n_kv_heads == 0);
  const int group = shape.n_heads / shape.n_kv_heads;
  const int d = shape.head_dim;
  const KvElementReader reader{storage, shape.n_kv_heads, d};
  int64_t n_tokens = 0;
  for (int32_t s = 0; s < n_spans; ++s) n_tokens += spans[s].n;

  std::vector<double> sum_all(static_cast<size_t>(shape.n_kv_heads) * n_tokens, 0.0);  // [n_kv_heads, n_tokens]
  std::vector<double> sum_window(sum_all.size(), 0.0);
  std::vector<double> last(sum_all.size(), 0.0);
  int32_t first_window = n_q;  // the first query inside the window
  while (first_window > 0 && q_pos[first_window - 1] >= gathering.window_start) --first_window;
  std::vector<double> p(static_cast<size_t>(n_tokens));       // [n_tokens] one row's probabilities
  std::vector<double> folded(static_cast<size_t>(n_tokens));  // [n_tokens] one query's fold over a group
  for (int32_t i = 0; i < n_q; ++i) {
    for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
      std::fill(folded.begin(), folded.end(), 0.0);
      for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        const float* q_row = q + (static_cast<size_t>(i) * shape.n_heads + h) * d;
        double max_score = -std::numeric_limits<double>::infinity();
        int64_t t_global = 0;
        for (int32_t s = 0; s < n_spans; ++s) {
          for (int32_t t = 0; t < spans[s].n; ++t, ++t_global) {
            if (!AttendsPosition(q_pos[i], spans[s].positions[t], shape.window)) {
              p[t_global] = -std::numeric_limits<double>::infinity();  // not attended (later, or outside the window)
              continue;
            }
            double dot = 0;
            for (int c = 0; c < d; ++c) dot += static_cast<double>(q_row[c]) * reader.K(spans[s], t, kv_head, c);
            p[t_global] = CapScore(dot * shape.scale, shape.softcap);
            max_score = std::max(max_score, p[t_global]);
          }
        }
        if (max_score == -std::numeric_limits<double>::infinity()) {
          std::fill(p.begin(), p.end(), 0.0);
        } else {
          double sum = 0;
          for (double& x : p) {
            x = std::exp(x - max_score);  // exp(-inf) = 0 for unattended tokens
            sum += x;
          }
          for (double& x : p) x /= sum;
        }
        for (int64_t t = 0; t < n_tokens; ++t) {
          folded[t] = gathering.aggregation == GqaAggregation::kMax ? std::max(folded[t], p[t]) : folded[t] + p[t];
        }
      }
      if (gathering.aggregation == GqaAggregation::kMean) {
        for (double& x : folded) x /= group;
      }
      double* all_row = &sum_all[static_cast<size_t>(kv_head) * n_tokens];
      double* window_row = &sum_window[static_cast<size_t>(kv_head) * n_tokens];
      double* last_row = &last[static_cast<size_t>(kv_head) * n_tokens];
      const bool in_window = q_pos[i] >= gathering.window_start;
      for (int64_t t = 0; t < n_tokens; ++t) {
        all_row[t] += folded[t];
        if (in_window) window_row[t] += folded[t];
        if (i == n_q - 1) last_row[t] = folded[t];
      }
      if (in_window && outputs.window_rows != nullptr) {
        // [n_window, n_kv_heads, n_tokens]: window queries are the call's last ones.
        float* row = outputs.window_rows + (static_cast<size_t>(i - first_window) * shape.n_kv_heads + kv_head) * n_tokens;
        for (int64_t t = 0; t < n_tokens; ++t) row[t] = static_cast<float>(folded[t]);
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
