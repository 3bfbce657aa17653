// kvsparse: one binary with subcommands — generate, inspect, convert, synth, bench-speed, bench-serve, bench,
// serve, probe-heads, calibrate.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "commands.h"
#include "kvsparse/isa.h"

int main(int argc, char** argv) {
  CLI::App app{"kvsparse: LLM inference whose KV cache really shrinks"};
  app.require_subcommand(1);
  int exit_code = 0;
  app.set_version_flag("--version", [] { return std::string("kvsparse " KVS_VERSION "\nkernels: ") + kvsparse::IsaSummary(); });
  // The kernel family: KVSPARSE_ISA, then --isa (accepted before or after the subcommand); both
  // are checked before any subcommand runs, so a family the CPU lacks is a clear error.
  std::string isa;
  app.add_option("--isa", isa, "kernel family: scalar, avx2 or avx512 (default: the best this CPU runs)");
  app.fallthrough();
  app.parse_complete_callback([&isa] {
    if (kvsparse::Status env = kvsparse::SetIsaFromEnvironment(); !env.ok()) throw CLI::ValidationError(env.message());
    if (isa.empty()) return;
    auto parsed = kvsparse::ParseIsa(isa);
    const kvsparse::Status status = parsed.ok() ? kvsparse::SetIsa(*parsed) : parsed.status();
    if (!status.ok()) throw CLI::ValidationError("--isa", status.message());
  });
  kvsparse::cli::RegisterGenerate(app, &exit_code);
  kvsparse::cli::RegisterInspect(app, &exit_code);
  kvsparse::cli::RegisterConvert(app, &exit_code);
  kvsparse::cli::RegisterSynth(app, &exit_code);
  kvsparse::cli::RegisterBenchSpeed(app, &exit_code);
  kvsparse::cli::RegisterBenchServe(app, &exit_code);
  kvsparse::cli::RegisterBench(app, &exit_code);
  kvsparse::cli::RegisterServe(app, &exit_code);
  kvsparse::cli::RegisterProbeHeads(app, &exit_code);
  kvsparse::cli::RegisterCalibrate(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0 through CLI11; a bad flag or value reads like every other
    // error ("error: --threads: Value -1 not in range 0 to 1024").
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s\nRun with --help for more information.\n", e.what());
    return e.get_exit_code();
  }
  return exit_code;
}
