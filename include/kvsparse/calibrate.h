// `kvsparse calibrate`: the cheapest per-layer KV configuration that keeps a user's accuracy on
// the user's own tasks and lengths, found by a search instead of copying a paper's uniform
// setting. Every candidate is a per-layer config file (kv_config.h) run by the bench's machinery
// (bench_runner.h), so what the search measured is exactly what `generate --kv-config`, `bench
// --kv-config` and `serve --kv-config` run.
//
// The search (docs/DESIGN.md "Calibration"):
//   1. reference: the full f16 cache on every cell (task x protocol x length); a candidate passes
//      a question cell when its accuracy >= keep x the reference's, a fidelity cell when its KL
//      to the full cache <= kl_max, and passes when it passes every cell. Cells run shortest
//      first and a candidate stops at its first failing cell (failures cost the least).
//   2. uniform baselines: each method at each budget of the ladder (ascending, stopping at the
//      first that passes), then cheaper KV types at that budget: the best uniform configuration of
//      each method, what the result is compared with.
//   3. sensitivity (cheap proxy: the shortest length, proxy_samples samples): one layer compressed
//      at a time, the others full; per (layer, method) the least budget of the ladder that still
//      passes (the lowest rung first, then a binary search over the rungs cheaper than the layer's
//      best so far).
//   4. allocation: each layer takes its cheapest passing (method, budget); a layer no method
//      passes alone stays dense.
//   5. refinement on every cell with the search samples, because the losses do not add: while
//      the combination fails, every compressed layer goes one rung up (past the top: dense);
//      then, largest saving first, each layer one rung down, and each layer to cheaper KV types,
//      kept where the combination still passes; until nothing changes or the time is up.
//  5b. budgets by length (with several lengths): per length, longest first, each layer's rung at
//      that length one down while that length's cells pass; the config then states
//      "budget_by_length" (kv_budget.h), which every request resolves by its own length.
//  5c. cumulative layers: the shared ranking's re-rank period doubled while the combination
//      passes (up to 8x); per-layer candidates run cumulative layers with "schedule": "none", so
//      the searched budgets are the layers' retentions.
//   6. held-out check: the reference, the calibrated config and the cheapest uniform baseline on
//      new samples (another seed, holdout_samples each), with 95% intervals.
// Evaluations are cached in the work folder (evaluations*.jsonl), so an interrupted run resumes
// without repeating one; --shard i/N runs a share of phases 1-3 (independent evaluations) and stops.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvsparse/bench_results.h"
#include "kvsparse/bench_tasks.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct CalibrateSpec {
  std::string model_path;
  std::string model_name;  // in the report (default: the file name)
  // Any bench task: built-in question tasks, user:FILE.jsonl, fidelity.
  std::vector<std::string> tasks = {"niah_single"};
  std::vector<int32_t> lengths = {1024};
  std::vector<BenchProtocol> protocols = {BenchProtocol::kQuestionLast};
  // Candidate methods, each with parameters as bench --methods takes them ("snapkv:window=16").
  // Default: query-agnostic (streaming_llm, h2o, tova) and query-aware (snapkv) methods that
  // compress under the prompt_end protocol.
  std::vector<std::string> methods = {"streaming_llm", "h2o", "tova", "snapkv"};
  // The budget ladder, fractions of the context or token counts; searched in ascending order.
  std::vector<std::string> budgets = {"0.01", "0.02", "0.05", "0.1", "0.2", "0.3", "0.5"};
  // Storage types, the first the search starts from; later ones are tried where the first passes.
  std::vector<std::string> kv_types = {"f16", "int8"};
  double keep = 0.99;    // question tasks: accuracy >= keep x the full cache's
  double kl_max = 0.05;  // fidelity: mean KL to the full cache (nats per token) <= kl_max
  // "memory": the fewest KV bytes stored; "speed": the fewest KV bytes read per decode step (methods
  // that keep every token and select, such as quest, then cost their budget, not the whole cache).
  std::string objective = "memory";
  double max_minutes = 0;  // 0: no limit; else refinement stops there and the best so far is checked
  int samples = 8;          // per cell, search phases
  int proxy_samples = 4;    // per cell, sensitivity pass
  int holdout_samples = 16;  // per cell, final check (another seed)
  uint64_t seed = 1;
  int n_threads = 0;
  int value_tokens = 3;
  std::vector<double> depths = {0.1, 0.3, 0.5, 0.7, 0.9};
  std::string prefill_eviction = "prompt_end";
  // Decode eviction interval of every candidate; 0: the least paper cadence of the methods a
  // candidate uses (PaperEvictInterval), else the config default.
  int evict_interval = 0;
  std::string fidelity_text, fidelity_tokens;
};

Status ValidateCalibrateSpec(const CalibrateSpec& spec);

struct CalibrateOptions {
  std::string work_dir;  // evaluations*.jsonl, configs/, kv-config.json, report.{json,md}, frontier.png
  BenchShard shard;      // count > 1: run this share of phases 1-3, then stop
  bool plots = true;     // frontier.png (python3-matplotlib; a warning without it)
  // After each evaluation: phase, evaluations done in it, its estimated total (at least done),
  // seconds since the start, and the seconds left before max_minutes (< 0: no limit).
  std::function<void(const std::string&, size_t, size_t, double, double)> progress;
};

struct CalibrateResult {
  KvSparsityConfig config;    // the calibrated config
  std::string config_path;    // work_dir/kv-config.json
  nlohmann::json report;      // what report.json holds
  bool sharded_only = false;  // a shard ran its share and stopped
};

StatusOr<CalibrateResult> RunCalibrate(const CalibrateSpec& spec, const CalibrateOptions& options);

// report.md from report.json.
std::string CalibrateReportMarkdown(const nlohmann::json& report);

}  // namespace kvsparse
