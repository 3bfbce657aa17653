// LinkSequencePolicies: the cross-layer methods' sharing, one linker per method.
#include "kvsparse/kv_policies.h"
#include "policy/policy_base.h"

namespace kvsparse {

void LinkSequencePolicies(std::span<KvPolicy* const> layer_policies) {
  policy::LinkCumulativeLayers(layer_policies);
  policy::LinkReuseLayers(layer_policies);
}

}  // namespace kvsparse
