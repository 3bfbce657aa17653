// CAKE (cake.cc): the layer-budget allocator and the policy class.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "policy/snapkv.h"

namespace kvsparse {

// CAKE's split of `total` tokens over the layers observed so far: each gets its window (capped by
// the room and by an equal share of `total`), then the rest in proportion to its preference (an
// equal split when every preference is 0); no layer gets more than `room` (the tokens seen),
// its excess going to the others. The budgets sum to min(total, layers x room).
// prefs, windows: [n observed layers].
std::vector<int64_t> CakeLayerBudgets(std::span<const double> prefs, std::span<const int32_t> windows, int64_t room,
                                      int64_t total);

namespace policy {

struct CakeGroup;

class CakePolicy final : public SnapKvPolicy {
 public:
  CakePolicy(const KvBudget& budget, const KvMethodParams& params, int layer, int n_layers);
  std::string_view name() const override { return "cake"; }
  std::unique_ptr<KvPolicy> Clone() const override;
  int32_t BudgetTokens(int32_t n_seen) const override;
  bool CascadesBudget() const override { return true; }
  void Observe(const AttentionObservation& obs) override;
  int layer() const { return layer_; }

 protected:
  float WindowVote(const float* ring, int32_t window, int32_t observed) const override;

 private:
  friend void LinkCakeLayers(std::span<KvPolicy* const> all_policies);
  int layer_;
  int n_layers_;
  // The last prompt's measurements over this policy's heads: spatial dispersion (entropy) and
  // temporal shift (variance), and whether any prompt was measured.
  double entropy_ = 0, variance_ = 0;
  bool observed_ = false;
  int32_t measured_at_ = -1;  // position of the last query of the prompt call measured
  std::shared_ptr<const CakeGroup> group_;  // the sequence's cake layers (LinkCakeLayers); null: unlinked
};

}  // namespace policy
}  // namespace kvsparse
