// CreatePolicy: validates a layer's configuration and builds its policy.
#include <fmt/format.h>

#include "kvsparse/kv_policies.h"
#include "policy/cake.h"
#include "policy/policy_base.h"

namespace kvsparse {

namespace {

// The method's own policy (before any CAKE layer allocation).
StatusOr<std::unique_ptr<KvPolicy>> MakeMethodPolicy(const LayerKvConfig& config, int layer, int n_layers,
                                                     uint64_t seed, int kv_head) {
  const KvBudget& b = config.budget;
  const KvMethodParams& p = config.params;
  switch (config.method) {
    case KvMethod::kFull: return policy::MakeFullPolicy();
    case KvMethod::kStreamingLlm: return policy::MakeStreamingLlmPolicy(b, p);
    case KvMethod::kH2O: return policy::MakeH2OPolicy(b, p);
    case KvMethod::kTova: return policy::MakeTovaPolicy(b, p);
    case KvMethod::kScissorhands: return policy::MakeScissorhandsPolicy(b, p);
    case KvMethod::kSnapKv: return policy::MakeSnapKvPolicy(b, p);
    case KvMethod::kPyramidKv: return policy::MakePyramidKvPolicy(b, p, layer, n_layers);
    case KvMethod::kKNorm: return policy::MakeKNormPolicy(b, p);
    case KvMethod::kRandom: return policy::MakeRandomPolicy(b, p, seed);
    case KvMethod::kQuest: return policy::MakeQuestPolicy(b, p);
    case KvMethod::kOracle: return policy::MakeOraclePolicy(b, p);
    case KvMethod::kReuse: return policy::MakeReusePolicy(b, p);
    case KvMethod::kCumulative: return policy::MakeCumulativePolicy(b, p, layer, n_layers, kv_head);
    case KvMethod::kCake: return policy::MakeCakePolicy(b, p, layer);
    case KvMethod::kRazor: {
      if (!p.full_heads_resolved) {
        return InvalidArgumentError(fmt::format(
            "layer {} (razor): the retrieval heads are not resolved; build the runtime with CreateRuntime (it reads "
            "\"heads\" or probes the model) or call ResolveRetrievalHeads first",
            layer));
      }
      if (kv_head < 0 || kv_head >= 64) return InvalidArgumentError(fmt::format("layer {} (razor): KV head {} outside [0, 64)", layer, kv_head));
      const bool retrieval = ((p.full_heads >> kv_head) & 1u) != 0;
      if (retrieval) return policy::MakeFullPolicy();
      return p.compensation ? policy::MakeRazorLocalPolicy(b, p) : policy::MakeStreamingLlmPolicy(b, p);
    }
  }
  return InternalError(fmt::format("layer {}: unhandled method", layer));
}

}  // namespace

StatusOr<std::unique_ptr<KvPolicy>> CreatePolicy(const LayerKvConfig& config, int layer, int n_layers,
                                                 uint64_t seed, int kv_head) {
  if (n_layers < 1 || layer < 0 || layer >= n_layers)
    return InvalidArgumentError(fmt::format("CreatePolicy: layer {} outside [0, n_layers {})", layer, n_layers));
  KVS_RETURN_IF_ERROR(ValidateLayerKvConfig(config, layer));
  // KNorm and Quest leave the first layers whole, as their papers do.
  if (layer < config.params.dense_layers) return policy::MakeFullPolicy();
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> made, MakeMethodPolicy(config, layer, n_layers, seed, kv_head));
  if (config.params.layer_budgets == LayerBudgets::kCake) {
    return policy::WrapCakeAllocation(std::move(made), config.params, layer);
  }
  return made;
}

}  // namespace kvsparse
