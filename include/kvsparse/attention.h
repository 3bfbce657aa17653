// Attention over the KV cache, reading K/V only through KvSpans (see kv_cache.h).
// GQA-aware: each K/V row is read once for all query heads of its group.
#pragma once

#include <cstdint>

#include "kvsparse/kv_types.h"

namespace kvsparse {

struct AttentionShape {
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // n_heads % n_kv_heads == 0; group = n_heads / n_kv_heads
  int head_dim = 0;
  float scale = 0.f;   // usually 1/sqrt(head_dim)
};

namespace ops {
// q:   [n_q, n_heads, head_dim] f32, already rotated.
// q_pos: [n_q] absolute positions; query i attends to cached tokens with position <= q_pos[i].
// spans: the live tokens (ascending positions), storage type `storage` (kInt8 spans carry
//   k_scale / v_scale).
// out: [n_q, n_heads, head_dim] f32 = softmax(q k^T * scale) v over the attended tokens.
// A query that attends to no token gets zeros.
// row_max_sum (optional): [n_q, n_heads, 2] each row's softmax statistics, natural-log
//   domain: max_t (scale * q.k_t) and sum_t exp(scale * q.k_t - max) over the attended tokens
//   (-inf and 0 when none). ops::AttentionScores (attention_scores.h) consumes them.
// raw_scores (optional): [n_q, n_heads, n_tokens] (n_tokens = all tokens of the spans, in span
//   order) each row's scores in the log2 domain, scale * log2(e) * q.k_t, and -inf for tokens
//   the query does not see. The kernel computes them anyway; storing them lets
//   ops::GatherScoresFromRaw (attention_scores.h) replace the second QK pass of
//   ops::AttentionScores. Meant for decode steps, where the array is small.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, int n_threads, float* row_max_sum = nullptr,
               float* raw_scores = nullptr);
}  // namespace ops

namespace ref {
// Scalar twin: materializes scores per query head, double accumulation.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, float* row_max_sum = nullptr,
               float* raw_scores = nullptr);
}  // namespace ref

}  // namespace kvsparse
