// Full: the uncompressed baseline. Its budget is unbounded, so the engine never asks it
// to evict; SelectKeep exists only to satisfy the interface and keeps every token.
#include <algorithm>
#include <limits>

#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class FullPolicy final : public KvPolicy {
 public:
  std::string_view name() const override { return "full"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<FullPolicy>(*this); }
  int32_t BudgetTokens(int32_t) const override { return std::numeric_limits<int32_t>::max(); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    KVS_CHECK_MSG(ctx.target == ctx.n_live, "the full policy never evicts: target must equal n_live");
    keep->assign(ctx.n_live, 1);
  }
  // Never an eviction of its own (its target is always n_live); SparseKvController::RemoveRange
  // drops positions through here.
  void OnEvict(const std::vector<uint8_t>& keep) override {
    KVS_CHECK_MSG(static_cast<int32_t>(keep.size()) == n_live_, "the full policy's token count drifted");
    n_live_ = static_cast<int32_t>(std::count_if(keep.begin(), keep.end(), [](uint8_t k) { return k != 0; }));
  }

 private:
  int32_t n_live_ = 0;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeFullPolicy() { return std::make_unique<FullPolicy>(); }

}  // namespace kvsparse::policy
