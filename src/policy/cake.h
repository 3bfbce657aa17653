// CAKE (cake.cc): the layer-budget allocator and the policy class.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvsparse/kv_policies.h"
#include "policy/snapkv.h"

namespace kvsparse {

// CAKE's split of `total` tokens over the layers observed so far: each gets its window (capped by
// the room and by an equal share of `total`), then the rest in proportion to its preference (an
// equal split when every preference is 0); no layer gets more than `room` (the tokens seen).
// What a layer cannot hold goes to the others:
// - kEqual (the reference's adjust_budgets): the shares are truncated to integers; the excess
//   over the room is split equally over the layers below it (the remainder one token each to the
//   first of them), then the shortfall of the truncation likewise; a share still above the room
//   is cut to it (the reference's eviction does), so the sum may fall short of the total.
// - kPreference: the excess goes to the others by preference, repeated until none is capped,
//   and the truncation's remainder by largest fraction: the budgets sum to min(total, layers x room).
// prefs, windows: [n observed layers].
std::vector<int64_t> CakeLayerBudgets(std::span<const double> prefs, std::span<const int32_t> windows, int64_t room,
                                      int64_t total, CakeExcess excess = CakeExcess::kEqual);

namespace policy {

struct CakeGroup;

// CAKE's layer allocation around any evicting method: `inner` scores and selects, this policy
// measures the layer's preference on each prompt call (from the window rows it asks the kernel
// for) and answers BudgetTokens with the layer's share of the sequence's total (LinkCakeLayers
// links a sequence's such policies). Every other call is the inner policy's.
class CakeAllocatedPolicy final : public KvPolicy {
 public:
  CakeAllocatedPolicy(std::unique_ptr<KvPolicy> inner, const KvMethodParams& params, int layer);
  CakeAllocatedPolicy(const CakeAllocatedPolicy& other);
  std::string_view name() const override { return inner_->name(); }
  std::unique_ptr<KvPolicy> Clone() const override;
  uint32_t NeededObservations() const override { return inner_->NeededObservations() | kObserveWindowRows; }
  int32_t ObservationWindow() const override { return window_; }
  int32_t BudgetTokens(int32_t n_seen) const override;
  bool EvictsDuringDecode() const override { return inner_->EvictsDuringDecode(); }
  bool MustEvictNow(int32_t n_live) const override { return inner_->MustEvictNow(n_live); }
  bool CascadesBudget() const override { return true; }
  bool ObservesDecode() const override;
  bool ObservesPrompt() const override { return true; }
  size_t MetadataBytes() const override { return inner_->MetadataBytes(); }
  size_t StateBytes() const override { return inner_->StateBytes(); }
  std::pair<int64_t, double> TakeRerankWork() override { return inner_->TakeRerankWork(); }
  void OnAppend(int32_t n_new) override { inner_->OnAppend(n_new); }
  void Observe(const AttentionObservation& obs) override;
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override { inner_->SelectKeep(ctx, keep); }
  bool ScoreForSelection(const SelectionContext& ctx, SelectionScoring* out) override {
    return inner_->ScoreForSelection(ctx, out);
  }
  void OnEvict(const std::vector<uint8_t>& keep) override { inner_->OnEvict(keep); }
  int layer() const { return layer_; }

 private:
  friend void LinkCakeLayers(std::span<KvPolicy* const> all_policies);
  std::unique_ptr<KvPolicy> inner_;
  KvMethodParams params_;
  int layer_;
  int32_t window_;  // queries whose attention measures the layer
  // The last prompt call's measurements over this policy's heads: spatial dispersion (entropy)
  // and temporal shift (variance), whether any prompt was measured, and the position of that
  // call's last query.
  double entropy_ = 0, variance_ = 0;
  bool observed_ = false;
  int32_t measured_at_ = -1;
  std::shared_ptr<const CakeGroup> group_;  // the sequence's CAKE layers (LinkCakeLayers); null: unlinked
};

std::unique_ptr<KvPolicy> WrapCakeAllocation(std::unique_ptr<KvPolicy> inner, const KvMethodParams& params, int layer);

}  // namespace policy
}  // namespace kvsparse
