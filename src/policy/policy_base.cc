#include "policy/policy_base.h"

#include <fmt/format.h>

namespace kvsparse::policy {

void BudgetedPolicy::CheckSelection(const SelectionContext& ctx, int32_t n_tracked) {
  KVS_CHECK_MSG(ctx.n_live == n_tracked,
                fmt::format("layer {}: SelectKeep with n_live {} but the policy tracks {} tokens "
                            "(OnAppend/OnEvict out of step with the cache)",
                            ctx.layer, ctx.n_live, n_tracked));
  KVS_CHECK_MSG(ctx.target >= 0 && ctx.target <= ctx.n_live,
                fmt::format("layer {}: target {} outside [0, n_live {}]", ctx.layer, ctx.target, ctx.n_live));
}

void BudgetedPolicy::CheckObservation(const AttentionObservation& obs, int32_t n_tracked, const float* field,
                                      const char* field_name) {
  KVS_CHECK_MSG(obs.n_tokens == n_tracked,
                fmt::format("observation over {} tokens but the policy tracks {} (Observe must follow OnAppend)",
                            obs.n_tokens, n_tracked));
  KVS_CHECK_MSG(obs.n_kv_heads > 0, "observation without KV heads");
  KVS_CHECK_MSG(field != nullptr || obs.n_tokens == 0,
                fmt::format("observation lacks '{}', which this policy reads", field_name));
}

void ReadSparsePolicy::SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) {
  KVS_CHECK_MSG(ctx.target == ctx.n_live, fmt::format("{} never evicts: target must equal n_live", name()));
  keep->assign(ctx.n_live, 1);
}

void ReadSparsePolicy::OnEvict(const std::vector<uint8_t>& keep) {
  for (uint8_t k : keep) KVS_CHECK_MSG(k, fmt::format("{} never evicts", name()));
}

int32_t ReadSparsePolicy::CheckedLiveTokens(const std::vector<KvSpan>& spans) const {
  int32_t n_live = 0;
  for (const KvSpan& s : spans) n_live += s.n;
  KVS_CHECK_MSG(n_live == n_live_, fmt::format("{}: the spans hold {} tokens but {} were appended", name(), n_live,
                                               n_live_));
  return n_live;
}

}  // namespace kvsparse::policy
