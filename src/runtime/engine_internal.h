// The Engine's private parts shared by its source files (engine.cc: the forward pass;
// engine_prompt_estimate.cc: two-pass Vertical-Slash): the step's entries, the scratch, and the
// row regrouping helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/engine.h"
#include "kvsparse/kv_cache.h"
#include "kvsparse/model.h"
#include "kvsparse/ops.h"
#include "kvsparse/sparse_prefill.h"

namespace kvsparse {

namespace engine_detail {
// Long prompts run in chunks of this many tokens, which bounds the scratch memory
// (the FFN buffers are [chunk, hidden]); chunking is exact because attention is causal.
constexpr int32_t kMaxChunkTokens = 512;
// Per-row elementwise work is spread over threads only when there are enough rows to pay for it.
constexpr int32_t kParallelRowThreshold = 16;

// rows [n, n_kv_heads, width] (a chunk's query rows: each kv head's group of query heads) ->
// out [n_kv_heads, n, width], so that each kv head's rows are one job's contiguous input.
inline void GroupRowsByKvHead(const float* rows, int32_t n, int n_kv_heads, size_t width, std::vector<float>* out) {
  out->resize(static_cast<size_t>(n_kv_heads) * n * width);
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int32_t i = 0; i < n; ++i) {
      std::copy_n(rows + (static_cast<size_t>(i) * n_kv_heads + h) * width, width,
                  out->data() + (static_cast<size_t>(h) * n + i) * width);
    }
  }
}

// The inverse: grouped [n_kv_heads, n, width] -> rows [n, n_kv_heads, width].
inline void UngroupRows(const float* grouped, int32_t n, int n_kv_heads, size_t width, float* rows) {
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int32_t i = 0; i < n; ++i) {
      std::copy_n(grouped + (static_cast<size_t>(h) * n + i) * width, width,
                  rows + (static_cast<size_t>(i) * n_kv_heads + h) * width);
    }
  }
}

// The same attention with other head counts (the per-head and per-query-head calls).
// A shape of a subset of a layer's heads: its sinks (the layer's [n_heads]) do not index the
// subset's heads, so they are dropped; AttentionBatch jobs carry their own heads' sinks
// (JobSinks).
inline AttentionShape WithHeads(const AttentionShape& shape, int n_heads, int n_kv_heads) {
  AttentionShape s = shape;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv_heads;
  s.sinks = nullptr;
  return s;
}
// The sinks of a job whose query heads start at the layer's `first_head` (null: the layer has none).
inline const float* JobSinks(const AttentionShape& layer_shape, int first_head) {
  return layer_shape.sinks != nullptr ? layer_shape.sinks + first_head : nullptr;
}

// How a MoE layer turns a token's router logits into expert weights (llama.cpp's build_moe_ffn).
struct RouterRule {
  int n_experts = 0;
  int n_used = 0;
  ExpertGating gating = ExpertGating::kSoftmax;
  const float* selection_bias = nullptr;  // [n_experts] added to the probabilities for the choice only
  bool normalize = false;
  float scale = 1.0f;
};
// One token's expert choice: the gating's probabilities [n_experts] (softmax of the logits, or
// each logit's sigmoid), the n_used best experts (by logit, or by probability + selection_bias
// when there is one; the lower id first among equals), their probabilities as weights,
// renormalized to sum 1 when `normalize` (the sum clamped below at 2^-14, as llama.cpp clamps
// it), times `scale`. kSoftmaxChosen (gpt-oss): the n_used best logits, weighted by the softmax
// of those logits alone. probs: [n_experts] scratch; experts, weights: [n_used].
void RouteToExperts(const float* logits, const RouterRule& rule, float* probs, int32_t* experts, float* weights);
// A step with at most this many rows (decode, small batches) runs its small products together.
constexpr int32_t kFewRows = 16;

// Products of one step on the same or different inputs: with few rows, in one parallel region
// (MatMulMany: a decode step's Q/K/V, gate/up and experts each cost a fork and join that is a
// measurable share of their time); else one MatMul each (MatMul packs many rows in parallel).
// Either way the same bits.
inline void RunProducts(std::initializer_list<ops::MatMulJob> jobs, int n_threads) {
  int64_t most_rows = 0;
  for (const ops::MatMulJob& job : jobs) most_rows = std::max(most_rows, job.n_tokens);
  if (most_rows <= kFewRows) {
    ops::MatMulMany(std::span<const ops::MatMulJob>(jobs.begin(), jobs.size()), n_threads);
    return;
  }
  for (const ops::MatMulJob& job : jobs) ops::MatMul(*job.w, job.x, job.n_tokens, job.y, n_threads);
}

}  // namespace engine_detail

struct Engine::Entry {
  int seq = 0;
  int32_t n = 0;
  int32_t pos0 = 0;
  EvictionPoint phase = EvictionPoint::kDecodeStep;
  int32_t row0 = 0;  // first row in the scratch
};

// Activations for one step, rows = every row of the batch; grown on demand and kept, so
// steady-state decode never allocates.
struct Engine::Scratch {
  int32_t rows = 0;
  std::vector<float> x;            // [rows, dim] residual stream
  std::vector<float> normed;       // [rows, dim] RmsNorm output fed to projections
  std::vector<float> q;            // [rows, n_heads, head_dim]
  std::vector<float> k;            // [rows, n_kv_heads, head_dim]
  std::vector<float> v;            // [rows, n_kv_heads, head_dim]
  std::vector<float> att;          // [rows, n_heads, head_dim]
  std::vector<float> proj;         // [rows, dim] attention output / FFN output before the residual add
  std::vector<float> gate;         // [rows, hidden]
  std::vector<float> up;           // [rows, hidden]
  std::vector<int32_t> positions;  // [rows]
  std::vector<float> row_max_sum;  // [rows, n_heads, 2] softmax statistics (observing policies, compensation)
  std::vector<KvCompensation> compensations;  // [n_kv_heads] a per-head layer's compensation tokens
  // Decode steps with an observing policy: the attention call's raw scores, which the policy's
  // scores are gathered from instead of a second pass over K. [n_heads, n_live] (per-head
  // layers: each kv head's [group, n_live of that head], one after another).
  std::vector<float> raw_scores;
  std::vector<KvSpan> spans;       // live K/V of the current (seq, layer)
  // Per-head layers: each kv head's live spans ([n, 1, head_dim] rows). [n_kv_heads]
  std::vector<std::vector<KvSpan>> head_spans;
  // Query-aware layers selecting per query head (Quest): the runs each query head reads. [n_heads]
  std::vector<std::vector<KvSpan>> query_spans;
  std::vector<AttentionJob> jobs;  // one ops::AttentionBatch call's jobs
  std::vector<AttentionJob> observe_jobs;  // sparse prefill, per-head layers: each kv head's observation
  // The step's batched decode attention (Engine::AttendDecodeBatch): the joining entries, each
  // one's live spans, and the call's jobs. [joining entries]
  std::vector<const Entry*> decode_batch;
  std::vector<std::vector<KvSpan>> decode_spans;
  std::vector<AttentionJob> decode_jobs;
  std::vector<uint8_t> decode_done;  // 1: the entry's storage type had its call
  std::vector<size_t> raw_offset;  // [n_kv_heads + 1] each head's first raw score in raw_scores
  std::vector<uint8_t> selected_by_query;  // [n_kv_heads] 1: the head's query heads got their own runs
  // Per-head layers, prompt chunks only (a decode step's group rows are contiguous in q / att):
  std::vector<float> q_head;       // [n_kv_heads, rows, group, head_dim] the query rows by kv head
  std::vector<float> att_head;     // [n_kv_heads, rows, group, head_dim] their attention output
  std::vector<float> q_job;        // sparse prefill per query head: [n_heads, rows, head_dim]
  // Logits of several sequences: the wanted rows' normed states and their logits.
  std::vector<float> logit_in;     // [wanted rows, dim]
  std::vector<float> logit_out;    // [wanted rows, n_vocab]
  std::vector<int32_t> wanted;     // [wanted rows] batch row of each
  std::vector<KvAppendPlan> plans; // [batch] what the step appends, checked before it runs
  std::vector<uint8_t> relative_positions;  // [n_layers] 1: StreamingLLM cache-position layer
  std::vector<Entry> entries;      // [batch] the step's sequences and their first rows
  // Sparse prefill: the keys as f32 (a shared layer: one [n_kv_heads, rows, head_dim] matrix in
  // [0]; a per-head layer: each head's [rows, head_dim]), each query's visible token count
  // ([n_q], per head likewise), per kv head its selector, and the selections (per query head, or
  // per kv head with group_shared).
  std::vector<std::vector<float>> prefill_keys;
  std::vector<int64_t> prefill_key_rows;  // rows of each prefill_keys matrix (n_tokens rounded up)
  std::vector<std::vector<int64_t>> visible;
  std::vector<PrefillSelector> selectors;
  std::vector<PrefillSelection> selections;
  std::vector<float> head_row_max_sum;  // [jobs, rows, query heads per job, 2] (observing policies)
  std::vector<KeySelection> selection_views;
  // MoE layers: the router's logits, each row's chosen experts and their weights, the (row,
  // choice) slots grouped by expert (counting sort: expert e's are expert_slots[expert_first[e]
  // .. expert_first[e + 1])), and one expert's rows gathered in and out.
  std::vector<float> router_logits;     // [rows, n_experts]
  std::vector<float> router_probs;      // [n_experts] one row's gating probabilities
  std::vector<int32_t> chosen_expert;   // [rows, n_experts_used]
  std::vector<float> chosen_weight;     // [rows, n_experts_used]
  std::vector<int32_t> expert_slots;    // [rows * n_experts_used] row * n_experts_used + choice
  std::vector<int32_t> expert_first;    // [n_experts + 1]
  std::vector<float> expert_in;         // [rows, dim]
  std::vector<float> expert_out;        // [rows, dim]
  // Steps of at most kGroupedExpertRows rows (decode) run every chosen expert at once: all slots'
  // rows gathered in expert order, their gate/up and down products in two MatMulMany calls.
  std::vector<float> grouped_in;        // [slots, dim]
  std::vector<float> grouped_gate;      // [slots, expert_hidden_dim]
  std::vector<float> grouped_up;        // [slots, expert_hidden_dim]
  std::vector<float> grouped_out;       // [slots, dim]
  std::vector<ops::MatMulJob> matmul_jobs;  // the products one MatMulMany call runs
  // MLA layers: the projected queries before absorption, the query bottleneck, each head's rows
  // gathered in and out of its absorption matrices (head-major, so heads run in parallel), and
  // the per-head outputs fed to attn_output.
  std::vector<float> mla_q;         // [rows, n_heads, nope + rope]
  std::vector<float> mla_q_lora;    // [rows, q_lora_rank]
  std::vector<float> mla_head_in;   // [n_heads, rows, max(nope, kv_lora_rank)]
  std::vector<float> mla_head_out;  // [n_heads, rows, max(kv_lora_rank, v_head_dim)]
  std::vector<float> mla_out;       // [rows, n_heads * v_head_dim]

  static constexpr int32_t kGroupedExpertRows = engine_detail::kFewRows;
  // Floats of the grouped-expert buffers, whatever the step's rows (Engine::ScratchBytesFor).
  static size_t GroupedExpertFloats(const ModelConfig& c) {
    if (!c.IsMoe()) return 0;
    const size_t slots = static_cast<size_t>(kGroupedExpertRows) * static_cast<size_t>(c.n_experts_used);
    return slots * (2 * static_cast<size_t>(c.dim) + 2 * static_cast<size_t>(c.expert_hidden_dim));
  }
  // Floats per row of the buffers Reserve sizes (Engine::ScratchBytesFor): keep the two in step.
  static size_t FloatsPerRow(const ModelConfig& c) {
    const size_t q_dim = static_cast<size_t>(c.n_heads) * c.head_dim;
    const size_t kv_dim = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
    return 3 * static_cast<size_t>(c.dim) + 2 * q_dim + 2 * kv_dim + 2 * static_cast<size_t>(c.MaxFfnWidth()) + 1 +
           MoeFloatsPerRow(c) + MlaFloatsPerRow(c);
  }
  static size_t MlaHeadWidth(const ModelConfig& c) {
    return static_cast<size_t>(std::max({c.mla_nope_dim, c.kv_lora_rank, c.mla_v_head_dim}));
  }
  static size_t MlaFloatsPerRow(const ModelConfig& c) {
    if (!c.IsMla()) return 0;
    const size_t heads = static_cast<size_t>(c.n_heads);
    return heads * static_cast<size_t>(c.QueryHeadDim()) + static_cast<size_t>(c.q_lora_rank) +
           2 * heads * MlaHeadWidth(c) + heads * static_cast<size_t>(c.mla_v_head_dim);
  }
  // (int32 entries count as one float each)
  static size_t MoeFloatsPerRow(const ModelConfig& c) {
    if (!c.IsMoe()) return 0;
    return static_cast<size_t>(c.n_experts) + 3 * static_cast<size_t>(c.n_experts_used) + 2 * static_cast<size_t>(c.dim);
  }
  void Reserve(const ModelConfig& c, int32_t n) {
    if (n <= rows) return;
    const size_t r = static_cast<size_t>(n);
    const size_t q_dim = static_cast<size_t>(c.n_heads) * c.head_dim;
    const size_t kv_dim = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
    x.resize(r * c.dim);
    normed.resize(r * c.dim);
    q.resize(r * q_dim);
    k.resize(r * kv_dim);
    v.resize(r * kv_dim);
    att.resize(r * q_dim);
    proj.resize(r * c.dim);
    gate.resize(r * c.MaxFfnWidth());
    up.resize(r * c.MaxFfnWidth());
    positions.resize(r);
    if (c.IsMoe()) {
      const size_t used = static_cast<size_t>(c.n_experts_used);
      router_logits.resize(r * c.n_experts);
      router_probs.resize(static_cast<size_t>(c.n_experts));
      chosen_expert.resize(r * used);
      chosen_weight.resize(r * used);
      expert_slots.resize(r * used);
      expert_first.resize(static_cast<size_t>(c.n_experts) + 1);
      expert_in.resize(r * c.dim);
      expert_out.resize(r * c.dim);
      if (grouped_in.empty()) {
        const size_t slots = static_cast<size_t>(kGroupedExpertRows) * used;
        grouped_in.resize(slots * c.dim);
        grouped_gate.resize(slots * c.expert_hidden_dim);
        grouped_up.resize(slots * c.expert_hidden_dim);
        grouped_out.resize(slots * c.dim);
      }
    }
    if (c.IsMla()) {
      const size_t heads = static_cast<size_t>(c.n_heads);
      mla_q.resize(r * heads * c.QueryHeadDim());
      mla_q_lora.resize(r * c.q_lora_rank);
      mla_head_in.resize(heads * r * MlaHeadWidth(c));
      mla_head_out.resize(heads * r * MlaHeadWidth(c));
      mla_out.resize(r * heads * c.mla_v_head_dim);
    }
    rows = n;
  }
};


// Two-pass Vertical-Slash (sparse_prefill.h's two_pass). Pass 1 runs the prompt on a fork
// (capture_seq) and keeps, per two-pass layer, the query rows of its last `tail` positions; at
// the layer's last chunk it estimates the layer's patterns from them. Pass 2 (pattern_seq)
// assembles every chunk's selections from those patterns.
struct Engine::PromptEstimate {
  int capture_seq = -1;  // pass 1's fork, -1: no pass 1 running
  int pattern_seq = -1;  // the sequence pass 2 serves, -1: none
  int32_t tail_begin = 0, prompt_end = 0;  // prompt positions whose queries are kept: [tail_begin, prompt_end)
  struct Layer {
    std::vector<float> q;        // [n_tail, n_heads, head_dim] rotated query rows, in order
    std::vector<int32_t> q_pos;  // [n_tail] their attention positions
    // [n_kv_heads * selections per kv head] columns as token positions (so that pass 2 finds
    // them among its own keys), diagonals as offsets; empty until the layer's last pass-1 chunk
    std::vector<VerticalSlashPattern> patterns;
  };
  std::vector<Layer> layers;  // [n_layers]
  // Pass 2's scratch: each table's token positions (ascending; one table, or one per kv head in
  // a per-head layer), taken once per chunk, and per kv head (they assemble in parallel) a
  // pattern with its columns mapped to them.
  std::vector<std::vector<int32_t>> table_positions;  // [n_tables][n_tokens]
  std::vector<VerticalSlashPattern> mapped;           // [n_kv_heads]
};

}  // namespace kvsparse
