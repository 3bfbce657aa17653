// Method names, paper-default parameters, accepted keys, and value checks.
#include <array>
#include <cmath>

#include <fmt/format.h>

#include "kvsparse/kv_policies.h"

namespace kvsparse {
namespace {

struct MethodInfo {
  KvMethod method;
  std::string_view name;
  std::span<const std::string_view> keys;
};

constexpr std::string_view kStreamingKeys[] = {"n_sink", "cache_positions"};
// "layer_budgets", "tau1", "tau2", "excess": CAKE's allocation of the layers' budgets (cake.h), on any evicting method.
constexpr std::string_view kWindowedKeys[] = {"n_sink", "recent", "recent_ratio", "head_reduce", "layer_budgets", "tau1", "tau2", "excess"};
constexpr std::string_view kH2OKeys[] = {"n_sink", "recent",        "recent_ratio", "head_reduce", "head_budgets",
                                         "adaptive_rule", "alpha", "floor",  "layer_budgets", "tau1", "tau2", "excess"};
constexpr std::string_view kScissorhandsKeys[] = {"n_sink",        "recent", "recent_ratio", "head_reduce", "history_window",
                                                  "layer_budgets", "tau1",   "tau2", "excess"};
constexpr std::string_view kSnapKvKeys[] = {"window",        "kernel", "pooling", "head_reduce",   "decode_evict",
                                            "head_budgets",  "adaptive_rule", "alpha", "floor", "layer_budgets",
                                            "tau1",          "tau2", "excess"};
constexpr std::string_view kPyramidKvKeys[] = {"window", "kernel",        "pooling", "head_reduce", "decode_evict",
                                               "beta",   "head_budgets",  "adaptive_rule", "alpha", "floor",
                                               "layer_budgets", "tau1",   "tau2", "excess"};
constexpr std::string_view kRandomKeys[] = {"n_sink", "recent", "recent_ratio", "layer_budgets", "tau1", "tau2", "excess"};
constexpr std::string_view kQuestKeys[] = {"page_tokens", "head_reduce", "dense_layers"};
constexpr std::string_view kOracleKeys[] = {"head_reduce"};
constexpr std::string_view kReuseKeys[] = {"dense_layers", "reselect_layer", "selection", "page_tokens", "head_reduce"};
constexpr std::string_view kCumulativeKeys[] = {"decay",        "rerank_period", "mode", "schedule", "spread",
                                                "layer_weight", "head_budgets",  "floor"};
constexpr std::string_view kCakeKeys[] = {"window", "kernel", "pooling", "head_reduce", "decode_evict",
                                          "gamma",  "tau1",   "tau2", "excess", "query_head_scores"};
constexpr std::string_view kRazorKeys[] = {"n_sink",          "heads",           "retrieval_heads",
                                           "echo_heads",      "induction_heads", "compensation"};
constexpr std::string_view kKNormKeys[] = {"n_sink",       "recent",        "recent_ratio", "head_reduce", "decode_evict",
                                           "dense_layers", "layer_budgets", "tau1",         "tau2", "excess"};

constexpr std::array<MethodInfo, 15> kMethods = {{
    {KvMethod::kFull, "full", {}},
    {KvMethod::kStreamingLlm, "streaming_llm", kStreamingKeys},
    {KvMethod::kH2O, "h2o", kH2OKeys},
    {KvMethod::kTova, "tova", kWindowedKeys},
    {KvMethod::kScissorhands, "scissorhands", kScissorhandsKeys},
    {KvMethod::kSnapKv, "snapkv", kSnapKvKeys},
    {KvMethod::kPyramidKv, "pyramidkv", kPyramidKvKeys},
    {KvMethod::kKNorm, "knorm", kKNormKeys},
    {KvMethod::kRandom, "random", kRandomKeys},
    {KvMethod::kQuest, "quest", kQuestKeys},
    {KvMethod::kOracle, "oracle", kOracleKeys},
    {KvMethod::kCumulative, "cumulative", kCumulativeKeys},
    {KvMethod::kReuse, "reuse", kReuseKeys},
    {KvMethod::kRazor, "razor", kRazorKeys},
    {KvMethod::kCake, "cake", kCakeKeys},
}};

const MethodInfo& Info(KvMethod method) {
  for (const MethodInfo& info : kMethods)
    if (info.method == method) return info;
  KVS_CHECK_MSG(false, "unknown KvMethod value");
  return kMethods[0];
}

bool Uses(KvMethod method, std::string_view key) {
  for (std::string_view k : Info(method).keys)
    if (k == key) return true;
  return false;
}

}  // namespace

std::string_view KvMethodName(KvMethod method) { return Info(method).name; }

std::optional<KvMethod> KvMethodFromName(std::string_view name) {
  for (const MethodInfo& info : kMethods)
    if (info.name == name) return info.method;
  return std::nullopt;
}

std::string ValidKvMethodNames() {
  std::string names;
  for (const MethodInfo& info : kMethods) names += (names.empty() ? "" : ", ") + std::string(info.name);
  return names;
}

std::span<const std::string_view> KvMethodParamKeys(KvMethod method) { return Info(method).keys; }

std::string_view HeadReduceName(HeadReduce r) {
  return r == HeadReduce::kMean ? "mean" : r == HeadReduce::kMax ? "max" : "none";
}
std::string_view VotePoolingName(VotePooling p) { return p == VotePooling::kMax ? "max" : "avg"; }
std::string_view RetentionScheduleName(RetentionSchedule s) {
  return s == RetentionSchedule::kLinear ? "linear" : s == RetentionSchedule::kCosine ? "cosine" : "none";
}
std::string_view ReuseSelectionName(ReuseSelectionKind s) { return s == ReuseSelectionKind::kExact ? "exact" : "quest"; }
std::string_view LayerBudgetsName(LayerBudgets b) { return b == LayerBudgets::kUniform ? "uniform" : "cake"; }
std::string_view CakeExcessName(CakeExcess e) { return e == CakeExcess::kEqual ? "equal" : "preference"; }
std::string_view HeadBudgetsName(HeadBudgets b) { return b == HeadBudgets::kUniform ? "uniform" : "adaptive"; }
std::string_view AdaptiveRuleName(AdaptiveRule r) { return r == AdaptiveRule::kReference ? "reference" : "kvpress"; }
std::string_view CumulativeModeName(CumulativeMode m) { return m == CumulativeMode::kEvict ? "evict" : "mask"; }

KvMethodParams DefaultMethodParams(KvMethod method) {
  KvMethodParams p;
  switch (method) {
    case KvMethod::kStreamingLlm: p.n_sink = 4; break;           // Xiao et al.: 4 sink tokens
    case KvMethod::kRazor: p.n_sink = 4; break;                  // Tang et al.: sinks + a recent buffer
    case KvMethod::kCake:  // Qin et al.'s reference: average pooling of kernel 5 (window 32, gamma 200, tau 1),
      p.kernel = 5;        // and eviction at every decode step (cake_cache.py's decoding cache)
      p.pooling = VotePooling::kAvg;
      p.decode_evict = true;
      break;
    case KvMethod::kH2O: p.recent_ratio = 0.5; break;             // Zhang et al.: half heavy, half recent
    case KvMethod::kScissorhands: p.recent_ratio = 0.1; break;    // ours (paper leaves it open)
    case KvMethod::kRandom: p.recent_ratio = 0.5; break;          // mirrors H2O's split
    case KvMethod::kQuest:  // Tang et al.: page 16, pages per query head, layers 0-1 dense
      p.head_reduce = HeadReduce::kNone;
      p.dense_layers = 2;
      break;
    case KvMethod::kKNorm: p.dense_layers = 2; break;  // Devoto et al.: the first two layers kept whole
    case KvMethod::kReuse:  // TidalDecode: sparse attention from layer 2, top-k per query head
      p.dense_layers = 2;
      p.head_reduce = HeadReduce::kNone;
      break;
    case KvMethod::kPyramidKv: p.obs_window = 8; break;  // KVCache-Factory's runs: window 8
    case KvMethod::kFull:
    case KvMethod::kTova:
    case KvMethod::kSnapKv:
    case KvMethod::kOracle:
    case KvMethod::kCumulative: break;  // the defaults are KvMethodParams' (cumulative.cc)
  }
  return p;
}

bool DefaultPerHead(KvMethod method) {
  switch (method) {
    case KvMethod::kH2O:
    case KvMethod::kSnapKv:
    case KvMethod::kPyramidKv:
    case KvMethod::kKNorm:
    case KvMethod::kCake:
    case KvMethod::kRazor: return true;
    case KvMethod::kFull:
    case KvMethod::kStreamingLlm:
    case KvMethod::kTova:
    case KvMethod::kScissorhands:
    case KvMethod::kRandom:
    case KvMethod::kQuest:
    case KvMethod::kOracle:
    case KvMethod::kCumulative:
    case KvMethod::kReuse: return false;
  }
  return false;
}

int PaperEvictInterval(KvMethod method) {
  switch (method) {
    case KvMethod::kStreamingLlm:
    case KvMethod::kH2O:
    case KvMethod::kTova:
    case KvMethod::kScissorhands:
    case KvMethod::kRandom:
    case KvMethod::kRazor:
    case KvMethod::kCake:
    case KvMethod::kCumulative: return 1;
    case KvMethod::kFull:
    case KvMethod::kSnapKv:
    case KvMethod::kPyramidKv:
    case KvMethod::kKNorm:
    case KvMethod::kQuest:
    case KvMethod::kOracle:
    case KvMethod::kReuse: return 0;
  }
  return 0;
}

Status ValidateLayerKvConfig(const LayerKvConfig& config, int layer) {
  const KvMethod method = config.method;
  const KvMethodParams& p = config.params;
  auto error = [&](std::string_view field, const std::string& what) {
    return InvalidArgumentError(fmt::format("layer {} ({}): field '{}': {}", layer, KvMethodName(method), field, what));
  };
  if (Status prefill = ValidatePrefillSparsity(config.prefill); !prefill.ok())
    return error("prefill", prefill.message());
  const KvBudget& budget = config.budget;
  if (budget.is_fraction()) {
    if (!(budget.fraction > 0.0 && budget.fraction <= 1.0))
      return error("budget", fmt::format("a fraction must lie in (0, 1]; found {:g}", budget.fraction));
  } else if (budget.is_by_length()) {
    if (budget.by_length.empty()) return error("budget_by_length", "give at least one length");
    for (size_t i = 0; i < budget.by_length.size(); ++i) {
      const auto [length, f] = budget.by_length[i];
      if (length < 1) return error("budget_by_length", fmt::format("a length must be >= 1; found {}", length));
      if (i > 0 && length <= budget.by_length[i - 1].first)
        return error("budget_by_length", fmt::format("lengths must ascend; {} follows {}", length, budget.by_length[i - 1].first));
      if (!(f > 0.0 && f <= 1.0))
        return error("budget_by_length", fmt::format("the fraction at {} must lie in (0, 1]; found {:g}", length, f));
    }
    if (method == KvMethod::kCumulative)
      return error("budget_by_length", "cumulative's retention schedule scales one budget over the layers; give "
                                       "'budget' (a token count or a fraction)");
  } else if (budget.tokens < 1) {
    return error("budget", fmt::format("a token budget must be >= 1; found {}", budget.tokens));
  }
  if (p.cache_positions && !Uses(method, "cache_positions"))
    return error("cache_positions", "only streaming_llm numbers positions inside the cache (Xiao et al. 2024); "
                                    "other methods keep absolute positions: remove the field or use streaming_llm");
  if (Uses(method, "n_sink") && p.n_sink < 0) return error("n_sink", fmt::format("must be >= 0; found {}", p.n_sink));
  if (Uses(method, "recent") && p.recent < -1) return error("recent", fmt::format("must be >= 0; found {}", p.recent));
  if (Uses(method, "recent_ratio") && !(p.recent_ratio >= 0.0 && p.recent_ratio <= 1.0))
    return error("recent_ratio", fmt::format("must lie in [0, 1]; found {:g}", p.recent_ratio));
  if (Uses(method, "history_window") && (p.history_window < 1 || p.history_window > 64))
    return error("history_window", fmt::format("must lie in [1, 64] queries; found {}", p.history_window));
  if (Uses(method, "window") && p.obs_window < 1)
    return error("window", fmt::format("must be >= 1 query; found {}", p.obs_window));
  if (Uses(method, "kernel") && (p.kernel < 1 || p.kernel % 2 == 0))
    return error("kernel", fmt::format("must be odd and >= 1 (centred pooling); found {}", p.kernel));
  if (Uses(method, "page_tokens") && p.page_tokens < 0)
    return error("page_tokens", fmt::format("must be >= 1 token (or 0 for the cache's page size); found {}",
                                            p.page_tokens));
  if (p.head_reduce == HeadReduce::kNone && method != KvMethod::kQuest && method != KvMethod::kReuse &&
      method != KvMethod::kOracle)
    return error("head_reduce", "\"none\" (a choice per query head) is for quest, reuse and oracle; use mean or max");
  if (Uses(method, "dense_layers") && p.dense_layers < 0)
    return error("dense_layers", fmt::format("must be >= 0 layers; found {}", p.dense_layers));
  if (Uses(method, "decay") && !(p.decay > 0.0 && p.decay <= 1.0))
    return error("decay", fmt::format("must lie in (0, 1] (1: a plain sum); found {:g}", p.decay));
  if (Uses(method, "rerank_period") && p.rerank_period < 1)
    return error("rerank_period", fmt::format("must be >= 1 token; found {}", p.rerank_period));
  if (Uses(method, "spread") && !(p.spread >= 1.0 && std::isfinite(p.spread)))
    return error("spread", fmt::format("must be >= 1 (the first layer's share over the last's); found {:g}", p.spread));
  if (Uses(method, "layer_weight") && !(std::isfinite(p.layer_weight) && (p.layer_weight >= 0.0 || p.layer_weight == -1.0)))
    return error("layer_weight", fmt::format("must be >= 0 (or -1 for 1 + depth); found {:g}", p.layer_weight));
  if (Uses(method, "alpha") && !(p.alpha >= 0.0 && p.alpha <= 1.0))
    return error("alpha", fmt::format("must lie in [0, 1] (the share of a head's uniform budget it is guaranteed); "
                                      "found {:g}", p.alpha));
  if (Uses(method, "floor") && !(p.floor >= 0.0 && p.floor <= 1.0))
    return error("floor", fmt::format("must lie in [0, 1] (the share of a head's uniform budget it keeps); found {:g}",
                                      p.floor));
  if (p.head_budgets == HeadBudgets::kAdaptive && !config.per_head)
    return error("head_budgets", "\"adaptive\" (AdaKV) splits a layer's budget over its KV heads' own tables; set "
                                 "per_head true");
  if (Uses(method, "gamma") && !(p.gamma >= 0.0 && std::isfinite(p.gamma)))
    return error("gamma", fmt::format("must be a finite number >= 0 (the variance's weight); found {:g}", p.gamma));
  for (const auto& [key, tau] : {std::pair<const char*, double>{"tau1", p.tau1}, {"tau2", p.tau2}}) {
    if (Uses(method, key) && !(tau > 0.0 && std::isfinite(tau)))
      return error(key, fmt::format("must be a finite number > 0 (the preference uses its inverse as exponent); found {:g}", tau));
  }
  for (const auto& [key, heads] : {std::pair<const char*, double>{"retrieval_heads", p.retrieval_heads},
                                    {"echo_heads", p.echo_heads},
                                    {"induction_heads", p.induction_heads}}) {
    const bool unset = std::string_view(key) == "retrieval_heads" && heads == -1;
    if (Uses(method, key) && !unset &&
        !(heads >= 0.0 && std::isfinite(heads) && (heads < 1.0 || heads == std::floor(heads))))
      return error(key, fmt::format("must be a head count (an integer >= 0) or a share of the KV heads in [0, 1); "
                                    "found {:g}",
                                    heads));
  }
  if (method == KvMethod::kRazor && !config.per_head)
    return error("per_head", "razor keeps every token in some KV heads and a window in the others: it needs one table "
                             "per KV head (per_head true)");
  if (Uses(method, "reselect_layer") && p.reselect_layer < -1)
    return error("reselect_layer", fmt::format("must be a layer index (or -1 for 13/32 of the depth); found {}",
                                               p.reselect_layer));
  if (method == KvMethod::kReuse && config.per_head)
    return error("per_head", "reuse shares each KV head's selection across a sequence's layers; set per_head false");
  if (method == KvMethod::kCumulative && config.per_head && p.mode == CumulativeMode::kMask)
    return error("per_head", "cumulative's mask mode reads one selection for all KV heads; per_head needs mode evict");
  if (Uses(method, "beta") && !(p.beta >= 1.0 && std::isfinite(p.beta)))
    return error("beta", fmt::format("must be >= 1 (the last layer gets 1/beta of the mean share); found {:g}", p.beta));

  // Protected tokens must leave room in an absolute budget (a fraction is checked as it
  // resolves: windows are clamped to the budget then).
  if (method != KvMethod::kFull && budget.is_tokens()) {
    const int32_t b = budget.tokens;
    if (Uses(method, "n_sink") && p.n_sink > b)
      return error("n_sink", fmt::format("{} sink tokens exceed the budget of {} tokens", p.n_sink, b));
    if (Uses(method, "recent") && p.recent >= 0 && static_cast<int64_t>(p.recent) + p.n_sink > b)
      return error("recent", fmt::format("a recent window of {} plus {} sink tokens exceeds the budget of {} tokens",
                                         p.recent, p.n_sink, b));
    if (Uses(method, "window") && p.obs_window >= b)
      return error("window", fmt::format("the observation window of {} tokens must be smaller than the budget of "
                                         "{} tokens so that earlier tokens can be selected",
                                         p.obs_window, b));
  }
  return Status::Ok();
}

}  // namespace kvsparse
