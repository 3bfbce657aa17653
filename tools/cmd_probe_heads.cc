// `kvsparse probe-heads -m MODEL -o heads.json`: RazorAttention's retrieval-head scores of every
// (layer, KV head), for razor's "heads" (see head_probe.h).
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "commands.h"
#include "kvsparse/head_probe.h"

namespace kvsparse::cli {
namespace {

struct ProbeArgs {
  std::string model, out;
  HeadProbeOptions options;
  int show = 10;
};

int Run(const ProbeArgs& a) {
  auto path = ResolveModelPath(a.model);
  if (!path.ok()) return Fail(path.status());
  auto model = Model::Load(*path);
  if (!model.ok()) return Fail(model.status());
  const ModelConfig& c = (*model)->config();
  auto heads = ProbeRetrievalHeads(**model, a.options);
  if (!heads.ok()) return Fail(heads.status());
  std::printf("%s: %d layers x %d KV heads; probe: %d random tokens x %d copies, %d trial(s)\n", path->c_str(),
              c.n_layers, c.n_kv_heads, std::min({a.options.tokens, c.n_vocab, c.max_context / a.options.repeats}),
              a.options.repeats, a.options.trials);
  std::printf("%5s %7s %9s %9s %9s\n", "layer", "kv_head", "score", "induction", "echo");
  for (size_t i = 0; i < heads->size() && static_cast<int>(i) < a.show; ++i) {
    const HeadScore& h = (*heads)[i];
    std::printf("%5d %7d %9.4f %9.4f %9.4f\n", h.layer, h.kv_head, h.score(), h.induction, h.echo);
  }
  std::fflush(stdout);
  if (!a.out.empty()) {
    std::ofstream f(a.out, std::ios::trunc);
    f << HeadScoresToJson(*heads, c.n_layers, c.n_kv_heads);
    if (!f) return Fail(InvalidArgumentError(fmt::format("-o: cannot write {}", a.out)));
    std::fprintf(stderr, "wrote %s (use it with --kv-method razor --kv-param heads=%s)\n", a.out.c_str(), a.out.c_str());
  }
  return 0;
}

}  // namespace

void RegisterProbeHeads(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<ProbeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "probe-heads", "Score every KV head as a retrieval head (echo and induction attention on a repeated random "
                     "sequence; RazorAttention) and write the heads file razor reads");
  cmd->add_option("-m,--model", a->model, "GGUF or llama2.c model (default: built-in synthetic TinyLlama shape)");
  cmd->add_option("-o,--output", a->out, "heads file (JSON) to write");
  cmd->add_option("--tokens", a->options.tokens,
                  "length of the random sequence (cut to the vocabulary and the context / --repeats)")
      ->capture_default_str()
      ->check(CLI::Range(4, 1 << 20));
  cmd->add_option("--repeats", a->options.repeats, "copies of the sequence in the probe prompt")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  cmd->add_option("--trials", a->options.trials, "random sequences averaged")->capture_default_str()->check(CLI::Range(1, 1000));
  cmd->add_option("--seed", a->options.seed, "sequence seed")->capture_default_str();
  cmd->add_option("-t,--threads", a->options.n_threads, "threads")->capture_default_str()->check(CLI::Range(1, 1024));
  cmd->add_option("--show", a->show, "heads to print, best first")->capture_default_str();
  cmd->callback([a, exit_code] { *exit_code = Run(*a); });
}

}  // namespace kvsparse::cli
