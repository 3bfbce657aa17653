// --kv-config files: any text is parsed for a 6-layer model; a config that parses must validate,
// summarize, build its policies (CreatePolicy per layer) without crashing, and write a file
// (KvSparsityConfigToJson, what calibrate writes) that reads back to the same config.
#include "fuzz_target.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"

namespace kvsparse::fuzz {

int FuzzKvConfig(const uint8_t* data, size_t size) {
  constexpr int kLayers = 6;
  auto config = ParseKvSparsityConfig(AsText(data, size), kLayers);
  if (!config.ok()) return 0;
  KVS_CHECK_MSG(ValidateKvSparsityConfig(*config).ok(), "a parsed config failed its own validation");
  const std::string summary = KvSparsityConfigSummary(*config);
  const std::string written = KvSparsityConfigToJson(*config);
  auto back = ParseKvSparsityConfig(written, kLayers, "written");
  KVS_CHECK_MSG(back.ok(), "a written config did not parse back");
  KVS_CHECK_MSG(KvSparsityConfigSummary(*back) == summary, "a written config read back differently");
  for (int layer = 0; layer < kLayers && layer < static_cast<int>(config->layers.size()); ++layer) {
    auto policy = CreatePolicy(config->layers[static_cast<size_t>(layer)], layer, kLayers, /*seed=*/1);
    (void)policy;
  }
  return 0;
}

}  // namespace kvsparse::fuzz
