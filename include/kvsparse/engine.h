// The forward pass over a batch of sequences. One step runs every row of the batch through
// each layer's matmuls together (weights are read once per step, whatever the number of
// sequences), while attention and the sparsity controller run per sequence over that
// sequence's own pages and policy state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

class SparseKvController;
struct AttentionShape;
struct PrefillSparsity;
struct PrefillSelection;
struct VerticalSlashPattern;

// One sequence's rows in a batch. The phase says what the sparsity policies may do after it
// (kv_policy.h): kPrefillChunk, a prompt chunk more chunks follow (trim to budget unless the
// config evicts at the prompt's end); kPromptEnd, the prompt's last chunk (trim to budget);
// kDecodeStep, generated tokens (grow to budget + evict_interval first).
struct BatchSequence {
  int seq = 0;
  const int32_t* tokens = nullptr;  // [n]
  int32_t n = 0;
  int32_t pos0 = 0;  // positions pos0 .. pos0 + n - 1
  EvictionPoint phase = EvictionPoint::kDecodeStep;
  // Null: no logits wanted. Else [n_vocab] of the last row, or [n, n_vocab] with all_logits.
  float* logits = nullptr;
  bool all_logits = false;
};

// The attention a layer of the model runs: heads, query scale (with RoPE magnitudes), window
// (sliding layers) and logit softcap. Shared by the forward pass and the benchmarks.
AttentionShape LayerAttentionShape(const ModelConfig& config, int layer);

// Per-engine scratch and the forward pass. One Engine serves any number of sequences stored
// in its KvCache; it is not thread-safe (it uses its own threads inside).
class Engine {
 public:
  // Rows one ForwardBatch may hold (the scratch is [rows, hidden]); Forward splits prompts.
  static constexpr int32_t kMaxBatchRows = 2048;

  // With a controller (sparse_kv_controller.h; it must manage this same cache) the forward
  // pass feeds the sparsity policies and evicts after each layer's attention. Without one
  // nothing is ever evicted. Layers whose policy numbers positions inside the cache
  // (StreamingLLM "cache_positions") rotate, store and attend a sequence's rows at the layer's
  // live token count + i instead of pos0 + i.
  Engine(const Model& model, KvCache* cache, int n_threads, SparseKvController* controller = nullptr);
  ~Engine();

  // The bytes of the scratch a step of `rows` rows grows to (its activations, and the logits of
  // one row): CreateRuntime checks it against the machine's memory together with the cache.
  static size_t ScratchBytesFor(const ModelConfig& config, int32_t rows);

  // One step over several sequences (each at most once). All-or-nothing: every check (token
  // ids, positions, the pages every layer of every sequence needs, KvCache::CheckAppend) runs
  // before anything is stored, so a failed step leaves the cache and the policies unchanged.
  // An eviction that would need pages the budget lacks is put off, not failed.
  // Errors: InvalidArgument (empty entry, duplicate sequence, more than kMaxBatchRows rows,
  // positions not after the stored ones), OutOfRange (token id), ResourceExhausted (pages).
  Status ForwardBatch(std::span<const BatchSequence> batch);

  // One sequence: n tokens at positions pos0 .. pos0+n-1. n > 1 is a prompt, run in chunks of
  // the controller's prefill_chunk (at most 512); n == 1 is a decode step. A prompt of more than
  // one chunk on a layer with two-pass Vertical-Slash (sparse_prefill.h, `two_pass`) runs twice:
  // first on a fork of seq (released after it) to estimate each such layer's pattern from the
  // prompt's tail, then on seq with that pattern.
  // logits: [n, n_vocab] when all_logits, else [n_vocab] for the last token.
  // Positions past the training context are allowed: the caller bounds the context.
  Status Forward(int seq, const int32_t* tokens, int32_t n, int32_t pos0, float* logits, bool all_logits = false);

  // The Vertical-Slash patterns the last two-pass prompt's second pass used for a layer
  // ([n_kv_heads * selections per kv head]; columns as token positions, diagonals as offsets),
  // empty when it had none. For analysis and tests.
  const std::vector<VerticalSlashPattern>& PromptPatterns(int layer) const;

  const Model& model() const { return model_; }
  KvCache* cache() const { return cache_; }
  int n_threads() const { return n_threads_; }
  SparseKvController* controller() const { return controller_; }

 private:
  struct Scratch;
  struct Entry;  // a validated BatchSequence and where its rows sit in the scratch
  struct PromptEstimate;  // two-pass Vertical-Slash: pass 1's tail queries, pass 2's patterns
  Status Validate(std::span<const BatchSequence> batch);
  // Forward's chunk loop (logits null: none wanted).
  Status ForwardChunks(int seq, const int32_t* tokens, int32_t n, int32_t pos0, int32_t max_chunk, float* logits,
                       bool all_logits);
  // ---- two-pass Vertical-Slash (engine_prompt_estimate.cc) ----
  // Whether a prompt of n tokens on seq runs in two passes (more than one chunk, and a layer
  // with two_pass whose chunks reach its min_context).
  bool WantsPromptEstimate(int seq, int32_t n, int32_t max_chunk) const;
  // Pass 1: the prompt on a fork of seq, which leaves each two-pass layer's pattern for seq.
  Status EstimatePrompt(int seq, const int32_t* tokens, int32_t n, int32_t pos0, int32_t max_chunk);
  // Pass 1, in Attend: keeps the tail's query rows and, at the layer's last chunk, estimates.
  void CapturePromptTail(const Entry& e, int layer, const AttentionShape& shape, const PrefillSparsity& prefill);
  // Pass 2, in SparsePrefillAttention: whether (seq, layer) has a pattern from pass 1.
  bool HasPromptPattern(int seq, int layer) const;
  // Pass 2, after LoadPrefillKeys read the chunk's spans: each table's key positions, once per
  // chunk, for AssembleFromPromptPattern.
  void TakeChunkKeyPositions(int layer);
  // Pass 2: selection `selection` of kv head h (table `table`) from its pattern, the columns
  // mapped to the chunk's keys. visible: [n_q].
  void AssembleFromPromptPattern(int layer, const PrefillSparsity& prefill, int table, int selection,
                                 const int64_t* visible, int32_t n_q, PrefillSelection* out);
  // The f32 keys of seq's layer, rows rounded up to round_to (0: no keys, only the rest), each
  // query's visible count (s.prefill_keys, s.visible, one table per kv head in a per-head layer)
  // and the spans they came from (s.spans / s.head_spans).
  void LoadPrefillKeys(int seq, int layer, const int32_t* q_pos, int32_t n_q, int round_to);
  // The attention of one sequence's rows in one layer, after its K/V were stored.
  Status Attend(const Entry& e, int layer, const AttentionShape& shape);
  // With a SparseKvController attached, on a layer shared by all kv heads.
  Status SparseAttention(const Entry& e, int layer, const AttentionShape& shape);
  // A prompt chunk of a layer with sparse prefill (LayerKvConfig::prefill), shared or per-head.
  Status SparsePrefillAttention(const Entry& e, int layer, const AttentionShape& shape, const PrefillSparsity& prefill);
  // A per-head layer (KvCache::per_head): one call per kv head, with or without a controller.
  Status PerHeadAttention(const Entry& e, int layer, const AttentionShape& shape);
  // Whether a sequence's rows in this layer join the step's batched decode attention: one decode
  // row, a shared layer, and (with a controller) a policy that neither observes this step's
  // attention nor selects pages, so its attention is the plain kernel call.
  bool JoinsDecodeBatch(const Entry& e, int layer) const;
  // The attention of those sequences (s.decode_batch) in one ops::AttentionBatch call per storage
  // type: one parallel region for all of them instead of one per sequence, each job exactly what
  // its own call would compute. The controller's OnAppend before, AfterAttention after.
  Status AttendDecodeBatch(int layer, const AttentionShape& shape);
  // ---- feed-forward (engine_ffn.cc) ----
 public:
  // MoE models: called in every MoE layer of every step with the router's logits of the step's
  // rows ([n_rows, n_experts], rows in batch order) before the experts are chosen: expert-usage
  // statistics, and tests that find router near-ties. Null (the default): nothing is called.
  using RouterObserver = std::function<void(int layer, int32_t n_rows, const float* router_logits)>;
  void SetRouterObserver(RouterObserver observer) { router_observer_ = std::move(observer); }

 private:
  RouterObserver router_observer_;
  // The FFN of the step's n rows: s.normed in, s.proj out. A dense layer's SwiGLU / GeGLU, or a
  // MoE layer's routed experts (each expert's rows gathered, so its weights are read once per
  // step) plus the shared expert.
  void FeedForward(int layer, int32_t n);
  void MixtureOfExperts(int layer, int32_t n);
  void GroupedExperts(int layer, int32_t n);  // MixtureOfExperts for a few rows (engine_ffn.cc)
  // s.normed in; Q, K, V into s.q / s.k / s.v with biases, Q/K norms and RoPE at s.positions.
  void ProjectAttention(int layer, int32_t n);
  // MLA layers (engine_mla.cc): s.normed in; the absorbed queries into s.q ([n, n_heads,
  // head_dim]) and the latent cache rows into s.k ([n, head_dim]), rotated at s.positions.
  void ProjectLatentAttention(int layer, int32_t n);
  // s.att ([n, n_heads, head_dim], each head's first kv_lora_rank values the latent output)
  // through each head's attn_v_b into s.mla_out ([n, n_heads * v_head_dim]), attn_output's input.
  void LatentAttentionOutput(int layer, int32_t n);
  const Model& model_;
  KvCache* cache_;
  int n_threads_;
  SparseKvController* controller_;
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<PromptEstimate> prompt_estimate_;  // null until a two-pass prompt
};

}  // namespace kvsparse
