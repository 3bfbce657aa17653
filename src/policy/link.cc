// LinkSequencePolicies: the cross-layer methods' sharing, one linker per method.
#include "kvsparse/kv_policies.h"
#include "policy/policy_base.h"

namespace kvsparse {

void LinkSequencePolicies(std::span<KvPolicy* const> layer_policies, std::span<KvPolicy* const> all_policies) {
  policy::LinkCumulativeLayers(layer_policies);
  policy::LinkReuseLayers(layer_policies);
  policy::LinkCakeLayers(all_policies);
}

}  // namespace kvsparse
