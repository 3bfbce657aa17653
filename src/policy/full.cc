// Full: the uncompressed baseline. Its budget is unbounded, so the engine never asks it
// to evict; SelectKeep exists only to satisfy the interface and keeps every token.
#include <limits>

#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class FullPolicy final : public KvPolicy {
 public:
  std::string_view name() const override { return "full"; }
  int32_t BudgetTokens(int32_t) const override { return std::numeric_limits<int32_t>::max(); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    KVS_CHECK_MSG(ctx.target == ctx.n_live, "the full policy never evicts: target must equal n_live");
    keep->assign(ctx.n_live, 1);
  }
  void OnEvict(const std::vector<uint8_t>& keep) override {
    for (uint8_t k : keep) KVS_CHECK_MSG(k, "the full policy never evicts");
  }

 private:
  int32_t n_live_ = 0;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeFullPolicy() { return std::make_unique<FullPolicy>(); }

}  // namespace kvsparse::policy
