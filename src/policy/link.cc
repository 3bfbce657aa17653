// LinkSequencePolicies: the cross-layer methods' sharing, one linker per method.
#include "kvsparse/kv_policies.h"
#include "policy/policy_base.h"

namespace kvsparse {

void LinkSequencePolicies(std::span<KvPolicy* const> layer_policies, std::span<KvPolicy* const> all_policies) {
  const std::span<KvPolicy* const> all = all_policies.empty() ? layer_policies : all_policies;
  policy::LinkCumulativeLayers(all);
  policy::LinkReuseLayers(layer_policies);
  policy::LinkCakeLayers(all);
}

}  // namespace kvsparse
