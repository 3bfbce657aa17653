// The KV-sparsity flags shared by `generate` and `bench-speed`, and how they become a
// KvSparsityConfig (nullopt: the dense cache, no policies).
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/status.h"

namespace kvsparse::cli {

struct KvFlags {
  std::string method;       // --kv-method
  std::string budget;       // --kv-budget: "0.2" (fraction of the tokens seen) or "512" (tokens)
  std::string kv_type;      // --kv-type; empty: the command's default
  std::string config_file;  // --kv-config FILE.json
  std::vector<std::string> params;  // --kv-param KEY=VALUE (repeatable): method parameters
  int page_size = 0;        // --page-size; 0: the config's (16; 32 with a KIVI type)
  int kivi_residual = -1;   // --kivi-residual; -1: the config's (128 with a KIVI type)
  int kivi_v_group = -1;    // --kivi-v-group; -1: the config's (32 where it divides head_dim)
  int evict_interval = 0;   // --evict-interval; 0: the config's (16)
  bool stats = false;       // --kv-stats
  bool per_head = false;    // --kv-per-head: every layer keeps its tokens per KV head
  bool shared_heads = false;  // --kv-shared-heads: every head of a layer keeps the same tokens
  std::string sparse_prefill;  // --sparse-prefill METHOD[:KEY=VALUE...]: every layer's prompt chunks
};

void AddKvFlags(CLI::App* cmd, KvFlags* flags, const std::string& default_kv_type);

// The paged, policy-driven cache is used when a method or config file is given, or when the
// KV type is int8 (the dense cache stores f32/f16 only), or --page-size / --evict-interval /
// --kv-per-head / --kv-shared-heads / --sparse-prefill is set; a method-less run is then "full". Otherwise nullopt: the
// dense cache of type *dense_storage. Conflicting or incomplete flags are errors naming the flag.
StatusOr<std::optional<KvSparsityConfig>> ResolveKvFlags(const KvFlags& flags, const std::string& default_kv_type,
                                                         int n_layers, KvStorage* dense_storage);

}  // namespace kvsparse::cli
