#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>

#include "commands.h"
#include "kvsparse/synth.h"

namespace kvsparse::cli {

int Fail(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

const CLI::Validator kPositive(
    [](std::string& text) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !(v > 0)) return "must be positive, got " + text;
      return "";
    },
    "POSITIVE");

CLI::Option* AddThreadsOption(CLI::App* cmd, int* n_threads) {
  return cmd->add_option("-t,--threads", *n_threads, "threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
}

StatusOr<std::string> ResolveModelPath(const std::string& path) {
  if (!path.empty()) return path;
  namespace fs = std::filesystem;
  const fs::path dir = ModelCacheDir();
  const fs::path file = dir / "synth-tinyllama-1.1b-q8_0.gguf";
  if (fs::exists(file)) return file.string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return InvalidArgumentError(fmt::format("cannot create cache folder {}: {}", dir.string(), ec.message()));
  KVS_ASSIGN_OR_RETURN(SynthShape shape, FindSynthShape("tinyllama-1.1b"));
  std::fprintf(stderr, "no -m given: synthesizing the built-in default (random weights, TinyLlama-1.1B shape, q8_0) into %s\n",
               file.string().c_str());
  SynthOptions options;
  options.weight_type = DType::kQ8_0;
  // Written under a private name and renamed into place: concurrent runs (shards of a job
  // array) never load a half-written file.
  const fs::path tmp = file.string() + fmt::format(".tmp.{}", static_cast<long>(getpid()));
  Status written = WriteSynthModel(shape, options, tmp.string());
  if (written.ok()) fs::rename(tmp, file, ec);
  if (!written.ok() || ec) {
    fs::remove(tmp, ec);
    return written.ok() ? InvalidArgumentError(fmt::format("cannot move the model into {}", file.string())) : written;
  }
  return file.string();
}

StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerIfAny(const Model& model) {
  if (model.gguf() == nullptr || model.gguf()->Find("tokenizer.ggml.tokens") == nullptr) {
    return std::unique_ptr<Tokenizer>();
  }
  return Tokenizer::FromGguf(*model.gguf());
}

StatusOr<LoadedModel> LoadModelWithTokenizer(const std::string& model_flag) {
  LoadedModel loaded;
  KVS_ASSIGN_OR_RETURN(loaded.path, ResolveModelPath(model_flag));
  KVS_ASSIGN_OR_RETURN(loaded.model, Model::Load(loaded.path));
  KVS_ASSIGN_OR_RETURN(loaded.tokenizer, LoadTokenizerIfAny(*loaded.model));
  return loaded;
}

// "2k" -> 2048, "32K" -> 32768, "1000" -> 1000.
StatusOr<int32_t> ParseLengthFlag(const std::string& text) {
  std::string digits = text;
  int32_t scale = 1;
  if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
    scale = 1024;
    digits.pop_back();
  }
  int32_t value = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || ec != std::errc() || ptr != digits.data() + digits.size() || value <= 0 ||
      value > (1 << 24) / scale) {
    return InvalidArgumentError(fmt::format("--lengths: expected a token count like 1024 or 2k, found '{}'", text));
  }
  return value * scale;
}

}  // namespace kvsparse::cli
