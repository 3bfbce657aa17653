// Attention-score gathering for sparsity policies: the softmax probabilities of one layer
// call, folded over the query heads of each KV head (GQA) and summed over queries, without
// materializing [n_q, n_heads, n_tokens]. The output fills an AttentionObservation
// (kv_policy.h). AttentionScores costs a second pass over K (QK only, no V), so callers run it
// only when the layer's policy NeedsAttention(); on decode steps GatherScoresFromRaw reuses the
// scores ops::Attention already computed instead.
#pragma once

#include <climits>
#include <cstdint>

#include "kvsparse/attention.h"
#include "kvsparse/kv_types.h"

namespace kvsparse {

struct ScoreGathering {
  GqaAggregation aggregation = GqaAggregation::kMean;  // how a KV head's query heads are folded
  // Queries at positions >= window_start also add to sum_window (SnapKV's observation window).
  int32_t window_start = INT32_MAX;
};

// Outputs, each [n_kv_heads, n_tokens] where n_tokens = total tokens of the spans; every
// element is overwritten (tokens no query sees get 0). Null outputs are skipped.
//   sum_all[h, t]    = Σ_queries agg_{query heads of h} p(query, head, t)
//   sum_window[h, t] = the same over the queries with position >= window_start
//   last[h, t]       = agg p(last query, head, t)
// and, [n_window, n_kv_heads, n_tokens] with n_window = the queries at positions >= window_start
// (the call's last ones), oldest first:
//   window_rows[w, h, t] = agg p(window query w, head, t)
// (AttentionScores only; GatherScoresFromRaw serves decode steps, whose one row is `last`).
struct ScoreOutputs {
  float* sum_all = nullptr;
  float* sum_window = nullptr;
  float* last = nullptr;
  float* window_rows = nullptr;
};

namespace ops {
// Same shape / q / q_pos / spans as the ops::Attention call that produced row_max_sum
// ([n_q, n_heads, 2], see attention.h): the probabilities are exp(score - max) / sum, with the
// scores that call attended (softcapped with shape.softcap), and 0 for the tokens outside a
// query's sliding window (shape.window), as for the ones after its position.
void AttentionScores(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos,
                     int32_t n_q, const KvSpan* spans, int32_t n_spans, const float* row_max_sum,
                     const ScoreGathering& gathering, const ScoreOutputs& outputs, int n_threads);
// The same outputs from the raw scores an ops::Attention call wrote (raw_scores
// [n_q, n_heads, n_tokens] and row_max_sum [n_q, n_heads, 2], see attention.h): no second
// pass over K, one exp2 per (query head, token). The raw scores already carry the softcap and
// the window's mask (-inf), so shape.window and shape.softcap play no part here. For decode
// steps; prompt chunks use
// AttentionScores, since their raw scores would be [chunk, n_heads, n_tokens].
void GatherScoresFromRaw(const AttentionShape& shape, const int32_t* q_pos, int32_t n_q, int64_t n_tokens,
                         const float* raw_scores, const float* row_max_sum, const ScoreGathering& gathering,
                         const ScoreOutputs& outputs, int n_threads);
}  // namespace ops

namespace ref {
// Scalar twin: computes each row's softmax itself (double), then aggregates.
void AttentionScores(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos,
                     int32_t n_q, const KvSpan* spans, int32_t n_spans, const ScoreGathering& gathering,
                     const ScoreOutputs& outputs);
// Scalar twin of ops::GatherScoresFromRaw (double).
void GatherScoresFromRaw(const AttentionShape& shape, const int32_t* q_pos, int32_t n_q, int64_t n_tokens,
                         const float* raw_scores, const float* row_max_sum, const ScoreGathering& gathering,
                         const ScoreOutputs& outputs);
}  // namespace ref

}  // namespace kvsparse
