// The sparsity methods, their parameters, and the factory that builds one KvPolicy per
// (sequence, layer). Each method's file in src/policy/ cites its paper and its defaults:
//
//   full           keep everything (never evicts)
//   streaming_llm  n_sink first tokens + the most recent ones            (n_sink 4, cache_positions off)
//   h2o            accumulated attention heavy hitters + recent window   (recent_ratio 0.5, per KV head)
//   tova           attention of the last query, averaged over heads      (no window)
//   scissorhands   fewest "unimportant" marks over a history of queries  (history 32, recent_ratio 0.1)
//   snapkv         observation-window votes, pooled, + the window        (window 32, kernel 7, max, per KV head)
//   pyramidkv      SnapKV scoring, budgets decreasing with depth         (window 8, beta 20, per KV head)
//   knorm          lowest key L2 norm, prompt only                       (layers 0-1 whole, per KV head)
//   random         uniform random subset, seeded                         (recent_ratio 0.5)
//   quest          never evicts; each decode step reads the pages whose  (page_tokens = cache page,
//                  key min/max bound q·k highest, within the budget       layers 0-1 dense)
//   oracle         never evicts; each decode step each KV head reads its  (head_reduce mean, every layer)
//                  exact top-budget tokens by attention (the upper bound)
//   reuse          never evicts; selection layers attend densely and     (layers 0-1 dense,
//                  pick each KV head's top-budget tokens, which the       reselect at 13/32 depth)
//                  layers after them read (TidalDecode)
//   (h2o, snapkv and pyramidkv per-head layers take "head_budgets": "adaptive": AdaKV, floor 0.5)
//   cumulative     one ranking per sequence by attention summed over     (decay 0.99, re-rank every 16,
//                  layers; each layer keeps a share, nested by depth      linear 3:1 schedule, evict)
//   cake           SnapKV-like windowed scores (mean + gamma var), layer   (window 32, gamma 200, tau 1/1,
//                  budgets split by attention entropy x variance          avg pool 5, per KV head, cascading)
//   razor          retrieval heads (probe-heads' top scores) keep every   (15% of KV heads, 4 sinks,
//                  token, the other heads sinks + a recent window +       per KV head; RazorAttention)
//                  a compensation token (mean of the dropped K/V)
// Every selection keeps the token just appended (see selection.h).
#pragma once

#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/kv_budget.h"
#include "kvsparse/kv_cache.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/sparse_prefill.h"
#include "kvsparse/status.h"

namespace kvsparse {

enum class KvMethod {
  kFull,
  kStreamingLlm,
  kH2O,
  kTova,
  kScissorhands,
  kSnapKv,
  kPyramidKv,
  kKNorm,
  kRandom,
  kQuest,
  kOracle,
  kCumulative,
  kReuse,
  kRazor,
  kCake,
};

std::string_view KvMethodName(KvMethod method);                  // "h2o"
std::optional<KvMethod> KvMethodFromName(std::string_view name);  // exact, lower case
std::string ValidKvMethodNames();                                 // "full, streaming_llm, ..."

// How a token's per-KV-head importance becomes one score when a layer keeps the same tokens
// for every head (per_head false): the mean over heads, or the head that values it most.
// Quest folds a page's bounds with it twice: over the query heads of each kv head's group,
// then (shared layers) over kv heads; kNone ("none", Quest only) selects per query head.
enum class HeadReduce { kMean, kMax, kNone };
// SnapKV's smoothing of the votes over neighbouring tokens.
enum class VotePooling { kMax, kAvg };
// How `cumulative` spreads its mean retention over depth (cumulative.cc): linearly or along a
// half cosine from the first layer's share down to the last's, or each layer's budget as given.
enum class RetentionSchedule { kLinear, kCosine, kNone };
// What `cumulative` does with the tokens a layer stops keeping: free them (evict), or keep them
// in memory and skip reading them, so a re-rank can bring them back (mask).
enum class CumulativeMode { kEvict, kMask };
// How a per-head layer splits its budget over its KV heads: the same budget each, or AdaKV's
// adaptive split (adakv.h): one top over every head's scores, each head kept a floor.
enum class HeadBudgets { kUniform, kAdaptive };
// AdaKV's split rule: the reference's (AdaKV's snapkv_utils.py: head h keeps round((1 - alpha)
// c_h + floor(alpha B)) of its scored tokens, c_h its count in the unconstrained top over every
// head) or kvpress's (each head's best floor·B first, then the best of the rest together).
enum class AdaptiveRule { kReference, kKvpress };
// Where a layer's budget comes from: the method's own (its configured budget, or PyramidKV's
// schedule), or CAKE's allocation (cake.h): the layers' total split by each layer's attention.
enum class LayerBudgets { kUniform, kCake };
// Where CAKE's split puts the budget a layer cannot hold (more than the tokens it has seen):
// equally over the other layers (the reference's adjust_budgets, and its rounding remainder
// likewise), or by the other layers' preferences, repeated until nothing is capped (kvsparse's).
enum class CakeExcess { kEqual, kPreference };
// How reuse's selection layers choose (oracle.cc): the exact top-budget of their own dense
// attention (TidalDecode), or Quest's page bounds (quest_pages.h), reading only those pages.
enum class ReuseSelectionKind { kExact, kQuest };

// Parameters of every method in one flat struct; each method reads the fields named in
// KvMethodParamKeys (which are also its JSON keys) and ignores the rest.
struct KvMethodParams {
  int32_t n_sink = 0;           // "n_sink": first live tokens always kept
  int32_t recent = -1;          // "recent": newest tokens always kept; -1 = use recent_ratio
  double recent_ratio = 0.0;    // "recent_ratio": recent window as a fraction of the budget
  HeadReduce head_reduce = HeadReduce::kMean;  // "head_reduce": "mean" | "max" | "none" (quest)
  int32_t history_window = 32;  // "history_window": Scissorhands queries remembered (1..64)
  int32_t obs_window = 32;      // "window": SnapKV/PyramidKV observation window (queries)
  int32_t kernel = 7;           // "kernel": SnapKV pooling kernel (odd)
  VotePooling pooling = VotePooling::kMax;  // "pooling": "max" | "avg"
  bool decode_evict = false;    // "decode_evict": SnapKV/PyramidKV/KNorm also evict while decoding
  double beta = 20.0;           // "beta": PyramidKV: last layer gets 1/beta of the mean share
  int32_t page_tokens = 0;      // "page_tokens": Quest page in tokens; 0 = the cache's page size
  // "dense_layers": KNorm and Quest leave the model's first layers uncompressed (both papers: 2);
  // those layers run Full.
  int32_t dense_layers = 0;
  // "cache_positions": StreamingLLM only. RoPE positions are places in the cache (0..n-1, a new
  // token gets n) instead of places in the text; survivors are renumbered and their keys
  // re-rotated after every eviction (the paper's setting; see docs/DESIGN.md "Positions").
  bool cache_positions = false;
  // cumulative (cumulative.cc). Every cumulative layer of a config must agree on decay,
  // rerank_period and mode: they describe the one ranking the layers share.
  double decay = 0.99;          // "decay": per-token smoothing of the importance, in (0, 1] (1: a plain sum)
  int32_t rerank_period = 16;   // "rerank_period": tokens between two global re-ranks (>= 1)
  CumulativeMode mode = CumulativeMode::kEvict;  // "mode": "evict" | "mask"
  RetentionSchedule schedule = RetentionSchedule::kLinear;  // "schedule": "linear" | "cosine" | "none"
  double spread = 3.0;          // "spread": first layer's retention / last layer's (>= 1)
  double layer_weight = -1.0;   // "layer_weight": the layer's weight in the importance; -1: 1 + depth (1 to 2)
  // AdaKV (adakv.h) for H2O, SnapKV and PyramidKV per-head layers: "head_budgets" "adaptive"
  // gives the heads budgets that differ and sum to the layer's. "adaptive_rule" "reference"
  // (default): AdaKV's own, "alpha" (default 0.2, its LongBench scripts') of each head's uniform
  // share guaranteed; "kvpress": each head keeps at least "floor" (default 0.5) of its uniform
  // share of the scored tokens (also per-head cumulative's rule).
  HeadBudgets head_budgets = HeadBudgets::kUniform;
  AdaptiveRule adaptive_rule = AdaptiveRule::kReference;
  double alpha = 0.2;
  double floor = 0.5;
  // reuse (oracle.cc): the second token-selection layer; -1: 13/32 of the depth (TidalDecode's 13 of 32).
  int32_t reselect_layer = -1;  // "reselect_layer"
  ReuseSelectionKind selection = ReuseSelectionKind::kExact;  // "selection": "exact" | "quest"
  // razor (razor.cc, head_probe.h). "heads": a heads file (`kvsparse probe-heads`' JSON); empty:
  // the runtime probes the model when it starts. The KV heads that keep every token, ranked over
  // the whole model: the reference's two lists, the best "echo_heads" (0.01) by echo score and the
  // best "induction_heads" (0.14) by induction score; or, when "retrieval_heads" is set (>= 0),
  // the best that many by echo + induction (kvsparse's one list). Each a count (an integer >= 0)
  // or a share of the KV heads (< 1).
  // "layer_budgets": "cake" gives an evicting method CAKE's layer allocation (the `cake` method
  // always has it): the layers' total budget split by entropy^(1/tau1) x variance^(1/tau2) of
  // each layer's window attention.
  LayerBudgets layer_budgets = LayerBudgets::kUniform;
  // cake (cake.cc): the eviction indicator's variance weight and the preference's exponents.
  double gamma = 200.0;         // "gamma"
  double tau1 = 1.0;            // "tau1": spatial dispersion (entropy) exponent 1 / tau1
  double tau2 = 1.0;            // "tau2": temporal shift (variance) exponent 1 / tau2
  CakeExcess excess = CakeExcess::kEqual;  // "excess": "equal" (the reference) | "preference"
  // "query_head_scores": cake's indicator and preference per query head (the reference), or
  // (false) from the mean attention of each KV head's group.
  bool query_head_scores = true;
  std::string heads_file;
  // "compensation": razor's local heads summarize what they drop in one token, the mean of the
  // dropped keys and values, attended with the weight of the tokens it stands for (the paper's
  // Eq. 4-5); false drops them outright.
  bool compensation = true;
  double retrieval_heads = -1;  // -1: unset (the two lists)
  double echo_heads = 0.01;
  double induction_heads = 0.14;
  // The KV heads of this layer that keep every token (bit h = KV head h), set by
  // ResolveRetrievalHeads from the scores; razor policies refuse to run before that.
  uint64_t full_heads = 0;
  bool full_heads_resolved = false;
};

// The paper defaults of `method` (see the table above).
KvMethodParams DefaultMethodParams(KvMethod method);
// The decode eviction cadence of the method's paper, in steps: 1 for methods that evict at every
// generated token (H2O, TOVA, StreamingLLM, Scissorhands, Random, CAKE), 0 for methods that never
// evict while decoding by default (Full, SnapKV, PyramidKV, KNorm, Quest, Oracle). `bench` accuracy runs
// use it unless --evict-interval is given; serving keeps KvSparsityConfig::evict_interval.
int PaperEvictInterval(KvMethod method);
// The granularity of the method's reference code: true where it selects tokens per KV head
// (H2O, SnapKV, PyramidKV, KNorm), false where one selection serves every head (TOVA averages
// heads; StreamingLLM, Random and Full need no scores; Quest keeps every token and selects its
// pages per query head at decode time whatever the layout). LayerKvConfig::per_head's default.
bool DefaultPerHead(KvMethod method);
// JSON keys `method` accepts besides method/budget/kv_type.
std::span<const std::string_view> KvMethodParamKeys(KvMethod method);

std::string_view HeadReduceName(HeadReduce r);
std::string_view VotePoolingName(VotePooling p);
std::string_view RetentionScheduleName(RetentionSchedule s);
std::string_view CumulativeModeName(CumulativeMode m);
std::string_view HeadBudgetsName(HeadBudgets b);
std::string_view AdaptiveRuleName(AdaptiveRule r);
std::string_view LayerBudgetsName(LayerBudgets b);
std::string_view CakeExcessName(CakeExcess e);  // "equal", "preference"
std::string_view ReuseSelectionName(ReuseSelectionKind s);

// Everything that configures one layer.
struct LayerKvConfig {
  KvMethod method = KvMethod::kFull;
  KvBudget budget = KvBudget::Fraction(1.0);  // ignored by kFull
  KvStorage kv_type = KvStorage::kF32;
  KvMethodParams params = DefaultMethodParams(KvMethod::kFull);
  // One policy and one page table per KV head, so each head keeps its own tokens
  // (PagedKvCacheOptions::layer_per_head). False: every head keeps the same tokens.
  bool per_head = false;
  // How this layer attends prompt chunks (sparse_prefill.h); dense by default.
  PrefillSparsity prefill;
  // Set by a JSON "layers" entry naming this layer. On a model with sliding-window layers the
  // config's default (and the --kv-method flags) applies to the global layers only; a sliding
  // layer takes a method only from an explicit entry (ResolveSlidingLayers, runtime.h).
  bool named_by_layers_entry = false;
};

// Checks a layer's values (budget range, parameter ranges, sinks/windows that cannot fit
// an absolute budget). Messages name `layer` and the field.
Status ValidateLayerKvConfig(const LayerKvConfig& config, int layer);

// Builds the policy of `layer` (of n_layers; PyramidKV needs both) for one sequence.
// `seed` feeds the Random method; pass a different one per (sequence, layer).
// `kv_head`: the KV head a per-head layer's policy serves (razor treats its heads differently).
StatusOr<std::unique_ptr<KvPolicy>> CreatePolicy(const LayerKvConfig& config, int layer, int n_layers,
                                                 uint64_t seed, int kv_head = 0);

// Cross-layer methods (cumulative, reuse, cake): the layers of one sequence share state. After
// building or cloning the policies of a sequence, the controller passes them here: one per layer
// in depth order (head 0 of a per-head layer), and every policy of the sequence (all heads);
// methods without cross-layer state ignore the call. Without all_policies: the layers' are all.
void LinkSequencePolicies(std::span<KvPolicy* const> layer_policies, std::span<KvPolicy* const> all_policies = {});

// `cumulative`'s budget for `layer`: the config's budget is the mean over the model's layers;
// the schedule spreads it from spread:1 (first layer : last) with CumulativeSpread's spread.
KvBudget CumulativeLayerBudget(const KvBudget& mean_budget, const KvMethodParams& params, int layer, int n_layers);
// The spread the schedule uses: params.spread, lowered for a fraction budget m above 1/2 to
// 1 / (2m - 1), the most that keeps the first layer's share 2 s m / (1 + s) within the whole
// context, so the layers still average m (a larger spread would cap the first layer and give a
// lower mean). DescribeLayer reports a lowered spread. Token budgets are not lowered: they
// resolve against the tokens seen, as every method's do.
double CumulativeSpread(const KvBudget& mean_budget, const KvMethodParams& params);

// PyramidKV (Cai et al., 2024): per-layer budgets (window included) that decrease
// linearly with depth and sum to n_layers * average_budget. Of the share above the window,
// S = average_budget - window, the last layer gets S / beta and the first 2S - S / beta, the
// first clamped to what n_seen tokens fill (KVCache-Factory's rule, see pyramidkv.cc). When
// average_budget <= window, n_seen <= average_budget or n_seen < 2S every layer gets
// average_budget.
std::vector<int32_t> PyramidBudgets(int n_layers, int32_t average_budget, int32_t window, double beta,
                                    int32_t n_seen = INT32_MAX);
// PyramidBudgets(...)[layer] without allocating.
int32_t PyramidLayerBudget(int layer, int n_layers, int32_t average_budget, int32_t window, double beta,
                           int32_t n_seen = INT32_MAX);

}  // namespace kvsparse
