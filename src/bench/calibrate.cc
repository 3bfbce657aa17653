#include "kvsparse/calibrate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "kvsparse/bench_report.h"
#include "kvsparse/bench_runner.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/model.h"
#include "kvsparse/tokenizer.h"
#include "common/timing.h"

namespace kvsparse {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kHoldoutSeedOffset = 1000003;  // held-out samples: another seed, same generator

// One layer of a candidate: dense (method < 0) or a method of the spec at a rung of the ladder;
// kv_type indexes the spec's storage ladder (-1: f16, the reference's).
struct LayerChoice {
  int method = -1;
  int budget = 0;
  int kv_type = 0;
  // Fitted per length (phase 5b): the rung at each of lengths_; empty: `budget` at every length.
  std::vector<int> by_length;
  // Cumulative layers (phase 5c): the shared ranking's re-rank period; 0: the method's own.
  int rerank_period = 0;
  int RungAt(size_t length_index) const { return by_length.empty() ? budget : by_length[length_index]; }
  bool operator==(const LayerChoice&) const = default;
};
using Candidate = std::vector<LayerChoice>;  // [n_layers]

LayerChoice Choice(int method, int budget, int kv_type) {
  LayerChoice c;
  c.method = method;
  c.budget = budget;
  c.kv_type = kv_type;
  return c;
}

struct Cell {
  std::string task;
  BenchProtocol protocol = BenchProtocol::kQuestionLast;
  int32_t length = 0;
  bool fidelity() const { return task == "fidelity"; }
  std::string Name() const {
    return fidelity() ? fmt::format("{}@{}", task, length)
                      : fmt::format("{}/{}@{}", task, BenchProtocolName(protocol), length);
  }
};

struct Evaluation {
  bool pass = true;
  bool complete = false;     // every asked cell ran (a failing cell stops a short-circuited one)
  std::vector<json> rows;    // per cell run, in cell order
};

bool IsQuestion(const std::string& task) { return task != "fidelity"; }

// The ladder in ascending order of the share of the shortest length it keeps.
double BudgetShare(const KvBudget& b, double length) {
  return b.is_fraction() ? b.fraction : std::min(1.0, b.tokens / length);
}

// The bench spec of the user's tasks, lengths and candidates: what ValidateBenchSpec checks, and
// what each evaluation runs with its config file, samples and seed.
BenchSpec BaseBenchSpec(const CalibrateSpec& spec) {
  BenchSpec bench;
  bench.model_path = spec.model_path;
  bench.model_name = spec.model_name;
  bench.tasks = spec.tasks;
  bench.lengths = spec.lengths;
  bench.protocols = spec.protocols;
  bench.methods = spec.methods;
  bench.budgets = spec.budgets;
  bench.kv_types = spec.kv_types;
  bench.samples = spec.samples;
  bench.seed = spec.seed;
  bench.n_threads = spec.n_threads;
  bench.value_tokens = spec.value_tokens;
  bench.depths = spec.depths;
  bench.prefill_eviction = spec.prefill_eviction;
  bench.evict_interval = spec.evict_interval;
  bench.fidelity_text = spec.fidelity_text;
  bench.fidelity_tokens = spec.fidelity_tokens;
  return bench;
}

class Calibrator {
 public:
  Calibrator(const CalibrateSpec& spec, const CalibrateOptions& options, const Model& model, const Tokenizer* tokenizer)
      : spec_(spec), options_(options), model_(model), tokenizer_(tokenizer), n_layers_(model.config().n_layers) {}

  Status Init();
  StatusOr<CalibrateResult> Run();

 private:
  // Reads every evaluations*.jsonl of the work folder (other shards' included) and opens this
  // process's own file for appending.
  Status OpenCache();
  KvSparsityConfig ConfigFor(const Candidate& c) const;
  double EstimatedShare(const Candidate& c) const;
  std::string Describe(const Candidate& c) const;
  std::string BudgetName(const LayerChoice& ch) const;  // "0.1", or "0.1@1024/0.05@4096"
  bool Passes(size_t cell, const json& row, const json& reference) const;
  // Runs `c` on `cells` (indices into cells_) with `samples` per cell and seed `seed`; stops at
  // the first failing cell when `short_circuit`. `reference` (cell -> row) decides passing; null
  // for the reference itself.
  StatusOr<Evaluation> Evaluate(const Candidate& c, const std::vector<size_t>& cells, int samples, uint64_t seed,
                                bool short_circuit, const std::map<size_t, json>* reference, const std::string& phase);
  // The bench spec that runs `config_path` with `samples` per cell and seed `seed`.
  BenchSpec BenchSpecFor(const std::string& config_path, int samples, uint64_t seed) const;
  // The first held-out sample of the first question_last cell, its prompt and the calibrated
  // config's greedy ids: what `generate --kv-config` must reproduce.
  StatusOr<json> RoundTripCheck(const Evaluation& held, uint64_t seed) const;
  double SecondsLeft() const;
  void Report(const std::string& phase, size_t done, size_t total);
  json CandidateJson(const Candidate& c, const Evaluation& e) const;

  const CalibrateSpec& spec_;
  const CalibrateOptions& options_;
  const Model& model_;
  const Tokenizer* tokenizer_;
  const int n_layers_;
  std::vector<KvMethodSpec> methods_;
  std::vector<KvBudget> budgets_;            // ascending
  std::vector<std::string> budget_names_;    // as given, same order
  std::vector<KvStorage> kv_types_;
  std::vector<std::vector<LayerKvConfig>> templates_;  // [method][budget]; method kFull where invalid
  std::vector<std::vector<uint8_t>> valid_;             // [method][budget]
  std::vector<Cell> cells_;                  // shortest length first
  std::vector<int32_t> lengths_;             // ascending, distinct
  std::map<std::string, json> cache_;        // key -> row
  std::unique_ptr<BenchResultStore> store_;
  std::map<std::pair<int, uint64_t>, FidelityStreamCache> streams_;  // (samples, seed) -> streams
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  json log_ = json::array();  // every evaluation, in order
  std::map<std::string, size_t> phase_done_;
  std::map<std::string, size_t> phase_total_;
};

Status Calibrator::Init() {
  for (const std::string& m : spec_.methods) {
    StatusOr<KvMethodSpec> parsed = ParseKvMethodSpec(m, "--methods");
    if (!parsed.ok()) return parsed.status();
    if (parsed->name == "full") return InvalidArgumentError("--methods: 'full' is not a candidate (dense layers always are)");
    methods_.push_back(std::move(*parsed));
  }
  const double shortest = *std::min_element(spec_.lengths.begin(), spec_.lengths.end());
  std::vector<std::pair<KvBudget, std::string>> ladder;
  for (const std::string& b : spec_.budgets) {
    StatusOr<KvBudget> parsed = ParseKvBudget(b);
    if (!parsed.ok()) return InvalidArgumentError("--budgets: " + parsed.status().message());
    ladder.emplace_back(*parsed, b);
  }
  std::stable_sort(ladder.begin(), ladder.end(), [&](const auto& a, const auto& b) {
    return BudgetShare(a.first, shortest) < BudgetShare(b.first, shortest);
  });
  for (auto& [b, name] : ladder) {
    budgets_.push_back(b);
    budget_names_.push_back(name);
  }
  for (const std::string& t : spec_.kv_types) {
    std::optional<KvStorage> s = KvStorageFromName(t);
    if (!s) return InvalidArgumentError(fmt::format("--kv-types: unknown KV storage type '{}'", t));
    kv_types_.push_back(*s);
  }
  // A (method, budget) the method rejects (a token budget below its sinks and window) is skipped.
  templates_.assign(methods_.size(), std::vector<LayerKvConfig>(budgets_.size()));
  valid_.assign(methods_.size(), std::vector<uint8_t>(budgets_.size(), 0));
  for (size_t m = 0; m < methods_.size(); ++m) {
    for (size_t b = 0; b < budgets_.size(); ++b) {
      StatusOr<KvSparsityConfig> one = KvSparsityConfigFromFlags(methods_[m].name, budget_names_[b], "f16", 1);
      if (!one.ok()) continue;
      // A parameter error is the user's to fix, not a rung to skip.
      if (Status s = ApplyKvParams(methods_[m].params, &*one); !s.ok()) {
        return InvalidArgumentError(fmt::format("--methods {}: {}", spec_.methods[m], s.message()));
      }
      templates_[m][b] = one->layers[0];
      templates_[m][b].named_by_layers_entry = true;
      valid_[m][b] = 1;
    }
  }
  std::vector<int32_t> lengths = spec_.lengths;
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  lengths_ = lengths;
  for (int32_t length : lengths) {
    for (const std::string& task : spec_.tasks) {
      if (!IsQuestion(task)) {
        cells_.push_back({task, BenchProtocol::kQuestionLast, length});
        continue;
      }
      for (BenchProtocol p : spec_.protocols) cells_.push_back({task, p, length});
    }
  }
  std::error_code ec;
  fs::create_directories(fs::path(options_.work_dir) / "configs", ec);
  if (ec) return InvalidArgumentError(fmt::format("-o: cannot create {}: {}", options_.work_dir, ec.message()));
  return OpenCache();
}

Status Calibrator::OpenCache() {
  const std::string own = options_.shard.count > 1 ? fmt::format("evaluations.shard{}of{}.jsonl", options_.shard.index,
                                                                 options_.shard.count)
                                                   : std::string("evaluations.jsonl");
  // Other shards' files are only read (a shard may be appending to its own): a line that does not
  // parse, such as one being written, is left for later.
  for (const fs::directory_entry& entry : fs::directory_iterator(options_.work_dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("evaluations", 0) != 0 || entry.path().extension() != ".jsonl" || name == own) continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      json row = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (row.is_object() && row.contains("key") && row["key"].is_string()) {
        cache_.emplace(row["key"].get<std::string>(), std::move(row));
      }
    }
  }
  KVS_ASSIGN_OR_RETURN(BenchResultStore store, BenchResultStore::Open((fs::path(options_.work_dir) / own).string()));
  for (const json& row : store.rows()) cache_.emplace(row["key"].get<std::string>(), row);
  store_ = std::make_unique<BenchResultStore>(std::move(store));
  return Status::Ok();
}

KvSparsityConfig Calibrator::ConfigFor(const Candidate& c) const {
  KvSparsityConfig config;
  config.layers.resize(n_layers_);
  int cadence = 0;  // the least paper cadence of the methods used
  // Per-layer candidates give each cumulative layer its own retention (the searched budget), in
  // place of the method's depth schedule; a uniform candidate keeps the method as given.
  const bool uniform = std::all_of(c.begin(), c.end(), [&](const LayerChoice& ch) { return ch == c[0]; });
  for (int l = 0; l < n_layers_; ++l) {
    const LayerChoice& ch = c[l];
    LayerKvConfig layer;
    if (ch.method >= 0) {
      layer = templates_[ch.method][ch.budget];
      if (layer.method == KvMethod::kCumulative) {
        if (!uniform) layer.params.schedule = RetentionSchedule::kNone;
        if (ch.rerank_period > 0) layer.params.rerank_period = ch.rerank_period;
      }
      const int paper = PaperEvictInterval(layer.method);
      if (paper > 0) cadence = cadence == 0 ? paper : std::min(cadence, paper);
      if (!ch.by_length.empty()) {  // each length's rung as a fraction of that length
        std::vector<std::pair<int32_t, double>> points;
        for (size_t k = 0; k < lengths_.size(); ++k)
          points.emplace_back(lengths_[k], BudgetShare(budgets_[ch.by_length[k]], lengths_[k]));
        layer.budget = KvBudget::ByLength(std::move(points));
      }
    }
    layer.kv_type = ch.kv_type < 0 ? KvStorage::kF16 : kv_types_[ch.kv_type];
    layer.named_by_layers_entry = true;
    config.layers[l] = layer;
  }
  if (spec_.evict_interval > 0) config.evict_interval = spec_.evict_interval;
  else if (cadence > 0) config.evict_interval = cadence;
  config.prefill_eviction = spec_.prefill_eviction == "chunk" ? PrefillEviction::kEveryChunk : PrefillEviction::kPromptEnd;
  return config;
}

// The share of the dense f16 cache a candidate holds (memory) or reads per decode step (speed),
// from its budgets at the mean length: what the search ranks by; reports give the measured bytes.
double Calibrator::EstimatedShare(const Candidate& c) const {
  double total = 0;
  for (int l = 0; l < n_layers_; ++l) {
    const LayerChoice& ch = c[l];
    const double bits = KvStorageBits(ch.kv_type < 0 ? KvStorage::kF16 : kv_types_[ch.kv_type]) / 16.0;
    for (size_t k = 0; k < lengths_.size(); ++k) {  // the mean over the lengths served
      double share = 1.0;
      if (ch.method >= 0) {
        const LayerKvConfig& t = templates_[ch.method][ch.budget];
        const bool keeps_every_token = t.method == KvMethod::kQuest || t.method == KvMethod::kOracle ||
                                       t.method == KvMethod::kReuse ||
                                       (t.method == KvMethod::kCumulative && t.params.mode == CumulativeMode::kMask);
        share = keeps_every_token && spec_.objective == "memory" ? 1.0
                                                                  : BudgetShare(budgets_[ch.RungAt(k)], lengths_[k]);
      }
      total += bits * share;
    }
  }
  return total / (n_layers_ * static_cast<double>(lengths_.size()));
}

std::string Calibrator::Describe(const Candidate& c) const {
  std::string out;
  for (int l = 0; l < n_layers_;) {
    int last = l;
    while (last + 1 < n_layers_ && c[last + 1] == c[l]) ++last;
    const LayerChoice& ch = c[l];
    const std::string kv = ch.kv_type < 0 ? "f16" : spec_.kv_types[ch.kv_type];
    std::string what = ch.method < 0 ? "full " + kv
                                     : fmt::format("{} {} {}", spec_.methods[ch.method], BudgetName(ch), kv);
    if (ch.rerank_period > 0) what += fmt::format(" rerank_period={}", ch.rerank_period);
    out += fmt::format("{}{}: {}", out.empty() ? "" : "; ", l == last ? fmt::format("L{}", l) : fmt::format("L{}-{}", l, last),
                       what);
    l = last + 1;
  }
  return out;
}

std::string Calibrator::BudgetName(const LayerChoice& ch) const {
  if (ch.method < 0) return "-";
  if (ch.by_length.empty()) return budget_names_[ch.budget];
  std::string out;
  for (size_t k = 0; k < lengths_.size(); ++k)
    out += fmt::format("{}{}@{}", out.empty() ? "" : "/", budget_names_[ch.by_length[k]], lengths_[k]);
  return out;
}

bool Calibrator::Passes(size_t cell, const json& row, const json& reference) const {
  if (cells_[cell].fidelity()) {
    return row.contains("kl") && row["kl"].is_number() && row["kl"].get<double>() <= spec_.kl_max;
  }
  const double acc = row.value("accuracy", 0.0), ref = reference.value("accuracy", 0.0);
  return acc + 1e-9 >= spec_.keep * ref;
}

double Calibrator::SecondsLeft() const {
  if (spec_.max_minutes <= 0) return -1;
  return spec_.max_minutes * 60 - Seconds(start_, std::chrono::steady_clock::now());
}

void Calibrator::Report(const std::string& phase, size_t done, size_t total) {
  if (options_.progress) options_.progress(phase, done, total, Seconds(start_, std::chrono::steady_clock::now()), SecondsLeft());
}

BenchSpec Calibrator::BenchSpecFor(const std::string& config_path, int samples, uint64_t seed) const {
  BenchSpec bench = BaseBenchSpec(spec_);
  bench.kv_config_file = config_path;
  bench.samples = samples;
  bench.seed = seed;
  return bench;
}

StatusOr<Evaluation> Calibrator::Evaluate(const Candidate& c, const std::vector<size_t>& cells, int samples,
                                          uint64_t seed, bool short_circuit, const std::map<size_t, json>* reference,
                                          const std::string& phase) {
  const KvSparsityConfig config = ConfigFor(c);
  KVS_RETURN_IF_ERROR(ValidateKvSparsityConfig(config));
  const std::string text = KvSparsityConfigToJson(config);
  uint64_t h = 1469598103934665603ULL;  // FNV-1a of the file: equal candidates share a file and a key
  for (char ch : text) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ULL;
  const std::string path = (fs::path(options_.work_dir) / "configs" / fmt::format("{:016x}.json", h)).string();
  if (std::error_code ec; !fs::exists(path, ec)) {
    std::ofstream f(path + ".tmp", std::ios::trunc);
    f << text;
    f.close();
    if (f) fs::rename(path + ".tmp", path, ec);
    if (!f || ec) return InvalidArgumentError(fmt::format("cannot write {}{}", path, ec ? ": " + ec.message() : ""));
  }
  BenchSpec bench = BenchSpecFor(path, samples, seed);
  Evaluation e;
  for (size_t i : cells) {
    const Cell& cell = cells_[i];
    bench.tasks = {cell.task};
    bench.lengths = {cell.length};
    const BenchConfig bc{cell.task, cell.protocol, "config", "", "", cell.length};
    const std::string key = bc.Key(bench);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      FidelityStreamCache& streams = streams_[{samples, seed}];
      StatusOr<json> row = RunBenchConfig(bench, bc, model_, tokenizer_, &streams);
      if (!row.ok()) {
        return Status(row.status().code(), fmt::format("{} ({}), {}: {}", phase, Describe(c), cell.Name(),
                                                       row.status().message()));
      }
      (*row)["config_file"] = path;
      KVS_RETURN_IF_ERROR(store_->Append(*row));
      it = cache_.emplace(key, *row).first;
    }
    e.rows.push_back(it->second);
    if (reference != nullptr && !Passes(i, it->second, reference->at(i))) {
      e.pass = false;
      if (short_circuit) break;
    }
  }
  e.complete = e.rows.size() == cells.size();
  ++phase_done_[phase];
  Report(phase, phase_done_[phase], std::max(phase_done_[phase], phase_total_[phase]));
  json entry = CandidateJson(c, e);
  entry["phase"] = phase;
  entry["samples"] = samples;
  entry["seed"] = seed;
  log_.push_back(std::move(entry));
  return e;
}

StatusOr<json> Calibrator::RoundTripCheck(const Evaluation& held, uint64_t seed) const {
  for (size_t i = 0; i < cells_.size() && i < held.rows.size(); ++i) {
    const Cell& cell = cells_[i];
    if (cell.fidelity() || cell.protocol != BenchProtocol::kQuestionLast || !held.rows[i].contains("first_generated"))
      continue;
    const BenchSpec bench = BenchSpecFor("", spec_.holdout_samples, seed);
    const BenchConfig bc{cell.task, cell.protocol, "config", "", "", cell.length};
    KVS_ASSIGN_OR_RETURN(std::vector<BenchSample> samples, BenchQuestionSamples(bench, bc, model_, tokenizer_));
    if (samples.empty()) continue;
    return json{{"cell", cell.Name()},
                {"prompt_tokens", PromptTokens(samples[0], cell.protocol)},
                {"max_new_tokens", samples[0].max_new_tokens},
                {"generated", held.rows[i]["first_generated"]}};
  }
  return json();
}

json Calibrator::CandidateJson(const Candidate& c, const Evaluation& e) const {
  json scores = json::object();
  double measured = 0, decode_ms = 0;
  int decode_rows = 0;
  for (const json& row : e.rows) {
    const std::string name = Cell{row["task"].get<std::string>(),
                                  row["protocol"] == "question_after" ? BenchProtocol::kQuestionAfter
                                                                      : BenchProtocol::kQuestionLast,
                                  row["length"].get<int32_t>()}
                                 .Name();
    if (row.contains("kl")) scores[name] = {{"kl", row["kl"]}};
    else scores[name] = {{"accuracy", row.value("accuracy", 0.0)}, {"ci", row.value("accuracy_ci", json::array())}};
    measured += row.value("kv_ratio", 0.0);
    if (row.contains("decode_ms") && row["decode_ms"].is_object()) {
      decode_ms += row["decode_ms"].value("median", 0.0);
      ++decode_rows;
    }
  }
  json out = {{"config", Describe(c)}, {"estimated_kv_share", EstimatedShare(c)}, {"pass", e.pass},
              {"complete", e.complete}, {"cells", scores}};
  if (!e.rows.empty()) out["kv_share"] = measured / static_cast<double>(e.rows.size());
  if (decode_rows > 0) out["decode_ms"] = decode_ms / decode_rows;  // the cells' median decode step, averaged
  return out;
}

StatusOr<CalibrateResult> Calibrator::Run() {
  std::vector<size_t> all(cells_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  std::vector<size_t> shortest;  // the sensitivity proxy: the cells of the shortest length
  for (size_t i = 0; i < cells_.size(); ++i)
    if (cells_[i].length == cells_.front().length) shortest.push_back(i);
  const Candidate dense(n_layers_, Choice(-1, 0, -1));
  const bool sharded = options_.shard.count > 1;

  // 1. The reference on every cell, for the search and the proxy samples.
  phase_total_["reference"] = 2;
  std::map<size_t, json> reference, proxy_reference;
  {
    KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(dense, all, spec_.samples, spec_.seed, false, nullptr, "reference"));
    for (size_t i = 0; i < all.size(); ++i) reference[i] = e.rows[i];
    KVS_ASSIGN_OR_RETURN(Evaluation p, Evaluate(dense, shortest, spec_.proxy_samples, spec_.seed, false, nullptr, "reference"));
    for (size_t i = 0; i < shortest.size(); ++i) proxy_reference[shortest[i]] = p.rows[i];
  }
  json warnings = json::array();
  for (const auto& [i, row] : reference) {
    if (!cells_[i].fidelity() && row.value("accuracy", 0.0) <= 0) {
      warnings.push_back(fmt::format("{}: the full cache scores 0, so every configuration keeps its accuracy; the "
                                     "cell constrains nothing (can the model do this task at this length?)",
                                     cells_[i].Name()));
    }
  }
  const size_t n_methods = methods_.size(), n_budgets = budgets_.size();

  // 2. Uniform baselines: the least passing rung of each method, then cheaper storage there.
  phase_total_["uniform"] = n_methods * (n_budgets + kv_types_.size() - 1);
  json uniform = json::array();
  std::optional<Candidate> best_uniform;
  for (size_t m = 0; m < n_methods; ++m) {
    if (sharded && !options_.shard.Owns(m)) continue;
    std::optional<Candidate> found;
    Evaluation found_eval;
    for (size_t b = 0; b < n_budgets && !found; ++b) {
      if (!valid_[m][b]) continue;
      Candidate c(n_layers_, Choice(static_cast<int>(m), static_cast<int>(b), 0));
      KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, all, spec_.samples, spec_.seed, true, &reference, "uniform"));
      if (e.pass) found = c, found_eval = e;
    }
    for (size_t t = 1; found && t < kv_types_.size(); ++t) {
      Candidate c = *found;
      for (LayerChoice& ch : c) ch.kv_type = static_cast<int>(t);
      if (EstimatedShare(c) >= EstimatedShare(*found)) continue;
      KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, all, spec_.samples, spec_.seed, true, &reference, "uniform"));
      if (e.pass) found = c, found_eval = e;
    }
    json entry = {{"method", spec_.methods[m]}};
    if (found) {
      entry.update(CandidateJson(*found, found_eval));
      entry["budget"] = budget_names_[(*found)[0].budget];
      entry["kv_type"] = spec_.kv_types[(*found)[0].kv_type];
      if (!best_uniform || EstimatedShare(*found) < EstimatedShare(*best_uniform)) best_uniform = found;
    } else {
      entry["pass"] = false;  // no rung of the ladder keeps the accuracy
    }
    uniform.push_back(entry);
  }

  // 3. Sensitivity: per (layer, method), the least rung that passes alone (binary search: a larger
  // budget keeps a superset of what a method's scores favour, so passing is taken as monotone).
  // Only rungs cheaper than the layer's best so far are searched, the lowest first, so a layer that
  // needs nothing costs one evaluation per method.
  constexpr int kNone = -1, kNotCheaper = -2;  // no rung passes; none cheaper than another method's
  std::vector<std::vector<int>> least(n_layers_, std::vector<int>(n_methods, kNone));
  phase_total_["sensitivity"] = static_cast<size_t>(n_layers_) * n_methods;
  size_t pair_index = 0;
  for (int l = 0; l < n_layers_; ++l) {
    double best_share = 2.0;  // of this layer so far (f16 dense: 1)
    for (size_t m = 0; m < n_methods; ++m, ++pair_index) {
      if (sharded && !options_.shard.Owns(pair_index)) continue;
      Candidate probe = dense;
      auto share_at = [&](int b) {
        probe[l] = Choice(static_cast<int>(m), b, 0);
        return EstimatedShare(probe);
      };
      int limit = 0;  // rungs [0, limit) are cheaper than the best so far
      while (limit < static_cast<int>(n_budgets) && share_at(limit) < best_share) ++limit;
      auto passes_at = [&](int b) -> StatusOr<bool> {
        if (!valid_[m][b]) return false;
        Candidate c = dense;
        c[l] = Choice(static_cast<int>(m), b, 0);
        KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, shortest, spec_.proxy_samples, spec_.seed, true,
                                                    &proxy_reference, "sensitivity"));
        return e.pass;
      };
      int lo = 0, hi = limit;  // the answer lies in [lo, hi]; hi: none below the limit passes
      if (limit > 0) {
        KVS_ASSIGN_OR_RETURN(bool lowest, passes_at(0));
        if (lowest) hi = 0;
        else lo = 1;
      }
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        KVS_ASSIGN_OR_RETURN(bool ok, passes_at(mid));
        if (ok) hi = mid;
        else lo = mid + 1;
      }
      if (lo < limit) {
        least[l][m] = lo;
        best_share = std::min(best_share, share_at(lo));
      } else {
        least[l][m] = limit < static_cast<int>(n_budgets) ? kNotCheaper : kNone;
      }
    }
  }
  CalibrateResult result;
  if (sharded) {
    result.sharded_only = true;
    return result;
  }

  // 4. Allocation: each layer its cheapest passing choice; dense where none passes.
  Candidate current = dense;
  for (int l = 0; l < n_layers_; ++l) {
    current[l].kv_type = 0;
    double best = EstimatedShare(current);
    for (size_t m = 0; m < n_methods; ++m) {
      if (least[l][m] < 0) continue;
      Candidate c = current;
      c[l] = Choice(static_cast<int>(m), least[l][m], 0);
      if (EstimatedShare(c) < best) best = EstimatedShare(c), current[l] = c[l];
    }
  }
  const Candidate allocated = current;

  // 5. Refinement on every cell. Time is kept for the held-out check: three configurations at
  // holdout_samples, from the reference's time per sample.
  double reference_seconds = 0;
  for (const auto& [i, row] : reference) reference_seconds += row.value("seconds", 0.0);
  const double holdout_seconds = 3.0 * reference_seconds * spec_.holdout_samples / std::max(1, spec_.samples);
  auto out_of_time = [&] { return spec_.max_minutes > 0 && SecondsLeft() < holdout_seconds; };
  phase_total_["refine"] = static_cast<size_t>(n_layers_) * 2;
  phase_total_["by_length"] = lengths_.size() > 1 ? static_cast<size_t>(n_layers_) * lengths_.size() : 0;
  phase_total_["rerank"] = 3;
  std::optional<Candidate> chosen;
  auto try_candidate = [&](const Candidate& c) -> StatusOr<bool> {
    KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, all, spec_.samples, spec_.seed, true, &reference, "refine"));
    return e.pass;
  };
  for (;;) {
    KVS_ASSIGN_OR_RETURN(bool ok, try_candidate(current));
    if (ok) {
      chosen = current;
      break;
    }
    const bool any_compressed =
        std::any_of(current.begin(), current.end(), [](const LayerChoice& ch) { return ch.method >= 0; });
    if (!any_compressed || out_of_time()) break;  // every layer dense (at the first storage type) fails
    for (LayerChoice& ch : current) {  // one valid rung up everywhere; past the top, dense
      if (ch.method < 0) continue;
      do ++ch.budget;
      while (ch.budget < static_cast<int>(n_budgets) && !valid_[ch.method][ch.budget]);
      if (ch.budget >= static_cast<int>(n_budgets)) ch = Choice(-1, 0, 0);
    }
  }
  if (!chosen) chosen = best_uniform ? *best_uniform : dense;  // the time ran out: the best known
  // Descent: single moves, largest saving first, kept where the combination still passes.
  for (bool changed = true; changed && !out_of_time();) {
    changed = false;
    std::vector<Candidate> moves;
    for (int l = 0; l < n_layers_; ++l) {
      const LayerChoice& ch = (*chosen)[l];
      if (ch.method >= 0 && ch.budget > 0) {
        Candidate c = *chosen;
        for (int b = ch.budget - 1; b >= 0; --b) {
          if (valid_[ch.method][b]) {
            c[l].budget = b;
            moves.push_back(c);
            break;
          }
        }
      }
      if (ch.kv_type >= 0 && ch.kv_type + 1 < static_cast<int>(kv_types_.size())) {
        Candidate c = *chosen;
        ++c[l].kv_type;
        if (EstimatedShare(c) < EstimatedShare(*chosen)) moves.push_back(c);
      }
    }
    // Every layer's storage one step cheaper at once first: one evaluation where it holds.
    Candidate all_cheaper = *chosen;
    bool any = false;
    for (LayerChoice& ch : all_cheaper)
      if (ch.kv_type >= 0 && ch.kv_type + 1 < static_cast<int>(kv_types_.size())) ++ch.kv_type, any = true;
    if (any && n_layers_ > 1) moves.insert(moves.begin(), all_cheaper);
    std::stable_sort(moves.begin() + (any && n_layers_ > 1 ? 1 : 0), moves.end(),
                     [&](const Candidate& a, const Candidate& b) { return EstimatedShare(a) < EstimatedShare(b); });
    for (const Candidate& c : moves) {
      if (out_of_time()) break;
      KVS_ASSIGN_OR_RETURN(bool ok, try_candidate(c));
      if (ok) {
        chosen = c;
        changed = true;
        break;  // the moves were relative to the old choice: list them again
      }
    }
  }

  // 5b. Budgets by length (kv_budget.h): longer contexts often tolerate more sparsity. Per length,
  // longest first (it holds the most bytes), the same descent on that length's cells alone: the
  // other lengths' fractions are unchanged points of the interpolation, so their cells are too.
  for (size_t k = lengths_.size(); lengths_.size() > 1 && k-- > 0 && !out_of_time();) {
    std::vector<size_t> cells_k;
    for (size_t i = 0; i < cells_.size(); ++i)
      if (cells_[i].length == lengths_[k]) cells_k.push_back(i);
    for (bool changed = true; changed && !out_of_time();) {
      changed = false;
      std::vector<Candidate> moves;
      for (int l = 0; l < n_layers_; ++l) {
        const LayerChoice& ch = (*chosen)[l];
        if (ch.method < 0 || templates_[ch.method][ch.budget].method == KvMethod::kCumulative) continue;
        for (int b = ch.RungAt(k) - 1; b >= 0; --b) {
          if (!valid_[ch.method][b]) continue;
          Candidate c = *chosen;
          if (c[l].by_length.empty()) c[l].by_length.assign(lengths_.size(), ch.budget);
          c[l].by_length[k] = b;
          moves.push_back(c);
          break;
        }
      }
      std::stable_sort(moves.begin(), moves.end(),
                       [&](const Candidate& a, const Candidate& b) { return EstimatedShare(a) < EstimatedShare(b); });
      for (const Candidate& c : moves) {
        if (out_of_time()) break;
        KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, cells_k, spec_.samples, spec_.seed, true, &reference, "by_length"));
        if (e.pass) {
          chosen = c;
          changed = true;
          break;
        }
      }
    }
  }

  // 5c. The cumulative ranking's re-rank period (after the retentions, before nothing else changes
  // bytes): doubled while the combination passes, up to 8x, since fewer re-ranks cost less time.
  const auto is_cumulative = [&](const LayerChoice& ch) {
    return ch.method >= 0 && templates_[ch.method][ch.budget].method == KvMethod::kCumulative;
  };
  if (std::any_of(chosen->begin(), chosen->end(), is_cumulative)) {
    int period = 0;
    for (const LayerChoice& ch : *chosen)
      if (is_cumulative(ch)) period = templates_[ch.method][ch.budget].params.rerank_period;
    for (int step = 0; step < 3 && !out_of_time(); ++step) {
      Candidate c = *chosen;
      for (LayerChoice& ch : c)
        if (is_cumulative(ch)) ch.rerank_period = period * 2;
      KVS_ASSIGN_OR_RETURN(Evaluation e, Evaluate(c, all, spec_.samples, spec_.seed, true, &reference, "rerank"));
      if (!e.pass) break;
      chosen = c;
      period *= 2;
    }
  }

  // 6. Held-out check: new samples for the reference, the calibrated config and the best uniform one.
  const uint64_t holdout_seed = spec_.seed + kHoldoutSeedOffset;
  phase_total_["holdout"] = best_uniform ? 3 : 2;
  KVS_ASSIGN_OR_RETURN(Evaluation held_reference,
                       Evaluate(dense, all, spec_.holdout_samples, holdout_seed, false, nullptr, "holdout"));
  std::map<size_t, json> holdout_reference;
  for (size_t i = 0; i < all.size(); ++i) holdout_reference[i] = held_reference.rows[i];
  KVS_ASSIGN_OR_RETURN(Evaluation held,
                       Evaluate(*chosen, all, spec_.holdout_samples, holdout_seed, false, &holdout_reference, "holdout"));
  json holdout = {{"seed", holdout_seed},
                  {"samples", spec_.holdout_samples},
                  {"reference", CandidateJson(dense, held_reference)},
                  {"calibrated", CandidateJson(*chosen, held)}};
  if (best_uniform) {
    KVS_ASSIGN_OR_RETURN(Evaluation held_uniform, Evaluate(*best_uniform, all, spec_.holdout_samples, holdout_seed,
                                                           false, &holdout_reference, "holdout"));
    holdout["best_uniform"] = CandidateJson(*best_uniform, held_uniform);
  }

  KVS_ASSIGN_OR_RETURN(json check, RoundTripCheck(held, holdout_seed));

  // The report.
  result.config = ConfigFor(*chosen);
  result.config_path = (fs::path(options_.work_dir) / "kv-config.json").string();
  {
    std::ofstream f(result.config_path, std::ios::trunc);
    f << KvSparsityConfigToJson(result.config);
    if (!f) return InvalidArgumentError("cannot write " + result.config_path);
  }
  json layers = json::array();
  const std::vector<json>& chosen_rows = held.rows;
  for (int l = 0; l < n_layers_; ++l) {
    const LayerChoice& ch = (*chosen)[l];
    json layer = {{"layer", l},
                  {"method", ch.method < 0 ? std::string("full") : spec_.methods[ch.method]},
                  {"budget", BudgetName(ch)},
                  {"kv_type", ch.kv_type < 0 ? std::string("f16") : spec_.kv_types[ch.kv_type]}};
    json sensitivity = json::object();
    for (size_t m = 0; m < n_methods; ++m)
      sensitivity[spec_.methods[m]] = least[l][m] >= 0            ? json(budget_names_[least[l][m]])
                                      : least[l][m] == kNotCheaper ? json("not cheaper")
                                                                   : json(nullptr);
    layer["least_passing_alone"] = sensitivity;
    double live = 0;
    for (const json& row : chosen_rows) live += row["layer_live_tokens"][l].get<double>() / row["length"].get<double>();
    layer["live_share"] = chosen_rows.empty() ? 0.0 : live / chosen_rows.size();
    layers.push_back(layer);
  }
  json cells = json::array();
  for (const Cell& c : cells_) cells.push_back(c.Name());
  result.report = {{"model", spec_.model_name},
                   {"cells", cells},
                   {"methods", spec_.methods},
                   {"budgets", budget_names_},
                   {"kv_types", spec_.kv_types},
                   {"keep", spec_.keep},
                   {"kl_max", spec_.kl_max},
                   {"objective", spec_.objective},
                   {"samples", spec_.samples},
                   {"proxy_samples", spec_.proxy_samples},
                   {"allocated", Describe(allocated)},
                   {"chosen", Describe(*chosen)},
                   {"config_file", result.config_path},
                   {"config_summary", KvSparsityConfigSummary(result.config)},
                   {"layers", layers},
                   {"uniform", uniform},
                   {"holdout", holdout},
                   {"holdout_pass", held.pass},
                   {"warnings", warnings},
                   {"check", check},
                   {"evaluations", log_},
                   {"seconds", Seconds(start_, std::chrono::steady_clock::now())}};
  if (best_uniform) {
    const double mine = holdout["calibrated"].value("kv_share", 0.0);
    const double theirs = holdout["best_uniform"].value("kv_share", 0.0);
    result.report["best_uniform"] = Describe(*best_uniform);
    result.report["saving_vs_best_uniform"] = theirs > 0 ? 1.0 - mine / theirs : 0.0;
  }
  return result;
}

// frontier.png from report.json: every configuration run on all cells with the search samples,
// KV % of the dense f16 cache against the worst cell (accuracy relative to the full cache, or
// KL for fidelity-only runs); uniform baselines, the search's candidates and the chosen config.
constexpr const char* kPlotScript = R"PY(#!/usr/bin/env python3
import json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

report = json.load(open(sys.argv[1]))
out_dir = sys.argv[2]
samples = report["samples"]
# Configurations run on every cell with the search samples (by-length steps run one length's cells).
evals = [e for e in report["evaluations"]
         if e.get("samples") == samples and e["phase"] != "holdout" and len(e["cells"]) == len(report["cells"])]
reference = next((e for e in evals if e["phase"] == "reference" and e["complete"]), None)
if reference is None:
    sys.exit(0)
kl_only = all("kl" in c for c in reference["cells"].values())

def worst(e):
    if kl_only:
        return max(c["kl"] for c in e["cells"].values() if c.get("kl") is not None)
    ratios = []
    for name, c in e["cells"].items():
        ref = reference["cells"][name].get("accuracy")
        if "accuracy" in c and ref:
            ratios.append(100.0 * c["accuracy"] / ref)
    return min(ratios) if ratios else 0.0

fig, ax = plt.subplots(figsize=(7, 4.5))
styles = {"uniform": ("s", "uniform (one method, one budget)"), "refine": ("o", "per-layer candidates")}
for phase, (marker, label) in styles.items():
    pts = [(100 * e["kv_share"], worst(e), e["pass"]) for e in evals
           if e["phase"] == phase and e["complete"] and "kv_share" in e]
    if not pts:
        continue
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker,
               c=["tab:green" if p[2] else "tab:red" for p in pts], label=label, alpha=0.8)
chosen = report["holdout"]["calibrated"]
best = next((e for e in evals if e["config"] == chosen["config"] and e["complete"] and "kv_share" in e), None)
if best is not None:
    ax.scatter([100 * best["kv_share"]], [worst(best)], marker="*", s=250, c="gold", edgecolors="black",
               label="chosen", zorder=5)
if kl_only:
    ax.axhline(report["kl_max"], color="gray", linestyle="--", label="KL target")
    ax.set_ylabel("worst cell: KL to the full cache (nats)")
else:
    ax.axhline(100 * report["keep"], color="gray", linestyle="--", label="target")
    ax.set_ylabel("worst cell: accuracy, % of the full cache")
ax.set_xscale("log")
from matplotlib.ticker import FuncFormatter
ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax.set_xlabel("KV bytes, % of the dense f16 cache (measured)")
ax.set_title("kvsparse calibrate: " + report["model"] + " (green: passes, red: fails)")
ax.legend(fontsize=8)
fig.tight_layout()
path = os.path.join(out_dir, "frontier.png")
fig.savefig(path, dpi=120)
print(path)
)PY";

std::string Pct(const json& v) { return v.is_number() ? fmt::format("{:.1f}", 100 * v.get<double>()) : "-"; }

std::string CellScore(const json& cell) {
  if (cell.contains("kl")) return cell["kl"].is_number() ? fmt::format("KL {:.3g}", cell["kl"].get<double>()) : "KL -";
  std::string s = Pct(cell["accuracy"]);
  if (cell.contains("ci") && cell["ci"].is_array() && cell["ci"].size() == 2)
    s += fmt::format(" [{}, {}]", Pct(cell["ci"][0]), Pct(cell["ci"][1]));
  return s;
}

}  // namespace

Status ValidateCalibrateSpec(const CalibrateSpec& spec) {
  if (spec.tasks.empty()) return InvalidArgumentError("--tasks: give at least one task");
  for (const std::string& t : spec.tasks) {
    if (t == "latency") return InvalidArgumentError("--tasks: latency has no accuracy to keep; calibrate needs question tasks or fidelity");
  }
  if (spec.methods.empty()) return InvalidArgumentError("--methods: give at least one candidate method");
  if (spec.budgets.empty()) return InvalidArgumentError("--budgets: give at least one budget");
  if (spec.kv_types.empty()) return InvalidArgumentError("--kv-types: give at least one KV type");
  if (!(spec.keep > 0 && spec.keep <= 1)) return InvalidArgumentError(fmt::format("--keep: expected (0, 1], found {}", spec.keep));
  if (!(spec.kl_max >= 0)) return InvalidArgumentError(fmt::format("--kl-max: expected >= 0, found {}", spec.kl_max));
  if (spec.objective != "memory" && spec.objective != "speed")
    return InvalidArgumentError(fmt::format("--objective: expected memory or speed, found '{}'", spec.objective));
  if (spec.samples < 1 || spec.proxy_samples < 1 || spec.holdout_samples < 1)
    return InvalidArgumentError("--samples, --proxy-samples, --holdout-samples: expected >= 1");
  if (!(spec.max_minutes >= 0)) return InvalidArgumentError("--max-minutes: expected >= 0 (0: no limit)");
  // The rest (tasks, lengths, kv types, methods, fidelity stream) as bench checks it.
  return ValidateBenchSpec(BaseBenchSpec(spec));
}

StatusOr<CalibrateResult> RunCalibrate(const CalibrateSpec& spec_in, const CalibrateOptions& options) {
  CalibrateSpec spec = spec_in;
  if (spec.model_name.empty()) spec.model_name = fs::path(spec.model_path).filename().string();
  KVS_RETURN_IF_ERROR(ValidateCalibrateSpec(spec));
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(spec.model_path));
  model->SetContextLength(*std::max_element(spec.lengths.begin(), spec.lengths.end()));
  std::unique_ptr<Tokenizer> tokenizer;
  if (model->gguf() != nullptr && model->gguf()->Find("tokenizer.ggml.tokens") != nullptr) {
    KVS_ASSIGN_OR_RETURN(tokenizer, Tokenizer::FromGguf(*model->gguf()));
  }
  Calibrator calibrator(spec, options, *model, tokenizer.get());
  KVS_RETURN_IF_ERROR(calibrator.Init());
  KVS_ASSIGN_OR_RETURN(CalibrateResult result, calibrator.Run());
  if (!result.sharded_only) {
    const fs::path dir(options.work_dir);
    std::ofstream(dir / "report.json", std::ios::trunc) << result.report.dump(2) << "\n";
    std::string md = CalibrateReportMarkdown(result.report);
    if (options.plots) {
      StatusOr<std::vector<std::string>> pngs =
          RunPlotScript(kPlotScript, "plot_calibrate.py", (dir / "report.json").string(), options.work_dir);
      if (!pngs.ok()) {
        std::fprintf(stderr, "warning: no plot: %s\n", pngs.status().message().c_str());
      } else {
        for (const std::string& p : *pngs) md += fmt::format("\n![{0}]({0})\n", fs::path(p).filename().string());
      }
    }
    std::ofstream(dir / "report.md", std::ios::trunc) << md;
  }
  return result;
}

std::string CalibrateReportMarkdown(const json& r) {
  std::string md = fmt::format("# kvsparse calibrate: {}\n\n", r.value("model", ""));
  std::vector<std::string> cells;
  for (const json& c : r["cells"]) cells.push_back(c.get<std::string>());
  md += fmt::format("Target: every cell keeps >= {:g}% of the full f16 cache's accuracy (fidelity: KL <= {:g}); "
                    "objective: {}; {} search samples per cell, {} in the sensitivity proxy.\n\n",
                    100 * r.value("keep", 0.0), r.value("kl_max", 0.0), r.value("objective", ""),
                    r.value("samples", 0), r.value("proxy_samples", 0));
  md += fmt::format("**Chosen:** {}  \nConfig file: `{}`  \nHeld-out check: **{}**", r.value("chosen", ""),
                    r.value("config_file", ""), r.value("holdout_pass", false) ? "passes" : "FAILS");
  if (r.contains("saving_vs_best_uniform")) {
    md += fmt::format("; {:.0f}% fewer KV bytes than the cheapest uniform configuration that passes ({})",
                      100 * r["saving_vs_best_uniform"].get<double>(), r.value("best_uniform", ""));
  }
  md += fmt::format(". Search took {:.0f} s.\n\n", r.value("seconds", 0.0));
  if (r.contains("warnings")) {
    for (const json& w : r["warnings"]) md += "**Warning:** " + w.get<std::string>() + "\n\n";
  }
  md += "## Held-out check (accuracy % [95% interval], KV % of the dense f16 cache, decode step vs the full cache's in "
        "the same run)\n\n| configuration | KV % | decode time |";
  for (const std::string& c : cells) md += " " + c + " |";
  md += "\n|---|---|---|";
  for (size_t i = 0; i < cells.size(); ++i) md += "---|";
  md += "\n";
  const json& h = r["holdout"];
  for (const char* which : {"reference", "calibrated", "best_uniform"}) {
    if (!h.contains(which)) continue;
    const json& e = h[which];
    const double ref_ms = h["reference"].value("decode_ms", 0.0), ms = e.value("decode_ms", 0.0);
    const std::string decode = ref_ms > 0 && ms > 0 ? fmt::format("{:.2f}x", ms / ref_ms) : "-";
    md += fmt::format("| {} ({}) | {} | {} |", which, e.value("config", ""), Pct(e.value("kv_share", json())), decode);
    for (const std::string& c : cells) md += " " + (e["cells"].contains(c) ? CellScore(e["cells"][c]) : "-") + " |";
    md += "\n";
  }
  md += "\n## Chosen configuration per layer\n\n| layer | method | budget | kv type | live tokens % | least budget passing alone, per method |\n|---|---|---|---|---|---|\n";
  for (const json& l : r["layers"]) {
    std::string alone;
    for (const auto& [m, b] : l["least_passing_alone"].items())
      alone += fmt::format("{}{} {}", alone.empty() ? "" : ", ", m, b.is_null() ? "none" : b.get<std::string>());
    md += fmt::format("| {} | {} | {} | {} | {} | {} |\n", l["layer"].get<int>(), l["method"].get<std::string>(),
                      l["budget"].get<std::string>(), l["kv_type"].get<std::string>(), Pct(l["live_share"]), alone);
  }
  md += "\n## Best uniform configuration of each method (search samples)\n\n| method | budget | kv type | KV % | passes |\n|---|---|---|---|---|\n";
  for (const json& u : r["uniform"]) {
    md += fmt::format("| {} | {} | {} | {} | {} |\n", u.value("method", ""), u.value("budget", "none passes"),
                      u.value("kv_type", "-"), Pct(u.value("kv_share", json())), u.value("pass", false) ? "yes" : "no");
  }
  md += "\n## Frontier (every configuration run on all cells with the search samples; KV % measured)\n\n"
        "| KV % | passes | configuration |\n|---|---|---|\n";
  std::vector<const json*> complete;
  for (const json& e : r["evaluations"])
    if (e.value("complete", false) && e.value("samples", 0) == r.value("samples", 0) && e.contains("kv_share") &&
        e["cells"].size() == r["cells"].size() && e.value("phase", "") != "holdout")
      complete.push_back(&e);
  std::sort(complete.begin(), complete.end(), [](const json* a, const json* b) {
    return (*a)["kv_share"].get<double>() < (*b)["kv_share"].get<double>();
  });
  for (const json* e : complete) {
    md += fmt::format("| {} | {} | {} |\n", Pct((*e)["kv_share"]), (*e)["pass"].get<bool>() ? "yes" : "no",
                      (*e)["config"].get<std::string>());
  }
  md += fmt::format("\n{} evaluations in all (each: one configuration on one or more cells; failing ones stop at "
                    "their first failing cell).\n",
                    r["evaluations"].size());
  return md;
}

}  // namespace kvsparse
