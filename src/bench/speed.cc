#include "kvsparse/engine.h"
#include "kvsparse/speed_bench.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

#include "bench/synthetic_fill.h"
#include "kvsparse/attention.h"
#include "kvsparse/isa.h"
#include "kvsparse/ops.h"
#include "kvsparse/runtime.h"
#include "kvsparse/sparse_kv_controller.h"
#include "common/process_memory.h"
#include "common/timing.h"

namespace kvsparse {
namespace {

// Deterministic pseudo-random token ids: speed does not depend on which tokens run.
std::vector<int32_t> BenchTokens(int n, int n_vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(n_vocab));
  return t;
}

// Whether a layer estimates its sparse prefill from the whole prompt (two-pass Vertical-Slash),
// which needs the prompt in one Forward call.
bool EstimatesFromThePrompt(const SparseKvController* controller, int n_layers) {
  for (int layer = 0; controller != nullptr && layer < n_layers; ++layer) {
    if (controller->prefill_sparsity(0, layer).two_pass) return true;
  }
  return false;
}

// Runs `tokens` through the engine in chunks starting at pos0 (chunk 0: in one Forward call,
// which chunks it at the controller's prefill_chunk).
Status Prefill(Engine& engine, const std::vector<int32_t>& tokens, int32_t pos0, int chunk, std::vector<float>& logits) {
  if (chunk == 0) chunk = static_cast<int>(std::max<size_t>(tokens.size(), 1));
  for (size_t i = 0; i < tokens.size(); i += chunk) {
    const int32_t n = static_cast<int32_t>(std::min<size_t>(chunk, tokens.size() - i));
    KVS_RETURN_IF_ERROR(engine.Forward(0, tokens.data() + i, n, pos0 + static_cast<int32_t>(i), logits.data()));
  }
  return Status::Ok();
}

// Seconds of one decode step's attention over every layer of the cache as it stands (a random
// query at the next position), the best of `reps` timings.
double TimeDecodeAttention(const KvCache& cache, const ModelConfig& c, int32_t position, int n_threads, int reps) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(c.n_heads) * c.head_dim);  // [1, n_heads, head_dim]
  for (float& x : q) x = normal(rng);
  std::vector<float> out(q.size());  // [1, n_heads, head_dim]
  // Per-head layers (KvCache::per_head) attend each kv head's query group over that head's
  // spans, all heads in one ops::AttentionBatch call, as the engine does.
  const int group = c.n_heads / c.n_kv_heads;
  std::vector<std::vector<KvSpan>> spans(static_cast<size_t>(c.n_layers) * c.n_kv_heads);  // [layer, kv head]
  auto layer_spans = [&](int layer, int head) -> std::vector<KvSpan>& {
    return spans[static_cast<size_t>(layer) * c.n_kv_heads + head];
  };
  std::vector<AttentionJob> jobs(static_cast<size_t>(c.n_layers) * c.n_kv_heads);  // [layer, kv head]
  for (int layer = 0; layer < c.n_layers; ++layer) {
    if (!cache.per_head(layer)) {
      cache.Spans(0, layer, &layer_spans(layer, 0));
      continue;
    }
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const std::vector<KvSpan>& hs = layer_spans(layer, h);
      cache.HeadSpans(0, layer, h, &layer_spans(layer, h));
      const size_t offset = static_cast<size_t>(h) * group * c.head_dim;  // the group's rows of q / out
      jobs[static_cast<size_t>(layer) * c.n_kv_heads + h] =
          AttentionJob{hs.data(), static_cast<int32_t>(hs.size()), 0, q.data() + offset, out.data() + offset};
    }
  }
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    for (int layer = 0; layer < c.n_layers; ++layer) {
      const AttentionShape shape = LayerAttentionShape(c, layer);  // the engine's: scale, window, softcap
      if (!cache.per_head(layer)) {
        const std::vector<KvSpan>& ls = layer_spans(layer, 0);
        ops::Attention(shape, cache.layer_storage(layer), q.data(), &position, 1, ls.data(),
                       static_cast<int32_t>(ls.size()), out.data(), n_threads);
        continue;
      }
      AttentionShape head_shape = shape;
      head_shape.n_heads = group;
      head_shape.n_kv_heads = 1;
      ops::AttentionBatch(head_shape, 1, cache.layer_storage(layer), &position, 1,
                          jobs.data() + static_cast<size_t>(layer) * c.n_kv_heads, c.n_kv_heads, n_threads);
    }
    const double s = Seconds(t0, Clock::now());
    best = rep == 0 ? s : std::min(best, s);
  }
  return best;
}

// Seconds for `ops` attention operations (q.k and p.v, half each) over a layer stored as
// `storage`, at the measured peak of the instructions the kernel uses for each half; adds their
// names to `dots`.
double AttentionSeconds(double ops, KvStorage storage, int head_dim, const SpeedReport& report,
                        std::set<std::string>* dots) {
  if (ops::UsesIntegerDots(storage, head_dim)) {
    dots->insert("int8 dot products");
    return ops / (report.int8_peak_gops * 1e9);
  }
  if (ops::UsesBf16Dots(storage) && report.bf16_peak_gflops > 0) {
    dots->insert("bf16 dot products");
    const bool bf16_pv = head_dim % 32 == 0;  // else p.v stays f32 (attention.cc)
    if (!bf16_pv) dots->insert("f32 FMA");
    return ops / 2 / (report.bf16_peak_gflops * 1e9) +
           ops / 2 / ((bf16_pv ? report.bf16_peak_gflops : report.f32_peak_gflops) * 1e9);
  }
  dots->insert("f32 FMA");
  return ops / (report.f32_peak_gflops * 1e9);
}

// One decode step's attention arithmetic over the cache as it stands: q.k and p.v, 2 multiply-adds
// per query head, attended token and head dim (4 ops), and the seconds they take at least, at the
// measured peak of the instructions the kernel uses for each layer's storage.
struct AttentionArithmetic {
  double ops = 0;
  double seconds = 0;
  std::string dots;  // "int8 dot products", "bf16 dot products", "f32 FMA", joined by " + "
};
AttentionArithmetic DecodeAttentionOps(const KvCache& cache, const ModelConfig& c, const SpeedReport& report) {
  AttentionArithmetic a;
  std::set<std::string> dots;
  const int group = c.n_heads / c.n_kv_heads;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    double tokens = 0;  // attended tokens, summed over kv heads
    for (int h = 0; h < c.n_kv_heads; ++h) {
      int64_t n = cache.per_head(layer) ? cache.NumHeadTokens(0, layer, h) : cache.NumTokens(0, layer);
      if (const int32_t window = c.LayerWindow(layer); window > 0) n = std::min<int64_t>(n, window);
      tokens += static_cast<double>(n);
    }
    const double ops = 4.0 * group * c.head_dim * tokens;
    a.ops += ops;
    a.seconds += AttentionSeconds(ops, cache.layer_storage(layer), c.head_dim, report, &dots);
  }
  for (const std::string& name : dots) a.dots += (a.dots.empty() ? "" : " + ") + name;
  return a;
}

// The least time a prompt of n tokens after `depth` others spends in causal attention: q.k and
// p.v over every pair each layer attends (a sliding window caps a query's keys), at the peak of
// the layer's path.
double PromptAttentionSeconds(const KvCache& cache, const ModelConfig& c, int depth, int n, const SpeedReport& report) {
  double seconds = 0;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    const int32_t window = c.LayerWindow(layer);
    double pairs = 0;  // (query, key) pairs of one query head
    for (int i = 0; i < n; ++i) {
      const double keys = depth + i + 1.0;
      pairs += window > 0 ? std::min<double>(keys, window) : keys;
    }
    const double ops = 4.0 * c.n_heads * c.head_dim * pairs;
    std::set<std::string> dots;
    seconds += AttentionSeconds(ops, cache.layer_storage(layer), c.head_dim, report, &dots);
  }
  return seconds;
}

// The policy work recorded since the last ResetStats.
double PolicySeconds(const SparseKvController& controller, int64_t* evictions) {
  double s = 0;
  for (const SparseKvLayerStats& l : controller.layer_stats()) {
    s += l.policy_s();
    *evictions += l.evictions;
  }
  return s;
}

void MeanStd(const std::vector<double>& v, double* mean, double* sd) {
  *mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  double s = 0;
  for (double x : v) s += (x - *mean) * (x - *mean);
  *sd = v.size() > 1 ? std::sqrt(s / (v.size() - 1)) : 0.0;
}

}  // namespace

// Bad lengths are the user's input: a clear error, never an invariant abort further down.
Status ValidateSpeedBenchConfig(const SpeedBenchConfig& config) {
  auto list = [](const std::vector<int>& v) {
    std::string s;
    for (int x : v) {
      if (!s.empty()) s += ',';  // (operator+ chains trip a GCC 12 -Wrestrict false positive)
      s += std::to_string(x);
    }
    return s;
  };
  for (const auto& [flag, values] : {std::pair{"-p/--n-prompt", &config.n_prompt}, std::pair{"-n/--n-gen", &config.n_gen},
                                     std::pair{"-d/--depth", &config.depths}}) {
    for (int v : *values) {
      if (v < 0) return InvalidArgumentError(fmt::format("{}: lengths must be >= 0, found {}", flag, v));
    }
  }
  const bool any_test = std::any_of(config.n_prompt.begin(), config.n_prompt.end(), [](int n) { return n > 0; }) ||
                        std::any_of(config.n_gen.begin(), config.n_gen.end(), [](int n) { return n > 0; });
  if (!any_test || config.depths.empty()) {
    return InvalidArgumentError(fmt::format("nothing to time: -p/--n-prompt ({}) and -n/--n-gen ({}) need a length > 0 "
                                            "and -d/--depth ({}) at least one depth",
                                            list(config.n_prompt), list(config.n_gen), list(config.depths)));
  }
  return Status::Ok();
}

StatusOr<SpeedReport> RunSpeedBench(const Model& model, const SpeedBenchConfig& config) {
  KVS_RETURN_IF_ERROR(ValidateSpeedBenchConfig(config));
  const ModelConfig& c = model.config();
  const int n_threads = config.n_threads > 0 ? config.n_threads : omp_get_num_procs();
  SpeedReport report;
  report.isa = IsaName(ActiveIsa());
  report.model_path = model.path();
  report.weight_bytes = static_cast<double>(model.WeightBytes());
  // A decode step reads every weight once, except the token-embedding table, of which it reads one
  // row (unless the output projection is tied to it and reads it whole), and of a MoE layer's
  // experts only the chosen ones.
  const double weight_bytes_per_token = static_cast<double>(model.ActiveWeightBytesPerToken());
  report.active_weight_bytes_per_token = weight_bytes_per_token;
  report.n_params = model.ParameterCount();
  report.active_params = model.ActiveParameterCount();
  report.model_desc = model.Summary();
  if (config.known_bandwidth_gbs > 0) {
    report.read_bandwidth_gbs = config.known_bandwidth_gbs;
  } else if (config.measure_bandwidth) {
    report.read_bandwidth_gbs = ops::MeasureReadBandwidthGBs(n_threads);
  }
  if (config.measure_bandwidth || config.known_bandwidth_gbs > 0) {
    const ops::ComputePeak peak = ops::MeasureComputePeak(n_threads);
    report.f32_peak_gflops = peak.f32_fma_gflops;
    report.int8_peak_gops = peak.int8_dot_gops;
    report.bf16_peak_gflops = peak.bf16_dot_gflops;
  }

  int max_tokens = 0;
  for (int d : config.depths)
    for (int p : config.n_prompt) max_tokens = std::max(max_tokens, d + p);
  for (int d : config.depths)
    for (int g : config.n_gen) max_tokens = std::max(max_tokens, d + g);
  // Dense: one contiguous buffer per layer. Sparse: the paged cache and its policies.
  const KvSparsityConfig* sparsity = config.kv_sparsity ? &*config.kv_sparsity : nullptr;
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime,
                       CreateRuntime(model, sparsity, config.kv_storage, /*n_seqs=*/1, std::max(max_tokens, 1),
                                     n_threads));
  // What runs: the controller's config has the sliding layers resolved (ResolveSlidingLayers).
  report.kv_desc = sparsity ? KvSparsityConfigSummary(runtime->controller()->config())
                            : std::string("dense ") + KvStorageName(config.kv_storage);
  if (const int n_sliding = c.NumSlidingLayers(); n_sliding > 0) {
    report.kv_desc += fmt::format("; {} of {} layers slide with {}-token windows (freed as they move); \"% of dense "
                                  "f16\" is against llama.cpp's layout, whose sliding layers hold their window",
                                  n_sliding, c.n_layers, c.sliding_window);
  }
  KvCache& cache = runtime->cache();
  SparseKvController* controller = runtime->controller();
  Engine& engine = *runtime->engine;
  std::vector<float> logits(c.n_vocab);  // [n_vocab]
  const double dense_kv_bytes_per_token =
      static_cast<double>(c.n_layers) * c.KvValuesPerToken() * KvStorageBits(config.kv_storage) / 8;
  // After a test's last repetition: the cache's size and the policy work of its timed part.
  auto finish = [&](SpeedResult& r, double policy_s, int64_t evictions, int reps) {
    r.kv_allocated_bytes = cache.AllocatedBytes();
    r.kv_live_bytes = cache.LiveBytes();
    const PagedKvCache* paged = runtime->paged_cache();
    r.kv_peak_allocated_bytes = paged ? paged->Stats().peak_allocated_bytes : r.kv_allocated_bytes;
    r.dense_f16_kv_bytes = c.DenseKvBytes(r.depth + r.n_tokens, 2.0);  // sliding layers: their window
    r.peak_rss_bytes = PeakRssBytes();
    if (controller != nullptr) {
      r.policy_ms_per_token = policy_s * 1e3 / (static_cast<double>(r.n_tokens) * reps);
      r.evictions = evictions / reps;
      if (config.kv_stats) r.kv_stats_table = controller->FormatStats();
    }
  };

  // A two-pass prompt goes to Forward whole: per-call chunks would each be a prompt of their own.
  const int prompt_chunk = EstimatesFromThePrompt(controller, c.n_layers) ? 0 : config.prefill_chunk;
  for (int depth : config.depths) {
    const std::vector<int32_t> fill = config.synthetic_fill ? std::vector<int32_t>() : BenchTokens(depth, c.n_vocab, 7);
    auto reset_to_depth = [&]() -> Status {
      if (controller != nullptr) {
        KVS_RETURN_IF_ERROR(controller->ResetSequence(0));  // fresh policies too
      } else {
        cache.Clear(0);
      }
      if (config.synthetic_fill) return SyntheticFill(cache, controller, /*seq=*/0, depth, config.prefill_chunk);
      return Prefill(engine, fill, 0, config.prefill_chunk, logits);
    };
    // Starts the timed part: policy counters from zero.
    auto start_timing = [&]() {
      if (controller != nullptr) controller->ResetStats();
      return Clock::now();
    };
    auto timed_policy_s = [&](int64_t* evictions) {
      return controller != nullptr ? PolicySeconds(*controller, evictions) : 0.0;
    };
    for (int n : config.n_prompt) {
      if (n <= 0) continue;
      SpeedResult r;
      r.test = fmt::format("pp{}", n);
      r.depth = depth;
      r.n_tokens = n;
      r.n_threads = n_threads;
      const std::vector<int32_t> prompt = BenchTokens(n, c.n_vocab, 11);
      double policy_s = 0, attention_s = 0, estimate_s = 0;
      int64_t evictions = 0, selected_pairs = 0, causal_pairs = 0;
      for (int rep = config.warmup ? 0 : 1; rep <= config.repetitions; ++rep) {  // rep 0 warms up
        KVS_RETURN_IF_ERROR(reset_to_depth());
        const auto t0 = start_timing();
        KVS_RETURN_IF_ERROR(Prefill(engine, prompt, depth, prompt_chunk, logits));
        const double s = Seconds(t0, Clock::now());
        if (rep > 0) {
          r.samples_tokens_per_s.push_back(n / s);
          policy_s += timed_policy_s(&evictions);
          if (controller != nullptr) {
            for (const SparseKvLayerStats& l : controller->layer_stats()) {
              attention_s += l.prefill_attention_s;
              estimate_s += l.prefill_estimate_s;
              selected_pairs += l.prefill_selected_pairs;
              causal_pairs += l.prefill_causal_pairs;
            }
          }
        }
      }
      r.prefill_attention_s = attention_s / config.repetitions;
      r.prefill_estimate_s = estimate_s / config.repetitions;
      // Layers (or chunks) attended densely compute all their pairs; the share counts the
      // sparse chunks' pairs (a mixed config's dense layers are not in it).
      r.prefill_computed_share = causal_pairs > 0 ? static_cast<double>(selected_pairs) / causal_pairs : 1.0;
      MeanStd(r.samples_tokens_per_s, &r.tokens_per_s_mean, &r.tokens_per_s_stddev);
      // Prefill is compute-bound: its floor is the arithmetic at the measured peaks (the weights'
      // multiply-adds at the int8 dot peak, causal attention at its path's peak).
      if (report.f32_peak_gflops > 0 && report.int8_peak_gops > 0) {
        const double weight_s = 2.0 * report.active_params * n / (report.int8_peak_gops * 1e9);
        const double attention_s = PromptAttentionSeconds(cache, c, depth, n, report);
        r.compute_limit_tokens_per_s = n / (weight_s + attention_s);
        r.limit_tokens_per_s = r.compute_limit_tokens_per_s;
      }
      finish(r, policy_s, evictions, config.repetitions);
      report.results.push_back(r);
    }
    for (int n : config.n_gen) {
      if (n <= 0) continue;
      SpeedResult r;
      r.test = fmt::format("tg{}", n);
      r.depth = depth;
      r.n_tokens = n;
      r.n_threads = n_threads;
      double policy_s = 0, live_kv_bytes = 0;
      int64_t evictions = 0;
      for (int rep = config.warmup ? 0 : 1; rep <= config.repetitions; ++rep) {
        KVS_RETURN_IF_ERROR(reset_to_depth());
        int32_t token = 1 % c.n_vocab;
        live_kv_bytes = 0;
        const auto t0 = start_timing();
        for (int i = 0; i < n; ++i) {
          // Each step reads the cache as it stands (cheap: per-layer counters).
          if (controller != nullptr) live_kv_bytes += static_cast<double>(cache.LiveBytes());
          KVS_RETURN_IF_ERROR(engine.Forward(0, &token, 1, depth + i, logits.data()));
          token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        }
        const double s = Seconds(t0, Clock::now());
        if (rep > 0) {
          r.samples_tokens_per_s.push_back(n / s);
          policy_s += timed_policy_s(&evictions);
        }
      }
      MeanStd(r.samples_tokens_per_s, &r.tokens_per_s_mean, &r.tokens_per_s_stddev);
      // Decode floor. Dense: the mean KV depth over the run; sparse: the live KV bytes measured
      // before each step (positions and scales included).
      const double kv_bytes = controller != nullptr ? live_kv_bytes / n
                                                    : dense_kv_bytes_per_token * (depth + (n - 1) / 2.0);
      r.bytes_per_token = weight_bytes_per_token + kv_bytes;
      if (config.attention_reps > 0) {
        r.attention_ms_per_token =
            1e3 * TimeDecodeAttention(cache, c, depth + n, n_threads, config.attention_reps);
      }
      if (report.read_bandwidth_gbs > 0) {
        r.bandwidth_limit_tokens_per_s = report.read_bandwidth_gbs * 1e9 / r.bytes_per_token;
        r.limit_tokens_per_s = r.bandwidth_limit_tokens_per_s;
      }
      if (report.f32_peak_gflops > 0 && report.int8_peak_gops > 0) {
        const AttentionArithmetic attention = DecodeAttentionOps(cache, c, report);
        r.attention_ops_per_token = attention.ops;
        // The weights' multiply-adds at the int8 dot peak (the quantized matmuls' instructions).
        const double weight_s = 2.0 * report.active_params / (report.int8_peak_gops * 1e9);
        r.compute_limit_tokens_per_s = 1.0 / (attention.seconds + weight_s);
        if (r.limit_tokens_per_s <= 0 || r.compute_limit_tokens_per_s < r.limit_tokens_per_s) {
          r.limit_tokens_per_s = r.compute_limit_tokens_per_s;
        }
        report.attention_dots = attention.dots;
      }
      finish(r, policy_s, evictions, config.repetitions);
      report.results.push_back(r);
    }
  }
  return report;
}

std::string SpeedReportMarkdown(const SpeedReport& report) {
  std::string out;
  out += fmt::format("model: {} ({})\n", report.model_path, report.model_desc);
  out += fmt::format("kernels: {}\n", report.isa);
  out += fmt::format("weights: {:.1f} MiB, {:.3f} B params, {:.1f} MiB read per decoded token",
                     report.weight_bytes / (1 << 20), report.n_params / 1e9,
                     report.active_weight_bytes_per_token / (1 << 20));
  if (report.read_bandwidth_gbs > 0) out += fmt::format(", measured read bandwidth {:.1f} GB/s", report.read_bandwidth_gbs);
  out += "\n";
  if (report.f32_peak_gflops > 0) {
    const std::string bf16 =
        report.bf16_peak_gflops > 0 ? fmt::format(", bf16 dot products {:.0f} GFLOPS", report.bf16_peak_gflops) : "";
    out += fmt::format("measured peaks: f32 FMA {:.0f} GFLOPS, int8 dot products {:.0f} GOPS{}; "
                       "decode attention uses {}\n",
                       report.f32_peak_gflops, report.int8_peak_gops, bf16,
                       report.attention_dots.empty() ? std::string("(no decode test)") : report.attention_dots);
  }
  out += fmt::format("KV: {}\n\n", report.kv_desc);
  out += "| test | depth | threads | t/s | ± | limit t/s | % of limit | bound | KV alloc MiB | KV live MiB | % of dense f16 | policy ms/tok | attn ms/tok |\n";
  out += "|------|------:|--------:|----:|--:|----------:|-----------:|:------|-------------:|------------:|---------------:|--------------:|------------:|\n";
  for (const SpeedResult& r : report.results) {
    std::string limit = "", pct = "", bound = "";
    if (r.limit_tokens_per_s > 0) {
      limit = fmt::format("{:.2f}", r.limit_tokens_per_s);
      pct = fmt::format("{:.0f}%", 100.0 * r.tokens_per_s_mean / r.limit_tokens_per_s);
      bound = r.compute_limit_tokens_per_s > 0 && r.compute_limit_tokens_per_s <= r.limit_tokens_per_s ? "compute"
                                                                                                      : "bandwidth";
    }
    const std::string attn = r.attention_ms_per_token > 0 ? fmt::format("{:.2f}", r.attention_ms_per_token) : "";
    out += fmt::format("| {} | {} | {} | {:.2f} | {:.2f} | {} | {} | {} | {:.2f} | {:.2f} | {:.1f}% | {:.3f} | {} |\n",
                       r.test, r.depth, r.n_threads, r.tokens_per_s_mean, r.tokens_per_s_stddev, limit, pct, bound,
                       r.kv_allocated_bytes / 1048576.0, r.kv_live_bytes / 1048576.0,
                       100.0 * r.kv_allocated_bytes / r.dense_f16_kv_bytes, r.policy_ms_per_token, attn);
  }
  size_t peak_rss = 0, peak_kv = 0;
  for (const SpeedResult& r : report.results) {
    peak_rss = std::max(peak_rss, r.peak_rss_bytes);
    peak_kv = std::max(peak_kv, r.kv_peak_allocated_bytes);
  }
  out += fmt::format("\npeak KV allocated {:.2f} MiB; peak resident memory of the process {:.1f} MiB (weights are mmapped and count once read)\n",
                     peak_kv / 1048576.0, peak_rss / 1048576.0);
  out += "\nlimit = 1 / max(bytes / read bandwidth, ops / peak): the bytes one generated token must read (all weights "
         "except the unread rows of an untied token-embedding table and, in MoE layers, the experts not chosen, plus "
         "the live KV), and its arithmetic at the measured peaks: attention's q.k and p.v (4 x head_dim ops per query "
         "head and attended token) at the peak of the instructions the kernel uses, 2 ops per weight it multiplies "
         "at the int8 dot peak; bound = the side that sets it. "
         "ppN: compute only, the N tokens' weight ops and causal attention at the same peaks\n";
  for (const SpeedResult& r : report.results) {
    if (r.kv_stats_table.empty()) continue;
    out += fmt::format("\nKV stats after {} at depth {}:\n{}", r.test, r.depth, r.kv_stats_table);
  }
  return out;
}

std::string PrefillComparisonMarkdown(const SpeedReport& base, const SpeedReport& other, std::string_view base_label,
                                      std::string_view label) {
  const std::string_view b = base_label, o = label;
  std::string out = fmt::format("{}: {}\n{}: {}\n\n", b, base.kv_desc, o, other.kv_desc);
  out += fmt::format(
      "| test | depth | {0} t/s | {1} t/s | speedup | {0} attn s | {1} attn s | {1} estimate s | "
      "attn speedup | {1} pairs computed |\n",
      b, o);
  out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const SpeedResult& s : other.results) {
    for (const SpeedResult& d : base.results) {
      if (d.test != s.test || d.depth != s.depth || s.test.rfind("pp", 0) != 0) continue;
      const double sparse_s = s.prefill_attention_s + s.prefill_estimate_s;
      out += fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f}x | {:.2f} | {:.2f} | {:.2f} | {:.2f}x | {:.1f}% |\n",
                         s.test, s.depth, d.tokens_per_s_mean, s.tokens_per_s_mean,
                         s.tokens_per_s_mean / std::max(1e-12, d.tokens_per_s_mean), d.prefill_attention_s,
                         s.prefill_attention_s, s.prefill_estimate_s, d.prefill_attention_s / std::max(1e-12, sparse_s),
                         100.0 * s.prefill_computed_share);
    }
  }
  out +=
      "\nattn s = the prompt chunks' attention kernel, all layers, per repetition; attn speedup = dense attn / "
      "(sparse attn + estimate); pairs computed = (query, key) pairs attended / those causal attention attends\n";
  return out;
}

std::string SpeedComparisonMarkdown(const SpeedReport& base, const SpeedReport& other, std::string_view base_label,
                                    std::string_view label) {
  const std::string_view b = base_label, o = label;
  std::string out = fmt::format("{}: {}\n{}: {}\n\n", b, base.kv_desc, o, other.kv_desc);
  out += fmt::format("| test | depth | {0} t/s | {1} t/s | speedup | {0} attn ms/tok | {1} attn ms/tok | attn speedup | "
                     "{0} KV MiB | {1} KV MiB | {1}/{0} KV | {1} policy share of step |\n",
                     b, o);
  out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const SpeedResult& s : other.results) {
    for (const SpeedResult& d : base.results) {
      if (d.test != s.test || d.depth != s.depth) continue;
      auto ratio = [](double x, double y) { return y > 0 && x > 0 ? fmt::format("{:.2f}x", x / y) : std::string(); };
      auto ms = [](double v) { return v > 0 ? fmt::format("{:.2f}", v) : std::string(); };
      const double step_ms = s.tokens_per_s_mean > 0 ? 1e3 / s.tokens_per_s_mean : 0;
      out += fmt::format("| {} | {} | {:.2f} | {:.2f} | {} | {} | {} | {} | {:.2f} | {:.2f} | {:.1f}% | {:.1f}% |\n",
                         s.test, s.depth, d.tokens_per_s_mean, s.tokens_per_s_mean,
                         ratio(s.tokens_per_s_mean, d.tokens_per_s_mean), ms(d.attention_ms_per_token),
                         ms(s.attention_ms_per_token), ratio(d.attention_ms_per_token, s.attention_ms_per_token),
                         d.kv_allocated_bytes / 1048576.0, s.kv_allocated_bytes / 1048576.0,
                         100.0 * s.kv_allocated_bytes / std::max<double>(1, d.kv_allocated_bytes),
                         step_ms > 0 ? 100.0 * s.policy_ms_per_token / step_ms : 0.0);
    }
  }
  out += fmt::format("\nattn = one decode step's attention over the final cache, all layers (best of --attention-reps); "
                     "policy share = scoring + selection + compaction per token / the {} decode step\n",
                     o);
  return out;
}

std::string SpeedReportJson(const SpeedReport& report) {
  nlohmann::json j;
  j["model"] = report.model_path;
  j["model_desc"] = report.model_desc;
  j["isa"] = report.isa;
  j["weight_bytes"] = report.weight_bytes;
  j["active_weight_bytes_per_token"] = report.active_weight_bytes_per_token;
  j["n_params"] = report.n_params;
  j["active_params"] = report.active_params;
  j["read_bandwidth_gbs"] = report.read_bandwidth_gbs;
  j["f32_peak_gflops"] = report.f32_peak_gflops;
  j["int8_peak_gops"] = report.int8_peak_gops;
  j["bf16_peak_gflops"] = report.bf16_peak_gflops;
  j["attention_dots"] = report.attention_dots;
  j["kv"] = report.kv_desc;
  for (const SpeedResult& r : report.results) {
    j["results"].push_back({{"test", r.test},
                            {"depth", r.depth},
                            {"n_tokens", r.n_tokens},
                            {"threads", r.n_threads},
                            {"tokens_per_s", r.tokens_per_s_mean},
                            {"tokens_per_s_stddev", r.tokens_per_s_stddev},
                            {"samples", r.samples_tokens_per_s},
                            {"bytes_per_token", r.bytes_per_token},
                            {"limit_tokens_per_s", r.limit_tokens_per_s},
                            {"bandwidth_limit_tokens_per_s", r.bandwidth_limit_tokens_per_s},
                            {"compute_limit_tokens_per_s", r.compute_limit_tokens_per_s},
                            {"attention_ops_per_token", r.attention_ops_per_token},
                            {"kv_allocated_bytes", r.kv_allocated_bytes},
                            {"kv_live_bytes", r.kv_live_bytes},
                            {"policy_ms_per_token", r.policy_ms_per_token},
                            {"evictions", r.evictions},
                            {"attention_ms_per_token", r.attention_ms_per_token},
                            {"kv_peak_allocated_bytes", r.kv_peak_allocated_bytes},
                            {"dense_f16_kv_bytes", r.dense_f16_kv_bytes},
                            {"peak_rss_bytes", r.peak_rss_bytes},
                            {"prefill_attention_s", r.prefill_attention_s},
                            {"prefill_estimate_s", r.prefill_estimate_s},
                            {"prefill_computed_share", r.prefill_computed_share}});
    if (!r.kv_stats_table.empty()) j["results"].back()["kv_stats"] = r.kv_stats_table;
  }
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kvsparse
