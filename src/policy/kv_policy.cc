#include "kvsparse/kv_policy.h"

namespace kvsparse {

int32_t KvPolicy::EvictionTarget(int32_t n_live, int32_t n_seen, EvictionPoint point, int evict_interval) const {
  KVS_CHECK_MSG(evict_interval >= 1, "evict_interval must be >= 1");
  // Methods that keep generated tokens need no budget on decode steps (CAKE's is not free).
  if (point == EvictionPoint::kDecodeStep && !EvictsDuringDecode()) return n_live;
  const int32_t budget = BudgetTokens(n_seen);
  if (n_live <= budget) return n_live;
  if (point != EvictionPoint::kDecodeStep) return budget;
  if (MustEvictNow(n_live)) return budget;
  // Evicting evict_interval tokens at once amortizes selection and compaction.
  if (static_cast<int64_t>(n_live) - budget >= evict_interval) return budget;
  return n_live;
}

}  // namespace kvsparse
