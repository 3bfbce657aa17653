// Attention over the KV cache, reading K/V only through KvSpans (see kv_cache.h).
// GQA-aware: each K/V row is read once for all query heads of its group.
#pragma once

#include <cstdint>

#include "kvsparse/kv_cache.h"

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
// spans: the live tokens (ascending positions), storage type `storage`.
// out: [n_q, n_heads, head_dim] f32 = softmax(q k^T * scale) v over the attended tokens.
// A query that attends to no token gets zeros.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, int n_threads);
}  // namespace ops

namespace ref {
// Scalar twin: materializes scores per query head, double accumulation.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out);
}  // namespace ref

}  // namespace kvsparse
