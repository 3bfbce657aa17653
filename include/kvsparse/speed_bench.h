// llama-bench style speed measurement: prompt processing (ppN) and generation (tgN)
// at a chosen KV depth, next to the memory-bandwidth limit for decode.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct SpeedBenchConfig {
  std::vector<int> n_prompt = {512};  // ppN tests (0 entries skipped)
  std::vector<int> n_gen = {128};     // tgN tests
  std::vector<int> depths = {0};      // KV tokens present before timing starts
  int n_threads = 0;                  // <= 0: all cores
  int repetitions = 3;
  int prefill_chunk = 512;            // tokens per Forward call when filling the depth / prompt
  KvStorage kv_storage = KvStorage::kF16;  // dense cache (ignored when kv_sparsity is set)
  // Set: run through the paged cache with these sparsity policies (each test restarts them).
  std::optional<KvSparsityConfig> kv_sparsity;
  bool kv_stats = false;  // keep the per-layer KV table of each test (SpeedResult::kv_stats_table)
  bool measure_bandwidth = true;
};

struct SpeedResult {
  std::string test;      // "pp512", "tg128"
  int depth = 0;
  int n_tokens = 0;
  int n_threads = 0;
  double tokens_per_s_mean = 0;
  double tokens_per_s_stddev = 0;
  std::vector<double> samples_tokens_per_s;
  // Decode floor: bytes that must be read per generated token (weights + KV at this depth).
  double bytes_per_token = 0;
  double limit_tokens_per_s = 0;  // read bandwidth / bytes_per_token (0 when not measured)
  // KV cache at the end of the test's last repetition, and (sparse runs) the policy work of
  // the timed part: scoring + selection + compaction, per processed token.
  size_t kv_allocated_bytes = 0;
  size_t kv_live_bytes = 0;
  double policy_ms_per_token = 0;
  int64_t evictions = 0;           // eviction events per repetition (all layers)
  std::string kv_stats_table;      // SparseKvController::FormatStats() (with kv_stats)
};

struct SpeedReport {
  std::string model_path;
  std::string model_desc;  // "llama 1.1B q8_0"
  double weight_bytes = 0;
  int64_t n_params = 0;
  double read_bandwidth_gbs = 0;
  std::string kv_desc;  // "dense f16" or the sparsity config summary
  std::vector<SpeedResult> results;
};

StatusOr<SpeedReport> RunSpeedBench(const Model& model, const SpeedBenchConfig& config);
std::string SpeedReportMarkdown(const SpeedReport& report);
std::string SpeedReportJson(const SpeedReport& report);

}  // namespace kvsparse
