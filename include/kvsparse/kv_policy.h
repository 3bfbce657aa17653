// The sparsity-policy interface: a policy observes attention and decides which cached
// tokens of one (sequence, layer) to keep under a budget. The cache then frees the others.
//
// Token identity: a policy keeps per-token state in arrays indexed by the token's index
// in the live list of its (sequence, layer) — ascending positions, the order
// KvCache::Spans returns. New tokens are appended at the end (OnAppend); an eviction
// compacts every array with the same keep mask (OnEvict), exactly as the cache compacts.
//
// Call order the engine follows for one (sequence, layer), per forward call:
//   1. cache->Append(n new tokens);            policy->OnAppend(n)
//      decode steps of SelectsSpans() policies (Quest): policy->SelectSpans(ctx, &spans)
//      narrows the spans step 2 reads
//   2. attention over the live tokens;         policy->Observe(obs)   (if NeedsAttention())
//      obs.n_tokens equals the live count after step 1.
//   3. target = policy->EvictionTarget(n_live, n_seen, point, evict_interval);
//      if target < n_live: policy->SelectKeep(ctx, &keep); cache compacts with keep;
//                          policy->OnEvict(keep).
// One policy instance serves one (sequence, layer); CreatePolicy (kv_policies.h) builds them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsparse/kv_types.h"
#include "kvsparse/status.h"

namespace kvsparse {

// Which AttentionObservation fields a policy reads (a bit set), so the kernel gathers
// only what is used.
enum ObservationField : uint32_t {
  kObserveSumAll = 1u << 0,
  kObserveSumWindow = 1u << 1,
  kObserveLast = 1u << 2,
  kObserveWindowRows = 1u << 3,
  // Not a field: the fields asked for hold one row per query head instead of each KV head's fold
  // (CAKE scores per query head, as its reference does after repeat_kv).
  kObserveQueryHeads = 1u << 4,
};

// Attention probabilities gathered by the attention kernel for one call on one layer,
// aggregated over the query heads of each KV head (unless the policy asks kObserveQueryHeads).
// Rows are live-token indices; the `n_kv_heads` of the shapes below is `n_heads` with
// kObserveQueryHeads.
struct AttentionObservation {
  int32_t n_queries = 0;               // queries in this call (1 in decode)
  int32_t n_tokens = 0;                // live tokens the queries could see (= live count)
  int n_kv_heads = 0;
  // Heads of the arrays: n_kv_heads (0 says the same), or with kObserveQueryHeads the query
  // heads, n_kv_heads x group (KV head h's at h·group .. h·group + group - 1).
  int n_heads = 0;
  int heads() const { return n_heads > 0 ? n_heads : n_kv_heads; }
  const int32_t* query_positions = nullptr;  // [n_queries]
  const float* sum_all = nullptr;      // [n_kv_heads, n_tokens] Σ over all queries of p(query, token)
  // [n_kv_heads, n_tokens] Σ over the last min(ObservationWindow(), n_queries) queries of
  // this call (SnapKV's observation window); null when the policy asks for no window.
  const float* sum_window = nullptr;
  const float* last = nullptr;         // [n_kv_heads, n_tokens] p(last query, token)
  // Per query of the window (the call's last n_window = min(ObservationWindow(), n_queries)
  // queries, oldest first): [n_window, n_kv_heads, n_tokens] p(query, token). Null unless asked.
  int32_t n_window = 0;
  const float* window_rows = nullptr;
};

// What a policy may look at when it selects.
struct SelectionContext {
  int layer = 0;
  int32_t n_live = 0;                  // tokens currently cached
  int32_t target = 0;                  // tokens to keep (< n_live; == n_live only for Full)
  const int32_t* positions = nullptr;  // [n_live] ascending
  int32_t current_position = 0;        // position of the newest token
  bool in_prefill = false;             // true for a selection right after a prompt chunk
  // Keys for methods that score them (KNorm): live spans in the cache's storage type.
  const KvSpan* spans = nullptr;
  int32_t n_spans = 0;
  KvStorage storage = KvStorage::kF32;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// A token that stands for `count` dropped ones (RazorAttention's compensation token, Eq. 4):
// the mean of their keys and values. Attention adds it with weight `count`, as if each dropped
// token had that key and value (Eq. 5; ops::MergeWeightedToken). count 0: none.
struct KvCompensation {
  const float* k = nullptr;  // [head_dim] the dropped keys' mean (as cached: after RoPE)
  const float* v = nullptr;  // [head_dim] the dropped values' mean
  int64_t count = 0;
};

// What a policy that selects spans per decode query (Quest) may look at.
struct SpanSelectionContext {
  int layer = 0;
  const float* q = nullptr;  // [n_q_heads, head_dim] the decode query, after RoPE
  int n_q_heads = 0;         // query heads in q (a per-head table: its group)
  int n_kv_heads = 0;        // kv heads in each span row (1 for HeadSpans)
  int head_dim = 0;
  KvStorage storage = KvStorage::kF32;  // the layer's storage type
  int32_t cache_page_size = 0;          // tokens per page of the paged cache
  float scale = 0.f;                    // the attention's softmax scale (0: 1 / sqrt(head_dim))
};

// What a selection ranks, for AdaKV's allocation over the heads of a layer (adakv.h): per-token
// scores (higher kept first), and the tokens a selection keeping ctx.target protects whatever
// their score: the newest, the first n_sink and the last n_recent (KeepSinksRecentAndTop's rule).
struct SelectionScoring {
  const float* scores = nullptr;  // [n_live], valid until the policy's next call
  int32_t n_sink = 0;
  int32_t n_recent = 0;
};

// Where in the forward pass an eviction decision is taken.
enum class EvictionPoint {
  kPrefillChunk,  // after a prompt chunk that more chunks of the same prompt follow: trim to budget
                  // (unless the config evicts at the prompt's end only, see PrefillEviction)
  kPromptEnd,     // after the last chunk of a prompt (a multi-token forward call): trim to budget
  kDecodeStep,    // after a decode step: let the layer grow to budget + evict_interval first
};

class KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  virtual std::string_view name() const = 0;
  // A deep copy of the policy and all its per-token state (and, for Random, its PRNG state),
  // used when a sequence is forked (copy-on-write prefix sharing): the copy then continues
  // exactly as the original would, and the two evolve independently afterwards.
  virtual std::unique_ptr<KvPolicy> Clone() const = 0;
  // Bit set of ObservationField the policy reads in Observe; 0 = it never looks at attention.
  virtual uint32_t NeededObservations() const { return 0; }
  // True when the policy needs AttentionObservation (costs a second pass over K).
  virtual bool NeedsAttention() const { return NeededObservations() != 0; }
  // Observation window in queries (SnapKV, PyramidKV); 0 = none (sum_window may be null).
  virtual int32_t ObservationWindow() const { return 0; }
  // Tokens this layer may keep once `n_seen` tokens of the sequence have been processed
  // (prompt + generated so far). Fraction budgets grow with n_seen; Full is unbounded.
  virtual int32_t BudgetTokens(int32_t n_seen) const = 0;
  // False for methods that compress the prompt only (SnapKV, PyramidKV by default):
  // generated tokens are then all kept.
  virtual bool EvictsDuringDecode() const { return true; }
  // True when a decode step must evict now whatever evict_interval says: cumulative, when a
  // shallower layer dropped tokens this layer still caches (so the cached sets stay nested).
  virtual bool MustEvictNow(int32_t n_live) const { return false; }
  // True when the budget of this layer shrinks as later layers of the sequence observe a prompt
  // (CAKE's cascading split of one total over the layers measured so far): after such a layer's
  // eviction at a prompt point the controller re-applies the budgets of the earlier such layers.
  virtual bool CascadesBudget() const { return false; }
  // False when observations of decode steps are never used (SnapKV, PyramidKV without
  // decode_evict): the controller then skips the scoring pass on decode steps.
  virtual bool ObservesDecode() const { return true; }
  // False when observations of prompt chunks are never used (reuse's selection layers, which read
  // decode steps' attention only): the controller then skips the scoring pass on prompt chunks.
  virtual bool ObservesPrompt() const { return true; }
  // Query-aware span selection (Quest): true when decode attention should read only the spans
  // SelectSpans picks. Such policies keep every token (they save reads, not memory).
  virtual bool SelectsSpans() const { return false; }
  // Filters *spans (every live span of the table, ascending) in place, keeping order, to the
  // runs a decode step's attention reads for the query ctx.q. Called before decode attention only.
  virtual void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) {}
  // Per-query-head span selection (Quest with head_reduce "none", the reference's
  // granularity): true when SelectQueryHeadSpans is the policy's selection instead of
  // SelectSpans, so each query head attends only its own pages.
  virtual bool SelectsPerQueryHead() const { return false; }
  // spans: every live span of the table, ascending; ctx as for SelectSpans (q
  // [n_q_heads, head_dim]; query head i belongs to kv head i / (n_q_heads / n_kv_heads) of the
  // span rows). Returns false when every query head reads the whole table (the budget covers
  // it), leaving head_spans alone; else head_spans[i] (an array of ctx.n_q_heads lists) gets
  // the runs query head i reads, pointing into the spans' storage.
  virtual bool SelectQueryHeadSpans(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans,
                                    std::vector<KvSpan>* head_spans) {
    return false;
  }
  // True when SelectQueryHeadSpans chooses once per KV head (the oracle, reuse): it then fills
  // only the first list of each group (query head g * (n_q_heads / n_kv_heads)), and the whole
  // group attends those runs as one job, reading each K/V row once.
  virtual bool SelectsPerKvHead() const { return false; }
  // Bytes of per-page metadata the policy keeps (Quest's key bounds), allocated.
  virtual size_t MetadataBytes() const { return 0; }
  // Every byte the policy holds beyond the KV pages, allocated (capacity): its per-token state
  // (accumulated scores, vote rings, rankings) and its buffers, page metadata included. A state
  // shared by several policies (cumulative's ranking) is counted by one of them.
  virtual size_t StateBytes() const { return MetadataBytes(); }
  // Adaptive head budgets ("head_budgets": "adaptive") a policy divides itself (cumulative's
  // per-head rankings, which must stay nested across layers): called on head 0 of a per-head
  // layer before the controller evicts each head's table as usual, it re-divides the layer's
  // H·budget over the heads (their BudgetTokens then give their shares) unless the layer is
  // less than min_excess tokens over; returns true. False (the default): the controller splits
  // by the heads' ScoreForSelection (AdaKV over H2O, SnapKV).
  virtual bool SplitHeadBudgets(int32_t min_excess) { return false; }
  // Global re-ranks (count, seconds) the policy ran inside its calls since the last call, which
  // the controller reports apart from the incremental work (cumulative's run in OnAppend);
  // resets them.
  virtual std::pair<int64_t, double> TakeRerankWork() { return {0, 0.0}; }
  // The token that summarizes what this policy's evictions dropped (razor's local heads); none
  // by default. Valid until the policy's next call.
  virtual KvCompensation Compensation() const { return {}; }

  virtual void OnAppend(int32_t n_new) = 0;
  virtual void Observe(const AttentionObservation& obs) {}
  // Resizes *keep to ctx.n_live and sets keep[i] = 1 for exactly ctx.target tokens, 0 for
  // the rest. Reuses *keep's storage (no allocation once it has grown).
  virtual void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) = 0;
  // The scores and protected tokens SelectKeep would use for ctx (H2O, SnapKV, PyramidKV); false
  // for methods whose selection is not a top over per-token scores.
  virtual bool ScoreForSelection(const SelectionContext& ctx, SelectionScoring* out) { return false; }
  // Compacts per-token state after the cache applied `keep` (size = old n_live).
  virtual void OnEvict(const std::vector<uint8_t>& keep) = 0;

  // How many tokens to keep now: n_live when nothing is to be evicted, else the budget.
  // Prefill chunks trim to the budget whenever it is exceeded; decode steps wait until the
  // layer holds budget + evict_interval tokens (evict_interval = 1: every step) unless
  // MustEvictNow, and never evict when EvictsDuringDecode() is false.
  int32_t EvictionTarget(int32_t n_live, int32_t n_seen, EvictionPoint point, int evict_interval) const;
};

}  // namespace kvsparse
