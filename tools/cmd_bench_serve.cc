// `kvsparse bench-serve`: batched decode throughput against concurrency through the
// continuous-batching scheduler, and how many requests a fixed KV memory budget admits per KV
// config (and how fast they decode together). The work lives in src/bench/serve.cc.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "commands.h"
#include "kv_flags.h"
#include "kvsparse/serve_bench.h"

namespace kvsparse::cli {
namespace {
constexpr const char* kDefaultKvType = "f16";

struct ServeBenchArgs {
  std::string model, out_file, capacity_configs = "full:f16,h2o:0.2:f16,h2o:0.2:int8";
  bool no_capacity = false;
  bool no_load = false;
  KvFlags kv;
  ServeBenchConfig config;
};

int Run(ServeBenchArgs& a) {
  // Every flag is checked before the model loads (or is synthesized).
  auto specs = ParseServeKvSpecs(a.capacity_configs);
  if (!specs.ok()) return Fail(specs.status());
  a.config.capacity_configs = *specs;
  a.config.run_capacity = !a.no_capacity;
  a.config.run_load = !a.no_load;
  if (Status valid = ValidateServeBenchConfig(a.config); !valid.ok()) return Fail(valid);
  auto path = ResolveModelPath(a.model);
  if (!path.ok()) return Fail(path.status());
  auto model = Model::Load(*path);
  if (!model.ok()) return Fail(model.status());
  // Part 1 always runs on the paged cache: without KV flags, "full" on pages of the dense type.
  KvStorage storage = KvStorage::kF16;
  auto sparsity = ResolveKvFlags(a.kv, kDefaultKvType, (*model)->config().n_layers, &storage);
  if (!sparsity.ok()) return Fail(sparsity.status());
  if (*sparsity) {
    a.config.throughput_kv = **sparsity;
  } else {
    auto full = KvSparsityConfigFromFlags("full", "", KvStorageName(storage), (*model)->config().n_layers);
    if (!full.ok()) return Fail(full.status());
    a.config.throughput_kv = *full;
  }
  a.config.progress = [](const std::string& line) {
    std::fprintf(stderr, "bench-serve: %s\n", line.c_str());
    std::fflush(stderr);
  };
  auto report = RunServeBench(**model, a.config);
  if (!report.ok()) return Fail(report.status());
  const std::string text = ServeBenchMarkdown(*report);
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
  if (!a.out_file.empty()) {
    std::ofstream f(a.out_file);
    f << ServeBenchJson(*report);
    if (!f) return Fail(InvalidArgumentError("-o/--out: cannot write " + a.out_file));
  }
  return 0;
}
}  // namespace

void RegisterBenchServe(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<ServeBenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench-serve", "Serving benchmark: batched decode throughput vs concurrency, and capacity under a KV budget");
  cmd->add_option("-m,--model", a->model, "model (default: built-in synthetic TinyLlama-1.1B shape, q8_0)");
  AddThreadsOption(cmd, &a->config.n_threads);
  cmd->add_option("--streams", a->config.streams, "concurrent requests to time, one run each")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--prompt", a->config.prompt_tokens, "prompt tokens per request")->capture_default_str();
  cmd->add_option("--gen", a->config.gen_tokens, "tokens generated per request")->capture_default_str();
  cmd->add_option("--step-tokens", a->config.step_tokens, "rows per scheduler step (decode rows, then prompt chunks)")
      ->capture_default_str();
  cmd->add_option("--prefill", a->config.prefill_tokens,
                  "prompt length of the prefill ceiling (one prompt through the engine; 0 = skip)")
      ->capture_default_str();
  cmd->add_option("--kv-memory", a->config.kv_memory_mib, "KV memory budget in MiB (every runtime)")
      ->capture_default_str();
  cmd->add_option("--depth", a->config.depth, "capacity: context tokens per request (filled synthetically)")
      ->capture_default_str();
  cmd->add_option("--capacity-gen", a->config.capacity_gen, "capacity: decode steps timed (and reserved per request)")
      ->capture_default_str();
  cmd->add_option("--capacity-max", a->config.capacity_max, "capacity: most sequences one run fills and decodes")
      ->capture_default_str();
  cmd->add_option("--capacity-configs", a->capacity_configs,
                  "capacity: KV configs, comma-separated method[:budget][:kv_type] (the first is the reference)")
      ->capture_default_str();
  cmd->add_flag("--no-capacity", a->no_capacity, "skip the capacity part");
  cmd->add_option("--load-requests", a->config.load_requests, "latency part: requests submitted at once")
      ->capture_default_str();
  cmd->add_option("--load-prompt", a->config.load_prompt, "latency part: prompt tokens per request")
      ->capture_default_str();
  cmd->add_option("--load-gen", a->config.load_gen, "latency part: tokens generated per request")
      ->capture_default_str();
  cmd->add_option("--load-slots", a->config.load_dense_slots,
                  "latency part: the KV budget holds this many dense f16 requests at once")
      ->capture_default_str();
  cmd->add_flag("--no-load", a->no_load, "skip the latency-under-memory-pressure part");
  AddKvFlags(cmd, &a->kv, kDefaultKvType);
  cmd->add_option("-o,--out", a->out_file, "also write the figures to this JSON file");
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });
}

}  // namespace kvsparse::cli
