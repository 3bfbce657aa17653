// The one token ranking the `cumulative` layers of a sequence share (cumulative.cc has the
// method; docs/DESIGN.md "Cross-layer policies" the call order).
//
// Tokens are named by id: the order they were appended to the sequence (0, 1, ...); every
// layer appends the same tokens, so an id names the same token in every layer.
//
// Importance. S(id) = Σ over steps of decay^(tokens appended since) · Σ_layers w_l · a_l(id),
// where a_l is the attention the layer's queries gave the token (mean over kv heads). Kept as
// S~ = S / g with g = decay^(tokens appended so far), so a step adds to the tokens it observed
// and never touches the others; S~ and the keys are rescaled together when 1/g grows large.
//
// Nesting. depth(id) = how many cumulative layers, counted from the shallowest, hold the token
// (evict mode: keep; mask mode: read): layer c holds id iff depth(id) > c. So a token a deep
// layer holds is held by every shallower one, by construction. When layer c drops a token, its
// depth becomes c: the deeper layers lose it too. In evict mode they free it at their own next
// eviction in the same forward call (their attention of that call still reads it); a layer's
// pages may thus hold, for part of a step, tokens it no longer holds logically, never fewer.
//
// Ranking. Heap c holds every token of depth > c, lowest key first; a layer drops from the
// bottom of its own heap. Keys are S~ at the last global re-rank, or when the token entered (new
// tokens enter every heap with their S~ at the next trim of any layer, after the layers that
// trim before it observed them). Entering and leaving are O(log n) per layer; entries of tokens
// that a shallower layer dropped stay behind and are skipped when they surface. A global re-rank
// (when rerank_period tokens were appended since the last, at the next Append, before the new
// tokens enter) refreshes every key from S~ and rebuilds the heaps: O(n) per layer in evict mode;
// in mask mode it also re-assigns every depth from the new order, O(n log n), so a masked token
// can come back.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kvsparse/kv_budget.h"
#include "kvsparse/kv_policies.h"

namespace kvsparse::policy {

class CumulativeRanking {
 public:
  struct Layer {
    float weight = 1.f;  // w_l in the importance
    KvBudget budget;     // tokens the layer keeps (mask mode's re-rank reads it)
  };
  // layers: the cumulative layers of one sequence, shallowest first.
  CumulativeRanking(std::vector<Layer> layers, double decay, int32_t rerank_period, CumulativeMode mode);

  int n_layers() const { return static_cast<int>(layers_.size()); }
  CumulativeMode mode() const { return mode_; }
  int32_t n_ids() const { return static_cast<int32_t>(depth_.size()); }
  // Tokens of the sequence (appended less removed): what fraction budgets are a fraction of.
  int32_t n_present() const { return n_present_; }

  // Runs a due global re-rank, then n_new tokens enter at full depth (held by every layer); their
  // ids follow the last ones.
  void Append(int32_t n_new);
  // Layer `layer`'s attention: mass[i] to token ids[i].
  void AddAttention(int layer, const int32_t* ids, const float* mass, int32_t n);
  // Tokens layer `layer` holds (those of depth > layer); 0 past the deepest layer.
  int32_t HeldBy(int layer) const;
  bool Held(int layer, int32_t id) const { return depth_[static_cast<size_t>(id)] > layer; }
  // Drops layer `layer`'s lowest-ranked tokens (never the newest token), and with them every
  // deeper layer's, until the layer holds at most `target` (>= 1). Returns the tokens dropped.
  int32_t Trim(int layer, int32_t target);
  // The key of the token Trim(layer, HeldBy(layer) - 1) would drop; nullopt when it would drop
  // none. (Drops entries a shallower layer made stale, as Trim does.)
  std::optional<float> LowestKey(int layer);
  // The token left the sequence (RemoveRange): no layer holds it and no re-rank brings it back.
  void Remove(int32_t id);

  // Current smoothed importance S(id).
  double Score(int32_t id) const { return static_cast<double>(scaled_score_[static_cast<size_t>(id)]) / inv_scale_; }
  // Global re-ranks run and their time since the last call; resets both.
  std::pair<int64_t, double> TakeRerankWork();
  // Allocated bytes: scores and depths of every id ever appended, the heaps, the buffers.
  size_t bytes() const;

 private:
  using Entry = std::pair<float, int32_t>;  // (key, id); heaps pop the lowest key, then the oldest id
  void Rerank();
  void FlushPending();
  void SetDepth(int32_t id, int depth);
  void Push(int heap, Entry entry);

  std::vector<Layer> layers_;
  double decay_;
  int32_t rerank_period_;
  CumulativeMode mode_;

  double inv_scale_ = 1.0;              // 1/g
  std::vector<float> scaled_score_;     // [n_ids] S~
  std::vector<int16_t> depth_;          // [n_ids] layers holding the token, from the shallowest; -1: removed
  std::vector<int32_t> depth_count_;    // [n_layers + 1] tokens per depth 0..n_layers
  std::vector<std::vector<Entry>> heaps_;  // [n_layers] min-heaps; heap c: tokens of depth > c (and stale entries)
  std::vector<int32_t> pending_;        // ids appended since the last trim (not in the heaps yet)
  int32_t n_present_ = 0;
  int32_t since_rerank_ = 0;            // tokens appended since the last global re-rank
  int64_t reranks_ = 0;
  double rerank_s_ = 0;
  std::vector<int32_t> order_;          // mask-mode re-rank scratch
};

}  // namespace kvsparse::policy
