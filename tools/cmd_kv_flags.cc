#include <fmt/format.h>

#include <algorithm>

#include "commands.h"
#include "kv_flags.h"

namespace kvsparse::cli {

void AddKvFlags(CLI::App* cmd, KvFlags* f, const std::string& default_kv_type) {
  cmd->add_option("--kv-method", f->method, "KV sparsity method: " + ValidKvMethodNames() + " (default: dense cache)");
  cmd->add_option("--kv-budget", f->budget,
                  "KV tokens kept per layer: a fraction of the tokens seen (0.2) or a count (512)");
  cmd->add_option(
      "--kv-type", f->kv_type,
      "KV storage: f32, f16, bf16, int8, int8_kivi, fp8_e4m3 (or fp8), fp8_e5m2, int4_kivi or int2_kivi (default " +
          default_kv_type + ")");
  cmd->add_option("--kv-config", f->config_file,
                  "per-layer KV sparsity config (JSON); excludes --kv-method/--kv-budget");
  cmd->add_option("--kv-param", f->params,
                  "a method parameter as KEY=VALUE, repeatable (the config file's keys, e.g. head_budgets=adaptive, "
                  "mode=mask, rerank_period=8, reselect_layer=9)")
      ->allow_extra_args(false);
  cmd->add_option("--page-size", f->page_size,
                  "tokens per KV page (default 16; 32, KIVI's K group, when a layer stores a KIVI type)")
      ->check(kPositive);
  cmd->add_option("--kivi-residual", f->kivi_residual,
                  "KIVI types: the newest N tokens stay in f16 besides the partly filled page, KIVI's residual "
                  "length (a multiple of --page-size; default 128, rounded up to whole pages; 0: only the partly "
                  "filled page; JSON: \"kivi_residual\")")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--kivi-v-group", f->kivi_v_group,
                  "int4_kivi / int2_kivi: V channels per scale and zero point (default 32, KIVI's group, where it "
                  "divides head_dim; 0: the whole head row, fewer bytes; JSON: \"kivi_v_group\")")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--evict-interval", f->evict_interval,
                  "decode steps a layer may grow past its budget before evicting (default 16)")
      ->check(kPositive);
  cmd->add_flag("--kv-stats", f->stats, "print per-layer KV bytes (allocated, live), evictions and policy time");
  CLI::Option* per_head =
      cmd->add_flag("--kv-per-head", f->per_head,
                    "one policy and page table per KV head, so each head keeps its own tokens (JSON: \"per_head\": "
                    "true; default: the method's reference granularity)");
  cmd->add_flag("--kv-shared-heads", f->shared_heads,
                "every KV head of a layer keeps the same tokens, scores folded over heads (JSON: \"per_head\": false)")
      ->excludes(per_head);
  cmd->add_option("--sparse-prefill", f->sparse_prefill,
                  "attend every layer's prompt chunks sparsely: vertical_slash, block_sparse or xattention, with "
                  "parameters as METHOD:KEY=VALUE:... (e.g. xattention:threshold=0.8; JSON: \"prefill\")");
}

StatusOr<std::optional<KvSparsityConfig>> ResolveKvFlags(const KvFlags& f, const std::string& default_kv_type,
                                                         int n_layers, KvStorage* dense_storage) {
  const std::string kv_type = f.kv_type.empty() ? default_kv_type : f.kv_type;
  // A window on a cache that quantizes nothing would do nothing: refused rather than ignored.
  const char* kivi_flag = f.kivi_residual > 0 ? "--kivi-residual" : "--kivi-v-group";
  const bool kivi_flags = f.kivi_residual > 0 || f.kivi_v_group > 0;
  auto residual_without_kivi = [kivi_flag](const std::string& found) {
    return InvalidArgumentError(
        fmt::format("{} applies to the KIVI kv types (int8_kivi, int4_kivi, int2_kivi); {}", kivi_flag, found));
  };
  const std::optional<KvStorage> storage = KvStorageFromName(kv_type);
  if (!storage) {
    return InvalidArgumentError(
        fmt::format("--kv-type: expected f32, f16, bf16, int8, int8_kivi, fp8_e4m3 (or fp8), fp8_e5m2, int4_kivi or "
                    "int2_kivi, found '{}'",
                    kv_type));
  }
  *dense_storage = *storage;

  KvSparsityConfig config;
  if (!f.config_file.empty()) {
    if (!f.method.empty() || !f.budget.empty()) {
      return InvalidArgumentError("--kv-config sets method and budget per layer; drop --kv-method/--kv-budget");
    }
    if (!f.kv_type.empty()) {
      return InvalidArgumentError("--kv-config sets kv_type per layer; drop --kv-type (or set \"kv_type\" in the file)");
    }
    if (f.per_head || f.shared_heads) {
      return InvalidArgumentError(fmt::format("--kv-config sets per_head per layer; drop {} (or set \"per_head\" in "
                                              "the file)",
                                              f.per_head ? "--kv-per-head" : "--kv-shared-heads"));
    }
    if (!f.params.empty()) {
      return InvalidArgumentError("--kv-config sets method parameters per layer; drop --kv-param (or set the keys in "
                                  "the file)");
    }
    if (!f.sparse_prefill.empty()) {
      return InvalidArgumentError(
          "--kv-config sets sparse prefill per layer; drop --sparse-prefill (or set "
          "\"prefill\" in the file)");
    }
    KVS_ASSIGN_OR_RETURN(config, LoadKvSparsityConfig(f.config_file, n_layers));
  } else if (!f.method.empty()) {
    KVS_ASSIGN_OR_RETURN(config, KvSparsityConfigFromFlags(f.method, f.budget, kv_type, n_layers));
  } else if (!f.budget.empty() || !f.params.empty()) {
    return InvalidArgumentError(fmt::format("{} needs --kv-method (one of {})",
                                            f.budget.empty() ? "--kv-param" : "--kv-budget", ValidKvMethodNames()));
  } else if (!DenseCacheHolds(*storage) || f.page_size > 0 || f.evict_interval > 0 || f.per_head || f.shared_heads ||
             !f.sparse_prefill.empty()) {  // int8, fp8 and KIVI need the paged cache
    KVS_ASSIGN_OR_RETURN(config, KvSparsityConfigFromFlags("full", "", kv_type, n_layers));
  } else {
    if (kivi_flags) return residual_without_kivi("--kv-type is " + kv_type);  // the dense cache
    return std::optional<KvSparsityConfig>();  // dense
  }
  if (f.per_head || f.shared_heads) {
    for (LayerKvConfig& layer : config.layers) layer.per_head = f.per_head;
  }
  KVS_RETURN_IF_ERROR(ApplyKvParams(f.params, &config));
  if (!f.sparse_prefill.empty()) {
    KVS_ASSIGN_OR_RETURN(const PrefillSparsity prefill, ParsePrefillSparsity(f.sparse_prefill, "--sparse-prefill"));
    for (LayerKvConfig& layer : config.layers) layer.prefill = prefill;
  }
  if (f.page_size > 0) config.page_size = f.page_size;
  if (f.kivi_residual >= 0) config.kivi_residual = f.kivi_residual;
  if (f.kivi_v_group >= 0) config.kivi_v_group = f.kivi_v_group;
  if (f.evict_interval > 0) config.evict_interval = f.evict_interval;
  if (kivi_flags && std::none_of(config.layers.begin(), config.layers.end(),
                                          [](const LayerKvConfig& layer) { return IsKiviStorage(layer.kv_type); })) {
    return residual_without_kivi(f.config_file.empty() ? "--kv-type is " + kv_type
                                                       : "no layer of " + f.config_file + " stores one");
  }
  // V groups are int4/int2 KIVI's: int8_kivi keeps one scale per token row.
  if (f.kivi_v_group >= 0 && std::none_of(config.layers.begin(), config.layers.end(), [](const LayerKvConfig& layer) {
        return IsLowBitKivi(layer.kv_type);
      })) {
    return InvalidArgumentError(fmt::format(
        "--kivi-v-group applies to int4_kivi and int2_kivi (int8_kivi quantizes V per token row); {}",
        f.config_file.empty() ? "--kv-type is " + kv_type : "no layer of " + f.config_file + " stores one"));
  }
  KVS_RETURN_IF_ERROR(ValidateKvSparsityConfig(config));
  return std::optional<KvSparsityConfig>(std::move(config));
}

}  // namespace kvsparse::cli
