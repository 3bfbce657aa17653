// Subcommands of the `kvsparse` binary. Each Register* adds a CLI11 subcommand whose
// callback sets *exit_code. Front ends stay thin: the work lives in the library.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "kvsparse/kv_cache.h"
#include "kvsparse/model.h"
#include "kvsparse/tokenizer.h"
#include "kvsparse/status.h"

namespace kvsparse::cli {

void RegisterGenerate(CLI::App& app, int* exit_code);
void RegisterInspect(CLI::App& app, int* exit_code);
void RegisterConvert(CLI::App& app, int* exit_code);
void RegisterSynth(CLI::App& app, int* exit_code);
void RegisterBenchSpeed(CLI::App& app, int* exit_code);
void RegisterBenchServe(CLI::App& app, int* exit_code);  // serving benchmark (src/bench/serve.cc)
void RegisterBench(CLI::App& app, int* exit_code);  // bench, bench-merge, bench-report
void RegisterServe(CLI::App& app, int* exit_code);  // OpenAI-compatible HTTP server
void RegisterProbeHeads(CLI::App& app, int* exit_code);  // retrieval-head scores for razor
void RegisterCalibrate(CLI::App& app, int* exit_code);   // per-layer config search (src/bench/calibrate.cc)

// --lengths values: "2k" -> 2048, "32K" -> 32768, "1000" -> 1000.
StatusOr<int32_t> ParseLengthFlag(const std::string& text);

// Prints "error: <status>" to stderr and returns 1.
int Fail(const Status& status);

// A value above 0 (CLI::PositiveNumber's message prints the range up to DBL_MAX).
extern const CLI::Validator kPositive;

// -t/--threads, the same range for every command: 0 (all cores) to 1024.
CLI::Option* AddThreadsOption(CLI::App* cmd, int* n_threads);

// The model a command runs on: `path` when given, else the built-in default —
// a random-weight model of TinyLlama-1.1B's exact shape (Q8_0), synthesized once into
// $KVSPARSE_CACHE (default ~/.cache/kvsparse) so no download is needed.
StatusOr<std::string> ResolveModelPath(const std::string& path);
// The model's tokenizer from its GGUF tokenizer.ggml.* keys; null (not an error) when the file
// has none (llama2.c checkpoints, vocab-less GGUFs): such models take token-id prompts only.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerIfAny(const Model& model);

// What `generate` and `serve` start from: the resolved path, the model and its tokenizer (null
// when the file has none).
struct LoadedModel {
  std::string path;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
};
StatusOr<LoadedModel> LoadModelWithTokenizer(const std::string& model_flag);

}  // namespace kvsparse::cli
