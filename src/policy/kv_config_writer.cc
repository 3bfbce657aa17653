// KvSparsityConfigToJson: the inverse of ParseKvSparsityConfig (kv_config.cc), so a config built
// in code (`kvsparse calibrate`) becomes a file that generate, bench and serve read.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/sparse_prefill.h"

namespace kvsparse {
namespace {

using nlohmann::json;

// The JSON value of method parameter `key` (a key of KvMethodParamKeys); null where the key has
// no value to write (unset optional parameters, or one that another key replaces).
json ParamValue(const KvMethodParams& p, std::string_view key) {
  if (key == "n_sink") return p.n_sink;
  if (key == "recent") return p.recent >= 0 ? json(p.recent) : json();
  if (key == "recent_ratio") return p.recent < 0 ? json(p.recent_ratio) : json();
  if (key == "head_reduce") return HeadReduceName(p.head_reduce);
  if (key == "history_window") return p.history_window;
  if (key == "window") return p.obs_window;
  if (key == "kernel") return p.kernel;
  if (key == "pooling") return VotePoolingName(p.pooling);
  if (key == "decode_evict") return p.decode_evict;
  if (key == "query_head_scores") return p.query_head_scores;
  if (key == "compensation") return p.compensation;
  if (key == "beta") return p.beta;
  if (key == "page_tokens") return p.page_tokens;
  if (key == "dense_layers") return p.dense_layers;
  if (key == "cache_positions") return p.cache_positions;
  if (key == "decay") return p.decay;
  if (key == "rerank_period") return p.rerank_period;
  if (key == "mode") return CumulativeModeName(p.mode);
  if (key == "schedule") return RetentionScheduleName(p.schedule);
  if (key == "spread") return p.spread;
  if (key == "layer_weight") return p.layer_weight >= 0 ? json(p.layer_weight) : json();
  if (key == "reselect_layer") return p.reselect_layer >= 0 ? json(p.reselect_layer) : json();
  if (key == "head_budgets") return HeadBudgetsName(p.head_budgets);
  if (key == "adaptive_rule") return AdaptiveRuleName(p.adaptive_rule);
  if (key == "alpha") return p.alpha;
  if (key == "floor") return p.floor;
  if (key == "selection") return ReuseSelectionName(p.selection);
  if (key == "layer_budgets") return LayerBudgetsName(p.layer_budgets);
  if (key == "gamma") return p.gamma;
  if (key == "tau1") return p.tau1;
  if (key == "tau2") return p.tau2;
  if (key == "excess") return CakeExcessName(p.excess);
  if (key == "heads") return p.heads_file.empty() ? json() : json(p.heads_file);
  if (key == "retrieval_heads") return p.retrieval_heads >= 0 ? json(p.retrieval_heads) : json();
  if (key == "echo_heads") return p.retrieval_heads < 0 ? json(p.echo_heads) : json();
  if (key == "induction_heads") return p.retrieval_heads < 0 ? json(p.induction_heads) : json();
  KVS_CHECK_MSG(false, "a method parameter without a writer");
  return json();
}

double PrefillParamValue(const PrefillSparsity& p, std::string_view key) {
  if (key == "threshold") return p.threshold;
  if (key == "block") return p.block;
  if (key == "min_queries") return p.min_queries;
  if (key == "min_context") return p.min_context;
  if (key == "last_q") return p.last_q;
  if (key == "vertical") return p.vertical;
  if (key == "slash") return p.slash;
  if (key == "sink_columns") return p.sink_columns;
  if (key == "local_diagonals") return p.local_diagonals;
  if (key == "top_blocks") return p.top_blocks;
  if (key == "stride") return p.stride;
  if (key == "estimate_bits") return p.estimate_bits;
  if (key == "group_shared") return p.group_shared;
  if (key == "two_pass") return p.two_pass;
  KVS_CHECK_MSG(false, "a prefill parameter without a writer");
  return 0;
}

json BudgetValue(const KvBudget& b) { return b.is_fraction() ? json(b.fraction) : json(b.tokens); }

// Every field of one layer, so that the entry reads the same whatever "default" says.
json LayerObject(const LayerKvConfig& layer) {
  json o = json::object();
  o["method"] = KvMethodName(layer.method);
  if (layer.method != KvMethod::kFull && layer.budget.is_by_length()) {
    json points = json::object();
    for (const auto& [length, f] : layer.budget.by_length) points[std::to_string(length)] = f;
    o["budget_by_length"] = points;
  } else if (layer.method != KvMethod::kFull) {
    o["budget"] = BudgetValue(layer.budget);  // a fraction 1.0 stays a float: the integer 1 is one token
  }
  o["kv_type"] = KvStorageName(layer.kv_type);
  o["per_head"] = layer.per_head;
  for (std::string_view key : KvMethodParamKeys(layer.method)) {
    json value = ParamValue(layer.params, key);
    if (!value.is_null()) o[std::string(key)] = std::move(value);
  }
  if (layer.prefill.method != PrefillMethod::kDense) {
    json prefill = {{"method", PrefillMethodName(layer.prefill.method)}};
    for (std::string_view key : PrefillParamKeys(layer.prefill.method)) {
      prefill[std::string(key)] = PrefillParamValue(layer.prefill, key);
    }
    o["prefill"] = prefill;
  }
  return o;
}

}  // namespace

std::string KvSparsityConfigToJson(const KvSparsityConfig& config) {
  json root = json::object();
  root["evict_interval"] = config.evict_interval;
  if (config.page_size > 0) root["page_size"] = config.page_size;
  if (config.kivi_residual >= 0) root["kivi_residual"] = config.kivi_residual;
  if (config.kivi_v_group >= 0) root["kivi_v_group"] = config.kivi_v_group;
  root["gqa_aggregation"] = config.agg == GqaAggregation::kMean ? "mean" : "max";
  root["prefill_chunk"] = config.prefill_chunk;
  root["prefill_eviction"] = config.prefill_eviction == PrefillEviction::kPromptEnd ? "prompt_end" : "chunk";
  // Layers no entry named came from the default (they are alike); the others get entries, one
  // per run of equal layers.
  const int n = static_cast<int>(config.layers.size());
  // A layer that differs from the default although no entry named it (changed in code) gets an
  // entry too.
  json default_object;
  std::vector<uint8_t> needs_entry(n, 1);
  for (int l = 0; l < n; ++l) {
    if (config.layers[l].named_by_layers_entry) continue;
    const json object = LayerObject(config.layers[l]);
    if (default_object.is_null()) default_object = object;
    needs_entry[l] = object != default_object;
  }
  if (!default_object.is_null()) root["default"] = default_object;
  json entries = json::array();
  for (int first = 0; first < n;) {
    if (!needs_entry[first]) {
      ++first;
      continue;
    }
    const json object = LayerObject(config.layers[first]);
    int last = first;
    while (last + 1 < n && needs_entry[last + 1] && LayerObject(config.layers[last + 1]) == object) ++last;
    json entry = {{"layers", first == last ? json(first) : json(fmt::format("{}-{}", first, last))}};
    entry.update(object);
    entries.push_back(std::move(entry));
    first = last + 1;
  }
  if (!entries.empty()) root["layers"] = std::move(entries);
  return root.dump(2) + "\n";
}

}  // namespace kvsparse
