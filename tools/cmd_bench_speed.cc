// `kvsparse bench-speed`: llama-bench style pp/tg throughput at chosen KV depths.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "commands.h"
#include "kv_flags.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/speed_bench.h"

namespace kvsparse::cli {
namespace {
constexpr const char* kDefaultKvType = "f16";

struct BenchArgs {
  std::string model, output = "md", out_file, fill = "prefill";
  bool compare_dense = false;
  std::vector<std::string> compare_methods;  // --compare-method METHOD[:KEY=VALUE...]
  std::vector<std::string> compare_prefill;  // --compare-prefill METHOD[:KEY=VALUE...]
  KvFlags kv;
  SpeedBenchConfig config;
};

int Run(BenchArgs& a) {
  if (Status valid = ValidateSpeedBenchConfig(a.config); !valid.ok()) return Fail(valid);
  auto path = ResolveModelPath(a.model);
  if (!path.ok()) return Fail(path.status());
  if (a.output != "md" && a.output != "json") return Fail(InvalidArgumentError("-o/--output: expected md or json, found '" + a.output + "'"));
  auto model = Model::Load(*path);
  if (!model.ok()) return Fail(model.status());
  {
    // LongRoPE files pick their factor table by the longest sequence the run holds, as -c would.
    int longest = 0;
    for (int d : a.config.depths) {
      for (int n : a.config.n_prompt) longest = std::max(longest, d + n);
      for (int n : a.config.n_gen) longest = std::max(longest, d + n);
    }
    (*model)->SetContextLength(longest);
  }
  auto sparsity = ResolveKvFlags(a.kv, kDefaultKvType, (*model)->config().n_layers, &a.config.kv_storage);
  if (!sparsity.ok()) return Fail(sparsity.status());
  a.config.kv_sparsity = *sparsity;
  a.config.kv_stats = a.kv.stats;
  a.config.synthetic_fill = a.fill == "synthetic";
  // --compare-method: the same budget, KV type and schedule under other methods, in this process.
  std::vector<std::pair<std::string, SpeedBenchConfig>> others;
  if (!a.compare_methods.empty()) {
    if (a.kv.method.empty() || a.kv.budget.empty()) {
      return Fail(InvalidArgumentError("--compare-method needs --kv-method and --kv-budget (the run it compares with)"));
    }
    for (const std::string& text : a.compare_methods) {
      auto spec = ParseKvMethodSpec(text, "--compare-method");
      if (!spec.ok()) return Fail(spec.status());
      auto other = KvSparsityConfigFromFlags(spec->name, a.kv.budget, a.kv.kv_type.empty() ? kDefaultKvType : a.kv.kv_type,
                                             (*model)->config().n_layers);
      if (!other.ok()) return Fail(other.status());
      const KvSparsityConfig& main = *a.config.kv_sparsity;
      other->evict_interval = main.evict_interval;
      other->page_size = main.page_size;
      other->kivi_residual = main.kivi_residual;
      other->kivi_v_group = main.kivi_v_group;
      other->prefill_chunk = main.prefill_chunk;
      other->prefill_eviction = main.prefill_eviction;
      other->agg = main.agg;
      if (Status s = ApplyKvParams(spec->params, &*other); !s.ok()) return Fail(s);
      SpeedBenchConfig config = a.config;
      config.kv_sparsity = std::move(*other);
      others.emplace_back(text, std::move(config));
    }
  }
  std::string text;
  if (!a.compare_prefill.empty()) {
    // --compare-prefill: this run's prompt attention (usually dense) against sparse prefill
    // methods, every layer, in this process.
    if (!a.config.kv_sparsity) {
      return Fail(InvalidArgumentError("--compare-prefill needs the paged cache: add --kv-method full (or a method)"));
    }
    auto base = RunSpeedBench(**model, a.config);
    if (!base.ok()) return Fail(base.status());
    const std::string base_label(PrefillMethodName(a.config.kv_sparsity->layers[0].prefill.method));
    text = SpeedReportMarkdown(*base) + "\n";
    for (const std::string& spec_text : a.compare_prefill) {
      auto prefill = ParsePrefillSparsity(spec_text, "--compare-prefill");
      if (!prefill.ok()) return Fail(prefill.status());
      SpeedBenchConfig config = a.config;
      for (LayerKvConfig& layer : config.kv_sparsity->layers) layer.prefill = *prefill;
      config.known_bandwidth_gbs = base->read_bandwidth_gbs;
      auto report = RunSpeedBench(**model, config);
      if (!report.ok()) return Fail(report.status());
      text +=
          SpeedReportMarkdown(*report) + "\n" + PrefillComparisonMarkdown(*base, *report, base_label, spec_text) + "\n";
    }
  } else if ((a.compare_dense || !others.empty()) && a.config.kv_sparsity) {
    // The dense f16 baseline first, in the same process and with the same bandwidth figure.
    SpeedBenchConfig dense_config = a.config;
    dense_config.kv_sparsity.reset();
    dense_config.kv_storage = KvStorage::kF16;
    auto dense = RunSpeedBench(**model, dense_config);
    if (!dense.ok()) return Fail(dense.status());
    a.config.known_bandwidth_gbs = dense->read_bandwidth_gbs;
    auto sparse = RunSpeedBench(**model, a.config);
    if (!sparse.ok()) return Fail(sparse.status());
    std::vector<std::pair<std::string, SpeedReport>> compared;
    for (auto& [name, config] : others) {
      config.known_bandwidth_gbs = dense->read_bandwidth_gbs;
      auto report = RunSpeedBench(**model, config);
      if (!report.ok()) return Fail(report.status());
      compared.emplace_back(name, std::move(*report));
    }
    if (a.output == "json") {
      text = "{\"dense\": " + SpeedReportJson(*dense) + ",\n\"sparse\": " + SpeedReportJson(*sparse);
      if (!compared.empty()) {
        text += ",\n\"compared\": {";
        for (size_t i = 0; i < compared.size(); ++i) {
          text += fmt::format("{}\n\"{}\": {}", i ? "," : "", compared[i].first, SpeedReportJson(compared[i].second));
        }
        text += "}";
      }
      text += "}\n";
    } else {
      text = SpeedReportMarkdown(*dense) + "\n" + SpeedReportMarkdown(*sparse) + "\n";
      for (const auto& [name, report] : compared) text += SpeedReportMarkdown(report) + "\n";
      text += SpeedComparisonMarkdown(*dense, *sparse);
      for (const auto& [name, report] : compared) {
        text += "\n" + SpeedComparisonMarkdown(*dense, report, "dense", name) + "\n" +
                SpeedComparisonMarkdown(report, *sparse, name, a.kv.method);
      }
    }
  } else {
    auto report = RunSpeedBench(**model, a.config);
    if (!report.ok()) return Fail(report.status());
    text = a.output == "json" ? SpeedReportJson(*report) : SpeedReportMarkdown(*report);
  }
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
  AddThreadsOption(cmd, &a->config.n_threads);
  cmd->add_option("-r,--repetitions", a->config.repetitions, "timed repetitions per test")->capture_default_str()->check(kPositive);
  cmd->add_option("-b,--batch-size", a->config.prefill_chunk, "tokens per forward pass in prefill (a two-pass sparse prefill gets the whole prompt in one)")->capture_default_str()->check(kPositive);
  cmd->add_option("--fill", a->fill,
                  "how the depth is filled: prefill (run the tokens through the model) or synthetic (append random "
                  "K/V; decode speed and memory do not depend on the values)")
      ->capture_default_str()
      ->check(CLI::IsMember({"prefill", "synthetic"}));
  cmd->add_flag("!--no-bandwidth", a->config.measure_bandwidth,
                "skip the read-bandwidth probe (it touches 1 GiB, which then shows in the peak resident memory)");
  cmd->add_option("--warmup", a->config.warmup, "run an untimed repetition before the timed ones (0 or 1)")
      ->capture_default_str();
  cmd->add_option("--attention-reps", a->config.attention_reps,
                  "time one decode step's attention over the final cache this many times (0 = off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--compare-prefill", a->compare_prefill,
                  "also run every layer with this sparse prefill (vertical_slash, block_sparse, xattention; "
                  "METHOD:KEY=VALUE:...) and compare prompt speed and attention time (repeatable; md output)");
  cmd->add_flag("--compare-dense", a->compare_dense,
                "with a sparse KV method: also run the same tests with the dense f16 cache and print both side by side");
  cmd->add_option("--compare-method", a->compare_methods,
                  "with --kv-method and --kv-budget: also run another method (METHOD[:KEY=VALUE...]) at the same budget, "
                  "KV type and schedule, in the same process, and print each against dense and against --kv-method "
                  "(repeatable; implies --compare-dense)");
  AddKvFlags(cmd, &a->kv, kDefaultKvType);
  cmd->add_option("-o,--output", a->output, "md or json")->capture_default_str();
  cmd->add_option("--out-file", a->out_file, "also write the report to this file");
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });
}

}  // namespace kvsparse::cli
