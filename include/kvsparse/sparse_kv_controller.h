// The glue between the forward pass, the sparsity policies and the paged KV cache.
//
// A SparseKvController owns one KvPolicy per (sequence, layer), built from a
// KvSparsityConfig. The Engine calls it at fixed points of each layer:
//   1. after storing the chunk's K/V:   OnAppend       (the policy grows its per-token state)
//   2. around attention:                WantsScores → ObserveAttention (only for policies
//      that read attention: a QK-only second pass, ops::AttentionScores, for prompt chunks;
//      on decode steps the scores ops::Attention wrote, ops::GatherScoresFromRaw)
//   3. after attention:                 AfterAttention (eviction: SelectKeep →
//      PagedKvCache::Evict → OnEvict, when the policy's EvictionTarget says so)
// Evicting right after each layer's attention bounds every layer to budget + chunk tokens
// during prefill (and budget + evict_interval while decoding).
//
// Per-head layers (LayerKvConfig::per_head): one KvPolicy per (sequence, layer, kv head). The
// engine attends every head over its own spans (KvCache::HeadSpans) in one AttentionBatch and
// calls ObserveHeadsAttention; each policy sees observations with n_kv_heads = 1 and evicts its
// own head table, so heads keep different tokens. Layer statistics sum over the heads. With
// "head_budgets": "adaptive" (AdaKV, policy/adakv.h) the heads evict together: the controller
// asks each head's policy for its scores (ScoreForSelection), splits the layer's H·B tokens over
// the heads and evicts each table with its mask (OnEvict tells each policy).
//
// Policies whose decode observations are never used (KvPolicy::ObservesDecode false: SnapKV,
// PyramidKV without decode_evict) are not scored on decode steps: WantsScores says no.
//
// Query-aware layers (KvPolicy::SelectsSpans: Quest) never evict; before each decode step's
// attention the engine calls SelectSpans, which narrows the spans attention reads to the pages
// the policy picks for the query. Prompt chunks stay dense.
//
// Time spent in policy work is measured per layer: scoring (the gathering pass + Observe),
// selection (SelectKeep, SelectSpans) and compaction (Evict + OnEvict).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/attention_scores.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/status.h"

namespace kvsparse {

// Per layer, all sequences (and, in per-head layers, all heads) together.
struct SparseKvLayerStats {
  int64_t evictions = 0;       // eviction events (SelectKeep + Evict calls; one per head in per-head layers)
  int64_t evicted_tokens = 0;  // tokens dropped by them (per-head layers: (token, head) slots)
  int64_t observations = 0;    // gathering passes fed to a policy (one per head in per-head layers)
  int32_t peak_live_tokens = 0;  // most live tokens (of one head, in per-head layers) seen by an attention call
  double score_s = 0;          // ops::AttentionScores (or GatherScoresFromRaw) + Observe
  double select_s = 0;         // SelectKeep
  double compact_s = 0;        // PagedKvCache::Evict + OnEvict
  // Query-aware span selection (Quest): decode attention calls narrowed, the tokens they read
  // and the live tokens they could have read (one per head in per-head layers).
  int64_t span_selections = 0;
  int64_t selected_tokens = 0;
  int64_t selectable_tokens = 0;
  // Bytes the layer's policies hold as page metadata (Quest's key bounds and selection
  // buffers), all sequences and heads, allocated now; a gauge that ResetStats keeps.
  size_t metadata_bytes = 0;
  // Evictions put off because compacting needed pages the budget did not have (copies of
  // shared pages, int8_kivi rewrites); the tokens stay until the next eviction point, so a
  // forward step never fails half-way for want of pages.
  int64_t deferred_evictions = 0;
  // Sliding-window layers: tokens freed because they left the window (whole pages at a time),
  // counted apart from the policy's evictions.
  int64_t window_evicted_tokens = 0;
  // Global re-ranks of cross-layer rankings (cumulative), counted at the layer whose OnAppend
  // ran them (the shallowest cumulative layer); their time is part of select_s.
  int64_t reranks = 0;
  double rerank_s = 0;
  // Prompt chunks: the attention kernel's time (dense or sparse, without the gathering pass).
  double prefill_attention_s = 0;
  // Sparse prefill (LayerKvConfig::prefill): chunks attended over a selection, their estimates'
  // time, and the (query, key) pairs computed of those causal attention would have (summed
  // over kv heads).
  int64_t sparse_prefill_chunks = 0;
  double prefill_estimate_s = 0;
  int64_t prefill_selected_pairs = 0;
  int64_t prefill_causal_pairs = 0;
  double policy_s() const { return score_s + select_s + compact_s; }
};

class SparseKvController {
 public:
  // cache must outlive the controller; its geometry gives the layer count. `seed` feeds the
  // Random method (each (sequence, layer) derives its own).
  static StatusOr<std::unique_ptr<SparseKvController>> Create(const KvSparsityConfig& config, PagedKvCache* cache,
                                                              uint64_t seed = 0);
  SparseKvController(const SparseKvController&) = delete;
  SparseKvController& operator=(const SparseKvController&) = delete;

  const KvSparsityConfig& config() const { return config_; }

  // Sees every observation a policy receives, just before the policy does: (seq, layer, kv_head,
  // observation), kv_head -1 for a layer whose heads share one policy (the observation then
  // covers every head). For analysis tools (probe-heads); the heads of a per-head layer may call
  // it from several threads at once. Only layers whose policies observe attention call it.
  // query_heads: the tap sees the observation's fields per query head (kObserveQueryHeads),
  // gathered for it when the policy's own are folded.
  using ObservationTap = std::function<void(int seq, int layer, int kv_head, const AttentionObservation&)>;
  void SetObservationTap(ObservationTap tap, bool query_heads = false) {
    tap_ = std::move(tap);
    tap_query_heads_ = query_heads;
  }
  PagedKvCache* cache() const { return cache_; }
  // Tokens per forward chunk for prompts (the config's prefill_chunk).
  int32_t prefill_chunk() const { return config_.prefill_chunk; }
  // The policy of (seq, layer), or of one kv head of a per-head layer (kv_head 0 otherwise).
  KvPolicy& policy(int seq, int layer, int kv_head = 0) { return *policies_[Index(seq, layer, kv_head)]; }
  bool per_head(int layer) const { return config_.layers[layer].per_head; }

  // ---- StreamingLLM's positions within the cache (params.cache_positions) ----
  // True when `layer` numbers RoPE positions inside the cache: the engine rotates a chunk's q
  // and k at NextCachePosition() + i and stores and attends with those positions; after every
  // eviction of the layer the controller renumbers the survivors 0..n-1 and re-rotates their
  // keys (PagedKvCache::RenumberPositions) with the rotation below.
  bool UsesCachePositions(int layer) const {
    return config_.layers[layer].method == KvMethod::kStreamingLlm && config_.layers[layer].params.cache_positions;
  }
  // The model's RoPE (an Engine sets it); needed before a cache-position layer evicts.
  // RoPE of a layer's keys by a position delta (each layer may have its own frequencies).
  using LayerKeyRotateFn = std::function<void(int layer, float* k, int64_t n_rows, int32_t delta)>;
  void SetKeyRotation(LayerKeyRotateFn rotate) { rotate_ = std::move(rotate); }
  // Position the next token of (seq, layer) gets: the layer's live token count. Renumbers the
  // layer first when its positions are not 0..n-1 (e.g. after RemoveRange).
  StatusOr<int32_t> NextCachePosition(int seq, int layer);

  // How seq's layer attends prompt chunks (its LayerKvConfig::prefill).
  const PrefillSparsity& prefill_sparsity(int seq, int layer) const { return LayerConfig(seq, layer).prefill; }
  // The engine's record of one sparsely attended prompt chunk of `layer`.
  void RecordSparsePrefill(int layer, double estimate_s, double attention_s, const PrefillWork& work) {
    SparseKvLayerStats& st = stats_[static_cast<size_t>(layer)];
    ++st.sparse_prefill_chunks;
    st.prefill_estimate_s += estimate_s;
    st.prefill_attention_s += attention_s;
    st.prefill_selected_pairs += work.selected_pairs;
    st.prefill_causal_pairs += work.causal_pairs;
  }

  // The engine's record of a two-pass layer's estimate from the prompt's tail (sparse_prefill.h).
  void RecordPromptEstimate(int layer, double estimate_s) { stats_[static_cast<size_t>(layer)].prefill_estimate_s += estimate_s; }

  // The engine's record of a densely attended prompt chunk's attention time.
  void RecordPrefillAttention(int layer, double attention_s) {
    stats_[static_cast<size_t>(layer)].prefill_attention_s += attention_s;
  }

  // ---- Engine hooks (same seq / layer order as the forward pass) ----
  // Every policy of the layer (each head's, in a per-head layer) grows by n_new tokens, the
  // newest at position `last_position` (layer 0's call counts them in SeenTokens).
  void OnAppend(int seq, int layer, int32_t n_new, int32_t last_position = -1);
  // True when this layer's policy reads attention at this point (the caller then asks
  // ops::Attention for row_max_sum and calls ObserveAttention / ObserveHeadsAttention).
  // False on decode steps for policies that do not observe them (ObservesDecode).
  bool WantsScores(int seq, int layer, EvictionPoint point) const;
  // Runs the gathering pass over the same inputs as the attention call and feeds the policy
  // (shared layers). raw_scores: the raw_scores that attention call wrote ([n_q, n_heads,
  // n_tokens], see attention.h), given on decode steps; the scores then come from them
  // (ops::GatherScoresFromRaw) instead of a second pass over K (ops::AttentionScores).
  void ObserveAttention(int seq, int layer, const AttentionShape& shape, const float* q, const int32_t* q_pos,
                        int32_t n_q, const KvSpan* spans, int32_t n_spans, const float* row_max_sum, int n_threads,
                        const float* raw_scores = nullptr);
  // The same for every kv head of a per-head layer, after its ops::AttentionBatch call:
  // jobs[h] is head h's job (q [n_q, group, head_dim], its HeadSpans, row_max_sum
  // [n_q, group, 2] and, on decode steps, raw_scores [n_q, group, n_tokens of the head]);
  // head_shape has n_kv_heads 1 (n_heads = the group). When every job has raw_scores (decode)
  // the heads are gathered in one parallel region, one head per thread (each is small);
  // otherwise one after another, each with n_threads.
  void ObserveHeadsAttention(int seq, int layer, const AttentionShape& head_shape, const AttentionJob* jobs,
                             int n_kv_heads, const int32_t* q_pos, int32_t n_q, int n_threads);
  // Evicts when the policy's schedule says so (each head on its own in a per-head layer).
  // n_seen: tokens of the sequence processed so far (prompt + generated), which sizes
  // fraction budgets.
  Status AfterAttention(int seq, int layer, EvictionPoint point, int32_t n_seen, int32_t current_position);
  // Before a decode step's attention: a query-aware policy (Quest) filters *spans in place
  // (keeping order) to the runs attention reads; other policies leave them as they are.
  // kv_head -1 with the layer's Spans and the model's shape and q [n_heads, head_dim]; for a
  // per-head layer the head's index, its HeadSpans, shape {group, 1, head_dim} and q
  // [group, head_dim]. The spans must be every live token of the table.
  // Per-query-head selection (Quest's head_reduce "none", KvPolicy::SelectQueryHeadSpans):
  // given query_head_spans (an array of shape.n_heads lists), such a policy fills list i with
  // the runs query head i reads (only each group's first when the policy SelectsPerKvHead: the
  // group then attends as one job), leaves *spans as it is and the call returns true; false
  // otherwise (also when the budget covers the table: every head reads *spans). Without
  // query_head_spans it narrows *spans to the union of the query heads' pages. Stats count one
  // selection per call and, per query head, the mean of the tokens they read.
  bool SelectSpans(int seq, int layer, int kv_head, const AttentionShape& shape, const float* q,
                   std::vector<KvSpan>* spans, std::vector<KvSpan>* query_head_spans = nullptr);
  // The compensation token of a per-head layer's kv head (razor's local heads; count 0: none),
  // which the engine adds to that head's attention (ops::MergeWeightedToken).
  KvCompensation Compensation(int seq, int layer, int kv_head) const {
    return policies_[Index(seq, layer, kv_head)]->Compensation();
  }
  // Whether the layer's per-query-head selection is one per KV head (KvPolicy::SelectsPerKvHead).
  bool SelectsPerKvHead(int seq, int layer) const { return policies_[Index(seq, layer)]->SelectsPerKvHead(); }
  // Whether the (seq, layer) policy narrows decode steps' spans (SelectSpans may pick pages).
  bool SelectsSpans(int seq, int layer) const { return policies_[Index(seq, layer)]->SelectsSpans(); }

  // Drops every token of seq from the cache and restarts its policies.
  Status ResetSequence(int seq);

  // ---- Sequences that come and go (a serving runtime) ----
  // An empty sequence with fresh policies: a released id when there is one, else a new id (the
  // cache grows by one sequence; empty tables cost no pages). `layers` (optional, checked by
  // CheckSequenceLayers) gives this sequence its own methods and budgets.
  StatusOr<int> AcquireSequence(std::shared_ptr<const std::vector<LayerKvConfig>> layers = nullptr);
  // A per-sequence override may change methods, budgets and kv_type (the sequence's pages then
  // use that storage: PagedKvCache::SetSequenceStorage), but must keep every layer's per_head
  // (the cache's tables are laid out at start-up) and cannot turn on StreamingLLM cache
  // positions; its values are validated as the config file's. Messages name the layer and field.
  Status CheckSequenceLayers(const std::vector<LayerKvConfig>& layers) const;
  // Drops every token of seq, frees its pages and its policies' state at once and makes its id
  // available again.
  Status ReleaseSequence(int seq);
  // Sequences acquired (or created with the cache) and not released.
  int n_active_sequences() const;
  // Tokens of seq appended since its last reset, less those RemoveRange took out of its context:
  // what fraction budgets are a fraction of (positions need not start at 0).
  int32_t SeenTokens(int seq) const { return seen_[static_cast<size_t>(seq)]; }
  // dst (an acquired sequence) becomes a copy of src: every page shared copy-on-write and every
  // policy cloned, so both continue exactly as src would.
  Status Fork(int src, int dst);
  // Drops the tokens with positions in [p0, p1) (p1 < 0: to the end) from every table of seq;
  // each policy compacts its per-token state with its table's mask, as after an eviction.
  Status RemoveRange(int seq, int32_t p0, int32_t p1);
  // The most bytes of KV pages one sequence can hold between steps while it runs a prompt of
  // prompt_tokens (chunked, evicting as configured) and then generates max_new_tokens: per
  // layer the most live tokens its budget allows (its budget after each prompt chunk, budget +
  // evict_interval while decoding; everything for full and query-aware layers, and the whole
  // prompt when eviction waits for the prompt's end), in pages, plus a page in flight. What a
  // scheduler reserves to admit a request (with ChunkReserveBytes for the chunks it runs).
  size_t SequenceReserveBytes(int32_t prompt_tokens, int32_t max_new_tokens,
                              const std::vector<LayerKvConfig>* layers = nullptr) const;
  // What one prompt chunk of chunk_tokens holds beyond its sequence's SequenceReserveBytes
  // until the chunk's eviction: a layer that trims after each chunk holds the chunk on top of
  // its budget (0 for layers that keep the whole prompt). A scheduler reserves this only for
  // the chunks of the step it runs, not for every admitted request: that is what lets a sparse
  // request reserve its budget rather than its budget plus a chunk.
  size_t ChunkReserveBytes(int32_t chunk_tokens, const std::vector<LayerKvConfig>* layers = nullptr) const;

  const std::vector<SparseKvLayerStats>& layer_stats() const { return stats_; }
  // Bytes the policies hold beyond the KV pages (KvPolicy::StateBytes: per-token scores, vote
  // rings, rankings, page metadata, buffers), allocated now; a released sequence's are fresh.
  size_t PolicyStateBytes() const;
  void ResetStats();
  // Per-layer table: method, storage ("/head" for per-head layers), allocated and live KV
  // bytes, live tokens (per-head layers: "min-max" over heads), evictions, policy time; then totals,
  // and for query-aware layers the share of live tokens decode attention read and their page
  // metadata bytes; the policies' state bytes (PolicyStateBytes).
  std::string FormatStats() const;

 private:
  SparseKvController(const KvSparsityConfig& config, PagedKvCache* cache, uint64_t seed);
  size_t Index(int seq, int layer, int kv_head = 0) const {
    return static_cast<size_t>(seq) * policies_per_seq_ + policy_offset_[layer] + kv_head;
  }
  int n_policies(int layer) const { return per_head(layer) ? cache_->geometry().n_kv_heads : 1; }
  Status BuildPolicies(int seq);
  // Lets cross-layer policies of seq share their state (LinkSequencePolicies).
  void LinkSequence(int seq);
  // The config of seq's layer: its own (AcquireSequence with layers) or the controller's.
  const LayerKvConfig& LayerConfig(int seq, int layer) const {
    return seq_layers_[static_cast<size_t>(seq)] ? (*seq_layers_[static_cast<size_t>(seq)])[layer]
                                                 : config_.layers[layer];
  }

  // The policy that sizes a reservation: the layer's template, or (layers given) *own, made
  // from the override's config.
  const KvPolicy& ReservePolicy(int layer, int kv_head, const std::vector<LayerKvConfig>* layers,
                                std::unique_ptr<KvPolicy>* own) const;
  // Reused gathering outputs of one Observe (no allocation in steady-state decode).
  struct ObserveScratch {
    std::vector<float> sum_all, sum_window, last;  // each [heads, n_tokens]
    std::vector<float> window_rows;                // [n_window, heads, n_tokens]
    std::vector<float> q_slice, row_max_sum_slice, slice;  // per-query-head gathering's one head of each group
    std::vector<float> tap_sum_all, tap_sum_window, tap_last, tap_window_rows;  // a query-head tap's own
  };
  // The gathering pass and Observe for one policy, into `scratch`; touches nothing else of
  // the controller, so policies of different heads may observe concurrently.
  // `tap`, when set, sees the observation first (with seq, layer, kv_head), per query head when
  // tap_query_heads.
  // The gathering pass's outputs asked in `outputs`: each KV head's fold, or per query head.
  static void GatherScores(const AttentionShape& shape, KvStorage storage, const ScoreGathering& gathering,
                           const float* q, const int32_t* q_pos, int32_t n_q, const KvSpan* spans, int32_t n_spans,
                           int64_t n_tokens, const float* row_max_sum, const float* raw_scores, bool query_heads,
                           const ScoreOutputs& outputs, int n_threads, ObserveScratch* scratch);
  static void Observe(KvPolicy& p, KvStorage storage, GqaAggregation aggregation, const AttentionShape& shape,
                      const float* q, const int32_t* q_pos, int32_t n_q, const KvSpan* spans, int32_t n_spans,
                      const float* row_max_sum, int n_threads, const float* raw_scores, ObserveScratch* scratch,
                      const std::function<void(const AttentionObservation&)>& tap, bool tap_query_heads);
  // RenumberPositions of the layer's table(s) (kv_head < 0: all) with rotate_.
  Status RenumberPositions(int seq, int layer, int kv_head);
  // Eviction of a layer: its table, each head's, or AdaKV's joint eviction of its heads.
  Status EvictLayer(int seq, int layer, EvictionPoint point, int32_t n_seen, int32_t current_position);
  // A sliding-window layer's table (kv_head < 0: the shared one): drops the whole leading pages
  // of tokens that no later query can see (positions <= current_position + 1 - window).
  Status TrimToWindow(int seq, int layer, int kv_head, int32_t current_position);
  Status TrimLayerToWindow(int seq, int layer, int32_t current_position);  // every table of the layer
  // Eviction of one table: the layer's (kv_head < 0) or one head's.
  Status EvictTable(int seq, int layer, int kv_head, EvictionPoint point, int32_t n_seen,
                    int32_t current_position);
  // The selection context of one table (kv_head < 0: the layer's), its spans and positions read
  // into *spans / *positions; target = every live token (the caller sets it).
  SelectionContext TableSelection(int seq, int layer, int kv_head, EvictionPoint point, int32_t current_position,
                                  std::vector<KvSpan>* spans, std::vector<int32_t>* positions) const;
  // A per-head layer with adaptive head budgets (AdaKV): every head's table at once.
  Status EvictHeadsAdaptively(int seq, int layer, EvictionPoint point, int32_t n_seen, int32_t current_position);

  KvSparsityConfig config_;
  PagedKvCache* cache_;
  uint64_t seed_;
  int n_layers_;
  std::vector<size_t> policy_offset_;                // [n_layers] first policy of each layer within a sequence
  size_t policies_per_seq_ = 0;                      // Σ layers' policies (n_kv_heads for per-head layers)
  std::vector<std::unique_ptr<KvPolicy>> policies_;  // [n_seqs, policies_per_seq_]
  std::vector<uint64_t> generation_;                  // [n_seqs] restarts, varies the Random seed
  std::vector<int32_t> seen_;                         // [n_seqs] SeenTokens
  std::vector<int32_t> last_position_;                // [n_seqs] newest position appended (-1: none)
  std::vector<uint8_t> released_;                     // [n_seqs] 1: free for AcquireSequence
  // [n_seqs] a sequence's own layer configs (null: config_.layers)
  std::vector<std::shared_ptr<const std::vector<LayerKvConfig>>> seq_layers_;
  // [Σ layers' policies] fresh policies (budgets, properties), indexed like one sequence's policies_.
  std::vector<std::unique_ptr<KvPolicy>> layer_templates_;
  std::vector<SparseKvLayerStats> stats_;             // [n_layers], all sequences together
  ObservationTap tap_;
  bool tap_query_heads_ = false;
  LayerKeyRotateFn rotate_;                              // RoPE by a position delta (cache-position layers)

  // Reused buffers (no allocation in steady-state decode).
  std::vector<ObserveScratch> observe_scratch_;     // [max(1, n_kv_heads)]: one per head observed at once
  std::vector<KvSpan> spans_;
  std::vector<int32_t> positions_;                  // [n_live]
  std::vector<uint8_t> keep_;                       // [n_live]
  std::vector<std::vector<KvSpan>> head_spans_;     // [n_kv_heads] adaptive head budgets: each head's spans,
  std::vector<std::vector<int32_t>> head_positions_;  // its positions [n_live of the head]
  std::vector<std::vector<uint8_t>> head_keeps_;    // and its keep mask
};

// A paged cache sized for max_tokens per sequence in every table (storage and per-head tables
// per layer from the config), and its controller. Its page budget stops at the machine's
// available memory less `reserved_bytes` (what the caller allocates beside it, e.g. the engine's
// scratch).
struct SparseKvSetup {
  std::unique_ptr<PagedKvCache> cache;
  std::unique_ptr<SparseKvController> controller;
};
StatusOr<SparseKvSetup> CreateSparseKv(const KvGeometry& geometry, const KvSparsityConfig& config, int n_seqs,
                                       int32_t max_tokens, uint64_t seed = 0, size_t reserved_bytes = 0);
// A serving cache: no sequences yet (SparseKvController::AcquireSequence adds them) and a
// fixed budget of budget_bytes for every page of every sequence together.
StatusOr<SparseKvSetup> CreateServingKv(const KvGeometry& geometry, const KvSparsityConfig& config,
                                        size_t budget_bytes, uint64_t seed = 0);

}  // namespace kvsparse
