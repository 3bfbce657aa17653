// The sparsity methods, their parameters, and the factory that builds one KvPolicy per
// (sequence, layer). Each method's file in src/policy/ cites its paper and its defaults:
//
//   full           keep everything (never evicts)
//   streaming_llm  n_sink first tokens + the most recent ones            (n_sink 4)
//   h2o            accumulated attention heavy hitters + recent window   (recent_ratio 0.5)
//   tova           attention of the last query, averaged over heads      (no window)
//   scissorhands   fewest "unimportant" marks over a history of queries  (history 32, recent_ratio 0.1)
//   snapkv         observation-window votes, pooled, + the window        (window 32, kernel 7, max)
//   pyramidkv      SnapKV scoring, budgets decreasing with depth         (beta 20)
//   knorm          lowest key L2 norm                                    (no window)
//   random         uniform random subset, seeded                         (recent_ratio 0.5)
#pragma once

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
#include "kvsparse/status.h"

namespace kvsparse {

enum class KvMethod { kFull, kStreamingLlm, kH2O, kTova, kScissorhands, kSnapKv, kPyramidKv, kKNorm, kRandom };

std::string_view KvMethodName(KvMethod method);                  // "h2o"
std::optional<KvMethod> KvMethodFromName(std::string_view name);  // exact, lower case
std::string ValidKvMethodNames();                                 // "full, streaming_llm, ..."

// How a token's per-KV-head importance becomes one score (this increment keeps the same
// tokens for every head of a layer): the mean over heads, or the head that values it most.
enum class HeadReduce { kMean, kMax };
// SnapKV's smoothing of the votes over neighbouring tokens.
enum class VotePooling { kMax, kAvg };

// Parameters of every method in one flat struct; each method reads the fields named in
// KvMethodParamKeys (which are also its JSON keys) and ignores the rest.
struct KvMethodParams {
  int32_t n_sink = 0;           // "n_sink": first live tokens always kept
  int32_t recent = -1;          // "recent": newest tokens always kept; -1 = use recent_ratio
  double recent_ratio = 0.0;    // "recent_ratio": recent window as a fraction of the budget
  HeadReduce head_reduce = HeadReduce::kMean;  // "head_reduce": "mean" | "max"
  int32_t history_window = 32;  // "history_window": Scissorhands queries remembered (1..64)
  int32_t obs_window = 32;      // "window": SnapKV/PyramidKV observation window (queries)
  int32_t kernel = 7;           // "kernel": SnapKV pooling kernel (odd)
  VotePooling pooling = VotePooling::kMax;  // "pooling": "max" | "avg"
  bool decode_evict = false;    // "decode_evict": SnapKV/PyramidKV also evict while decoding
  double beta = 20.0;           // "beta": PyramidKV: last layer gets 1/beta of the mean share
};

// The paper defaults of `method` (see the table above).
KvMethodParams DefaultMethodParams(KvMethod method);
// JSON keys `method` accepts besides method/budget/kv_type.
std::span<const std::string_view> KvMethodParamKeys(KvMethod method);

std::string_view HeadReduceName(HeadReduce r);
std::string_view VotePoolingName(VotePooling p);

// Everything that configures one layer.
struct LayerKvConfig {
  KvMethod method = KvMethod::kFull;
  KvBudget budget = KvBudget::Fraction(1.0);  // ignored by kFull
  KvStorage kv_type = KvStorage::kF32;
  KvMethodParams params = DefaultMethodParams(KvMethod::kFull);
};

// Checks a layer's values (budget range, parameter ranges, sinks/windows that cannot fit
// an absolute budget). Messages name `layer` and the field.
Status ValidateLayerKvConfig(const LayerKvConfig& config, int layer);

// Builds the policy of `layer` (of n_layers; PyramidKV needs both) for one sequence.
// `seed` feeds the Random method; pass a different one per (sequence, layer).
StatusOr<std::unique_ptr<KvPolicy>> CreatePolicy(const LayerKvConfig& config, int layer, int n_layers,
                                                 uint64_t seed);

// PyramidKV (Cai et al., 2024): per-layer budgets (window included) that decrease
// linearly with depth and sum to n_layers * average_budget. Of the share above the window,
// S = average_budget - window, the last layer gets S / beta and the first 2S - S / beta.
// When average_budget <= window every layer gets average_budget.
std::vector<int32_t> PyramidBudgets(int n_layers, int32_t average_budget, int32_t window, double beta);
// PyramidBudgets(...)[layer] without allocating.
int32_t PyramidLayerBudget(int layer, int n_layers, int32_t average_budget, int32_t window, double beta);

}  // namespace kvsparse
