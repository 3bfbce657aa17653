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
  // Sliding-window attention (Gemma 2 / 3 local layers): when > 0, a query at position p
  // attends only to tokens with p - window < position <= p (a token is masked when
  // p - position >= window, as llama.cpp's standard SWA). The window is on positions, not on
  // token indices: gaps in the positions (evicted tokens) do not widen it. 0: no window.
  int32_t window = 0;
  // Attention-logit softcapping (Gemma 2): when > 0, each score s = scale * q.k becomes
  // softcap * tanh(s / softcap) before the softmax. 0: none.
  float softcap = 0.f;
  // int8 KV (kInt8, head_dim a multiple of 64) on kernel families with integer dot products
  // (avx512: VNNI; scalar: its twin): q.k and p.v as integer dots. Each query row is quantized
  // to int8 per 32 dims (scale amax / 127, as llama.cpp's q8_0) and each row's block of 16
  // probabilities times the tokens' V scales to u8 (step max / 255). Off: f32 dots of the
  // dequantized values (exact up to f32 rounding). The engine turns it on; the error it adds
  // is bounded in docs/DESIGN.md ("Integer attention") and tested in attention_test.cc.
  // bf16 KV on the avx512 family where the CPU has AVX512_BF16 (Bf16DotsEnabled, isa.h): q.k as
  // bf16 dot products, the query rounded to bf16 (DESIGN.md, "bf16 dots"); p.v stays f32.
  bool integer_dots = false;
  // Attention sinks (gpt-oss; Xiao et al. 2023's sink as a learned logit): [n_heads] one logit
  // per query head that joins every row's softmax denominator, natural-log domain, and
  // contributes no value: out = sum_t e^(s_t) v_t / (e^(sink) + sum_t e^(s_t)). Null: none. Read
  // by Attention; AttentionBatch takes each job's own (AttentionJob::sinks) and refuses a shape
  // that carries them, so a job cannot silently lose its heads' sinks.
  const float* sinks = nullptr;
};

namespace ops {
// q:   [n_q, n_heads, head_dim] f32, already rotated.
// q_pos: [n_q] absolute positions; query i attends to cached tokens with position <= q_pos[i]
//   (and, with shape.window > 0, > q_pos[i] - shape.window).
// spans: the live tokens (ascending positions), storage type `storage` (kInt8 spans carry
//   k_scale / v_scale).
// out: [n_q, n_heads, head_dim] f32 = softmax(s) v over the attended tokens, with the scores
//   s_t = scale * q.k_t (softcapped: softcap * tanh(s_t / softcap) when shape.softcap > 0).
// A query that attends to no token (none at or before its position, or none inside its window)
// gets zeros.
// row_max_sum (optional): [n_q, n_heads, 2] each row's softmax statistics, natural-log
//   domain: max_t s_t and sum_t exp(s_t - max) over the attended tokens (-inf and 0 when none);
//   with sinks, the max and the sum take the row's sink in as one more term (the sum stays the
//   output's denominator, so a merge of further tokens stays exact).
//   ops::AttentionScores (attention_scores.h) consumes them.
// raw_scores (optional): [n_q, n_heads, n_tokens] (n_tokens = all tokens of the spans, in span
//   order) each row's scores s_t in the log2 domain, log2(e) * s_t, and -inf for tokens the
//   query does not see (later ones, and those outside its window). The kernel computes them
//   anyway; storing them lets
//   ops::GatherScoresFromRaw (attention_scores.h) replace the second QK pass of
//   ops::AttentionScores. Meant for decode steps, where the array is small.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, int n_threads, float* row_max_sum = nullptr,
               float* raw_scores = nullptr);
// Whether the active kernel family computes attention over this storage and head size with
// integer dot products when AttentionShape::integer_dots is on.
bool UsesIntegerDots(KvStorage storage, int head_dim);
// Whether it computes q.k with bf16 dot products then (bf16 KV, Bf16DotsEnabled).
bool UsesBf16Dots(KvStorage storage);
}  // namespace ops

// Sparse prefill (sparse_prefill.h): the key tokens each block of a prompt chunk's queries
// attends to. Query i of the call belongs to block i / query_block; key tokens are numbered
// 0 .. n_tokens-1 over the job's spans in span order. Query block b attends to the token ranges
// ranges[2r] .. ranges[2r+1] - 1 for r in [range_offsets[b], range_offsets[b+1]), ascending and
// disjoint, and within them, as always, only to tokens its query's position (and window) sees. A
// query none of whose selected tokens it sees gets zeros.
struct KeySelection {
  int query_block = 0;                     // > 0
  const int64_t* range_offsets = nullptr;  // [n_query_blocks + 1], range_offsets[0] == 0
  const int64_t* ranges = nullptr;         // [2 * range_offsets[n_query_blocks]] (begin, end) pairs
};

// One attention problem of an AttentionBatch call: query heads over their own spans.
struct AttentionJob {
  const KvSpan* spans = nullptr;  // token rows [n, row_heads, head_dim] (see AttentionBatch)
  int32_t n_spans = 0;
  // The job's kv heads within a row: first_kv_head .. first_kv_head + shape.n_kv_heads - 1.
  int first_kv_head = 0;
  const float* q = nullptr;      // [n_q, shape.n_heads, head_dim]
  float* out = nullptr;          // [n_q, shape.n_heads, head_dim]
  float* row_max_sum = nullptr;  // optional, [n_q, shape.n_heads, 2] as in Attention
  float* raw_scores = nullptr;   // optional, [n_q, shape.n_heads, tokens of the job's spans] as in Attention
  // Optional: attend only to these tokens (sparse prefill). The kernel walks only the selected
  // tokens, so its cost follows the selection. Not with raw_scores.
  const KeySelection* selection = nullptr;
  // Optional: the job's own query positions [n_q] instead of the call's (one decode row of each
  // of several sequences in one call).
  const int32_t* q_pos = nullptr;
  // Optional: the sink logits of the job's shape.n_heads query heads (AttentionShape::sinks).
  const float* sinks = nullptr;
};

namespace ops {
// Several independent attention calls in one parallel region (a per-head layer's kv heads,
// each over its own token list; Quest's query heads, each over its own pages). Every job gets
// exactly what Attention(shape, storage, job.q, q_pos, n_q, job.spans, job.n_spans, job.out,
// n_threads, ...) gives over rows holding only its kv heads, bit for bit: the same token
// chunks and merge order; only the units of all jobs share one loop, so small jobs do not
// each pay a parallel region and leave threads idle at its end.
// row_heads: kv heads per stored token row of the spans (1 for HeadSpans; a shared layer's
// n_kv_heads), >= first_kv_head + shape.n_kv_heads for every job. All jobs share shape,
// storage and n_q, and q_pos unless a job brings its own (AttentionJob::q_pos).
void AttentionBatch(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos, int32_t n_q,
                    const AttentionJob* jobs, int32_t n_jobs, int n_threads);

// Adds one token that counts `weight` times (a compensation token standing for `weight`
// dropped tokens, RazorAttention Eq. 5) to rows already attended, as if the attention had also
// run over `weight` copies of (k, v): with the row's statistics (m, l) from Attention's
// row_max_sum and s = the token's score (scale and softcap as shape),
//   out = (l e^(m - M) out + weight e^(s - M) v) / (l e^(m - M) + weight e^(s - M)),  M = max(m, s).
// A row that attended to nothing (l = 0) becomes v. q, out: [n_rows, head_dim]; row_max_sum:
// [n_rows, 2]; k, v: [head_dim]. Scalar, O(n_rows x head_dim): one token per row.
void MergeWeightedToken(const AttentionShape& shape, const float* q, int32_t n_rows, const float* row_max_sum,
                        const float* k, const float* v, double weight, float* out);
}  // namespace ops

namespace ref {
// Scalar twin: materializes scores per query head, double accumulation.
void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, float* row_max_sum = nullptr,
               float* raw_scores = nullptr);
// Scalar twin of ops::AttentionBatch: each job on its own.
void AttentionBatch(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos, int32_t n_q,
                    const AttentionJob* jobs, int32_t n_jobs);
}  // namespace ref

}  // namespace kvsparse
