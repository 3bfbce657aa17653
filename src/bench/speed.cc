#include "kvsparse/speed_bench.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/ops.h"

namespace kvsparse {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Deterministic pseudo-random token ids: speed does not depend on which tokens run.
std::vector<int32_t> BenchTokens(int n, int n_vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(n_vocab));
  return t;
}

// Runs `tokens` through the engine in chunks starting at pos0.
Status Prefill(Engine& engine, const std::vector<int32_t>& tokens, int32_t pos0, int chunk, std::vector<float>& logits) {
  for (size_t i = 0; i < tokens.size(); i += chunk) {
    const int32_t n = static_cast<int32_t>(std::min<size_t>(chunk, tokens.size() - i));
    KVS_RETURN_IF_ERROR(engine.Forward(0, tokens.data() + i, n, pos0 + static_cast<int32_t>(i), logits.data()));
  }
  return Status::Ok();
}

void MeanStd(const std::vector<double>& v, double* mean, double* sd) {
  *mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  double s = 0;
  for (double x : v) s += (x - *mean) * (x - *mean);
  *sd = v.size() > 1 ? std::sqrt(s / (v.size() - 1)) : 0.0;
}

}  // namespace

StatusOr<SpeedReport> RunSpeedBench(const Model& model, const SpeedBenchConfig& config) {
  const ModelConfig& c = model.config();
  const int n_threads = config.n_threads > 0 ? config.n_threads : omp_get_num_procs();
  SpeedReport report;
  report.model_path = model.path();
  report.weight_bytes = static_cast<double>(model.WeightBytes());
  report.n_params = model.ParameterCount();
  report.model_desc = fmt::format("{} {:.2f}B {}", ArchName(c.arch), report.n_params / 1e9,
                                  DTypeName(model.layers.empty() ? DType::kF32 : model.layers[0].wq.type));
  if (config.measure_bandwidth) report.read_bandwidth_gbs = ops::MeasureReadBandwidthGBs(n_threads);

  int max_tokens = 0;
  for (int d : config.depths)
    for (int p : config.n_prompt) max_tokens = std::max(max_tokens, d + p);
  for (int d : config.depths)
    for (int g : config.n_gen) max_tokens = std::max(max_tokens, d + g);
  KvGeometry geo{c.n_layers, c.n_kv_heads, c.head_dim};
  ContiguousKvCache cache(geo, config.kv_storage, /*n_seqs=*/1, max_tokens);
  Engine engine(model, &cache, n_threads);
  std::vector<float> logits(c.n_vocab);  // [n_vocab]
  const double kv_bytes_per_token =
      2.0 * c.n_layers * c.n_kv_heads * c.head_dim * (config.kv_storage == KvStorage::kF16 ? 2 : 4);

  for (int depth : config.depths) {
    const std::vector<int32_t> fill = BenchTokens(depth, c.n_vocab, 7);
    auto reset_to_depth = [&]() -> Status {
      cache.Clear(0);
      return Prefill(engine, fill, 0, config.prefill_chunk, logits);
    };
    for (int n : config.n_prompt) {
      if (n <= 0) continue;
      SpeedResult r;
      r.test = fmt::format("pp{}", n);
      r.depth = depth;
      r.n_tokens = n;
      r.n_threads = n_threads;
      const std::vector<int32_t> prompt = BenchTokens(n, c.n_vocab, 11);
      for (int rep = 0; rep <= config.repetitions; ++rep) {  // rep 0 warms up
        KVS_RETURN_IF_ERROR(reset_to_depth());
        const auto t0 = Clock::now();
        KVS_RETURN_IF_ERROR(Prefill(engine, prompt, depth, config.prefill_chunk, logits));
        const double s = Seconds(t0, Clock::now());
        if (rep > 0) r.samples_tokens_per_s.push_back(n / s);
      }
      MeanStd(r.samples_tokens_per_s, &r.tokens_per_s_mean, &r.tokens_per_s_stddev);
      report.results.push_back(r);
    }
    for (int n : config.n_gen) {
      if (n <= 0) continue;
      SpeedResult r;
      r.test = fmt::format("tg{}", n);
      r.depth = depth;
      r.n_tokens = n;
      r.n_threads = n_threads;
      // Mean KV depth over the run: each step reads the cache as it stands.
      r.bytes_per_token = report.weight_bytes + kv_bytes_per_token * (depth + (n - 1) / 2.0);
      if (report.read_bandwidth_gbs > 0) r.limit_tokens_per_s = report.read_bandwidth_gbs * 1e9 / r.bytes_per_token;
      for (int rep = 0; rep <= config.repetitions; ++rep) {
        KVS_RETURN_IF_ERROR(reset_to_depth());
        int32_t token = 1 % c.n_vocab;
        const auto t0 = Clock::now();
        for (int i = 0; i < n; ++i) {
          KVS_RETURN_IF_ERROR(engine.Forward(0, &token, 1, depth + i, logits.data()));
          token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        }
        const double s = Seconds(t0, Clock::now());
        if (rep > 0) r.samples_tokens_per_s.push_back(n / s);
      }
      MeanStd(r.samples_tokens_per_s, &r.tokens_per_s_mean, &r.tokens_per_s_stddev);
      report.results.push_back(r);
    }
  }
  return report;
}

std::string SpeedReportMarkdown(const SpeedReport& report) {
  std::string out;
  out += fmt::format("model: {} ({})\n", report.model_path, report.model_desc);
  out += fmt::format("weights: {:.1f} MiB, {:.3f} B params", report.weight_bytes / (1 << 20), report.n_params / 1e9);
  if (report.read_bandwidth_gbs > 0) out += fmt::format(", measured read bandwidth {:.1f} GB/s", report.read_bandwidth_gbs);
  out += "\n\n";
  out += "| test | depth | threads | t/s | ± | limit t/s | % of limit |\n";
  out += "|------|------:|--------:|----:|--:|----------:|-----------:|\n";
  for (const SpeedResult& r : report.results) {
    std::string limit = "", pct = "";
    if (r.limit_tokens_per_s > 0) {
      limit = fmt::format("{:.2f}", r.limit_tokens_per_s);
      pct = fmt::format("{:.0f}%", 100.0 * r.tokens_per_s_mean / r.limit_tokens_per_s);
    }
    out += fmt::format("| {} | {} | {} | {:.2f} | {:.2f} | {} | {} |\n", r.test, r.depth, r.n_threads,
                       r.tokens_per_s_mean, r.tokens_per_s_stddev, limit, pct);
  }
  out += "\nlimit = read bandwidth / (weight bytes + KV bytes read per generated token)\n";
  return out;
}

std::string SpeedReportJson(const SpeedReport& report) {
  nlohmann::json j;
  j["model"] = report.model_path;
  j["model_desc"] = report.model_desc;
  j["weight_bytes"] = report.weight_bytes;
  j["n_params"] = report.n_params;
  j["read_bandwidth_gbs"] = report.read_bandwidth_gbs;
  for (const SpeedResult& r : report.results) {
    j["results"].push_back({{"test", r.test},
                            {"depth", r.depth},
                            {"n_tokens", r.n_tokens},
                            {"threads", r.n_threads},
                            {"tokens_per_s", r.tokens_per_s_mean},
                            {"tokens_per_s_stddev", r.tokens_per_s_stddev},
                            {"samples", r.samples_tokens_per_s},
                            {"bytes_per_token", r.bytes_per_token},
                            {"limit_tokens_per_s", r.limit_tokens_per_s}});
  }
  return j.dump(2);
}

}  // namespace kvsparse
