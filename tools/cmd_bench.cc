// `kvsparse bench`: the method benchmark (methods x budgets x lengths x kv types x tasks x
// protocols), with resume, sharding, a Markdown report and plots. `bench-merge` combines
// shards; `bench-report` redraws the report of a results file.
#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "commands.h"
#include "kvsparse/bench_report.h"
#include "kvsparse/bench_runner.h"
#include "kvsparse/retrieval_model.h"

namespace kvsparse::cli {
namespace {

namespace fs = std::filesystem;

struct BenchArgs {
  std::string model, out_dir = "bench-out", shard = "0/1", kv_config, suite = "quick", prefill_eviction;
  std::string sparse_prefill;
  std::string fidelity_text, fidelity_tokens;
  std::vector<std::string> methods, budgets, lengths, kv_types, tasks, protocols;
  std::vector<double> depths;
  // evict_interval 0: each method's paper cadence (BenchSpec::evict_interval).
  int samples = 0, threads = 0, evict_interval = 0, page_size = 0, value_tokens = 0;
  uint64_t seed = 1;
  bool no_plots = false;
};

// Progress on stderr: a bar with the ETA on a terminal, a line per ~5% otherwise.
void Progress(size_t done, size_t total, double seconds, const std::string& key) {
  const double eta = done > 0 ? seconds / done * (total - done) : 0;
  auto clock = [](double s) { return fmt::format("{}:{:02}", static_cast<int>(s) / 60, static_cast<int>(s) % 60); };
  if (isatty(fileno(stderr))) {
    const int width = 30, filled = static_cast<int>(width * done / total);
    std::fprintf(stderr, "\r[%s%s] %zu/%zu  %s elapsed, ETA %s  %-60.60s", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), done, total, clock(seconds).c_str(), clock(eta).c_str(),
                 key.c_str());
    if (done == total) std::fputc('\n', stderr);
  } else if (done == total || done % std::max<size_t>(1, total / 20) == 0) {
    std::fprintf(stderr, "%zu/%zu configurations, %s elapsed, ETA %s\n", done, total, clock(seconds).c_str(),
                 clock(eta).c_str());
  }
}

// The suites the command runs: the user's model with the flags, or the built-in default.
StatusOr<std::vector<BenchSpec>> BuildSpecs(const BenchArgs& a) {
  auto apply_flags = [&](BenchSpec& s) -> Status {
    if (!a.methods.empty()) s.methods = a.methods;
    if (!a.budgets.empty()) s.budgets = a.budgets;
    if (!a.kv_types.empty()) s.kv_types = a.kv_types;
    if (!a.tasks.empty()) s.tasks = a.tasks;
    if (!a.depths.empty()) s.depths = a.depths;
    if (a.samples > 0) s.samples = a.samples;
    if (a.value_tokens > 0) s.value_tokens = a.value_tokens;
    if (!a.lengths.empty()) {
      s.lengths.clear();
      for (const std::string& l : a.lengths) {
        KVS_ASSIGN_OR_RETURN(int32_t n, ParseLengthFlag(l));
        s.lengths.push_back(n);
      }
    }
    if (!a.protocols.empty()) {
      s.protocols.clear();
      for (const std::string& p : a.protocols) {
        KVS_ASSIGN_OR_RETURN(BenchProtocol protocol, ParseBenchProtocol(p));
        s.protocols.push_back(protocol);
      }
    }
    s.kv_config_file = a.kv_config;
    if (!a.prefill_eviction.empty()) s.prefill_eviction = a.prefill_eviction;
    s.sparse_prefill = a.sparse_prefill;
    s.n_threads = a.threads;
    s.seed = a.seed;
    s.evict_interval = a.evict_interval;
    s.fidelity_text = a.fidelity_text;
    s.fidelity_tokens = a.fidelity_tokens;
    s.page_size = a.page_size;
    return ValidateBenchSpec(s);
  };
  std::vector<BenchSpec> specs;
  if (!a.model.empty()) {
    BenchSpec s;
    s.model_path = a.model;
    s.model_name = fs::path(a.model).filename().string();
    KVS_RETURN_IF_ERROR(apply_flags(s));
    specs.push_back(s);
    return specs;
  }
  // The first run (--suite quick, the default: under 3 minutes on 2 cores) keeps the headline
  // findings of the full suite: the methods' ordering on the one-head instrument under both
  // protocols (query-aware selection wins only when the question comes last; keeping every token
  // and selecting, or the oracle, wins under both), razor and AdaKV against their uniform
  // counterparts on the multi-head one, and the latency/memory rows, at one length each.
  const bool quick = a.suite == "quick";
  const bool full = a.suite == "full" || a.suite == "all";  // "all": its name before quick existed
  // Built-in default, part 1: accuracy on the constructed retrieval model (an instrument that
  // solves token-level retrieval and copy with the full cache; see retrieval_model.h).
  // Flags shape the part --suite names (accuracy when "all").
  const bool flags_to_speed = a.suite == "speed";
  BenchSpec accuracy;
  KVS_ASSIGN_OR_RETURN(accuracy.model_path, BuiltinRetrievalModelPath());
  accuracy.model_name = "builtin-retrieval";
  accuracy.methods = {"full",  "streaming_llm", "h2o",        "tova",  "scissorhands", "snapkv", "pyramidkv", "cake",
                      "quest", "knorm",         "random",     "cumulative", "reuse", "razor",  "oracle"};
  accuracy.budgets = {"0.1", "0.2"};
  accuracy.lengths = {1024, 2048};
  accuracy.tasks = {"niah_single", "niah_multikey", "kv_retrieval", "copy"};
  accuracy.samples = 8;
  if (quick) {
    accuracy.methods = {"full", "streaming_llm", "h2o",    "tova",       "snapkv", "pyramidkv",
                        "quest", "knorm",        "random", "cumulative", "razor",  "oracle"};
    accuracy.lengths = {1024};
    accuracy.tasks = {"niah_single", "kv_retrieval"};
  }
  if (!flags_to_speed) KVS_RETURN_IF_ERROR(apply_flags(accuracy));
  // A one-head model: a second thread costs more in synchronisation than it saves.
  if (a.threads <= 0) accuracy.n_threads = 1;
  if (a.suite != "speed") specs.push_back(accuracy);
  // Part 1b: head-level methods on the multi-head instrument (retrieval_model.h: the circuit in 2
  // of its 16 KV heads, distractors elsewhere), against their uniform counterparts: AdaKV's
  // adaptive head budgets vs uniform per-head H2O / SnapKV, razor's retrieval heads vs
  // StreamingLLM's window everywhere, CAKE's layer budgets vs SnapKV's uniform and PyramidKV's
  // fixed schedule. One length: the model is 8x wider than the one-head one.
  BenchSpec heads;
  KVS_ASSIGN_OR_RETURN(heads.model_path, BuiltinRetrievalModelPath(RetrievalShape::kMultiHead));
  heads.model_name = "builtin-retrieval-mha";
  heads.methods = {"full",   "streaming_llm", "razor", "h2o",        "h2o:head_budgets=adaptive", "snapkv",
                   "snapkv:head_budgets=adaptive", "pyramidkv", "cake", "cumulative", "reuse", "oracle"};
  heads.budgets = {"0.1", "0.2"};
  heads.lengths = {1024};
  heads.tasks = {"niah_single", "copy"};
  heads.samples = 8;
  if (quick) {  // the head-level headline: razor's retrieval heads and AdaKV's split at 10%
    heads.methods = {"full", "streaming_llm", "razor", "snapkv", "snapkv:head_budgets=adaptive"};
    heads.budgets = {"0.1"};
    heads.tasks = {"niah_single"};
  }
  if (!flags_to_speed) KVS_RETURN_IF_ERROR(apply_flags(heads));
  if (a.threads <= 0) heads.n_threads = 2;
  if (a.suite != "speed") specs.push_back(heads);
  // Part 1c: where the retrieval head needs more than a uniform share. niah_multiquery asks all
  // 4 needles (3 value tokens each) in the question, so SnapKV's window votes for all of them:
  // the retrieval head needs its window plus 4 pooled clusters (about 60 tokens), while a uniform
  // per-head budget at 512 tokens is 25 (5%) or 51 (10%). AdaKV and CAKE can move budget there
  // from heads and layers that need less; PyramidKV's schedule moves it away. question_last only:
  // after compression without the question no allocation can know which needles matter.
  BenchSpec shares = heads;
  shares.methods = {"full",   "streaming_llm", "razor",     "snapkv", "snapkv:head_budgets=adaptive",
                    "snapkv:layer_budgets=cake", "cake", "pyramidkv", "oracle"};
  shares.budgets = {"0.05", "0.1", "0.2"};
  shares.lengths = {512};
  shares.tasks = {"niah_multiquery"};
  shares.protocols = {BenchProtocol::kQuestionLast};
  shares.samples = 16;
  if (!flags_to_speed) KVS_RETURN_IF_ERROR(apply_flags(shares));
  if (full || a.suite == "accuracy") specs.push_back(shares);
  if (a.suite == "accuracy") return specs;
  // Part 2: latency and memory on a random-weight model of TinyLlama-1.1B's shape (speed and
  // bytes are real whatever the weights): the dense f16 cache against sparse int8 caches.
  BenchSpec speed;
  KVS_ASSIGN_OR_RETURN(speed.model_path, ResolveModelPath(""));
  speed.model_name = "synth-tinyllama-1.1b-q8_0";
  speed.tasks = {"latency"};
  speed.lengths = quick ? std::vector<int32_t>{512, 2048} : std::vector<int32_t>{512, 1024, 2048};
  speed.samples = 1;
  speed.methods = {"full"};
  speed.kv_types = {"f16"};
  speed.n_threads = a.threads;
  speed.prefill_eviction = "chunk";  // bounded prefill memory: what a server would run
  if (flags_to_speed && (!a.methods.empty() || !a.kv_types.empty())) {
    KVS_RETURN_IF_ERROR(apply_flags(speed));
    specs.push_back(speed);
    return specs;
  }
  BenchSpec sparse_speed = speed;
  sparse_speed.methods = {"streaming_llm", "h2o", "snapkv"};
  sparse_speed.budgets = {"0.1"};
  sparse_speed.kv_types = {"int8"};
  if (flags_to_speed) {
    KVS_RETURN_IF_ERROR(apply_flags(speed));
    KVS_RETURN_IF_ERROR(apply_flags(sparse_speed));
  }
  specs.push_back(speed);
  specs.push_back(sparse_speed);
  return specs;
}

int WriteReport(const std::string& results_path, const std::string& out_dir, bool plots) {
  auto rows = ReadBenchResultsSorted(results_path);
  if (!rows.ok()) return Fail(rows.status());
  const std::string report_path = (fs::path(out_dir) / "report.md").string();
  std::string report = BenchReportMarkdown(*rows);
  if (plots) {
    auto pngs = WriteBenchPlots(results_path, out_dir);
    if (!pngs.ok()) {
      std::fprintf(stderr, "warning: no plots: %s\n", pngs.status().message().c_str());
    } else {
      report += "\n## Plots\n\n";
      for (const std::string& p : *pngs) report += fmt::format("![{0}]({0})\n", fs::path(p).filename().string());
    }
  }
  std::ofstream f(report_path, std::ios::trunc);
  f << report;
  if (!f) return Fail(InvalidArgumentError("cannot write " + report_path));
  // The report on stdout, then where it went: stdout is flushed first, so the two streams never
  // interleave on a terminal or in a shared log.
  std::fputs(report.c_str(), stdout);
  std::fflush(stdout);
  std::fprintf(stderr, "\nresults: %s\nreport:  %s\n", results_path.c_str(), report_path.c_str());
  if (plots) std::fprintf(stderr, "plots:   %s/*.png\n", out_dir.c_str());
  std::fflush(stderr);
  return 0;
}

int Run(const BenchArgs& a) {
  auto shard = ParseBenchShard(a.shard);
  if (!shard.ok()) return Fail(shard.status());
  auto specs = BuildSpecs(a);
  if (!specs.ok()) return Fail(specs.status());
  std::error_code ec;
  fs::create_directories(a.out_dir, ec);
  if (ec) return Fail(InvalidArgumentError(fmt::format("-o: cannot create {}: {}", a.out_dir, ec.message())));
  // Shards write their own files so that they can run at once on a shared file system.
  const std::string results = (fs::path(a.out_dir) / (shard->count == 1 ? std::string("results.jsonl")
                                                                          : fmt::format("results.shard{}of{}.jsonl",
                                                                                        shard->index, shard->count)))
                                  .string();
  size_t total = 0;
  for (const BenchSpec& s : *specs) {
    const size_t n = EnumerateBenchConfigs(s).size();
    for (size_t i = 0; i < n; ++i) total += shard->Owns(i) ? 1 : 0;
  }
  std::fprintf(stderr, "kvsparse bench: %zu configurations (shard %d/%d) -> %s\n", total, shard->index, shard->count,
               results.c_str());
  for (const BenchSpec& s : *specs) {
    BenchRunOptions options;
    options.results_path = results;
    options.shard = *shard;
    options.progress = Progress;
    Status st = RunBench(s, options);
    if (!st.ok()) return Fail(st);
  }
  if (shard->count > 1) {
    std::fprintf(stderr, "shard done; combine the shards with: kvsparse bench-merge -o %s %s/results.shard*.jsonl\n",
                 a.out_dir.c_str(), a.out_dir.c_str());
    return 0;
  }
  return WriteReport(results, a.out_dir, !a.no_plots);
}

}  // namespace

void RegisterBench(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Method benchmark: accuracy, fidelity, latency and memory over methods x budgets x lengths x tasks. Without -m: "
      "the built-in retrieval model (accuracy) and a TinyLlama-shape random model (latency, memory)");
  cmd->add_option("-m,--model", a->model, "GGUF or llama2.c model (default: the built-in suite)");
  cmd->add_option("--suite", a->suite,
                  "without -m: quick (the first run, under 3 minutes on 2 cores: both retrieval models at 1024 "
                  "tokens under both protocols, and latency/memory at 512 and 2048 tokens), full (every part, about 13 "
                  "minutes; 'all' is the same), accuracy (the built-in retrieval models, one-head and multi-head) or "
                  "speed (TinyLlama-shape random model); the other flags shape the part named (accuracy for quick "
                  "and full)")
      ->capture_default_str()
      ->check(CLI::IsMember({"quick", "full", "all", "accuracy", "speed"}));
  cmd->add_option("--methods", a->methods,
                  "e.g. full,streaming_llm,h2o,tova,scissorhands,snapkv,pyramidkv,quest,knorm,random,oracle; "
                  "METHOD:KEY=VALUE[:KEY=VALUE] sets parameters (--kv-param's keys), e.g. snapkv:head_budgets=adaptive")
      ->delimiter(',');
  cmd->add_option("--budgets", a->budgets, "fractions of the context (0.1) or token counts (512)")->delimiter(',');
  cmd->add_option("--lengths", a->lengths, "context lengths in tokens: 1024,2k,32k")->delimiter(',');
  cmd->add_option("--kv-types", a->kv_types,
                  "KV storage types: f32,f16,bf16,int8,int8_kivi,fp8_e4m3,fp8_e5m2,int4_kivi,int2_kivi")
      ->delimiter(',');
  cmd->add_option("--tasks", a->tasks,
                  "niah_single,niah_multikey,niah_multiquery,kv_retrieval,variable_tracking,freq_words,copy,fidelity,latency,"
                  "user:FILE.jsonl")
      ->delimiter(',');
  cmd->add_option("--protocols", a->protocols, "question_last,question_after")->delimiter(',');
  cmd->add_option("--depths", a->depths, "needle depths in [0, 1], cycled over samples")->delimiter(',');
  cmd->add_option("--samples", a->samples, "samples per configuration (default 8; latency 1)")
      ->check(kPositive);
  cmd->add_option("--value-tokens", a->value_tokens,
                  "token-level needles: value tokens after each key (default 3: later answer tokens come from the "
                  "compressed cache)")
      ->check(kPositive);
  cmd->add_option("--kv-config", a->kv_config, "per-layer KV config file: replaces methods x budgets x kv types");
  cmd->add_option("--sparse-prefill", a->sparse_prefill,
                  "attend every layer's prompt chunks sparsely in every method row: vertical_slash, block_sparse "
                  "or xattention, as METHOD:KEY=VALUE:... (not with --kv-config: set \"prefill\" in the file)");
  cmd->add_option("--prefill-eviction", a->prefill_eviction,
                  "prompt_end (compress after the whole prompt; default of the accuracy runs) or chunk (after every "
                  "prompt chunk: bounded memory; default of the latency runs)")
      ->check(CLI::IsMember({"chunk", "prompt_end"}));
  cmd->add_option("--evict-interval", a->evict_interval,
                  "decode eviction interval of every method (a performance option). Default: each method's paper "
                  "cadence in accuracy and fidelity runs (1 for streaming_llm, h2o, tova, scissorhands, random; 16 "
                  "for methods that do not evict while decoding) and 16 in latency runs")
      ->check(kPositive);
  cmd->add_option("--fidelity-text", a->fidelity_text,
                  "fidelity task: teacher-force the first --lengths tokens of this text file (encoded by the model's "
                  "tokenizer) instead of a stream sampled from the model");
  cmd->add_option("--fidelity-tokens", a->fidelity_tokens,
                  "fidelity task: teacher-force the first --lengths token ids of this file (whitespace-separated; # "
                  "starts a comment) instead of a stream sampled from the model");
  cmd->add_option("--page-size", a->page_size, "tokens per KV page (default 16; 32 for the KIVI types)")
      ->check(kPositive);
  AddThreadsOption(cmd, &a->threads);
  cmd->add_option("--seed", a->seed, "task seed")->capture_default_str();
  cmd->add_option("-o,--out-dir", a->out_dir, "results.jsonl, report.md and plots go here")->capture_default_str();
  cmd->add_option("--shard", a->shard, "i/N: run every N-th configuration starting at i (job arrays)")
      ->capture_default_str();
  cmd->add_flag("--no-plots", a->no_plots, "skip the PNG plots");
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });

  auto merge_inputs = std::make_shared<std::vector<std::string>>();
  auto merge_out = std::make_shared<std::string>("bench-out");
  auto merge_no_plots = std::make_shared<bool>(false);
  CLI::App* merge = app.add_subcommand("bench-merge", "Combine shard results of `kvsparse bench --shard` and report");
  merge->add_option("inputs", *merge_inputs, "results files of the shards")->required();
  merge->add_option("-o,--out-dir", *merge_out, "merged results.jsonl, report.md and plots go here")
      ->capture_default_str();
  merge->add_flag("--no-plots", *merge_no_plots, "skip the PNG plots");
  merge->callback([=] {
    std::error_code ec;
    fs::create_directories(*merge_out, ec);
    const std::string results = (fs::path(*merge_out) / "results.jsonl").string();
    Status st = MergeBenchResults(*merge_inputs, results);
    *exit_code = st.ok() ? WriteReport(results, *merge_out, !*merge_no_plots) : Fail(st);
  });

  auto report_dir = std::make_shared<std::string>();
  auto report_no_plots = std::make_shared<bool>(false);
  CLI::App* report = app.add_subcommand("bench-report", "Redraw report.md and plots from DIR/results.jsonl");
  report->add_option("dir", *report_dir, "a bench output folder")->required();
  report->add_flag("--no-plots", *report_no_plots, "skip the PNG plots");
  report->callback([=] {
    *exit_code = WriteReport((fs::path(*report_dir) / "results.jsonl").string(), *report_dir, !*report_no_plots);
  });
}

}  // namespace kvsparse::cli
