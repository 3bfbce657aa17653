// `kvsparse calibrate`: searches the cheapest per-layer KV config that keeps the accuracy of the
// user's tasks at the user's lengths (calibrate.h), writes it as a --kv-config file, and reports
// the search. Without -m: the built-in multi-head retrieval instrument.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "kvsparse/calibrate.h"
#include "kvsparse/retrieval_model.h"

namespace kvsparse::cli {
namespace {

namespace fs = std::filesystem;

struct CalibrateArgs {
  std::string model, out_dir = "calibrate-out", shard = "0/1", objective = "memory", prefill_eviction = "prompt_end";
  std::string fidelity_text, fidelity_tokens;
  std::vector<std::string> methods, budgets, lengths, kv_types, tasks, protocols;
  double keep = 0.99, kl_max = 0.05, max_minutes = 0;
  int samples = 0, proxy_samples = 0, holdout_samples = 0, threads = 0, evict_interval = 0;
  uint64_t seed = 1;
  bool no_plots = false;
};

// One line per evaluation: the phase, its count against the phase's estimate, and the phase's ETA
// from its own pace (phases differ: sensitivity runs the shortest length, refinement every one).
void Progress(const std::string& phase, size_t done, size_t total, double seconds, double left) {
  static std::string current;
  static double phase_start = 0, last = 0;
  if (phase != current) current = phase, phase_start = last;
  last = seconds;
  auto clock = [](double s) { return fmt::format("{}:{:02}", static_cast<int>(s) / 60, static_cast<int>(s) % 60); };
  const double eta = done > 0 ? (seconds - phase_start) / done * static_cast<double>(total - done) : 0;
  const std::string limit = left >= 0 ? fmt::format(", {} left of --max-minutes", clock(left)) : "";
  std::fprintf(stderr, "%s%-11s %zu/~%zu evaluations, %s elapsed, phase ETA %s%s%s", isatty(fileno(stderr)) ? "\r" : "",
               phase.c_str(), done, total, clock(seconds).c_str(), clock(eta).c_str(), limit.c_str(),
               isatty(fileno(stderr)) ? "   " : "\n");
}

int Run(const CalibrateArgs& a) {
  CalibrateSpec spec;
  if (a.model.empty()) {
    // The built-in instrument (retrieval_model.h): the circuit lives in 2 of 16 KV heads of layers 0
    // and 3; layers 1-2 are distractors. What a per-layer search should find.
    auto path = BuiltinRetrievalModelPath(RetrievalShape::kMultiHead);
    if (!path.ok()) return Fail(path.status());
    spec.model_path = *path;
    spec.model_name = "builtin-retrieval-mha";
    spec.tasks = {"niah_multiquery", "niah_single"};
    spec.lengths = {1024, 4096};
    spec.n_threads = 2;
  } else {
    spec.model_path = a.model;
  }
  if (!a.tasks.empty()) spec.tasks = a.tasks;
  if (!a.methods.empty()) spec.methods = a.methods;
  if (!a.budgets.empty()) spec.budgets = a.budgets;
  if (!a.kv_types.empty()) spec.kv_types = a.kv_types;
  if (!a.lengths.empty()) {
    spec.lengths.clear();
    for (const std::string& l : a.lengths) {
      auto n = ParseLengthFlag(l);
      if (!n.ok()) return Fail(n.status());
      spec.lengths.push_back(*n);
    }
  }
  if (!a.protocols.empty()) {
    spec.protocols.clear();
    for (const std::string& p : a.protocols) {
      auto protocol = ParseBenchProtocol(p);
      if (!protocol.ok()) return Fail(protocol.status());
      spec.protocols.push_back(*protocol);
    }
  }
  spec.keep = a.keep;
  spec.kl_max = a.kl_max;
  spec.objective = a.objective;
  spec.max_minutes = a.max_minutes;
  if (a.samples > 0) spec.samples = a.samples;
  if (a.proxy_samples > 0) spec.proxy_samples = a.proxy_samples;
  if (a.holdout_samples > 0) spec.holdout_samples = a.holdout_samples;
  if (a.threads > 0) spec.n_threads = a.threads;
  spec.seed = a.seed;
  spec.evict_interval = a.evict_interval;
  spec.prefill_eviction = a.prefill_eviction;
  spec.fidelity_text = a.fidelity_text;
  spec.fidelity_tokens = a.fidelity_tokens;
  auto shard = ParseBenchShard(a.shard);
  if (!shard.ok()) return Fail(shard.status());
  CalibrateOptions options;
  options.work_dir = a.out_dir;
  options.shard = *shard;
  options.progress = Progress;
  options.plots = !a.no_plots;
  std::fprintf(stderr, "kvsparse calibrate: %s -> %s\n", spec.model_path.c_str(), a.out_dir.c_str());
  auto result = RunCalibrate(spec, options);
  if (!result.ok()) return Fail(result.status());
  if (result->sharded_only) {
    std::fprintf(stderr, "\nshard done; run calibrate again without --shard on the same -o to finish the search\n");
    return 0;
  }
  std::fputs(CalibrateReportMarkdown(result->report).c_str(), stdout);
  std::fflush(stdout);
  std::fprintf(stderr, "\nconfig: %s\nreport: %s\nuse it: kvsparse generate -m MODEL --kv-config %s\n",
               result->config_path.c_str(), (fs::path(a.out_dir) / "report.md").c_str(), result->config_path.c_str());
  return result->report.value("holdout_pass", false) ? 0 : 3;
}

}  // namespace

void RegisterCalibrate(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Search the cheapest per-layer KV config (method, budget, KV type per layer) that keeps the accuracy of your "
      "tasks at your lengths; writes OUT/kv-config.json for --kv-config and a report. Without -m: the built-in "
      "multi-head retrieval instrument at 1024 and 4096 tokens");
  cmd->add_option("-m,--model", a->model, "GGUF or llama2.c model (default: the built-in instrument)");
  cmd->add_option("--tasks", a->tasks,
                  "tasks to hold, as bench takes them: niah_single, niah_multiquery, ..., user:FILE.jsonl, fidelity")
      ->delimiter(',');
  cmd->add_option("--lengths", a->lengths, "context lengths to serve: 1024,4k")->delimiter(',');
  cmd->add_option("--protocols", a->protocols, "question_last (default), question_after")->delimiter(',');
  cmd->add_option("--methods", a->methods,
                  "candidate methods, METHOD[:KEY=VALUE...] (default streaming_llm,h2o,tova,snapkv)")
      ->delimiter(',');
  cmd->add_option("--budgets", a->budgets, "the budget ladder (default 0.01,0.02,0.05,0.1,0.2,0.3,0.5)")->delimiter(',');
  cmd->add_option("--kv-types", a->kv_types, "KV storage types, the first the reference for search (default f16,int8)")
      ->delimiter(',');
  cmd->add_option("--keep", a->keep, "accuracy to keep, relative to the full cache, per cell")->capture_default_str();
  cmd->add_option("--kl-max", a->kl_max, "fidelity cells: mean KL to the full cache at most this")
      ->capture_default_str();
  cmd->add_option("--objective", a->objective, "memory (bytes stored) or speed (bytes read per decode step)")
      ->capture_default_str()
      ->check(CLI::IsMember({"memory", "speed"}));
  cmd->add_option("--max-minutes", a->max_minutes, "stop refining in time for the held-out check (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--samples", a->samples, "samples per cell in the search (default 8)")->check(kPositive);
  cmd->add_option("--proxy-samples", a->proxy_samples, "samples per cell in the sensitivity pass (default 4)")
      ->check(kPositive);
  cmd->add_option("--holdout-samples", a->holdout_samples, "samples per cell in the held-out check (default 16)")
      ->check(kPositive);
  cmd->add_option("--prefill-eviction", a->prefill_eviction, "prompt_end (default) or chunk")
      ->check(CLI::IsMember({"chunk", "prompt_end"}));
  cmd->add_option("--evict-interval", a->evict_interval,
                  "decode eviction interval (default: the least paper cadence of the methods a config uses)")
      ->check(kPositive);
  cmd->add_option("--fidelity-text", a->fidelity_text, "fidelity task: this text file's tokens as the stream");
  cmd->add_option("--fidelity-tokens", a->fidelity_tokens, "fidelity task: this file's token ids as the stream");
  AddThreadsOption(cmd, &a->threads);
  cmd->add_option("--seed", a->seed, "sample seed (the held-out check uses another)")->capture_default_str();
  cmd->add_option("-o,--out-dir", a->out_dir, "work folder: evaluations (resumable), configs, kv-config.json, report")
      ->capture_default_str();
  cmd->add_option("--shard", a->shard, "i/N: run this share of the independent phases, then stop")
      ->capture_default_str();
  cmd->add_flag("--no-plots", a->no_plots, "skip frontier.png");
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });
}

}  // namespace kvsparse::cli
