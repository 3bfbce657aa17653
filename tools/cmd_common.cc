#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "commands.h"
#include "kvsparse/synth.h"

namespace kvsparse::cli {

int Fail(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

StatusOr<std::string> ResolveModelPath(const std::string& path) {
  if (!path.empty()) return path;
  namespace fs = std::filesystem;
  fs::path dir;
  if (const char* env = std::getenv("KVSPARSE_CACHE")) {
    dir = env;
  } else if (const char* home = std::getenv("HOME")) {
    dir = fs::path(home) / ".cache" / "kvsparse";
  } else {
    dir = fs::temp_directory_path() / "kvsparse";
  }
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
  KVS_RETURN_IF_ERROR(WriteSynthModel(shape, options, file.string()));
  return file.string();
}

}  // namespace kvsparse::cli
