// `kvsparse bench-speed`: llama-bench style pp/tg throughput at chosen KV depths.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "commands.h"
#include "kvsparse/speed_bench.h"

namespace kvsparse::cli {
namespace {
struct BenchArgs {
  std::string model, output = "md", out_file, kv_type = "f16";
  SpeedBenchConfig config;
};

int Run(BenchArgs& a) {
  auto path = ResolveModelPath(a.model);
  if (!path.ok()) return Fail(path.status());
  auto storage = ParseKvStorage(a.kv_type);
  if (!storage.ok()) return Fail(storage.status());
  a.config.kv_storage = *storage;
  if (a.output != "md" && a.output != "json") return Fail(InvalidArgumentError("-o/--output: expected md or json, found '" + a.output + "'"));
  auto model = Model::Load(*path);
  if (!model.ok()) return Fail(model.status());
  auto report = RunSpeedBench(**model, a.config);
  if (!report.ok()) return Fail(report.status());
  const std::string text = a.output == "json" ? SpeedReportJson(*report) : SpeedReportMarkdown(*report);
  std::fputs(text.c_str(), stdout);
  if (!a.out_file.empty()) {
    std::ofstream f(a.out_file);
    f << text;
    if (!f) return Fail(InvalidArgumentError("cannot write " + a.out_file));
  }
  return 0;
}
}  // namespace

void RegisterBenchSpeed(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench-speed", "Prompt-processing and generation throughput (llama-bench style)");
  cmd->add_option("-m,--model", a->model, "model (default: built-in synthetic TinyLlama-1.1B shape, q8_0)");
  cmd->add_option("-p,--n-prompt", a->config.n_prompt, "prompt lengths to time (ppN)")->delimiter(',')->capture_default_str();
  cmd->add_option("-n,--n-gen", a->config.n_gen, "generation lengths to time (tgN)")->delimiter(',')->capture_default_str();
  cmd->add_option("-d,--depth", a->config.depths, "KV depths: tokens in the cache before timing")->delimiter(',')->capture_default_str();
  cmd->add_option("-t,--threads", a->config.n_threads, "threads (0 = all cores)")->capture_default_str();
  cmd->add_option("-r,--repetitions", a->config.repetitions, "timed repetitions per test")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("-b,--batch-size", a->config.prefill_chunk, "tokens per forward pass in prefill")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--kv-type", a->kv_type, "KV cache storage: f16 or f32")->capture_default_str();
  cmd->add_option("-o,--output", a->output, "md or json")->capture_default_str();
  cmd->add_option("--out-file", a->out_file, "also write the report to this file");
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });
}

}  // namespace kvsparse::cli
