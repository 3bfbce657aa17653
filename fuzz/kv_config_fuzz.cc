// --kv-config files: any text is parsed for a 6-layer model; a config that parses must validate,
// summarize, and build its policies (CreatePolicy per layer) without crashing.
#include "fuzz_target.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"

namespace kvsparse::fuzz {

int FuzzKvConfig(const uint8_t* data, size_t size) {
  constexpr int kLayers = 6;
  auto config = ParseKvSparsityConfig(AsText(data, size), kLayers);
  if (!config.ok()) return 0;
  KVS_CHECK_MSG(ValidateKvSparsityConfig(*config).ok(), "a parsed config failed its own validation");
  (void)KvSparsityConfigSummary(*config);
  for (int layer = 0; layer < kLayers && layer < static_cast<int>(config->layers.size()); ++layer) {
    auto policy = CreatePolicy(config->layers[static_cast<size_t>(layer)], layer, kLayers, /*seed=*/1);
    (void)policy;
  }
  return 0;
}

}  // namespace kvsparse::fuzz
