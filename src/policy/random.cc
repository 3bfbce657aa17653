// Random: the control baseline. Keeps the protected sinks and recent window and fills the
// rest of the budget with a uniform random subset of the other tokens, drawn from a
// per-(sequence, layer) seed so runs are reproducible. Default recent_ratio 0.5 (no
// sinks): half the budget random, half recent, mirroring H2O's split so that comparing
// the two isolates the value of attention-based heavy hitters.
#include <algorithm>
#include <limits>
#include <random>

#include "policy/policy_base.h"
#include "policy/selection.h"

namespace kvsparse::policy {
namespace {

// Uniform in [0, bound) without modulo bias, identical on every standard library.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % bound;
  uint64_t draw;
  do draw = rng();
  while (draw >= limit);
  return draw % bound;
}

class RandomPolicy final : public BudgetedPolicy {
 public:
  RandomPolicy(const KvBudget& budget, const KvMethodParams& params, uint64_t seed)
      : BudgetedPolicy(budget, params), rng_(seed) {}
  std::string_view name() const override { return "random"; }
  // Copies the generator's state too: the clone draws the same sequence the original will.
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<RandomPolicy>(*this); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, n_live_);
    // As KeepSinksRecentAndTop: the newest token first, then the sinks, then the window.
    const int32_t newest = ctx.target > 0 ? 1 : 0;
    const int32_t sinks = std::clamp(params_.n_sink, 0, ctx.target - newest);
    const int32_t recent =
        std::clamp(std::max(RecentWindowTokens(params_, ctx.target), newest), 0, ctx.target - sinks);
    keep->assign(ctx.n_live, 0);
    for (int32_t t = 0; t < sinks; ++t) (*keep)[t] = 1;
    for (int32_t t = ctx.n_live - recent; t < ctx.n_live; ++t) (*keep)[t] = 1;
    // Partial Fisher-Yates: the first k slots become a uniform k-subset of the candidates.
    const int32_t begin = sinks, end = ctx.n_live - recent, k = ctx.target - sinks - recent;
    candidates_.resize(end - begin);
    for (int32_t t = begin; t < end; ++t) candidates_[t - begin] = t;
    const uint64_t n = candidates_.size();
    for (int32_t i = 0; i < k; ++i) {
      const uint64_t j = i + UniformBelow(rng_, n - i);
      std::swap(candidates_[i], candidates_[j]);
      (*keep)[candidates_[i]] = 1;
    }
  }

  void OnEvict(const std::vector<uint8_t>& keep) override {
    KVS_CHECK(keep.size() == static_cast<size_t>(n_live_));
    int32_t kept = 0;
    for (uint8_t k : keep) kept += k != 0;
    n_live_ = kept;
  }
  size_t StateBytes() const override { return candidates_.capacity() * sizeof(int32_t); }

 private:
  std::mt19937_64 rng_;
  int32_t n_live_ = 0;
  std::vector<int32_t> candidates_;  // scratch
};

}  // namespace

std::unique_ptr<KvPolicy> MakeRandomPolicy(const KvBudget& budget, const KvMethodParams& params, uint64_t seed) {
  return std::make_unique<RandomPolicy>(budget, params, seed);
}

}  // namespace kvsparse::policy
