// StreamingLLM — G. Xiao, Y. Tian, B. Chen, S. Han, M. Lewis, "Efficient Streaming Language
// Models with Attention Sinks", ICLR 2024, arXiv:2309.17453.
//
// Keeps the first n_sink tokens (the "attention sinks"; default 4, as the paper) and the
// most recent budget - n_sink tokens. Sinks count inside the budget; a budget of at most n_sink
// keeps the newest token and budget - 1 sinks. Needs no attention.
// Positions: the paper (§3.2) numbers positions inside the rolling cache (the cache holds
// 0..n-1, a new token gets n). By default keys here keep their original positions (cached
// after RoPE, never re-rotated); "cache_positions": true reproduces the paper: after each
// eviction the controller renumbers the survivors 0..n-1 and re-rotates their keys
// (PagedKvCache::RenumberPositions), and the engine rotates new tokens at the live count.
#include <algorithm>

#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class StreamingLlmPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "streaming_llm"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<StreamingLlmPolicy>(*this); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, n_live_);
    KeepSinksAndRecent(ctx, params_.n_sink, keep);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override {
    KVS_CHECK(keep.size() == static_cast<size_t>(n_live_));
    int32_t kept = 0;
    for (uint8_t k : keep) kept += k != 0;
    n_live_ = kept;
  }

 private:
  int32_t n_live_ = 0;
};

}  // namespace

void KeepSinksAndRecent(const SelectionContext& ctx, int32_t n_sink, std::vector<uint8_t>* keep) {
  // The newest token always stays (the next step attends to it); a target below n_sink + 1
  // keeps fewer sinks, never later tokens in their place.
  const int32_t sinks = std::clamp(n_sink, 0, std::max(ctx.target - 1, 0));
  keep->assign(ctx.n_live, 0);
  for (int32_t t = 0; t < sinks; ++t) (*keep)[t] = 1;
  for (int32_t t = ctx.n_live - (ctx.target - sinks); t < ctx.n_live; ++t) (*keep)[t] = 1;
}

std::unique_ptr<KvPolicy> MakeStreamingLlmPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<StreamingLlmPolicy>(budget, params);
}

}  // namespace kvsparse::policy
