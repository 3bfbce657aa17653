// `kvsparse bench-serve`: batched decode throughput against concurrency through the Scheduler,
// and the requests a fixed KV budget admits (and how fast they decode) per KV config.
#include "kvsparse/serve_bench.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "bench/synthetic_fill.h"
#include "kvsparse/engine.h"
#include "kvsparse/isa.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/sparse_kv_controller.h"
#include "common/timing.h"

namespace kvsparse {
namespace {

constexpr double kMiB = 1048576.0;
// Engine::Forward and the scheduler never run prompt chunks above this.
constexpr int kMaxPromptChunk = 512;

// Linear interpolation between the closest ranks (numpy's default); 0 for no samples.
double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

std::vector<int32_t> RandomTokens(int n, int n_vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(n_vocab));
  return t;
}

size_t BudgetBytes(const ServeBenchConfig& config) { return static_cast<size_t>(config.kv_memory_mib * kMiB); }

std::string JoinInts(const std::vector<int>& v) {
  std::string s;
  for (int x : v) {
    if (!s.empty()) s += ',';  // (operator+ chains trip a GCC 12 -Wrestrict false positive)
    s += std::to_string(x);
  }
  return s;
}

void Progress(const ServeBenchConfig& config, const std::string& line) {
  if (config.progress) config.progress(line);
}

// The prefill ceiling: one prompt of n tokens through Engine::Forward on a fresh sequence,
// after an untimed short prompt that brings the weights into memory.
// Its own runtime (same KV config and threads as the stream runs), so their KV peaks exclude it.
StatusOr<double> MeasurePrefill(const Model& model, const KvSparsityConfig& kv_config, const ServeBenchConfig& config,
                                int n_threads) {
  const ModelConfig& c = model.config();
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime,
                       CreateServingRuntime(model, kv_config, BudgetBytes(config), n_threads, config.seed));
  Engine& engine = *runtime->engine;
  SparseKvController& controller = *runtime->controller();
  const int n = config.prefill_tokens;
  const uint64_t seed = config.seed;
  const int n_vocab = c.n_vocab;
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  {
    KVS_ASSIGN_OR_RETURN(int seq, controller.AcquireSequence());
    const std::vector<int32_t> warm = RandomTokens(16, n_vocab, seed + 101);
    const Status s = engine.Forward(seq, warm.data(), static_cast<int32_t>(warm.size()), 0, logits.data());
    KVS_RETURN_IF_ERROR(controller.ReleaseSequence(seq));
    KVS_RETURN_IF_ERROR(s);
  }
  if (n <= 0) return 0.0;
  KVS_ASSIGN_OR_RETURN(int seq, controller.AcquireSequence());
  const std::vector<int32_t> prompt = RandomTokens(n, n_vocab, seed + 103);
  const auto t0 = Clock::now();
  const Status s = engine.Forward(seq, prompt.data(), n, 0, logits.data());
  const double secs = Seconds(t0, Clock::now());
  KVS_RETURN_IF_ERROR(controller.ReleaseSequence(seq));
  if (!s.ok()) return Status(s.code(), fmt::format("the {}-token prefill ceiling: {}", n, s.message()));
  return n / secs;
}

// n greedy requests of `prompt` random tokens + `gen` submitted at once, the scheduler stepped
// on this thread until every one has finished (each must end by length).
struct Driven {
  std::vector<double> ttft, itl;     // every request's TTFT; every gap between two of its tokens
  Clock::time_point t0, all_started, end;
  int64_t generated_at_start = 0;    // generated tokens when every request had its first
  int most_running = 0;
};

StatusOr<Driven> Drive(Scheduler& scheduler, const Model& model, int n, int prompt, int gen, uint64_t seed,
                       const std::string& what) {
  Driven d;
  std::vector<std::shared_ptr<RequestHandle>> handles;
  d.t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    GenerationRequest request;
    request.prompt = RandomTokens(prompt, model.config().n_vocab, seed * 1000003 + static_cast<uint64_t>(i));
    request.max_tokens = gen;
    request.sampling.temperature = 0;  // greedy
    request.sampling.repeat_penalty = 1.0f;
    KVS_ASSIGN_OR_RETURN(std::shared_ptr<RequestHandle> h, scheduler.Submit(std::move(request)));
    handles.push_back(std::move(h));
  }
  bool all_started = false;
  d.all_started = d.end = d.t0;
  for (;;) {
    const bool progressed = scheduler.Step();
    const auto now = Clock::now();
    d.most_running = std::max(d.most_running, scheduler.Stats().running);
    if (!all_started) {
      all_started = std::all_of(handles.begin(), handles.end(),
                                [](const auto& h) { return h->finished() || h->stats().ttft_s >= 0; });
      if (all_started) {
        d.all_started = now;
        d.generated_at_start = scheduler.Stats().generated_tokens;
      }
    }
    if (std::all_of(handles.begin(), handles.end(), [](const auto& h) { return h->finished(); })) {
      d.end = now;
      break;
    }
    if (!progressed) return InternalError(fmt::format("{}: the scheduler stopped making progress", what));
  }
  for (const auto& h : handles) {
    if (h->finish_reason() != FinishReason::kLength) {
      return InternalError(fmt::format("{}: request {} ended as '{}' instead of 'length': {}", what, h->id(),
                                       FinishReasonName(h->finish_reason()), h->error().ToString()));
    }
    const RequestStats st = h->stats();
    d.ttft.push_back(st.ttft_s);
    for (size_t i = 1; i < st.token_times_s.size(); ++i) d.itl.push_back(st.token_times_s[i] - st.token_times_s[i - 1]);
  }
  return d;
}

// Part 1 for one stream count, on a fresh runtime.
StatusOr<ServeThroughputResult> RunStreams(const Model& model, const KvSparsityConfig& kv_config,
                                           const ServeBenchConfig& config, int n_threads, int streams) {
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime,
                       CreateServingRuntime(model, kv_config, BudgetBytes(config), n_threads, config.seed));
  SchedulerOptions options;
  options.max_running = streams;
  options.step_tokens = config.step_tokens;
  options.max_queue = std::max(streams, 64);
  options.max_context = config.prompt_tokens + config.gen_tokens;
  Scheduler scheduler(runtime->engine.get(), runtime->controller(), options);

  ServeThroughputResult r;
  r.streams = streams;
  r.prompt_tokens = config.prompt_tokens;
  r.gen_tokens = config.gen_tokens;
  r.kv_reserved_bytes = scheduler.ReserveBytes(config.prompt_tokens, config.gen_tokens);
  KVS_ASSIGN_OR_RETURN(Driven d, Drive(scheduler, model, streams, config.prompt_tokens, config.gen_tokens, config.seed,
                                       fmt::format("streams {}", streams)));
  const SchedulerStats stats = scheduler.Stats();
  r.generated_tokens = stats.generated_tokens;
  r.decode_window_tokens = stats.generated_tokens - d.generated_at_start;
  r.decode_window_s = Seconds(d.all_started, d.end);
  r.aggregate_decode_tps = r.decode_window_s > 0 ? r.decode_window_tokens / r.decode_window_s : 0;
  r.per_stream_decode_tps = r.aggregate_decode_tps / streams;
  r.ttft_p50_s = Percentile(d.ttft, 50);
  r.ttft_p95_s = Percentile(d.ttft, 95);
  r.itl_p50_s = Percentile(d.itl, 50);
  r.itl_p95_s = Percentile(d.itl, 95);
  r.kv_peak_bytes = runtime->paged_cache()->budget().peak_bytes();
  r.wall_s = Seconds(d.t0, d.end);
  r.steps = stats.steps;
  r.preemptions = stats.preemptions;
  r.pages_leaked = runtime->paged_cache()->pages_in_use();
  return r;
}

// Part 3 for one KV config: every request at once, on a budget of budget_bytes.
StatusOr<ServeLoadResult> RunLoad(const Model& model, const ServeKvSpec& spec, const ServeBenchConfig& config,
                                  int n_threads, size_t budget_bytes) {
  KVS_ASSIGN_OR_RETURN(KvSparsityConfig kv_config,
                       KvSparsityConfigFromFlags(spec.method, spec.budget, spec.kv_type, model.config().n_layers));
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime,
                       CreateServingRuntime(model, kv_config, budget_bytes, n_threads, config.seed));
  SchedulerOptions options;
  options.max_running = config.load_requests;
  options.step_tokens = config.step_tokens;
  options.max_queue = config.load_requests;
  options.max_context = config.load_prompt + config.load_gen;
  Scheduler scheduler(runtime->engine.get(), runtime->controller(), options);
  ServeLoadResult r;
  r.label = spec.label();
  r.requests = config.load_requests;
  r.reserve_bytes = scheduler.ReserveBytes(config.load_prompt, config.load_gen);
  KVS_ASSIGN_OR_RETURN(Driven d, Drive(scheduler, model, config.load_requests, config.load_prompt, config.load_gen,
                                       config.seed + 7, "load " + r.label));
  const SchedulerStats stats = scheduler.Stats();
  r.most_running = d.most_running;
  r.ttft_p50_s = Percentile(d.ttft, 50);
  r.ttft_p95_s = Percentile(d.ttft, 95);
  r.itl_p50_s = Percentile(d.itl, 50);
  r.itl_p95_s = Percentile(d.itl, 95);
  r.wall_s = Seconds(d.t0, d.end);
  r.tokens_per_s = r.wall_s > 0 ? stats.generated_tokens / r.wall_s : 0;
  r.preemptions = stats.preemptions;
  r.kv_peak_bytes = runtime->paged_cache()->budget().peak_bytes();
  r.pages_leaked = runtime->paged_cache()->pages_in_use();
  return r;
}

// Part 2 for one KV config, on a fresh runtime.
StatusOr<ServeCapacityResult> RunCapacity(const Model& model, const ServeKvSpec& spec, const ServeBenchConfig& config,
                                          int n_threads) {
  const ModelConfig& c = model.config();
  KVS_ASSIGN_OR_RETURN(KvSparsityConfig kv_config,
                       KvSparsityConfigFromFlags(spec.method, spec.budget, spec.kv_type, c.n_layers));
  const size_t budget = BudgetBytes(config);
  // The engine comes with it: it gives the controller the model's RoPE (StreamingLLM's cache positions).
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime,
                       CreateServingRuntime(model, kv_config, budget, n_threads, config.seed));
  SparseKvController& controller = *runtime->controller();
  PagedKvCache& cache = *runtime->paged_cache();
  Engine& engine = *runtime->engine;
  ServeCapacityResult r;
  r.label = spec.label();
  r.kv_desc = KvSparsityConfigSummary(controller.config());
  r.reserve_bytes = controller.SequenceReserveBytes(config.depth, config.capacity_gen);
  // As the scheduler admits: every reservation, and room for one prompt chunk on top.
  r.chunk_reserve_bytes =
      controller.ChunkReserveBytes(std::min({kv_config.prefill_chunk, config.step_tokens, config.depth}));
  r.admitted = r.reserve_bytes > 0 && budget > r.chunk_reserve_bytes
                   ? static_cast<int64_t>((budget - r.chunk_reserve_bytes) / r.reserve_bytes)
                   : 0;
  r.ran = static_cast<int>(std::min<int64_t>(r.admitted, config.capacity_max));
  if (r.ran == 0) return r;
  std::vector<int> seqs;
  Status status = Status::Ok();
  const auto fill0 = Clock::now();
  for (int i = 0; i < r.ran && status.ok(); ++i) {
    auto seq = controller.AcquireSequence();
    if (!seq.ok()) {
      status = seq.status();
      break;
    }
    seqs.push_back(*seq);
    status = SyntheticFill(cache, &controller, *seq, config.depth,
                           std::clamp(controller.prefill_chunk(), 1, kMaxPromptChunk));
  }
  r.fill_s = Seconds(fill0, Clock::now());
  std::vector<double> step_s;
  if (status.ok()) {
    std::vector<int32_t> tokens(seqs.size());
    std::vector<float> logits(seqs.size() * static_cast<size_t>(c.n_vocab));  // [ran, n_vocab]
    std::vector<BatchSequence> batch(seqs.size());
    std::mt19937_64 rng(config.seed + 7);
    for (int step = 0; step < config.capacity_gen && status.ok(); ++step) {
      for (size_t i = 0; i < seqs.size(); ++i) {
        tokens[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.n_vocab));
        BatchSequence& b = batch[i];
        b.seq = seqs[i];
        b.tokens = &tokens[i];
        b.n = 1;
        b.pos0 = config.depth + step;
        b.phase = EvictionPoint::kDecodeStep;
        b.logits = logits.data() + i * static_cast<size_t>(c.n_vocab);
      }
      const auto t0 = Clock::now();
      status = engine.ForwardBatch(batch);
      step_s.push_back(Seconds(t0, Clock::now()));
    }
  }
  r.kv_used_bytes = cache.budget().used_bytes();
  r.kv_peak_bytes = cache.budget().peak_bytes();
  if (!seqs.empty()) r.live_tokens_per_layer = cache.NumTokens(seqs[0], 0);
  for (const SparseKvLayerStats& l : controller.layer_stats()) r.evicted_tokens += l.evicted_tokens;
  for (int seq : seqs) KVS_RETURN_IF_ERROR(controller.ReleaseSequence(seq));
  r.pages_leaked = cache.pages_in_use();
  if (!status.ok()) {
    return Status(status.code(), fmt::format("capacity run '{}' ({} sequences of {} tokens): {}", r.label, r.ran,
                                             config.depth, status.message()));
  }
  double total = 0;
  for (double s : step_s) total += s;
  r.steps = static_cast<int>(step_s.size());
  r.decode_tps = total > 0 ? r.ran * static_cast<double>(r.steps) / total : 0;
  r.step_p50_s = Percentile(step_s, 50);
  r.step_p95_s = Percentile(step_s, 95);
  return r;
}

}  // namespace

std::string ServeKvSpec::label() const {
  return budget.empty() ? fmt::format("{} {}", method, kv_type) : fmt::format("{} {} {}", method, budget, kv_type);
}

StatusOr<ServeKvSpec> ParseServeKvSpec(std::string_view text) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t colon = text.find(':', start);
    parts.emplace_back(text.substr(start, colon == std::string_view::npos ? std::string_view::npos : colon - start));
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  const auto bad = [&](const std::string& why) {
    return InvalidArgumentError(fmt::format("--capacity-configs: '{}': {} (expected method[:budget][:kv_type], e.g. "
                                            "full:f16 or h2o:0.2:int8)",
                                            text, why));
  };
  if (parts.size() > 3) return bad("too many ':' fields");
  ServeKvSpec spec;
  spec.method = parts[0];
  spec.kv_type = "f16";
  if (parts.size() == 3) {
    spec.budget = parts[1];
    spec.kv_type = parts[2];
  } else if (parts.size() == 2) {
    (KvStorageFromName(parts[1]) ? spec.kv_type : spec.budget) = parts[1];
  }
  if (spec.method.empty()) return bad("no method");
  if (spec.kv_type.empty()) return bad("empty kv type");
  // The method, budget and type checks of --kv-method/--kv-budget/--kv-type.
  auto checked = KvSparsityConfigFromFlags(spec.method, spec.budget, spec.kv_type, 1);
  if (!checked.ok()) return bad(checked.status().message());
  return spec;
}

StatusOr<std::vector<ServeKvSpec>> ParseServeKvSpecs(std::string_view text) {
  std::vector<ServeKvSpec> specs;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    const size_t len = comma == std::string_view::npos ? std::string_view::npos : comma - start;
    const std::string_view item = text.substr(start, len);
    if (!item.empty()) {
      KVS_ASSIGN_OR_RETURN(ServeKvSpec spec, ParseServeKvSpec(item));
      specs.push_back(std::move(spec));
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (specs.empty()) return InvalidArgumentError("--capacity-configs: no configuration given");
  return specs;
}

Status ValidateServeBenchConfig(const ServeBenchConfig& config) {
  if (config.streams.empty()) {
    return InvalidArgumentError("--streams: give at least one stream count (e.g. 1,4,16)");
  }
  for (int s : config.streams) {
    if (s <= 0) {
      return InvalidArgumentError(fmt::format("--streams: stream counts must be >= 1, found {} in {}", s,
                                              JoinInts(config.streams)));
    }
  }
  const auto positive = [](const char* flag, int64_t v) -> Status {
    if (v <= 0) return InvalidArgumentError(fmt::format("{}: must be >= 1, found {}", flag, v));
    return Status::Ok();
  };
  KVS_RETURN_IF_ERROR(positive("--prompt", config.prompt_tokens));
  KVS_RETURN_IF_ERROR(positive("--gen", config.gen_tokens));
  KVS_RETURN_IF_ERROR(positive("--depth", config.depth));
  KVS_RETURN_IF_ERROR(positive("--capacity-gen", config.capacity_gen));
  KVS_RETURN_IF_ERROR(positive("--capacity-max", config.capacity_max));
  KVS_RETURN_IF_ERROR(positive("--step-tokens", config.step_tokens));
  if (!(config.kv_memory_mib > 0) || !std::isfinite(config.kv_memory_mib)) {
    return InvalidArgumentError(
        fmt::format("--kv-memory: the KV budget in MiB must be > 0, found {}", config.kv_memory_mib));
  }
  if (config.prefill_tokens < 0) {
    return InvalidArgumentError(fmt::format("--prefill: must be >= 0 (0 skips the prefill ceiling), found {}",
                                            config.prefill_tokens));
  }
  if (config.step_tokens > Engine::kMaxBatchRows) {
    return InvalidArgumentError(
        fmt::format("--step-tokens: at most {} rows fit one step, found {}", Engine::kMaxBatchRows, config.step_tokens));
  }
  if (config.capacity_max > Engine::kMaxBatchRows) {
    return InvalidArgumentError(fmt::format("--capacity-max: at most {} sequences decode in one step, found {}",
                                            Engine::kMaxBatchRows, config.capacity_max));
  }
  if (static_cast<int64_t>(config.prompt_tokens) + config.gen_tokens > INT32_MAX / 2 ||
      static_cast<int64_t>(config.depth) + config.capacity_gen > INT32_MAX / 2) {
    return InvalidArgumentError("--prompt/--gen/--depth/--capacity-gen: lengths too large");
  }
  if (config.run_load) {
    KVS_RETURN_IF_ERROR(positive("--load-requests", config.load_requests));
    KVS_RETURN_IF_ERROR(positive("--load-prompt", config.load_prompt));
    KVS_RETURN_IF_ERROR(positive("--load-gen", config.load_gen));
    KVS_RETURN_IF_ERROR(positive("--load-slots", config.load_dense_slots));
    if (config.load_requests > Engine::kMaxBatchRows) {
      return InvalidArgumentError(fmt::format("--load-requests: at most {} requests run in one step, found {}",
                                              Engine::kMaxBatchRows, config.load_requests));
    }
    if (static_cast<int64_t>(config.load_prompt) + config.load_gen > INT32_MAX / 2) {
      return InvalidArgumentError("--load-prompt/--load-gen: lengths too large");
    }
  }
  if (config.run_capacity && config.capacity_configs.empty()) {
    return InvalidArgumentError("--capacity-configs: no configuration given");
  }
  if (config.throughput_kv) KVS_RETURN_IF_ERROR(ValidateKvSparsityConfig(*config.throughput_kv));
  return Status::Ok();
}

StatusOr<ServeBenchReport> RunServeBench(const Model& model, const ServeBenchConfig& config) {
  KVS_RETURN_IF_ERROR(ValidateServeBenchConfig(config));
  for (const ServeKvSpec& spec : config.capacity_configs) {
    KVS_RETURN_IF_ERROR(ParseServeKvSpec(spec.method + (spec.budget.empty() ? "" : ":" + spec.budget) + ":" +
                                         spec.kv_type)
                            .status());
  }
  const auto start = Clock::now();
  const ModelConfig& c = model.config();
  const int n_threads = config.n_threads > 0 ? config.n_threads : omp_get_num_procs();
  ServeBenchReport report;
  report.isa = IsaName(ActiveIsa());
  report.model_path = model.path();
  report.model_desc = model.Summary();
  report.n_threads = n_threads;
  report.kv_memory_mib = config.kv_memory_mib;
  report.step_tokens = config.step_tokens;
  report.prefill_tokens = config.prefill_tokens;
  report.depth = config.depth;
  report.capacity_gen = config.capacity_gen;
  report.capacity_max = config.capacity_max;

  KvSparsityConfig throughput_kv;
  if (config.throughput_kv) {
    throughput_kv = *config.throughput_kv;
    if (static_cast<int>(throughput_kv.layers.size()) != c.n_layers) {
      return InvalidArgumentError(fmt::format("the throughput KV config has {} layers; the model has {}",
                                              throughput_kv.layers.size(), c.n_layers));
    }
  } else {
    KVS_ASSIGN_OR_RETURN(throughput_kv, KvSparsityConfigFromFlags("full", "", "f16", c.n_layers));
  }
  {
    KvSparsityConfig resolved = throughput_kv;  // as it runs: sliding layers windowed
    KVS_RETURN_IF_ERROR(ResolveSlidingLayers(model, &resolved));
    report.throughput_kv_desc = KvSparsityConfigSummary(resolved);
  }

  // Every stream count must be admitted at once, or the figures would mix in queueing.
  {
    const KvGeometry geometry = ModelKvGeometry(model, /*with_windows=*/false);
    KVS_ASSIGN_OR_RETURN(SparseKvSetup probe, CreateServingKv(geometry, throughput_kv, BudgetBytes(config)));
    const size_t reserve = probe.controller->SequenceReserveBytes(config.prompt_tokens, config.gen_tokens);
    const size_t chunk = probe.controller->ChunkReserveBytes(
        std::min({throughput_kv.prefill_chunk, config.step_tokens, config.prompt_tokens}));
    const int most = *std::max_element(config.streams.begin(), config.streams.end());
    if (static_cast<double>(reserve) * most + static_cast<double>(chunk) > static_cast<double>(BudgetBytes(config))) {
      return InvalidArgumentError(fmt::format(
          "--streams {}: {} requests of {} + {} tokens reserve {:.1f} MiB of KV pages, above --kv-memory {} MiB; "
          "raise --kv-memory or lower --streams/--prompt/--gen",
          JoinInts(config.streams), most, config.prompt_tokens, config.gen_tokens, reserve * most / kMiB,
          config.kv_memory_mib));
    }
  }

  // The prefill ceiling first: its untimed warm-up also brings the weights into memory.
  KVS_ASSIGN_OR_RETURN(report.prefill_tps, MeasurePrefill(model, throughput_kv, config, n_threads));
  if (config.prefill_tokens > 0) {
    Progress(config,
             fmt::format("prefill ceiling: {} tokens at {:.1f} t/s", config.prefill_tokens, report.prefill_tps));
  }
  for (const int s : config.streams) {
    KVS_ASSIGN_OR_RETURN(ServeThroughputResult r, RunStreams(model, throughput_kv, config, n_threads, s));
    Progress(config, fmt::format("streams {}: {:.1f} decode t/s aggregate, TTFT p50 {:.2f} s ({:.1f} s)", s,
                                 r.aggregate_decode_tps, r.ttft_p50_s, r.wall_s));
    report.throughput.push_back(r);
  }
  for (ServeThroughputResult& r : report.throughput) {
    r.ratio_to_prefill = report.prefill_tps > 0 ? r.aggregate_decode_tps / report.prefill_tps : 0;
  }

  if (config.run_capacity) {
    for (const ServeKvSpec& spec : config.capacity_configs) {
      KVS_ASSIGN_OR_RETURN(ServeCapacityResult r, RunCapacity(model, spec, config, n_threads));
      Progress(config, fmt::format("capacity {}: {} admitted, {} ran, {:.1f} decode t/s (fill {:.1f} s)", r.label,
                                   r.admitted, r.ran, r.decode_tps, r.fill_s));
      report.capacity.push_back(r);
    }
    const ServeCapacityResult& first = report.capacity.front();
    for (ServeCapacityResult& r : report.capacity) {
      r.admitted_vs_first = first.admitted > 0 ? static_cast<double>(r.admitted) / first.admitted : 0;
      r.decode_tps_vs_first = first.decode_tps > 0 ? r.decode_tps / first.decode_tps : 0;
    }
  }
  if (config.run_load && !config.capacity_configs.empty()) {
    // The budget: load_dense_slots dense f16 requests at once (their reservations; dense
    // layers need no chunk reserve).
    KVS_ASSIGN_OR_RETURN(KvSparsityConfig dense, KvSparsityConfigFromFlags("full", "", "f16", c.n_layers));
    const KvGeometry geometry = ModelKvGeometry(model, /*with_windows=*/false);
    KVS_ASSIGN_OR_RETURN(SparseKvSetup probe, CreateServingKv(geometry, dense, size_t{1} << 30));
    report.load_requests = config.load_requests;
    report.load_prompt = config.load_prompt;
    report.load_gen = config.load_gen;
    report.load_dense_slots = config.load_dense_slots;
    report.load_budget_bytes = probe.controller->SequenceReserveBytes(config.load_prompt, config.load_gen) *
                               static_cast<size_t>(config.load_dense_slots);
    for (const ServeKvSpec& spec : config.capacity_configs) {
      KVS_ASSIGN_OR_RETURN(ServeLoadResult r, RunLoad(model, spec, config, n_threads, report.load_budget_bytes));
      Progress(config, fmt::format("load {}: at most {} running, TTFT p50 {:.2f} s p95 {:.2f} s, {:.1f} t/s ({:.1f} s)",
                                   r.label, r.most_running, r.ttft_p50_s, r.ttft_p95_s, r.tokens_per_s, r.wall_s));
      report.load.push_back(r);
    }
  }
  report.total_s = Seconds(start, Clock::now());
  return report;
}

std::string ServeBenchMarkdown(const ServeBenchReport& report) {
  std::string out;
  out += fmt::format("serving benchmark: model {} ({}), threads {}, kernels {}, KV budget {:g} MiB\n\n",
                     report.model_path, report.model_desc, report.n_threads, report.isa, report.kv_memory_mib);
  if (!report.throughput.empty()) {
    const ServeThroughputResult& f = report.throughput.front();
    out += fmt::format("Batched decode vs concurrency: `streams` requests submitted at once, prompt {} tokens, {} "
                       "generated each (greedy), continuous-batching scheduler (steps of up to {} rows), KV: {} "
                       "(paged).\n",
                       f.prompt_tokens, f.gen_tokens, report.step_tokens, report.throughput_kv_desc);
    if (report.prefill_tps > 0) {
      out += fmt::format("Prefill ceiling: one {}-token prompt at {:.1f} t/s (Engine::Forward on a fresh sequence, "
                         "same KV config and threads).\n",
                         report.prefill_tokens, report.prefill_tps);
    }
    out += "\n| streams | decode t/s (aggregate) | per stream t/s | vs prefill | TTFT p50 s | TTFT p95 s | "
           "ITL p50 ms | ITL p95 ms | KV MiB peak | wall s |\n";
    out += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const ServeThroughputResult& r : report.throughput) {
      out += fmt::format("| {} | {:.1f} | {:.2f} | {} | {:.2f} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n",
                         r.streams, r.aggregate_decode_tps, r.per_stream_decode_tps,
                         report.prefill_tps > 0 ? fmt::format("{:.2f}", r.ratio_to_prefill) : std::string("—"),
                         r.ttft_p50_s, r.ttft_p95_s, r.itl_p50_s * 1e3, r.itl_p95_s * 1e3, r.kv_peak_bytes / kMiB,
                         r.wall_s);
    }
    out += "\nAggregate decode t/s: tokens generated after the last request's first token, over the time from then "
           "to the last token. ITL: gaps between a request's tokens (prompt chunks of other requests included).\n";
  }
  if (!report.capacity.empty()) {
    const std::string& first = report.capacity.front().label;
    out += fmt::format("\nCapacity under a {:g} MiB KV budget: requests of {} context + {} generated tokens; admitted "
                       "= floor((budget - chunk) / the scheduler's reservation per request); the run fills min(admitted, {}) "
                       "sequences and decodes {} steps with all of them in each step (ForwardBatch).\n",
                       report.kv_memory_mib, report.depth, report.capacity_gen, report.capacity_max,
                       report.capacity_gen);
    out += fmt::format("The {}-token contexts are filled synthetically (random K/V appended through the controller in "
                       "prompt chunks, trimmed after each as a prefill would be): a real prefill of that length per "
                       "request would take minutes on 2 cores; decode speed and memory do not depend on the values.\n",
                       report.depth);
    out += "Admission reserves each request's pages between steps, plus once the pages of one prompt chunk held on "
           "top of a sparse budget until its eviction (chunk MiB).\n";
    out += fmt::format("\n| KV config | reserve MiB/request | chunk MiB | admitted | vs {} | ran | decode t/s (aggregate) | vs {} | "
                       "token latency p50 ms | p95 ms | KV MiB used | KV MiB peak | live tokens/layer |\n",
                       first, first);
    out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const ServeCapacityResult& r : report.capacity) {
      out += fmt::format("| {} | {:.2f} | {:.1f} | {} | {:.2f}× | {} | {:.1f} | {:.2f}× | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {} |\n",
                         r.label, r.reserve_bytes / kMiB, r.chunk_reserve_bytes / kMiB, r.admitted, r.admitted_vs_first, r.ran, r.decode_tps,
                         r.decode_tps_vs_first, r.step_p50_s * 1e3, r.step_p95_s * 1e3, r.kv_used_bytes / kMiB,
                         r.kv_peak_bytes / kMiB, r.live_tokens_per_layer);
    }
  }
  if (!report.load.empty()) {
    out += fmt::format("\nLatency under memory pressure: {} requests of {} prompt + {} generated tokens submitted at once; "
                       "KV budget {:.2f} MiB = {} dense f16 requests at a time; the scheduler admits what fits.\n",
                       report.load_requests, report.load_prompt, report.load_gen, report.load_budget_bytes / kMiB,
                       report.load_dense_slots);
    out += "\n| KV config | reserve KiB/request | most running | TTFT p50 s | TTFT p95 s | ITL p50 ms | ITL p95 ms | "
           "tokens/s (whole run) | wall s | preemptions |\n";
    out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const ServeLoadResult& r : report.load) {
      out += fmt::format("| {} | {:.1f} | {} | {:.2f} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {} |\n", r.label,
                         r.reserve_bytes / 1024.0, r.most_running, r.ttft_p50_s, r.ttft_p95_s, r.itl_p50_s * 1e3,
                         r.itl_p95_s * 1e3, r.tokens_per_s, r.wall_s, r.preemptions);
    }
  }
  out += fmt::format("\ntotal {:.1f} s\n", report.total_s);
  return out;
}

std::string ServeBenchJson(const ServeBenchReport& report) {
  nlohmann::json j;
  j["isa"] = report.isa;
  j["model"] = report.model_path;
  j["model_desc"] = report.model_desc;
  j["threads"] = report.n_threads;
  j["kv_memory_mib"] = report.kv_memory_mib;
  j["throughput_kv"] = report.throughput_kv_desc;
  j["step_tokens"] = report.step_tokens;
  j["prefill_tokens"] = report.prefill_tokens;
  j["prefill_tokens_per_s"] = report.prefill_tps;
  j["throughput"] = nlohmann::json::array();
  for (const ServeThroughputResult& r : report.throughput) {
    j["throughput"].push_back({{"streams", r.streams},
                               {"prompt_tokens", r.prompt_tokens},
                               {"gen_tokens", r.gen_tokens},
                               {"generated_tokens", r.generated_tokens},
                               {"decode_window_tokens", r.decode_window_tokens},
                               {"decode_window_s", r.decode_window_s},
                               {"aggregate_decode_tokens_per_s", r.aggregate_decode_tps},
                               {"per_stream_decode_tokens_per_s", r.per_stream_decode_tps},
                               {"decode_over_prefill", r.ratio_to_prefill},
                               {"ttft_p50_s", r.ttft_p50_s},
                               {"ttft_p95_s", r.ttft_p95_s},
                               {"itl_p50_s", r.itl_p50_s},
                               {"itl_p95_s", r.itl_p95_s},
                               {"kv_peak_bytes", r.kv_peak_bytes},
                               {"kv_reserved_bytes_per_request", r.kv_reserved_bytes},
                               {"wall_s", r.wall_s},
                               {"steps", r.steps},
                               {"preemptions", r.preemptions},
                               {"pages_leaked", r.pages_leaked}});
  }
  j["capacity"] = {{"depth", report.depth},
                   {"gen_tokens", report.capacity_gen},
                   {"max_sequences", report.capacity_max},
                   {"fill", "synthetic"},
                   {"configs", nlohmann::json::array()}};
  for (const ServeCapacityResult& r : report.capacity) {
    j["capacity"]["configs"].push_back({{"label", r.label},
                                        {"kv", r.kv_desc},
                                        {"reserve_bytes_per_request", r.reserve_bytes},
                                        {"chunk_reserve_bytes", r.chunk_reserve_bytes},
                                        {"admitted", r.admitted},
                                        {"admitted_vs_first", r.admitted_vs_first},
                                        {"ran", r.ran},
                                        {"fill_s", r.fill_s},
                                        {"steps", r.steps},
                                        {"decode_tokens_per_s", r.decode_tps},
                                        {"decode_tokens_per_s_vs_first", r.decode_tps_vs_first},
                                        {"token_latency_p50_s", r.step_p50_s},
                                        {"token_latency_p95_s", r.step_p95_s},
                                        {"kv_used_bytes", r.kv_used_bytes},
                                        {"kv_peak_bytes", r.kv_peak_bytes},
                                        {"live_tokens_per_layer", r.live_tokens_per_layer},
                                        {"evicted_tokens", r.evicted_tokens},
                                        {"pages_leaked", r.pages_leaked}});
  }
  j["load"] = {{"requests", report.load_requests},
               {"prompt_tokens", report.load_prompt},
               {"gen_tokens", report.load_gen},
               {"dense_slots", report.load_dense_slots},
               {"budget_bytes", report.load_budget_bytes},
               {"configs", nlohmann::json::array()}};
  for (const ServeLoadResult& r : report.load) {
    j["load"]["configs"].push_back({{"label", r.label},
                                    {"reserve_bytes_per_request", r.reserve_bytes},
                                    {"most_running", r.most_running},
                                    {"ttft_p50_s", r.ttft_p50_s},
                                    {"ttft_p95_s", r.ttft_p95_s},
                                    {"itl_p50_s", r.itl_p50_s},
                                    {"itl_p95_s", r.itl_p95_s},
                                    {"tokens_per_s", r.tokens_per_s},
                                    {"wall_s", r.wall_s},
                                    {"preemptions", r.preemptions},
                                    {"kv_peak_bytes", r.kv_peak_bytes},
                                    {"pages_leaked", r.pages_leaked}});
  }
  j["total_s"] = report.total_s;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace kvsparse
