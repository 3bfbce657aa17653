// kvsparse: one binary with subcommands — generate, inspect, convert, synth, bench-speed, bench.
#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvsparse: LLM inference whose KV cache really shrinks"};
  app.require_subcommand(1);
  int exit_code = 0;
  kvsparse::cli::RegisterGenerate(app, &exit_code);
  kvsparse::cli::RegisterInspect(app, &exit_code);
  kvsparse::cli::RegisterConvert(app, &exit_code);
  kvsparse::cli::RegisterSynth(app, &exit_code);
  kvsparse::cli::RegisterBenchSpeed(app, &exit_code);
  kvsparse::cli::RegisterBench(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
