// `kvsparse bench-serve`: what the serving runtime (Engine::ForwardBatch + Scheduler) delivers,
// in one run on one model.
//
// 1. Batched decode throughput against concurrency. For each stream count S, a fresh serving
//    runtime (paged cache + controller, the throughput KV config; dense "full" f16 by default)
//    gets S requests at once (prompt tokens each, greedy, no stop tokens, max_running S), and
//    Scheduler::Step runs on the calling thread until all have finished. Aggregate decode
//    tokens/s counts the tokens generated after the last request's first token, over the time
//    from then to the last token (every stream decoding, no prompt in the steps); TTFT and the
//    inter-token latencies come from each request's RequestStats. Beside it, the prefill
//    tokens/s of one prompt of prefill_tokens (Engine::Forward on a fresh sequence): the compute
//    ceiling batched decode approaches as S grows, since both run the same matmuls on S rows.
// 2. Capacity under a fixed KV memory budget. For each KV config, the scheduler's admission
//    rule gives the requests of depth + capacity_gen tokens that fit the budget at once
//    (floor((budget - ChunkReserveBytes) / SequenceReserveBytes)); that many sequences (at most
//    capacity_max) are filled with `depth` tokens of synthetic K/V through the controller, in
//    the config's prompt chunks (trimmed after every chunk as a chunked prefill would be; no
//    attention observations), then decode capacity_gen steps together, one row per sequence,
//    through Engine::ForwardBatch (then "admitted" is the admission rule; part 3 shows it live). The synthetic fill is what makes this part take seconds: a
//    real 8K-token prefill per request would take minutes on 2 cores, and decode speed and
//    memory do not depend on the cached values.
// 3. Latency under that memory pressure, for real: load_requests requests of load_prompt +
//    load_gen tokens submitted at once to a scheduler (max_running = load_requests) whose KV
//    budget admits load_dense_slots dense f16 requests at a time, once per capacity config on
//    that same budget. Sparse configs admit more of them at once, so fewer wait: TTFT and ITL
//    percentiles, most requests running at once, tokens/s over the whole run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

// One capacity configuration: "method[:budget][:kv_type]", e.g. "full:f16", "h2o:0.2:int8",
// "streaming_llm:512" (kv_type defaults to f16; full takes no budget).
struct ServeKvSpec {
  std::string method;
  std::string budget;   // empty for full
  std::string kv_type;  // f32, f16, int8 or int8_kivi
  std::string label() const;  // "full f16", "h2o 0.2 int8"
};
StatusOr<ServeKvSpec> ParseServeKvSpec(std::string_view text);
// Comma-separated specs (the --capacity-configs flag).
StatusOr<std::vector<ServeKvSpec>> ParseServeKvSpecs(std::string_view text);

struct ServeBenchConfig {
  int n_threads = 0;  // <= 0: all cores
  // ---- Part 1: batched decode throughput ----
  std::vector<int> streams = {1, 4, 16};
  int prompt_tokens = 128;
  int gen_tokens = 64;
  int step_tokens = 512;      // SchedulerOptions::step_tokens
  int prefill_tokens = 512;   // the prefill ceiling's prompt (0: not measured)
  // Paged-cache KV config of part 1; nullopt: "full" on f16 pages (dense, through the controller).
  std::optional<KvSparsityConfig> throughput_kv;
  // ---- Part 2: capacity under the KV budget ----
  double kv_memory_mib = 2048;  // the KV budget of every runtime (both parts)
  int depth = 8192;
  int capacity_gen = 32;
  int capacity_max = 64;        // most sequences one capacity run fills (admitted may be more)
  std::vector<ServeKvSpec> capacity_configs = {{"full", "", "f16"}, {"h2o", "0.2", "f16"}, {"h2o", "0.2", "int8"}};
  bool run_capacity = true;
  // ---- Part 3: latency under the memory pressure, per capacity config ----
  int load_requests = 12;
  int load_prompt = 128;
  int load_gen = 32;
  int load_dense_slots = 4;    // the part's KV budget: this many dense f16 requests at once
  bool run_load = true;
  uint64_t seed = 1;
  // Optional progress lines ("streams 4: ..."), e.g. to stderr.
  std::function<void(const std::string&)> progress;
};

struct ServeThroughputResult {
  int streams = 0;
  int prompt_tokens = 0;
  int gen_tokens = 0;
  int64_t generated_tokens = 0;      // all requests
  int64_t decode_window_tokens = 0;  // generated after the last request's first token
  double decode_window_s = 0;        // from the last first token to the last token
  double aggregate_decode_tps = 0;   // decode_window_tokens / decode_window_s
  double per_stream_decode_tps = 0;  // aggregate / streams (each stream gets one token a step)
  double ttft_p50_s = 0, ttft_p95_s = 0;
  double itl_p50_s = 0, itl_p95_s = 0;  // differences of RequestStats::token_times_s, all requests
  size_t kv_peak_bytes = 0;          // the cache's most bytes of pages in use
  size_t kv_reserved_bytes = 0;      // one request's admission reservation
  double wall_s = 0;                 // submit to the last token
  int64_t steps = 0;
  int64_t preemptions = 0;
  double ratio_to_prefill = 0;       // aggregate_decode_tps / prefill tokens/s (0 when not measured)
  int64_t pages_leaked = 0;          // pages in use after every request ended (must be 0)
};

struct ServeCapacityResult {
  std::string label;                 // "h2o 0.2 int8"
  std::string kv_desc;               // KvSparsityConfigSummary
  size_t reserve_bytes = 0;          // SequenceReserveBytes(depth, capacity_gen)
  size_t chunk_reserve_bytes = 0;    // ChunkReserveBytes of one prompt chunk (once, for all requests)
  int64_t admitted = 0;              // floor((budget - chunk_reserve_bytes) / reserve_bytes)
  int ran = 0;                       // sequences filled and decoded: min(admitted, capacity_max)
  double admitted_vs_first = 0;      // admitted / the first config's admitted
  double fill_s = 0;                 // the synthetic fill of every sequence
  int steps = 0;                     // decode steps timed
  double decode_tps = 0;             // ran * steps / time of the steps
  double decode_tps_vs_first = 0;
  double step_p50_s = 0, step_p95_s = 0;  // one step = one token of every sequence
  size_t kv_used_bytes = 0;          // pages in use after the last step
  size_t kv_peak_bytes = 0;          // most pages in use during fill and decode
  int32_t live_tokens_per_layer = 0; // sequence 0, layer 0, after the last step
  int64_t evicted_tokens = 0;        // all sequences and layers, fill and decode
  int64_t pages_leaked = 0;          // pages in use after every sequence was released (must be 0)
};

struct ServeLoadResult {
  std::string label;                 // "h2o 0.2 int8"
  int requests = 0;
  size_t reserve_bytes = 0;          // the scheduler's reservation per request
  int most_running = 0;              // requests running at once, at most
  double ttft_p50_s = 0, ttft_p95_s = 0;
  double itl_p50_s = 0, itl_p95_s = 0;
  double tokens_per_s = 0;           // generated tokens / wall
  double wall_s = 0;                 // submit to the last token
  int64_t preemptions = 0;
  size_t kv_peak_bytes = 0;
  int64_t pages_leaked = 0;          // must be 0
};

struct ServeBenchReport {
  std::string isa;
  std::string model_path;
  std::string model_desc;  // "llama 1.10B q8_0"
  int n_threads = 0;
  double kv_memory_mib = 0;
  // Part 1
  std::string throughput_kv_desc;
  int step_tokens = 0;
  int prefill_tokens = 0;
  double prefill_tps = 0;  // one prompt of prefill_tokens through Engine::Forward (0: not measured)
  std::vector<ServeThroughputResult> throughput;
  // Part 2
  int depth = 0;
  int capacity_gen = 0;
  int capacity_max = 0;
  std::vector<ServeCapacityResult> capacity;
  // Part 3
  int load_requests = 0, load_prompt = 0, load_gen = 0, load_dense_slots = 0;
  size_t load_budget_bytes = 0;
  std::vector<ServeLoadResult> load;
  double total_s = 0;
};

// InvalidArgument, naming the flag, for anything that cannot run (RunServeBench checks it too).
Status ValidateServeBenchConfig(const ServeBenchConfig& config);
StatusOr<ServeBenchReport> RunServeBench(const Model& model, const ServeBenchConfig& config);
std::string ServeBenchMarkdown(const ServeBenchReport& report);
std::string ServeBenchJson(const ServeBenchReport& report);

}  // namespace kvsparse
