// SnapKV's policy class, shared with PyramidKV (same scoring, per-layer budget).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "policy/per_token_heads.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {

// out[t] = max (or sum / kernel, zero padded like avg_pool1d) of votes over the `kernel`
// neighbours centred on t, clipped to [0, n). votes, out: [n].
void PoolVotes(const float* votes, int32_t n, int kernel, VotePooling pooling, float* out);

class SnapKvPolicy : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "snapkv"; }
  // Subclasses (PyramidKV) override Clone so the copy is not sliced to a SnapKvPolicy.
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<SnapKvPolicy>(*this); }
  uint32_t NeededObservations() const override { return kObserveWindowRows; }
  int32_t ObservationWindow() const override { return params_.obs_window; }
  bool EvictsDuringDecode() const override { return params_.decode_evict; }
  // Without decode-time compression the votes of decode queries would never be read.
  bool ObservesDecode() const override { return params_.decode_evict; }
  void OnAppend(int32_t n_new) override { rows_.Append(n_new); }
  void Observe(const AttentionObservation& obs) override;
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override;
  bool ScoreForSelection(const SelectionContext& ctx, SelectionScoring* out) override;
  void OnEvict(const std::vector<uint8_t>& keep) override { rows_.Compact(keep); }
  size_t StateBytes() const override {
    return rows_.bytes() + (column_.capacity() + pooled_.capacity() + scores_.capacity()) * sizeof(float) +
           scratch_.capacity() * sizeof(int32_t);
  }

  // The window a selection keeping `target` tokens uses: the configured one, or, when the target
  // does not exceed it, half the target (at least 1) so that earlier tokens are still chosen.
  static int32_t EffectiveWindow(int32_t obs_window, int32_t target);

 protected:
  // One head's score of a token from its ring (newest first) over the `window` latest queries,
  // of which `observed` (<= window) exist, for a selection after a prompt chunk (in_prefill) or
  // a decode step: SnapKV sums the votes either way; CAKE overrides it.
  virtual float WindowVote(const float* ring, int32_t window, int32_t observed, bool in_prefill) const;

  // [n_live, n_kv_heads, obs_window] attention each token received from the latest obs_window
  // queries, newest first (age 0 = the latest query; 0 for a query that did not see the token).
  PerTokenHeads<float> rows_{0.f};
  int heads_ = 0;                    // heads of the observations (KV heads, or query heads)
  int32_t queries_seen_ = 0;         // queries observed so far, capped at obs_window

 private:
  std::vector<float> column_;        // [n_live] one head's votes
  std::vector<float> pooled_;        // [n_live]
  std::vector<float> scores_;        // [n_live]
  std::vector<int32_t> scratch_;
};

}  // namespace kvsparse::policy
