#include "kvsparse/bench_runner.h"
#include "kvsparse/engine.h"
#include "kvsparse/runtime.h"
#include "kvsparse/isa.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>

#include "kvsparse/bench_metrics.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/tokenizer.h"
#include "common/process_memory.h"
#include "common/timing.h"

namespace kvsparse {
namespace {

constexpr int32_t kFidelityChunk = 64;  // teacher-forced tokens per forward call in the fidelity task
constexpr const char* kUserTaskPrefix = "user:";
constexpr const char* kAllSamples = "*";  // aggregation key of every sample of a configuration

bool IsQuestionTask(const std::string& task) { return task != "fidelity" && task != "latency"; }

// Stable 64-bit mix for per-sample seeds (independent of the method, so every method sees
// the same samples).
uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29;
  return x;
}
uint64_t HashString(std::string_view s) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
  return h;
}

// The token classes of a model without a tokenizer: GGUF keys kvsparse.retrieval.{filler,keys,values}
// (the built-in retrieval model writes them), else a split of the id space above the first
// three (usually special) ids: half filler, a quarter keys, a quarter values.
StatusOr<TokenVocab> ModelTokenVocab(const Model& model) {
  TokenVocab vocab;
  if (const GgufFile* g = model.gguf(); g != nullptr && g->Find("kvsparse.retrieval.keys") != nullptr) {
    auto read = [&](const char* key, std::vector<int32_t>* out) -> Status {
      KVS_ASSIGN_OR_RETURN(std::vector<int64_t> ids, g->GetIntArray(key));
      out->assign(ids.begin(), ids.end());
      return Status::Ok();
    };
    KVS_RETURN_IF_ERROR(read("kvsparse.retrieval.filler", &vocab.filler));
    KVS_RETURN_IF_ERROR(read("kvsparse.retrieval.keys", &vocab.keys));
    KVS_RETURN_IF_ERROR(read("kvsparse.retrieval.values", &vocab.values));
  } else {
    const int32_t n = model.config().n_vocab, first = std::min<int32_t>(3, n / 8);
    const int32_t usable = n - first;
    if (usable < 8) {
      return InvalidArgumentError(fmt::format("model {} has {} token ids: too few for token-level tasks", model.path(), n));
    }
    const int32_t n_filler = usable / 2, n_keys = usable / 4;
    for (int32_t i = 0; i < usable; ++i) {
      const int32_t id = first + i;
      (i < n_filler ? vocab.filler : i < n_filler + n_keys ? vocab.keys : vocab.values).push_back(id);
    }
  }
  KVS_RETURN_IF_ERROR(ValidateTokenVocab(vocab, model.config().n_vocab));
  return vocab;
}

// One configuration's cache, policies and engine, reused for all its samples.

StatusOr<KvSparsityConfig> SparsityFor(const BenchSpec& spec, const BenchConfig& config, int n_layers) {
  KvSparsityConfig sparsity;
  if (config.method == "config") {
    // The file's own schedule (interval, pages, chunks, prefill eviction) is what runs.
    KVS_ASSIGN_OR_RETURN(sparsity, LoadKvSparsityConfig(spec.kv_config_file, n_layers));
    return sparsity;
  }
  KVS_ASSIGN_OR_RETURN(const KvMethodSpec method, ParseKvMethodSpec(config.method, "--methods"));
  KVS_ASSIGN_OR_RETURN(sparsity, KvSparsityConfigFromFlags(method.name, config.budget, config.kv_type, n_layers));
  KVS_RETURN_IF_ERROR(ApplyKvParams(method.params, &sparsity));
  if (!spec.sparse_prefill.empty()) {
    KVS_ASSIGN_OR_RETURN(const PrefillSparsity prefill, ParsePrefillSparsity(spec.sparse_prefill, "--sparse-prefill"));
    for (LayerKvConfig& layer : sparsity.layers) layer.prefill = prefill;
  }
  sparsity.evict_interval = BenchEvictInterval(spec, config);
  sparsity.page_size = spec.page_size;
  sparsity.prefill_chunk = spec.prefill_chunk;
  sparsity.prefill_eviction =
      spec.prefill_eviction == "chunk" ? PrefillEviction::kEveryChunk : PrefillEviction::kPromptEnd;
  KVS_RETURN_IF_ERROR(ValidateKvSparsityConfig(sparsity));
  return sparsity;
}

StatusOr<std::unique_ptr<Runtime>> MakeEngine(const Model& model, const KvSparsityConfig& sparsity,
                                              int32_t max_tokens, int n_threads, uint64_t seed) {
  return CreateRuntime(model, &sparsity, KvStorage::kF16, /*n_seqs=*/1, max_tokens, n_threads, seed);
}

double PolicySeconds(const SparseKvController& controller) {
  double s = 0;
  for (const SparseKvLayerStats& l : controller.layer_stats()) s += l.policy_s();
  return s;
}

// Per-configuration accumulators (per sample values, then summarized into the row).
struct RowAccumulator {
  BenchAggregator scores;               // (task, subtask, "score")
  std::vector<double> ttft_ms, decode_ms, generated_len, distinct2, policy_share;
  std::vector<double> kv_allocated, kv_live, kv_dense, kv_peak, policy_state;
  std::vector<double> kv_live_values, kv_live_scales, kv_live_positions, kv_live_residual;  // kv_live by part
  std::vector<double> kv_live_sliding;  // kv_live of the sliding-window layers (gemma2/3)
  std::vector<std::vector<double>> layer_live;  // [n_layers][samples] live tokens after the prompt
  FidelityAccumulator fidelity;
  std::optional<std::vector<int32_t>> first_generated;  // the first sample's greedy ids
  double seconds = 0;
};

// Fills acc.layer_live from the cache (live tokens per layer; per-head layers: the head mean).
void RecordLayerLive(const PagedKvCache& cache, RowAccumulator& acc) {
  const KvGeometry& g = cache.geometry();
  acc.layer_live.resize(g.n_layers);
  for (int layer = 0; layer < g.n_layers; ++layer) {
    double live = 0;
    if (cache.per_head(layer)) {
      for (int h = 0; h < g.n_kv_heads; ++h) live += cache.NumHeadTokens(0, layer, h);
      live /= g.n_kv_heads;
    } else {
      live = cache.NumTokens(0, layer);
    }
    acc.layer_live[layer].push_back(live);
  }
}

void RecordKv(const PagedKvCache& cache, const SparseKvController& controller, double dense_f16_bytes,
              RowAccumulator& acc) {
  acc.policy_state.push_back(static_cast<double>(controller.PolicyStateBytes()));
  acc.kv_allocated.push_back(static_cast<double>(cache.AllocatedBytes()));
  acc.kv_live.push_back(static_cast<double>(cache.LiveBytes()));
  const KvLiveBytesByPart parts = cache.LiveBytesByPart();
  acc.kv_live_values.push_back(static_cast<double>(parts.values));
  acc.kv_live_scales.push_back(static_cast<double>(parts.scales));
  acc.kv_live_positions.push_back(static_cast<double>(parts.positions));
  acc.kv_live_residual.push_back(static_cast<double>(parts.residual));
  acc.kv_peak.push_back(static_cast<double>(cache.Stats().peak_allocated_bytes));
  acc.kv_dense.push_back(dense_f16_bytes);
  size_t sliding = 0;
  for (int layer = 0; layer < cache.geometry().n_layers; ++layer) {
    if (cache.geometry().LayerWindow(layer) > 0) sliding += cache.LayerLiveBytes(layer);
  }
  acc.kv_live_sliding.push_back(static_cast<double>(sliding));
}

// The dense f16 baseline: llama.cpp's layout (sliding-window layers hold their window).
double DenseF16Bytes(const ModelConfig& c, int64_t tokens) { return c.DenseKvBytes(tokens, 2.0); }

// Feeds the prompt (and, question_after, the question as a second turn), then decodes greedily.
Status RunQuestionSample(const BenchSample& sample, BenchProtocol protocol, const Model& model,
                         const Tokenizer* tokenizer, Runtime& e, RowAccumulator& acc) {
  const ModelConfig& c = model.config();
  std::vector<float> logits(c.n_vocab);  // [n_vocab]
  KVS_RETURN_IF_ERROR(e.controller()->ResetSequence(0));
  e.controller()->ResetStats();
  const std::vector<int32_t> prompt = PromptTokens(sample, protocol);
  const auto t0 = Clock::now();
  KVS_RETURN_IF_ERROR(e.engine->Forward(0, prompt.data(), static_cast<int32_t>(prompt.size()), 0, logits.data()));
  int32_t pos = static_cast<int32_t>(prompt.size());
  if (protocol == BenchProtocol::kQuestionAfter && !sample.question.empty()) {
    // The context was compressed as it was processed; the question arrives as the next turn.
    KVS_RETURN_IF_ERROR(
        e.engine->Forward(0, sample.question.data(), static_cast<int32_t>(sample.question.size()), pos, logits.data()));
    pos += static_cast<int32_t>(sample.question.size());
  }
  const double ttft = Seconds(t0, Clock::now());
  RecordLayerLive(*e.paged_cache(), acc);
  const int32_t eos = tokenizer != nullptr ? tokenizer->eos() : -1;
  std::vector<int32_t> generated;
  int32_t token = ArgMax(logits);
  for (int32_t i = 0; i < std::max(1, sample.max_new_tokens); ++i) {
    if (token == eos) break;
    generated.push_back(token);
    if (i + 1 == sample.max_new_tokens) break;
    const auto s0 = Clock::now();
    KVS_RETURN_IF_ERROR(e.engine->Forward(0, &token, 1, pos++, logits.data()));
    acc.decode_ms.push_back(1e3 * Seconds(s0, Clock::now()));
    token = ArgMax(logits);
  }
  const double total = Seconds(t0, Clock::now());
  if (!acc.first_generated) acc.first_generated = generated;
  const double score = ScoreGeneration(sample, generated, tokenizer);
  acc.scores.Add(sample.task, sample.subtask, "score", score);
  acc.scores.Add(kAllSamples, kAllSamples, "score", score);
  acc.ttft_ms.push_back(1e3 * ttft);
  acc.generated_len.push_back(static_cast<double>(generated.size()));
  acc.distinct2.push_back(DistinctN(generated, 2));
  acc.policy_share.push_back(total > 0 ? PolicySeconds(*e.controller()) / total : 0.0);
  RecordKv(*e.paged_cache(), *e.controller(), DenseF16Bytes(c, pos), acc);
  return Status::Ok();
}

// A random prompt of `length` tokens, then `n_gen` greedy decode steps: latency and memory only.
Status RunLatencySample(int32_t length, int n_gen, uint64_t seed, const Model& model, Runtime& e,
                        RowAccumulator& acc) {
  const ModelConfig& c = model.config();
  std::mt19937_64 rng(seed);
  std::vector<int32_t> prompt(length);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.n_vocab));
  std::vector<float> logits(c.n_vocab);  // [n_vocab]
  KVS_RETURN_IF_ERROR(e.controller()->ResetSequence(0));
  e.controller()->ResetStats();
  const auto t0 = Clock::now();
  KVS_RETURN_IF_ERROR(e.engine->Forward(0, prompt.data(), length, 0, logits.data()));
  acc.ttft_ms.push_back(1e3 * Seconds(t0, Clock::now()));
  RecordLayerLive(*e.paged_cache(), acc);
  int32_t token = ArgMax(logits);
  std::vector<int32_t> generated;
  for (int i = 0; i < n_gen; ++i) {
    generated.push_back(token);
    const auto s0 = Clock::now();
    KVS_RETURN_IF_ERROR(e.engine->Forward(0, &token, 1, length + i, logits.data()));
    acc.decode_ms.push_back(1e3 * Seconds(s0, Clock::now()));
    token = ArgMax(logits);
  }
  const double total = Seconds(t0, Clock::now());
  acc.generated_len.push_back(n_gen);
  acc.distinct2.push_back(DistinctN(generated, 2));
  acc.policy_share.push_back(total > 0 ? PolicySeconds(*e.controller()) / total : 0.0);
  RecordKv(*e.paged_cache(), *e.controller(), DenseF16Bytes(c, length + n_gen), acc);
  return Status::Ok();
}

// The same stream teacher-forced through a dense full cache and through the configuration,
// kFidelityChunk tokens per call (the configuration evicts between calls).
Status RunFidelitySample(const std::vector<int32_t>& stream, const Model& model, Runtime& e, int n_threads,
                         RowAccumulator& acc) {
  const ModelConfig& c = model.config();
  const int32_t n = static_cast<int32_t>(stream.size());
  ContiguousKvCache full_cache(ModelKvGeometry(model, /*with_windows=*/false), KvStorage::kF32, 1, n);
  Engine full(model, &full_cache, n_threads);
  KVS_RETURN_IF_ERROR(e.controller()->ResetSequence(0));
  e.controller()->ResetStats();
  std::vector<float> full_logits(static_cast<size_t>(kFidelityChunk) * c.n_vocab);    // [chunk, n_vocab]
  std::vector<float> sparse_logits(static_cast<size_t>(kFidelityChunk) * c.n_vocab);  // [chunk, n_vocab]
  for (int32_t done = 0; done < n; done += kFidelityChunk) {
    const int32_t m = std::min(kFidelityChunk, n - done);
    KVS_RETURN_IF_ERROR(full.Forward(0, stream.data() + done, m, done, full_logits.data(), /*all_logits=*/true));
    KVS_RETURN_IF_ERROR(e.engine->Forward(0, stream.data() + done, m, done, sparse_logits.data(), /*all_logits=*/true));
    for (int32_t i = 0; i < m; ++i) {
      const size_t row = static_cast<size_t>(i) * c.n_vocab;
      const int32_t next = done + i + 1 < n ? stream[done + i + 1] : -1;
      acc.fidelity.Add(std::span<const float>(full_logits.data() + row, c.n_vocab),
                       std::span<const float>(sparse_logits.data() + row, c.n_vocab), next);
    }
  }
  RecordLayerLive(*e.paged_cache(), acc);
  RecordKv(*e.paged_cache(), *e.controller(), DenseF16Bytes(c, n), acc);
  return Status::Ok();
}

nlohmann::json Summary(const std::vector<double>& values) {
  if (values.empty()) return nullptr;
  const LatencySummary s = SummarizeLatency(values);
  return {{"mean", s.mean}, {"median", s.median}, {"p90", s.p90}};
}
double Mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}
double Max(const std::vector<double>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }
// JSON has no NaN: absent metrics become null.
nlohmann::json Finite(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

}  // namespace

std::string BenchConfig::Key(const BenchSpec& spec) const {
  // Everything that changes a row's outcome: a rerun with other settings is a new configuration.
  std::string depths;
  for (double d : spec.depths) depths += fmt::format("{}{:g}", depths.empty() ? "" : ",", d);
  std::string schedule = method == "config"
                             ? fmt::format("file={:016x}", HashString(spec.kv_config_file))
                             : fmt::format("{}/i{}/p{}/c{}", spec.prefill_eviction, BenchEvictInterval(spec, *this),
                                           spec.page_size > 0 ? spec.page_size
                                           : IsKiviStorage(KvStorageFromName(kv_type).value_or(KvStorage::kF16))
                                               ? kKiviPageSize
                                               : kDefaultPageSize,
                                           spec.prefill_chunk);
  // KIVI rows since issue 28 (f16 scales, V groups of 32, a 128-token window) differ from
  // earlier ones at the same page size: a new key, so a resumed run does not reuse old rows.
  if (IsKiviStorage(KvStorageFromName(kv_type).value_or(KvStorage::kF16))) schedule += "/kivi-r128-g32-f16";
  std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|n{}|s{}|{}|v{}|d{}|g{}", spec.model_name, task,
                                IsQuestionTask(task) ? BenchProtocolName(protocol) : "-", method,
                                budget.empty() ? "-" : budget, kv_type.empty() ? "-" : kv_type, length, spec.samples,
                                spec.seed, schedule, spec.value_tokens, depths, spec.latency_gen);
  if (task == "fidelity") key += "|" + BenchFidelitySource(spec).Label();
  if (!spec.sparse_prefill.empty() && method != "config") key += "|prefill=" + spec.sparse_prefill;
  return key;
}

int BenchEvictInterval(const BenchSpec& spec, const BenchConfig& config) {
  if (spec.evict_interval > 0) return spec.evict_interval;
  const int serving = KvSparsityConfig{}.evict_interval;
  // Latency rows time what a server runs; accuracy and fidelity rows follow the papers.
  if (config.task == "latency") return serving;
  const auto parsed = ParseKvMethodSpec(config.method, "--methods");
  const std::optional<KvMethod> method = parsed.ok() ? KvMethodFromName(parsed->name) : std::nullopt;
  const int paper = method ? PaperEvictInterval(*method) : 0;
  // 0: the method does not evict while decoding, so any valid interval gives the same outcome.
  return paper > 0 ? paper : serving;
}

FidelityStreamSource BenchFidelitySource(const BenchSpec& spec) {
  FidelityStreamSource source;
  source.seed = spec.seed;
  if (!spec.fidelity_text.empty()) {
    source.kind = FidelityStreamKind::kText;
    source.path = spec.fidelity_text;
  } else if (!spec.fidelity_tokens.empty()) {
    source.kind = FidelityStreamKind::kTokens;
    source.path = spec.fidelity_tokens;
  }
  return source;
}

std::vector<BenchConfig> EnumerateBenchConfigs(const BenchSpec& spec) {
  std::vector<BenchConfig> out;
  for (const std::string& task : spec.tasks) {
    std::vector<BenchProtocol> protocols = spec.protocols;
    if (!IsQuestionTask(task)) protocols = {BenchProtocol::kQuestionLast};
    for (BenchProtocol protocol : protocols) {
      for (int32_t length : spec.lengths) {
        auto add = [&](const std::string& method, const std::string& budget, const std::string& kv_type) {
          out.push_back(BenchConfig{task, protocol, method, budget, kv_type, length});
        };
        if (!spec.kv_config_file.empty()) {
          add("config", "", "");
          continue;
        }
        for (const std::string& kv_type : spec.kv_types) {
          for (const std::string& method : spec.methods) {
            if (method == "full") {
              add(method, "", kv_type);
              continue;
            }
            for (const std::string& budget : spec.budgets) add(method, budget, kv_type);
          }
        }
      }
    }
  }
  return out;
}

Status ValidateBenchSpec(const BenchSpec& spec) {
  if (spec.samples < 1) return InvalidArgumentError(fmt::format("--samples: expected >= 1, found {}", spec.samples));
  if (spec.value_tokens < 1) {
    return InvalidArgumentError(fmt::format("--value-tokens: expected >= 1, found {}", spec.value_tokens));
  }
  if (spec.lengths.empty()) return InvalidArgumentError("--lengths: give at least one context length");
  for (int32_t length : spec.lengths) {
    if (length < 16) return InvalidArgumentError(fmt::format("--lengths: {} is too short (at least 16 tokens)", length));
  }
  if (spec.tasks.empty()) return InvalidArgumentError("--tasks: give at least one task");
  for (const std::string& task : spec.tasks) {
    if (!IsQuestionTask(task) || task.rfind(kUserTaskPrefix, 0) == 0) continue;
    KVS_RETURN_IF_ERROR(ParseBenchTask(task).status());
  }
  if (spec.kv_config_file.empty()) {
    for (const std::string& method : spec.methods) {
      KVS_RETURN_IF_ERROR(ParseKvMethodSpec(method, "--methods").status());
    }
    for (const std::string& budget : spec.budgets) KVS_RETURN_IF_ERROR(ParseKvBudget(budget).status());
    for (const std::string& kv_type : spec.kv_types) {
      if (!KvStorageFromName(kv_type)) {
        return InvalidArgumentError(fmt::format("--kv-types: unknown KV storage type '{}'", kv_type));
      }
    }
  }
  for (double d : spec.depths) {
    if (!(d >= 0 && d <= 1)) return InvalidArgumentError(fmt::format("--depths: {} is outside [0, 1]", d));
  }
  if (spec.depths.empty()) return InvalidArgumentError("--depths: give at least one depth");
  if (spec.evict_interval < 0) {
    return InvalidArgumentError(fmt::format(
        "--evict-interval: expected >= 1 (or 0: each method's paper cadence), found {}", spec.evict_interval));
  }
  if (!spec.fidelity_text.empty() || !spec.fidelity_tokens.empty()) {
    const char* flag = spec.fidelity_text.empty() ? "--fidelity-tokens" : "--fidelity-text";
    if (!spec.fidelity_text.empty() && !spec.fidelity_tokens.empty()) {
      return InvalidArgumentError("--fidelity-text and --fidelity-tokens: give at most one fidelity stream");
    }
    if (std::find(spec.tasks.begin(), spec.tasks.end(), "fidelity") == spec.tasks.end()) {
      return InvalidArgumentError(
          fmt::format("{} sets the stream of the fidelity task: add fidelity to --tasks", flag));
    }
    const std::string& path = spec.fidelity_text.empty() ? spec.fidelity_tokens : spec.fidelity_text;
    if (!std::ifstream(path)) return InvalidArgumentError(fmt::format("{}: cannot read {}", flag, path));
  }
  if (!spec.sparse_prefill.empty()) {
    KVS_RETURN_IF_ERROR(ParsePrefillSparsity(spec.sparse_prefill, "--sparse-prefill").status());
  }
  if (spec.prefill_eviction != "chunk" && spec.prefill_eviction != "prompt_end") {
    return InvalidArgumentError(
        fmt::format("--prefill-eviction: expected chunk or prompt_end, found '{}'", spec.prefill_eviction));
  }
  return Status::Ok();
}

StatusOr<std::vector<BenchSample>> BenchQuestionSamples(const BenchSpec& spec, const BenchConfig& config,
                                                        const Model& model, const Tokenizer* tokenizer) {
  const uint64_t base_seed = Mix(Mix(spec.seed, HashString(config.task)), static_cast<uint64_t>(config.length));
  std::vector<BenchSample> samples;
  if (config.task.rfind(kUserTaskPrefix, 0) == 0) {
    if (tokenizer == nullptr) {
      return InvalidArgumentError(fmt::format("task {}: user tasks are text and model {} has no tokenizer",
                                              config.task, model.path()));
    }
    KVS_ASSIGN_OR_RETURN(std::vector<UserTaskRecord> records,
                         LoadUserTasks(config.task.substr(std::char_traits<char>::length(kUserTaskPrefix))));
    UserSampleOptions options;
    options.max_context_tokens = config.length;
    for (size_t i = 0; i < records.size() && static_cast<int>(i) < spec.samples; ++i) {
      samples.push_back(BuildUserSample(records[i], *tokenizer, options));
    }
    return samples;
  }
  KVS_ASSIGN_OR_RETURN(BenchTask task, ParseBenchTask(config.task));
  std::optional<TokenVocab> vocab;
  if (tokenizer == nullptr) {
    if (!HasTokenLevelForm(task)) {
      return InvalidArgumentError(fmt::format("task {} is text-only and model {} has no tokenizer", config.task,
                                              model.path()));
    }
    KVS_ASSIGN_OR_RETURN(vocab, ModelTokenVocab(model));
  }
  for (int i = 0; i < spec.samples; ++i) {
    BenchTaskOptions options;
    options.depth = spec.depths[static_cast<size_t>(i) % spec.depths.size()];
    options.value_tokens = spec.value_tokens;
    if (task == BenchTask::kNiahMultiKey || task == BenchTask::kNiahMultiQuery) {
      // Every needle's values must be distinct tokens: fit the keys to the vocabulary.
      const int32_t fit = vocab ? static_cast<int32_t>(vocab->values.size()) / spec.value_tokens : options.n_keys;
      options.n_keys = std::max<int32_t>(2, std::min<int32_t>(options.n_keys, fit));
    }
    const uint64_t seed = Mix(base_seed, static_cast<uint64_t>(i));
    StatusOr<BenchSample> sample = tokenizer != nullptr
                                       ? GenerateTextSample(task, *tokenizer, config.length, seed, options)
                                       : GenerateTokenSample(task, *vocab, config.length, seed, options);
    if (!sample.ok()) {
      return Status(sample.status().code(),
                    fmt::format("task {} at length {}: {}", config.task, config.length, sample.status().message()));
    }
    samples.push_back(std::move(*sample));
  }
  return samples;
}

StatusOr<nlohmann::json> RunBenchConfig(const BenchSpec& spec, const BenchConfig& config, const Model& model,
                                        const Tokenizer* tokenizer, FidelityStreamCache* streams) {
  const ModelConfig& c = model.config();
  const int n_threads = spec.n_threads > 0 ? spec.n_threads : omp_get_num_procs();
  KVS_ASSIGN_OR_RETURN(KvSparsityConfig sparsity, SparsityFor(spec, config, c.n_layers));
  KVS_RETURN_IF_ERROR(ResolveSlidingLayers(model, &sparsity));  // what runs (and what the row reports): windowed sliding layers
  const auto t_start = Clock::now();
  RowAccumulator acc;
  const uint64_t base_seed = Mix(Mix(spec.seed, HashString(config.task)), static_cast<uint64_t>(config.length));

  // The samples (the same for every method, protocol and kv type).
  std::vector<BenchSample> samples;
  FidelityStreamCache local_streams;  // when the caller keeps none
  const std::vector<std::vector<int32_t>>* fidelity_streams = nullptr;  // [streams][length]
  if (config.task == "fidelity") {
    // The same streams for every method of the run (bench_fidelity.h).
    FidelityStreamCache& cache = streams != nullptr ? *streams : local_streams;
    if (!cache.count(config.length)) {
      KVS_ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> made,
                           MakeFidelityStreams(BenchFidelitySource(spec), model, tokenizer, config.length,
                                               spec.samples, n_threads));
      cache[config.length] = std::move(made);
    }
    fidelity_streams = &cache[config.length];
  } else if (IsQuestionTask(config.task)) {
    KVS_ASSIGN_OR_RETURN(samples, BenchQuestionSamples(spec, config, model, tokenizer));
  }

  int32_t max_tokens = config.length + 64;
  for (const BenchSample& s : samples) {
    max_tokens = std::max<int32_t>(
        max_tokens, static_cast<int32_t>(s.context.size() + s.question.size()) + s.max_new_tokens + 8);
  }
  if (config.task == "latency") max_tokens = config.length + spec.latency_gen + 8;
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> runtime, MakeEngine(model, sparsity, max_tokens, n_threads, spec.seed));
  Runtime& e = *runtime;

  ResetPeakRss();
  if (config.task == "latency") {
    for (int i = 0; i < spec.samples; ++i) {
      KVS_RETURN_IF_ERROR(RunLatencySample(config.length, spec.latency_gen, Mix(base_seed, i), model, e, acc));
    }
  } else if (config.task == "fidelity") {
    for (const std::vector<int32_t>& s : *fidelity_streams) {
      KVS_RETURN_IF_ERROR(RunFidelitySample(s, model, e, n_threads, acc));
    }
  } else {
    for (const BenchSample& s : samples) {
      KVS_RETURN_IF_ERROR(RunQuestionSample(s, config.protocol, model, tokenizer, e, acc));
    }
  }
  acc.seconds = Seconds(t_start, Clock::now());

  nlohmann::json row;
  row["key"] = config.Key(spec);
  row["model"] = spec.model_name;
  row["task"] = config.task;
  row["protocol"] = IsQuestionTask(config.task) ? std::string(BenchProtocolName(config.protocol)) : "-";
  row["method"] = config.method;
  row["budget"] = config.budget;
  row["kv_type"] = config.kv_type;
  row["length"] = config.length;
  row["samples"] = static_cast<int>(config.task == "latency"  ? spec.samples
                                    : fidelity_streams != nullptr ? fidelity_streams->size()
                                                                  : samples.size());
  row["seed"] = spec.seed;
  row["prefill_eviction"] = sparsity.prefill_eviction == PrefillEviction::kPromptEnd ? "prompt_end" : "chunk";
  row["prefill"] = PrefillSparsitySummary(sparsity.layers.empty() ? PrefillSparsity{} : sparsity.layers[0].prefill);
  row["evict_interval"] = sparsity.evict_interval;  // what ran: the paper cadence, the flag or the file's
  if (fidelity_streams != nullptr) {
    row["stream"] = BenchFidelitySource(spec).Label();
    row["stream_hash"] = FidelityStreamHash(*fidelity_streams);
  }
  row["kv_config"] = KvSparsityConfigSummary(sparsity);
  row["isa"] = IsaName(ActiveIsa());  // kernel family: latency figures depend on it
  if (std::optional<MetricSummary> all = acc.scores.Get(kAllSamples, kAllSamples, "score")) {
    row["accuracy"] = all->mean;
    row["accuracy_ci"] = {all->ci_low, all->ci_high};
    // Per subtask (user files may hold several tasks: "task/subtask").
    nlohmann::json subtasks = nlohmann::json::object();
    for (const BenchAggregator::Row& r : acc.scores.Rows()) {
      if (r.task == kAllSamples) continue;
      const std::string name = r.task == samples.front().task ? r.subtask : r.task + "/" + r.subtask;
      subtasks[name] = {{"n", r.summary.n}, {"accuracy", r.summary.mean}, {"ci", {r.summary.ci_low, r.summary.ci_high}}};
    }
    row["subtasks"] = subtasks;
  }
  // A check that another front end runs the same config alike (calibrate's round trip).
  if (acc.first_generated) row["first_generated"] = *acc.first_generated;
  if (acc.fidelity.positions() > 0) {
    row["kl"] = Finite(acc.fidelity.mean_kl());
    row["top1_agreement"] = Finite(acc.fidelity.top1_agreement());
    row["ppl_full"] = Finite(acc.fidelity.perplexity_full());
    row["ppl"] = Finite(acc.fidelity.perplexity_sparse());
    row["ppl_change"] = Finite(acc.fidelity.perplexity_change());
  }
  row["ttft_ms"] = Summary(acc.ttft_ms);
  row["decode_ms"] = Summary(acc.decode_ms);
  const double decode_median = acc.decode_ms.empty() ? 0 : SummarizeLatency(acc.decode_ms).median;
  row["decode_tokens_per_s"] = decode_median > 0 ? 1e3 / decode_median : 0.0;
  row["kv_allocated_bytes"] = Mean(acc.kv_allocated);
  row["kv_live_bytes"] = Mean(acc.kv_live);
  // What the live bytes hold: K/V values (codes), scales and zero points, positions, KIVI's f16 residual.
  row["kv_live_value_bytes"] = Mean(acc.kv_live_values);
  row["kv_live_scale_bytes"] = Mean(acc.kv_live_scales);
  row["kv_live_position_bytes"] = Mean(acc.kv_live_positions);
  row["kv_live_residual_bytes"] = Mean(acc.kv_live_residual);
  row["kv_peak_allocated_bytes"] = Max(acc.kv_peak);
  // The policies' own memory (scores, rings, rankings, page metadata) at the end of a sample.
  row["policy_state_bytes"] = Mean(acc.policy_state);
  row["kv_dense_f16_bytes"] = Mean(acc.kv_dense);  // llama.cpp's layout: sliding layers hold their window
  row["kv_live_sliding_bytes"] = Mean(acc.kv_live_sliding);  // of kv_live_bytes: the sliding-window layers
  row["kv_ratio"] = Mean(acc.kv_dense) > 0 ? Mean(acc.kv_allocated) / Mean(acc.kv_dense) : 0.0;
  row["peak_rss_bytes"] = PeakRssBytes();
  row["policy_share"] = Mean(acc.policy_share);
  row["generated_len"] = Mean(acc.generated_len);
  row["distinct2"] = Mean(acc.distinct2);
  nlohmann::json layers = nlohmann::json::array();
  for (const std::vector<double>& l : acc.layer_live) layers.push_back(Mean(l));
  row["layer_live_tokens"] = layers;
  row["seconds"] = acc.seconds;
  return row;
}

Status RunBench(const BenchSpec& spec, const BenchRunOptions& options) {
  KVS_RETURN_IF_ERROR(ValidateBenchSpec(spec));
  KVS_ASSIGN_OR_RETURN(BenchResultStore store, BenchResultStore::Open(options.results_path));
  const std::vector<BenchConfig> configs = EnumerateBenchConfigs(spec);
  std::vector<const BenchConfig*> todo;
  for (size_t i = 0; i < configs.size(); ++i) {
    if (options.shard.Owns(i) && !store.Has(configs[i].Key(spec))) todo.push_back(&configs[i]);
  }
  if (todo.empty()) return Status::Ok();
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(spec.model_path));
  // LongRoPE files pick their factor table by context, once per process: by the longest length.
  int32_t longest = 0;
  for (const BenchConfig* config : todo) longest = std::max(longest, config->length);
  model->SetContextLength(longest);
  std::unique_ptr<Tokenizer> tokenizer;
  if (model->gguf() != nullptr && model->gguf()->Find("tokenizer.ggml.tokens") != nullptr) {
    KVS_ASSIGN_OR_RETURN(tokenizer, Tokenizer::FromGguf(*model->gguf()));
  }
  FidelityStreamCache streams;
  if (const FidelityStreamSource source = BenchFidelitySource(spec); source.kind != FidelityStreamKind::kSampled) {
    // A stream file's faults (no tokenizer, bad ids, too short) show before any configuration runs.
    for (int32_t length : spec.lengths) {
      KVS_ASSIGN_OR_RETURN(streams[length], MakeFidelityStreams(source, *model, tokenizer.get(), length, spec.samples,
                                                                /*n_threads=*/1));
    }
  }
  const auto t0 = Clock::now();
  for (size_t i = 0; i < todo.size(); ++i) {
    StatusOr<nlohmann::json> row = RunBenchConfig(spec, *todo[i], *model, tokenizer.get(), &streams);
    if (!row.ok()) {
      return Status(row.status().code(),
                    fmt::format("configuration {}: {}", todo[i]->Key(spec), row.status().message()));
    }
    KVS_RETURN_IF_ERROR(store.Append(*row));
    if (options.progress) options.progress(i + 1, todo.size(), Seconds(t0, Clock::now()), todo[i]->Key(spec));
  }
  return Status::Ok();
}

}  // namespace kvsparse
