// The KV strings of the command line: --kv-param KEY=VALUE (lines of the input), --methods
// entries ("snapkv:head_budgets=adaptive:floor=0.2"), --kv-budget and --kv-type values, and a
// request's override of a running config.
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "kvsparse/kv_config.h"

namespace kvsparse::fuzz {

int FuzzKvParam(const uint8_t* data, size_t size) {
  const std::string text(AsText(data, size));
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line) && lines.size() < 16;) lines.push_back(line);
  if (lines.empty()) return 0;

  (void)ParseKvBudget(lines[0]);
  (void)KvStorageFromName(lines[0]);
  if (auto spec = ParseKvMethodSpec(lines[0], "--methods"); spec.ok()) {
    auto config = KvSparsityConfigFromFlags(spec->name, lines.size() > 1 ? lines[1] : "0.5", "f16", 4);
    if (config.ok() && ApplyKvParams(spec->params, &*config).ok()) (void)KvSparsityConfigSummary(*config);
  }
  for (const char* method : {"h2o", "snapkv", "quest", "cumulative", "streaming_llm", "razor"}) {
    auto config = KvSparsityConfigFromFlags(method, "0.25", "int8", 4);
    if (!config.ok()) continue;
    if (ApplyKvParams(std::vector<std::string>(lines.begin() + 1, lines.end()), &*config).ok()) {
      KVS_CHECK_MSG(ValidateKvSparsityConfig(*config).ok(), "--kv-param left an invalid config");
    }
    (void)KvLayersWithOverride(*config, lines[0], lines.size() > 1 ? lines[1] : "", lines.size() > 2 ? lines[2] : "");
  }
  return 0;
}

}  // namespace kvsparse::fuzz
