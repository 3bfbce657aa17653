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
  bool warmup = true;                 // an untimed first repetition of every test
  int prefill_chunk = 512;            // tokens per Forward call when filling the depth / prompt
  KvStorage kv_storage = KvStorage::kF16;  // dense cache (ignored when kv_sparsity is set)
  // Set: run through the paged cache with these sparsity policies (each test restarts them).
  std::optional<KvSparsityConfig> kv_sparsity;
  bool kv_stats = false;  // keep the per-layer KV table of each test (SpeedResult::kv_stats_table)
  bool measure_bandwidth = true;
  double known_bandwidth_gbs = 0;  // > 0: use this read bandwidth instead of measuring it again
  // Fill the depth by appending random K/V straight into the cache (policies still trim after
  // every chunk, without attention observations) instead of running the prompt through the
  // model. Decode speed and memory do not depend on the cached values, and a 32K-token depth
  // then takes seconds instead of the quadratic dense prefill.
  bool synthetic_fill = false;
  // Time one decode step's attention over the cache as it stands after each tgN test
  // (SpeedResult::attention_ms_per_token), repeated this many times (0 = off).
  int attention_reps = 5;
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
  // Decode floor: a step takes at least max(bytes_per_token / read bandwidth, its arithmetic /
  // the measured peak of the instructions doing it); the limits are 1 / each, 0 when not measured.
  double bandwidth_limit_tokens_per_s = 0;  // read bandwidth / bytes_per_token
  // tgN: 1 / (attention ops / its peak + weight ops / the int8 peak); ppN: the prompt's tokens over
  // its weight ops and causal attention at the same peaks (prefill's only limit).
  double compute_limit_tokens_per_s = 0;
  double limit_tokens_per_s = 0;            // the smaller of the two
  double attention_ops_per_token = 0;       // q.k and p.v, 2 per multiply-add, at the end of the test
  // KV cache at the end of the test's last repetition, and (sparse runs) the policy work of
  // the timed part: scoring + selection + compaction, per processed token.
  size_t kv_allocated_bytes = 0;
  size_t kv_live_bytes = 0;
  double policy_ms_per_token = 0;
  int64_t evictions = 0;           // eviction events per repetition (all layers)
  // Attention of one decode step over the final cache, all layers (ops::Attention alone,
  // without the policies' scoring pass, which policy_ms_per_token holds; over every live token,
  // so Quest's page selection is not applied). tgN only.
  double attention_ms_per_token = 0;
  size_t kv_peak_allocated_bytes = 0;  // paged cache: most KV bytes allocated at once since the run began
  // The dense f16 cache's bytes for the tokens of the sequence at the end of the test (the
  // reference of the "x% of dense f16"), as llama.cpp holds them: on sliding-window
  // models (gemma2/3) the sliding layers hold only their window (ModelConfig::DenseKvBytes).
  double dense_f16_kv_bytes = 0;
  size_t peak_rss_bytes = 0;       // the process's peak resident set so far (getrusage)
  std::string kv_stats_table;      // SparseKvController::FormatStats() (with kv_stats)
  // ppN with a controller: the prompt chunks' attention kernel time and (sparse prefill) the
  // estimates' time, all layers, per repetition; the share of causal (query, key) pairs the
  // sparse chunks computed (1 when dense).
  double prefill_attention_s = 0;
  double prefill_estimate_s = 0;
  double prefill_computed_share = 1;
};

struct SpeedReport {
  std::string isa;  // kernel family that ran (isa.h)
  std::string model_path;
  std::string model_desc;  // "llama 1.1B q8_0"
  double weight_bytes = 0;
  double active_weight_bytes_per_token = 0;  // Model::ActiveWeightBytesPerToken: what a decode step reads
  int64_t n_params = 0;
  int64_t active_params = 0;  // Model::ActiveParameterCount: the weights one token multiplies
  double read_bandwidth_gbs = 0;
  double f32_peak_gflops = 0;  // ops::MeasureComputePeak over the run's threads (with the bandwidth)
  double int8_peak_gops = 0;
  double bf16_peak_gflops = 0;  // 0 where the kernels have no bf16 dot products
  std::string attention_dots;  // what decode attention computes with: "int8 dot products", "f32 FMA", ...
  std::string kv_desc;  // "dense f16" or the sparsity config summary
  std::vector<SpeedResult> results;
};

// InvalidArgument for negative lengths or nothing to time (RunSpeedBench checks it too).
Status ValidateSpeedBenchConfig(const SpeedBenchConfig& config);
StatusOr<SpeedReport> RunSpeedBench(const Model& model, const SpeedBenchConfig& config);
std::string SpeedReportMarkdown(const SpeedReport& report);
std::string SpeedReportJson(const SpeedReport& report);
// The same tests run with a dense cache and with a sparse one, side by side: tokens/s,
// decode attention time and KV bytes, with the sparse/dense ratios.
// `base_label` / `label` name the two runs in the table (the dense cache against a sparse one by default).
// Prefill of `base` (dense prompt attention) against `other` (sparse prefill), test by test:
// throughput, the attention part (kernel time; the estimates' time beside it and in the
// ratio) and the share of (query, key) pairs computed.
std::string PrefillComparisonMarkdown(const SpeedReport& base, const SpeedReport& other, std::string_view base_label,
                                      std::string_view label);

std::string SpeedComparisonMarkdown(const SpeedReport& base, const SpeedReport& other, std::string_view base_label = "dense",
                                    std::string_view label = "sparse");

}  // namespace kvsparse
