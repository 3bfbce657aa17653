// Reads the per-layer KV sparsity configuration (JSON or flags) and rejects mistakes up
// front, naming the layer (or config entry) and the field.
#include "kvsparse/kv_config.h"

#include <algorithm>
#include <cstdint>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvsparse {
namespace {

using nlohmann::json;

constexpr std::string_view kTopLevelKeys[] = {"default",       "layers",          "evict_interval", "page_size",
                                              "kivi_residual", "kivi_v_group",    "gqa_aggregation", "prefill_chunk",
                                              "prefill_eviction"};
// "fp8" names fp8_e4m3, as vLLM's --kv-cache-dtype does.
constexpr std::string_view kKvTypeNames =
    "f32, f16, bf16, int8, int8_kivi, fp8_e4m3 (or fp8), fp8_e5m2, int4_kivi, int2_kivi";
const std::vector<std::string_view> kKvTypeList = {"f32", "f16",      "bf16",     "int8",      "int8_kivi",
                                                   "fp8", "fp8_e4m3", "fp8_e5m2", "int4_kivi", "int2_kivi"};

std::string Join(const std::vector<std::string_view>& items) {
  std::string out;
  for (std::string_view s : items) out += (out.empty() ? "" : ", ") + std::string(s);
  return out;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" when a candidate is a likely typo of `word`, else "".
std::string Suggestion(std::string_view word, const std::vector<std::string_view>& candidates) {
  std::string_view best;
  size_t best_distance = 3;  // at most two edits
  for (std::string_view c : candidates) {
    const size_t d = EditDistance(word, c);
    if (d < best_distance) best_distance = d, best = c;
  }
  return best.empty() ? std::string() : fmt::format(" (did you mean '{}'?)", best);
}

// "string", "boolean", "integer 4", "number 0.5", "array", ...
std::string Describe(const json& v) {
  if (v.is_number_integer()) return fmt::format("integer {}", v.dump());
  if (v.is_number_float()) return fmt::format("number {}", v.dump());
  if (v.is_string()) return fmt::format("string {}", v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  return v.type_name();
}

// Errors in one JSON object ("default", "layers[1]") name the object and the field.
class Where {
 public:
  Where(std::string_view source, std::string object) : source_(source), object_(std::move(object)) {}
  Status Error(std::string_view field, const std::string& what) const {
    return InvalidArgumentError(fmt::format("{}: {}: field '{}': {}", source_, object_, field, what));
  }
  Status Error(const std::string& what) const {
    return InvalidArgumentError(fmt::format("{}: {}: {}", source_, object_, what));
  }

 private:
  std::string_view source_;
  std::string object_;
};

Status ReadInt(const json& v, const Where& where, std::string_view field, int32_t* out) {
  if (!v.is_number_integer()) return where.Error(field, "expected an integer, found " + Describe(v));
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                             : (v.get<int64_t>() > std::numeric_limits<int32_t>::max() ||
                                v.get<int64_t>() < std::numeric_limits<int32_t>::min()))
    return where.Error(field, fmt::format("{} does not fit a 32-bit integer", v.dump()));
  *out = static_cast<int32_t>(v.get<int64_t>());
  return Status::Ok();
}

// Empty when kivi_residual is whole pages, else what is wrong with it.
std::string KiviResidualProblem(const KvSparsityConfig& config) {
  const int page = EffectivePageSize(config);
  if (config.kivi_residual == -1 || (config.kivi_residual >= 0 && config.kivi_residual % page == 0)) return {};
  return fmt::format("kivi_residual must be a multiple of page_size ({}) and >= 0; found {}", page,
                     config.kivi_residual);
}

// Empty when kivi_v_group can be a V group, else what is wrong with it.
std::string KiviVGroupProblem(const KvSparsityConfig& config) {
  if (config.kivi_v_group == -1 || (config.kivi_v_group >= 0 && config.kivi_v_group % 4 == 0)) return {};
  return fmt::format("kivi_v_group must be a multiple of 4 channels dividing head_dim, or 0 for the whole row; "
                     "found {}",
                     config.kivi_v_group);
}

bool StoresKivi(const KvSparsityConfig& config) {
  return std::any_of(config.layers.begin(), config.layers.end(),
                     [](const LayerKvConfig& layer) { return IsKiviStorage(layer.kv_type); });
}

Status ReadPositiveInt(const json& v, const Where& where, std::string_view field, int* out) {
  int32_t value = 0;
  KVS_RETURN_IF_ERROR(ReadInt(v, where, field, &value));
  if (value < 1) return where.Error(field, fmt::format("must be >= 1; found {}", value));
  *out = value;
  return Status::Ok();
}

Status ReadNumber(const json& v, const Where& where, std::string_view field, double* out) {
  if (!v.is_number()) return where.Error(field, "expected a number, found " + Describe(v));
  *out = v.get<double>();
  return Status::Ok();
}

Status ReadBool(const json& v, const Where& where, std::string_view field, bool* out) {
  if (!v.is_boolean()) return where.Error(field, "expected true or false, found " + Describe(v));
  *out = v.get<bool>();
  return Status::Ok();
}

// One of `names` (a string); *index gets its position.
Status ReadChoice(const json& v, const Where& where, std::string_view field, const std::vector<std::string_view>& names,
                  size_t* index) {
  if (!v.is_string()) return where.Error(field, fmt::format("expected one of {}, found {}", Join(names), Describe(v)));
  const std::string s = v.get<std::string>();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == s) return (*index = i, Status::Ok());
  return where.Error(field, fmt::format("unknown value '{}'{}; valid values: {}", s, Suggestion(s, names), Join(names)));
}

// An enum field: values[i] for names[i].
template <typename Enum>
Status ReadEnum(const json& v, const Where& where, std::string_view field, const std::vector<std::string_view>& names,
                const std::vector<Enum>& values, Enum* out) {
  KVS_CHECK(names.size() == values.size());
  size_t i = 0;
  KVS_RETURN_IF_ERROR(ReadChoice(v, where, field, names, &i));
  *out = values[i];
  return Status::Ok();
}

Status ReadBudget(const json& v, const Where& where, KvBudget* out) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                               : v.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return where.Error("budget", fmt::format("{} tokens does not fit a 32-bit count", v.dump()));
    const int64_t tokens = v.get<int64_t>();
    if (tokens <= 0) return where.Error("budget", fmt::format("must be > 0; found {}", tokens));
    *out = KvBudget::Tokens(static_cast<int32_t>(tokens));
    return Status::Ok();
  }
  if (v.is_number_float()) {
    const double f = v.get<double>();
    if (!(f > 0.0)) return where.Error("budget", fmt::format("must be > 0; found {}", v.dump()));
    if (f > 1.0)
      return where.Error("budget", fmt::format("a fraction of the context must be <= 1; found {} (write an integer "
                                               "for a token count)",
                                               v.dump()));
    *out = KvBudget::Fraction(f);
    return Status::Ok();
  }
  return where.Error("budget", "expected a number (an integer token count, or a fraction in (0, 1]), found " +
                                   Describe(v));
}

// "budget_by_length": {"4096": 0.5, "32768": 0.1} (kv_budget.h): fractions at context lengths.
Status ReadBudgetByLength(const json& v, const Where& where, KvBudget* out) {
  constexpr std::string_view kField = "budget_by_length";
  if (!v.is_object() || v.empty()) {
    return where.Error(kField, "expected an object of context lengths to fractions, e.g. {\"4096\": 0.5, \"32768\": "
                               "0.1}, found " + Describe(v));
  }
  std::vector<std::pair<int32_t, double>> points;
  for (const auto& [key, value] : v.items()) {
    int32_t length = 0;
    const auto [ptr, ec] = std::from_chars(key.data(), key.data() + key.size(), length);
    if (ec != std::errc() || ptr != key.data() + key.size() || length < 1) {
      return where.Error(kField, fmt::format("'{}' is not a context length (an integer >= 1 as a string, e.g. \"4096\")",
                                             key));
    }
    if (!value.is_number() || !(value.get<double>() > 0.0 && value.get<double>() <= 1.0)) {
      return where.Error(kField, fmt::format("the budget at {} must be a fraction in (0, 1]; found {}", length,
                                             Describe(value)));
    }
    points.emplace_back(length, value.get<double>());
  }
  // JSON object keys are unordered text ("32768" sorts before "4096"): order by length.
  std::sort(points.begin(), points.end());
  for (size_t i = 1; i < points.size(); ++i) {
    if (points[i].first == points[i - 1].first)
      return where.Error(kField, fmt::format("length {} is given twice", points[i].first));
  }
  *out = KvBudget::ByLength(std::move(points));
  return Status::Ok();
}

std::vector<std::string_view> MethodNameList() {
  std::vector<std::string_view> names;
  for (KvMethod m : {KvMethod::kFull, KvMethod::kStreamingLlm, KvMethod::kH2O, KvMethod::kTova, KvMethod::kScissorhands,
                     KvMethod::kSnapKv, KvMethod::kPyramidKv, KvMethod::kKNorm, KvMethod::kRandom, KvMethod::kQuest,
                     KvMethod::kOracle, KvMethod::kCumulative, KvMethod::kReuse, KvMethod::kRazor, KvMethod::kCake})
    names.push_back(KvMethodName(m));
  return names;
}

bool MethodUses(KvMethod method, std::string_view key) {
  for (std::string_view k : KvMethodParamKeys(method))
    if (k == key) return true;
  return false;
}

// Every method parameter key, once each.
std::vector<std::string_view> AllParamKeys() {
  std::vector<std::string_view> keys;
  for (std::string_view name : MethodNameList())
    for (std::string_view k : KvMethodParamKeys(*KvMethodFromName(name)))
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  return keys;
}

// Methods (other than `method`) that take `key` as a parameter, e.g. "snapkv, pyramidkv".
std::string MethodsUsing(std::string_view key) {
  std::vector<std::string_view> users;
  for (std::string_view name : MethodNameList())
    if (MethodUses(*KvMethodFromName(name), key)) users.push_back(name);
  return Join(users);
}

Status ReadParam(const json& v, const Where& where, std::string_view key, KvMethodParams* p) {
  if (key == "n_sink") return ReadInt(v, where, key, &p->n_sink);
  if (key == "recent") {
    KVS_RETURN_IF_ERROR(ReadInt(v, where, key, &p->recent));
    if (p->recent < 0) return where.Error(key, fmt::format("must be >= 0; found {}", p->recent));
    return Status::Ok();
  }
  if (key == "recent_ratio") {
    p->recent = -1;  // the ratio replaces an inherited token window
    return ReadNumber(v, where, key, &p->recent_ratio);
  }
  if (key == "head_reduce") {
    return ReadEnum<HeadReduce>(v, where, key, {"mean", "max", "none"},
                                {HeadReduce::kMean, HeadReduce::kMax, HeadReduce::kNone}, &p->head_reduce);
  }
  if (key == "history_window") return ReadInt(v, where, key, &p->history_window);
  if (key == "window") return ReadInt(v, where, key, &p->obs_window);
  if (key == "kernel") return ReadInt(v, where, key, &p->kernel);
  if (key == "pooling") {
    return ReadEnum<VotePooling>(v, where, key, {"max", "avg"}, {VotePooling::kMax, VotePooling::kAvg}, &p->pooling);
  }
  if (key == "decode_evict") return ReadBool(v, where, key, &p->decode_evict);
  if (key == "query_head_scores") return ReadBool(v, where, key, &p->query_head_scores);
  if (key == "compensation") return ReadBool(v, where, key, &p->compensation);
  if (key == "beta") return ReadNumber(v, where, key, &p->beta);
  if (key == "page_tokens") return ReadInt(v, where, key, &p->page_tokens);
  if (key == "dense_layers") return ReadInt(v, where, key, &p->dense_layers);
  if (key == "cache_positions") return ReadBool(v, where, key, &p->cache_positions);
  if (key == "decay") return ReadNumber(v, where, key, &p->decay);
  if (key == "rerank_period") return ReadInt(v, where, key, &p->rerank_period);
  if (key == "mode") {
    return ReadEnum<CumulativeMode>(v, where, key, {"evict", "mask"}, {CumulativeMode::kEvict, CumulativeMode::kMask},
                                    &p->mode);
  }
  if (key == "schedule") {
    return ReadEnum<RetentionSchedule>(
        v, where, key, {"linear", "cosine", "none"},
        {RetentionSchedule::kLinear, RetentionSchedule::kCosine, RetentionSchedule::kNone}, &p->schedule);
  }
  if (key == "spread") return ReadNumber(v, where, key, &p->spread);
  if (key == "layer_weight") return ReadNumber(v, where, key, &p->layer_weight);
  if (key == "reselect_layer") return ReadInt(v, where, key, &p->reselect_layer);
  if (key == "head_budgets") {
    return ReadEnum<HeadBudgets>(v, where, key, {"uniform", "adaptive"},
                                 {HeadBudgets::kUniform, HeadBudgets::kAdaptive}, &p->head_budgets);
  }
  if (key == "adaptive_rule") {
    return ReadEnum<AdaptiveRule>(v, where, key, {"reference", "kvpress"},
                                  {AdaptiveRule::kReference, AdaptiveRule::kKvpress}, &p->adaptive_rule);
  }
  if (key == "alpha") return ReadNumber(v, where, key, &p->alpha);
  if (key == "floor") return ReadNumber(v, where, key, &p->floor);
  if (key == "selection") {
    return ReadEnum<ReuseSelectionKind>(v, where, key, {"exact", "quest"},
                                        {ReuseSelectionKind::kExact, ReuseSelectionKind::kQuest}, &p->selection);
  }
  if (key == "layer_budgets") {
    return ReadEnum<LayerBudgets>(v, where, key, {"uniform", "cake"}, {LayerBudgets::kUniform, LayerBudgets::kCake},
                                  &p->layer_budgets);
  }
  if (key == "gamma") return ReadNumber(v, where, key, &p->gamma);
  if (key == "tau1") return ReadNumber(v, where, key, &p->tau1);
  if (key == "excess") {
    return ReadEnum<CakeExcess>(v, where, key, {"equal", "preference"}, {CakeExcess::kEqual, CakeExcess::kPreference},
                                &p->excess);
  }
  if (key == "tau2") return ReadNumber(v, where, key, &p->tau2);
  if (key == "heads") {
    if (!v.is_string() || v.get<std::string>().empty())
      return where.Error(key, "expected the path of a heads file (kvsparse probe-heads -o FILE), found " + Describe(v));
    p->heads_file = v.get<std::string>();
    p->full_heads_resolved = false;
    return Status::Ok();
  }
  if (key == "retrieval_heads" || key == "echo_heads" || key == "induction_heads") {
    p->full_heads_resolved = false;
    return ReadNumber(v, where, key,
                      key == "retrieval_heads" ? &p->retrieval_heads
                      : key == "echo_heads"    ? &p->echo_heads
                                               : &p->induction_heads);
  }
  return where.Error(key, "internal: parameter without a reader");
}

// "prefill": "xattention" (its defaults) or {"method": "xattention", "threshold": 0.8, ...}.
Status ReadPrefill(const json& v, const Where& where, PrefillSparsity* out) {
  if (v.is_string()) {
    StatusOr<PrefillSparsity> parsed = ParsePrefillSparsity(v.get<std::string>(), "prefill");
    if (!parsed.ok()) return where.Error("prefill", parsed.status().message());
    *out = *parsed;
    return Status::Ok();
  }
  if (!v.is_object() || !v.contains("method") || !v["method"].is_string()) {
    return where.Error("prefill",
                       "expected a method name or an object with \"method\" and its parameters, found " + Describe(v));
  }
  StatusOr<PrefillSparsity> parsed = ParsePrefillSparsity(v["method"].get<std::string>(), "prefill");
  if (!parsed.ok()) return where.Error("prefill", parsed.status().message());
  for (const auto& [key, value] : v.items()) {
    if (key == "method") continue;
    if (!value.is_number()) return where.Error("prefill." + key, "expected a number, found " + Describe(value));
    if (Status s = SetPrefillParam(key, value.get<double>(), &*parsed); !s.ok()) {
      return where.Error("prefill." + key, s.message());
    }
  }
  if (Status s = ValidatePrefillSparsity(*parsed); !s.ok()) return where.Error("prefill", s.message());
  *out = *parsed;
  return Status::Ok();
}

// Reads method, budget, kv_type and method parameters of one object on top of `base`.
Status ReadLayerFields(const json& obj, const Where& where, bool is_entry, const LayerKvConfig& base,
                       bool base_has_budget, LayerKvConfig* out, bool* has_budget) {
  if (!obj.is_object()) return where.Error("expected a JSON object, found " + Describe(obj));
  *out = base;
  *has_budget = base_has_budget;
  if (auto it = obj.find("method"); it != obj.end()) {
    if (!it->is_string()) return where.Error("method", "expected a method name (string), found " + Describe(*it));
    const std::string name = it->get<std::string>();
    const std::optional<KvMethod> method = KvMethodFromName(name);
    if (!method)
      return where.Error("method", fmt::format("unknown method '{}'{}; valid methods: {}", name,
                                               Suggestion(name, MethodNameList()), ValidKvMethodNames()));
    out->method = *method;
    // Parameters carry over only within the same method; another method starts from its paper defaults.
    // The same holds for per_head: another method starts from its reference's granularity.
    if (*method != base.method) {
      out->params = DefaultMethodParams(*method);
      out->per_head = DefaultPerHead(*method);
    }
  }
  if (obj.contains("budget") && obj.contains("budget_by_length"))
    return where.Error("budget_by_length", "give either 'budget' or 'budget_by_length', not both");
  if (MethodUses(out->method, "recent") && obj.contains("recent") && obj.contains("recent_ratio"))
    return where.Error("recent", "give either 'recent' (tokens) or 'recent_ratio' (of the budget), not both");
  for (const auto& [key, value] : obj.items()) {
    if (key == "method" || (is_entry && key == "layers")) continue;
    if (key == "budget") {
      KVS_RETURN_IF_ERROR(ReadBudget(value, where, &out->budget));
      *has_budget = true;
    } else if (key == "budget_by_length") {
      KVS_RETURN_IF_ERROR(ReadBudgetByLength(value, where, &out->budget));
      *has_budget = true;
    } else if (key == "kv_type") {
      if (!value.is_string()) return where.Error(key, fmt::format("expected one of {}, found {}", kKvTypeNames, Describe(value)));
      const std::string name = value.get<std::string>();
      const std::optional<KvStorage> storage = KvStorageFromName(name);
      if (!storage)
        return where.Error(key, fmt::format("unknown kv_type '{}'{}; valid kv types: {}", name,
                                            Suggestion(name, kKvTypeList), kKvTypeNames));
      out->kv_type = *storage;
    } else if (key == "per_head") {
      KVS_RETURN_IF_ERROR(ReadBool(value, where, key, &out->per_head));
    } else if (key == "prefill") {
      KVS_RETURN_IF_ERROR(ReadPrefill(value, where, &out->prefill));
    } else if (MethodUses(out->method, key)) {
      KVS_RETURN_IF_ERROR(ReadParam(value, where, key, &out->params));
    } else {
      std::vector<std::string_view> valid;
      if (is_entry) valid.push_back("layers");
      valid.insert(valid.end(), {"method", "budget", "budget_by_length", "kv_type"});
      for (std::string_view k : KvMethodParamKeys(out->method)) valid.push_back(k);
      valid.insert(valid.end(), {"per_head", "prefill"});
      const std::string users = MethodsUsing(key);
      if (!users.empty())
        return where.Error(key, fmt::format("is not a parameter of method '{}' (it belongs to {}); valid keys: {}",
                                            KvMethodName(out->method), users, Join(valid)));
      return where.Error(key, fmt::format("unknown key{}; valid keys for method '{}': {}", Suggestion(key, valid),
                                          KvMethodName(out->method), Join(valid)));
    }
  }
  return Status::Ok();
}

// "layers": 3, "3" or "2-5" (inclusive).
Status ReadLayerRange(const json& v, const Where& where, int n_layers, int* first, int* last) {
  auto parse_index = [](std::string_view s, int* out) {
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return ec == std::errc() && ptr == s.data() + s.size() && !s.empty();
  };
  if (v.is_number_integer()) {
    int32_t index = 0;
    KVS_RETURN_IF_ERROR(ReadInt(v, where, "layers", &index));
    *first = *last = index;
  } else if (v.is_string()) {
    const std::string s = v.get<std::string>();
    const size_t dash = s.find('-', 1);  // from 1: a leading '-' is a negative index
    const bool ok = dash == std::string::npos
                        ? parse_index(s, first) && (*last = *first, true)
                        : parse_index(std::string_view(s).substr(0, dash), first) &&
                              parse_index(std::string_view(s).substr(dash + 1), last);
    if (!ok) return where.Error("layers", fmt::format("expected a layer index or a range like \"0-3\", found \"{}\"", s));
  } else {
    return where.Error("layers", "expected a layer index or a range string like \"0-3\", found " + Describe(v));
  }
  if (*first > *last)
    return where.Error("layers", fmt::format("range {}-{} is reversed (write \"{}-{}\")", *first, *last, *last, *first));
  if (*first < 0 || *last >= n_layers)
    return where.Error("layers", fmt::format("range {}-{} lies outside the model's layers 0-{} ({} layers)", *first,
                                             *last, n_layers - 1, n_layers));
  return Status::Ok();
}

// 1-based line and column of byte offset `byte` (the count of bytes read) in `text`.
std::pair<size_t, size_t> LineColumn(std::string_view text, size_t byte) {
  const size_t end = std::min(byte > 0 ? byte - 1 : 0, text.size());
  size_t line = 1, column = 1;
  for (size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return {line, column};
}

// The cumulative layers of a config share one ranking per sequence: its parameters must agree.
Status CheckSharedRankingParams(const std::vector<LayerKvConfig>& layers) {
  const LayerKvConfig* first_cumulative = nullptr;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerKvConfig& layer = layers[l];
    if (layer.method != KvMethod::kCumulative) continue;
    if (first_cumulative == nullptr) {
      first_cumulative = &layer;
      continue;
    }
    const KvMethodParams& a = first_cumulative->params;
    const KvMethodParams& b = layer.params;
    const auto mismatch = [&](std::string_view field, const std::string& here, const std::string& first) {
      return InvalidArgumentError(fmt::format("layer {} (cumulative): field '{}': {} differs from {} in the first "
                                              "cumulative layer; the cumulative layers share one ranking (one per KV "
                                              "head with per_head), so decay, rerank_period, mode, per_head, "
                                              "head_budgets and floor must be the same in all of them",
                                              l, field, here, first));
    };
    if (a.decay != b.decay) return mismatch("decay", fmt::format("{:g}", b.decay), fmt::format("{:g}", a.decay));
    if (a.rerank_period != b.rerank_period)
      return mismatch("rerank_period", fmt::format("{}", b.rerank_period), fmt::format("{}", a.rerank_period));
    if (a.mode != b.mode)
      return mismatch("mode", std::string(CumulativeModeName(b.mode)), std::string(CumulativeModeName(a.mode)));
    if (first_cumulative->per_head != layer.per_head)
      return mismatch("per_head", layer.per_head ? "true" : "false", first_cumulative->per_head ? "true" : "false");
    if (a.head_budgets != b.head_budgets)
      return mismatch("head_budgets", std::string(HeadBudgetsName(b.head_budgets)),
                      std::string(HeadBudgetsName(a.head_budgets)));
    if (a.floor != b.floor) return mismatch("floor", fmt::format("{:g}", b.floor), fmt::format("{:g}", a.floor));
  }
  return Status::Ok();
}

std::string DescribeLayer(const LayerKvConfig& l) {
  std::string s(KvMethodName(l.method));
  if (l.method != KvMethod::kFull) s += " budget=" + KvBudgetToString(l.budget);
  s += fmt::format(" kv={}", KvStorageName(l.kv_type));
  if (l.per_head) s += " per_head";
  if (l.prefill.method != PrefillMethod::kDense) s += " prefill=" + PrefillSparsitySummary(l.prefill);
  const KvMethodParams& p = l.params;
  const bool cake_allocation = l.method == KvMethod::kCake || p.layer_budgets == LayerBudgets::kCake;
  for (std::string_view key : KvMethodParamKeys(l.method)) {
    if (key == "n_sink") s += fmt::format(" n_sink={}", p.n_sink);
    if (key == "recent" && p.recent >= 0) s += fmt::format(" recent={}", p.recent);
    if (key == "recent_ratio" && p.recent < 0) s += fmt::format(" recent_ratio={:g}", p.recent_ratio);
    if (key == "head_reduce") s += fmt::format(" head_reduce={}", HeadReduceName(p.head_reduce));
    if (key == "history_window") s += fmt::format(" history_window={}", p.history_window);
    if (key == "window") s += fmt::format(" window={}", p.obs_window);
    if (key == "kernel") s += fmt::format(" kernel={}", p.kernel);
    if (key == "pooling") s += fmt::format(" pooling={}", VotePoolingName(p.pooling));
    if (key == "decode_evict") s += fmt::format(" decode_evict={}", p.decode_evict);
    if (key == "beta") s += fmt::format(" beta={:g}", p.beta);
    if (key == "page_tokens" && p.page_tokens > 0) s += fmt::format(" page_tokens={}", p.page_tokens);
    if (key == "dense_layers") s += fmt::format(" dense_layers={}", p.dense_layers);
    if (key == "cache_positions" && p.cache_positions) s += " cache_positions";
    if (key == "decay") s += fmt::format(" decay={:g}", p.decay);
    if (key == "rerank_period") s += fmt::format(" rerank_period={}", p.rerank_period);
    if (key == "mode") s += fmt::format(" mode={}", CumulativeModeName(p.mode));
    if (key == "schedule") s += fmt::format(" schedule={}", RetentionScheduleName(p.schedule));
    if (key == "spread") {
      s += fmt::format(" spread={:g}", p.spread);
      const double used = CumulativeSpread(l.budget, p);
      if (used < p.spread) s += fmt::format(" (lowered to {:.3g}: the first layer keeps 100%)", used);
    }
    if (key == "layer_weight" && p.layer_weight >= 0) s += fmt::format(" layer_weight={:g}", p.layer_weight);
    if (key == "reselect_layer" && p.reselect_layer >= 0) s += fmt::format(" reselect_layer={}", p.reselect_layer);
    if (key == "selection") s += fmt::format(" selection={}", ReuseSelectionName(p.selection));
    if (key == "head_budgets" && p.head_budgets == HeadBudgets::kAdaptive) {
      if (!MethodUses(l.method, "adaptive_rule")) {  // cumulative: its own floor rule
        s += fmt::format(" head_budgets=adaptive floor={:g}", p.floor);
      } else if (p.adaptive_rule == AdaptiveRule::kReference) {
        s += fmt::format(" head_budgets=adaptive alpha={:g}", p.alpha);
      } else {
        s += fmt::format(" head_budgets=adaptive rule=kvpress floor={:g}", p.floor);
      }
    }
    if (key == "gamma") s += fmt::format(" gamma={:g}", p.gamma);
    if (key == "layer_budgets" && cake_allocation) s += " layer_budgets=cake";
    if (key == "tau1" && cake_allocation) s += fmt::format(" tau1={:g}", p.tau1);
    if (key == "tau2" && cake_allocation) s += fmt::format(" tau2={:g}", p.tau2);
    if (key == "excess" && cake_allocation) s += fmt::format(" excess={}", CakeExcessName(p.excess));
    if (key == "query_head_scores" && !p.query_head_scores) s += " query_head_scores=false";
    if (key == "compensation" && !p.compensation) s += " compensation=false";
    if (key == "heads") s += " heads=" + (p.heads_file.empty() ? std::string("probed") : p.heads_file);
    if (key == "retrieval_heads" && p.retrieval_heads >= 0) s += fmt::format(" retrieval_heads={:g}", p.retrieval_heads);
    if (key == "echo_heads" && p.retrieval_heads < 0) s += fmt::format(" echo_heads={:g}", p.echo_heads);
    if (key == "induction_heads" && p.retrieval_heads < 0) s += fmt::format(" induction_heads={:g}", p.induction_heads);
  }
  return s;
}

}  // namespace

std::optional<KvStorage> KvStorageFromName(std::string_view name) {
  if (name == "fp8") return KvStorage::kFp8E4M3;
  for (int s = 0; s < kNumKvStorage; ++s)
    if (name == KvStorageName(static_cast<KvStorage>(s))) return static_cast<KvStorage>(s);
  return std::nullopt;
}

StatusOr<KvMethodSpec> ParseKvMethodSpec(const std::string& text, std::string_view flag) {
  KvMethodSpec m;
  size_t start = 0;
  for (size_t end; start <= text.size(); start = end + 1) {
    end = std::min(text.find(':', start), text.size());
    const std::string part = text.substr(start, end - start);
    if (start == 0) {
      m.name = part;
    } else if (part.find('=') == std::string::npos || part.front() == '=') {
      return InvalidArgumentError(fmt::format(
          "{}: '{}': expected METHOD or METHOD:KEY=VALUE[:KEY=VALUE...], found the part '{}'", flag, text, part));
    } else {
      m.params.push_back(part);
    }
  }
  if (!KvMethodFromName(m.name)) {
    return InvalidArgumentError(fmt::format("{}: unknown method '{}' in '{}'{}; valid methods: {}", flag, m.name, text,
                                            Suggestion(m.name, MethodNameList()), ValidKvMethodNames()));
  }
  return m;
}

StatusOr<KvBudget> ParseKvBudget(std::string_view text) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  const bool percent = !text.empty() && text.back() == '%';
  if (percent) text.remove_suffix(1);
  const bool fractional = percent || text.find_first_of(".eE") != std::string_view::npos;
  if (!fractional) {
    int64_t tokens = 0;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), tokens);
    if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
      return InvalidArgumentError(fmt::format("budget '{}' is neither a token count (512) nor a fraction (0.2)", text));
    if (tokens <= 0 || tokens > std::numeric_limits<int32_t>::max())
      return InvalidArgumentError(fmt::format("budget must be a token count >= 1; found {}", tokens));
    return KvBudget::Tokens(static_cast<int32_t>(tokens));
  }
  double value = 0.0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    return InvalidArgumentError(fmt::format("budget '{}' is neither a token count (512) nor a fraction (0.2)", text));
  if (percent) value /= 100.0;
  if (!(value > 0.0)) return InvalidArgumentError(fmt::format("budget must be > 0; found '{}'", text));
  if (value > 1.0)
    return InvalidArgumentError(fmt::format("a budget fraction must be <= 1; found '{}' (write an integer for a "
                                            "token count)",
                                            text));
  return KvBudget::Fraction(value);
}

StatusOr<KvSparsityConfig> ParseKvSparsityConfig(std::string_view json_text, int n_layers, std::string_view source) {
  if (n_layers < 1) return InvalidArgumentError(fmt::format("{}: the model must have layers; found {}", source, n_layers));
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    const auto [line, column] = LineColumn(json_text, e.byte);
    std::string detail = e.what();
    // Keep nlohmann's reason, without its own prefix and position.
    if (size_t at = detail.find("column "); at != std::string::npos)
      if (size_t colon = detail.find(": ", at); colon != std::string::npos) detail = detail.substr(colon + 2);
    return InvalidArgumentError(
        fmt::format("{}: malformed JSON at line {}, column {}: {}", source, line, column, detail));
  } catch (const json::exception& e) {  // e.g. a number out of range ("1e999")
    return InvalidArgumentError(fmt::format("{}: malformed JSON: {}", source, e.what()));
  }
  const Where top(source, "top level");
  if (!root.is_object()) return top.Error("expected a JSON object, found " + Describe(root));
  std::vector<std::string_view> top_keys(std::begin(kTopLevelKeys), std::end(kTopLevelKeys));
  for (const auto& [key, value] : root.items()) {
    if (std::find(top_keys.begin(), top_keys.end(), key) == top_keys.end())
      return top.Error(key, fmt::format("unknown key{}; valid keys: {}", Suggestion(key, top_keys), Join(top_keys)));
  }

  KvSparsityConfig config;
  if (auto it = root.find("evict_interval"); it != root.end())
    KVS_RETURN_IF_ERROR(ReadPositiveInt(*it, top, "evict_interval", &config.evict_interval));
  if (auto it = root.find("page_size"); it != root.end())
    KVS_RETURN_IF_ERROR(ReadPositiveInt(*it, top, "page_size", &config.page_size));
  if (auto it = root.find("kivi_residual"); it != root.end()) {
    KVS_RETURN_IF_ERROR(ReadInt(*it, top, "kivi_residual", &config.kivi_residual));
    if (config.kivi_residual < 0)
      return top.Error("kivi_residual", fmt::format("must be >= 0 tokens; found {}", config.kivi_residual));
  }
  if (auto it = root.find("kivi_v_group"); it != root.end()) {
    KVS_RETURN_IF_ERROR(ReadInt(*it, top, "kivi_v_group", &config.kivi_v_group));
    if (const std::string problem = KiviVGroupProblem(config); !problem.empty() || config.kivi_v_group < 0)
      return top.Error("kivi_v_group", problem.empty() ? fmt::format("must be >= 0; found {}", config.kivi_v_group)
                                                       : problem);
  }
  if (auto it = root.find("prefill_chunk"); it != root.end())
    KVS_RETURN_IF_ERROR(ReadPositiveInt(*it, top, "prefill_chunk", &config.prefill_chunk));
  if (auto it = root.find("gqa_aggregation"); it != root.end()) {
    size_t i = 0;
    KVS_RETURN_IF_ERROR(ReadChoice(*it, top, "gqa_aggregation", {"mean", "max"}, &i));
    config.agg = i == 0 ? GqaAggregation::kMean : GqaAggregation::kMax;
  }
  if (auto it = root.find("prefill_eviction"); it != root.end()) {
    size_t i = 0;
    KVS_RETURN_IF_ERROR(ReadChoice(*it, top, "prefill_eviction", {"chunk", "prompt_end"}, &i));
    config.prefill_eviction = i == 0 ? PrefillEviction::kEveryChunk : PrefillEviction::kPromptEnd;
  }

  LayerKvConfig fallback;  // "full" when there is no "default"
  bool fallback_has_budget = false;
  if (auto it = root.find("default"); it != root.end()) {
    const LayerKvConfig full;
    KVS_RETURN_IF_ERROR(ReadLayerFields(*it, Where(source, "default"), /*is_entry=*/false, full, false, &fallback,
                                        &fallback_has_budget));
  }
  config.layers.assign(n_layers, fallback);
  std::vector<uint8_t> has_budget(n_layers, fallback_has_budget);
  std::vector<int> owner(n_layers, -1);  // entry index that configured each layer
  std::vector<std::string> entry_names;

  if (auto it = root.find("layers"); it != root.end()) {
    if (!it->is_array()) return top.Error("layers", "expected an array of layer entries, found " + Describe(*it));
    for (size_t i = 0; i < it->size(); ++i) {
      const json& entry = (*it)[i];
      std::string name = fmt::format("layers[{}]", i);
      if (!entry.is_object()) return Where(source, name).Error("expected a JSON object, found " + Describe(entry));
      auto range_it = entry.find("layers");
      if (range_it == entry.end())
        return Where(source, name).Error("layers", "missing: say which layers this entry configures (3 or \"0-3\")");
      name += " (layers " + (range_it->is_string() ? range_it->get<std::string>() : range_it->dump()) + ")";
      const Where where(source, name);
      int first = 0, last = 0;
      KVS_RETURN_IF_ERROR(ReadLayerRange(*range_it, where, n_layers, &first, &last));
      for (int l = first; l <= last; ++l)
        if (owner[l] >= 0)
          return where.Error("layers", fmt::format("overlaps {} at layer {}", entry_names[owner[l]], l));
      LayerKvConfig layer;
      bool layer_has_budget = false;
      KVS_RETURN_IF_ERROR(
          ReadLayerFields(entry, where, /*is_entry=*/true, fallback, fallback_has_budget, &layer, &layer_has_budget));
      layer.named_by_layers_entry = true;
      for (int l = first; l <= last; ++l) {
        config.layers[l] = layer;
        has_budget[l] = layer_has_budget;
        owner[l] = static_cast<int>(i);
      }
      entry_names.push_back(std::move(name));
    }
  }

  for (int l = 0; l < n_layers; ++l) {
    const std::string origin = owner[l] >= 0 ? entry_names[owner[l]] : std::string("default");
    const LayerKvConfig& layer = config.layers[l];
    if (layer.method != KvMethod::kFull && !has_budget[l])
      return InvalidArgumentError(fmt::format("{}: layer {} ({}): field 'budget': missing; method '{}' needs a "
                                              "budget (an integer token count, or a fraction in (0, 1]) [set by {}]",
                                              source, l, KvMethodName(layer.method), KvMethodName(layer.method),
                                              origin));
    const Status status = ValidateLayerKvConfig(layer, l);
    if (!status.ok())
      return InvalidArgumentError(fmt::format("{}: {} [set by {}]", source, status.message(), origin));
  }
  if (const Status status = CheckSharedRankingParams(config.layers); !status.ok())
    return InvalidArgumentError(fmt::format("{}: {}", source, status.message()));
  // The default page size depends on the layers' types, so whole pages are checked last.
  if (const std::string problem = KiviResidualProblem(config); !problem.empty())
    return top.Error("kivi_residual", problem);
  return config;
}

StatusOr<KvSparsityConfig> LoadKvSparsityConfig(const std::string& path, int n_layers) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("kv config '{}': cannot open the file", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return DataLossError(fmt::format("kv config '{}': read failed", path));
  return ParseKvSparsityConfig(text.str(), n_layers, fmt::format("kv config '{}'", path));
}

StatusOr<std::vector<LayerKvConfig>> KvLayersWithOverride(const KvSparsityConfig& base, std::string_view method,
                                                          std::string_view budget, std::string_view kv_type) {
  std::optional<KvStorage> storage;
  if (!kv_type.empty()) {
    storage = KvStorageFromName(kv_type);
    if (!storage) {
      return InvalidArgumentError(fmt::format("kv_type: unknown kv type '{}'{}; valid kv types: {}", kv_type,
                                              Suggestion(kv_type, kKvTypeList),
                                              kKvTypeNames));
    }
  }
  std::optional<KvMethod> m;
  if (!method.empty()) {
    m = KvMethodFromName(method);
    if (!m) {
      return InvalidArgumentError(fmt::format("kv_method: unknown method '{}'{}; valid methods: {}", method,
                                              Suggestion(method, MethodNameList()), ValidKvMethodNames()));
    }
  }
  std::optional<KvBudget> b;
  if (!budget.empty()) {
    StatusOr<KvBudget> parsed = ParseKvBudget(budget);
    if (!parsed.ok()) return InvalidArgumentError("kv_budget: " + parsed.status().message());
    b = *parsed;
  }
  std::vector<LayerKvConfig> layers = base.layers;
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerKvConfig& layer = layers[i];
    if (m && *m != layer.method) {
      if (*m == KvMethod::kRazor) {
        return InvalidArgumentError("kv_method: razor's retrieval heads are chosen when the server starts; start it "
                                    "with --kv-method razor to serve razor (a request may then change its budget)");
      }
      const bool had_budget = layer.method != KvMethod::kFull;
      layer.method = *m;
      layer.params = DefaultMethodParams(*m);
      if (!b && !had_budget && *m != KvMethod::kFull) {
        return InvalidArgumentError(fmt::format("kv_budget: method '{}' needs a budget (512 tokens, or a fraction such "
                                                "as 0.2); layer {} has none",
                                                method, i));
      }
    }
    if (b) layer.budget = *b;
    if (storage) layer.kv_type = *storage;
    const Status status = ValidateLayerKvConfig(layer, static_cast<int>(i));
    if (!status.ok()) return InvalidArgumentError("kv_method/kv_budget: " + status.message());
  }
  return layers;
}

Status ApplyKvParams(std::span<const std::string> key_values, KvSparsityConfig* config) {
  for (const std::string& key_value : key_values) {
    const size_t eq = key_value.find('=');
    if (eq == std::string::npos || eq == 0) {
      return InvalidArgumentError(fmt::format("--kv-param: expected KEY=VALUE (e.g. head_budgets=adaptive), found '{}'",
                                              key_value));
    }
    const std::string key = key_value.substr(0, eq), text = key_value.substr(eq + 1);
    json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) value = text;  // a bare word: a string value (mode=mask)
    const Where where("--kv-param", key_value);
    if (key == "per_head") {  // a layer field, not a method parameter: every sparse layer takes it
      bool per_head = false;
      KVS_RETURN_IF_ERROR(ReadBool(value, where, key, &per_head));
      for (LayerKvConfig& layer : config->layers)
        if (layer.method != KvMethod::kFull) layer.per_head = per_head;
      continue;
    }
    bool used = false;
    for (LayerKvConfig& layer : config->layers) {
      if (!MethodUses(layer.method, key)) continue;
      KVS_RETURN_IF_ERROR(ReadParam(value, where, key, &layer.params));
      used = true;
    }
    if (!used) {
      const std::string users = MethodsUsing(key);
      return where.Error(key, users.empty() ? "unknown parameter" + Suggestion(key, AllParamKeys())
                                            : fmt::format("no layer's method takes it (it belongs to {})", users));
    }
  }
  return ValidateKvSparsityConfig(*config);
}

StatusOr<KvSparsityConfig> KvSparsityConfigFromFlags(std::string_view method, std::string_view budget,
                                                     std::string_view kv_type, int n_layers) {
  if (n_layers < 1) return InvalidArgumentError(fmt::format("the model must have layers; found {}", n_layers));
  const std::optional<KvMethod> m = KvMethodFromName(method);
  if (!m)
    return InvalidArgumentError(fmt::format("--kv-method: unknown method '{}'{}; valid methods: {}", method,
                                            Suggestion(method, MethodNameList()), ValidKvMethodNames()));
  LayerKvConfig layer;
  layer.method = *m;
  layer.params = DefaultMethodParams(*m);
  layer.per_head = DefaultPerHead(*m);
  if (budget.empty()) {
    if (*m != KvMethod::kFull)
      return InvalidArgumentError(fmt::format("--kv-budget: method '{}' needs a budget (512 tokens, or a fraction "
                                              "such as 0.2)",
                                              method));
  } else {
    StatusOr<KvBudget> parsed = ParseKvBudget(budget);
    if (!parsed.ok()) return InvalidArgumentError("--kv-budget: " + parsed.status().message());
    layer.budget = *parsed;
  }
  if (!kv_type.empty()) {
    const std::optional<KvStorage> storage = KvStorageFromName(kv_type);
    if (!storage)
      return InvalidArgumentError(fmt::format("--kv-type: unknown kv type '{}'; valid kv types: {}", kv_type,
                                              kKvTypeNames));
    layer.kv_type = *storage;
  }
  const Status status = ValidateLayerKvConfig(layer, 0);
  if (!status.ok()) return InvalidArgumentError("--kv-method/--kv-budget: " + status.message());
  KvSparsityConfig config;
  config.layers.assign(n_layers, layer);
  return config;
}

Status ValidateKvSparsityConfig(const KvSparsityConfig& config) {
  if (config.layers.empty()) return InvalidArgumentError("kv config: no layers");
  if (config.evict_interval < 1)
    return InvalidArgumentError(fmt::format("kv config: evict_interval must be >= 1; found {}", config.evict_interval));
  if (config.page_size < 0)
    return InvalidArgumentError(
        fmt::format("kv config: page_size must be >= 1 (or 0: the default); found {}", config.page_size));
  if (const std::string problem = KiviResidualProblem(config); !problem.empty())
    return InvalidArgumentError("kv config: " + problem);
  if (const std::string problem = KiviVGroupProblem(config); !problem.empty())
    return InvalidArgumentError("kv config: " + problem);
  if (config.prefill_chunk < 1)
    return InvalidArgumentError(fmt::format("kv config: prefill_chunk must be >= 1; found {}", config.prefill_chunk));
  for (size_t l = 0; l < config.layers.size(); ++l)
    KVS_RETURN_IF_ERROR(ValidateLayerKvConfig(config.layers[l], static_cast<int>(l)));
  KVS_RETURN_IF_ERROR(CheckSharedRankingParams(config.layers));
  return Status::Ok();
}

std::string KvSparsityConfigSummary(const KvSparsityConfig& config) {
  std::string out;
  const int n = static_cast<int>(config.layers.size());
  for (int first = 0; first < n;) {
    const std::string description = DescribeLayer(config.layers[first]);
    int last = first;
    while (last + 1 < n && DescribeLayer(config.layers[last + 1]) == description) ++last;
    out += (out.empty() ? "" : "; ") +
           (first == last ? fmt::format("layer {}", first) : fmt::format("layers {}-{}", first, last)) + ": " +
           description;
    first = last + 1;
  }
  if (config.prefill_eviction == PrefillEviction::kPromptEnd) out += "; prefill_eviction=prompt_end";
  out += fmt::format("; evict_interval={} page_size={} gqa_aggregation={} prefill_chunk={}", config.evict_interval,
                     EffectivePageSize(config), config.agg == GqaAggregation::kMean ? "mean" : "max",
                     config.prefill_chunk);
  if (StoresKivi(config)) {
    out += fmt::format(" kivi_residual={} kivi_v_group={}", EffectiveKiviResidual(config),
                       config.kivi_v_group == -1 ? fmt::format("{} (or the row where it does not divide head_dim)",
                                                               kKiviVGroup)
                       : config.kivi_v_group == 0 ? std::string("row")
                                                  : std::to_string(config.kivi_v_group));
  }
  return out;
}

int EffectivePageSize(const KvSparsityConfig& config) {
  if (config.page_size > 0) return config.page_size;
  return StoresKivi(config) ? kKiviPageSize : kDefaultPageSize;
}

int EffectiveKiviResidual(const KvSparsityConfig& config) {
  if (config.kivi_residual >= 0) return config.kivi_residual;
  if (!StoresKivi(config)) return 0;
  const int64_t page = EffectivePageSize(config);  // (64-bit: a page near INT32_MAX must not overflow)
  return static_cast<int>(std::min<int64_t>((kKiviResidualTokens + page - 1) / page * page, INT32_MAX));
}

int EffectiveKiviVGroup(const KvSparsityConfig& config, int head_dim) {
  if (config.kivi_v_group >= 0) return config.kivi_v_group;
  return head_dim % kKiviVGroup == 0 ? kKiviVGroup : 0;
}

}  // namespace kvsparse
