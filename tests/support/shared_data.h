// Locates ../shared test data. Tests call SharedPath("models/stories260K.bin") and
// GTEST_SKIP() with a clear message when it returns nullopt.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

namespace kvsparse::testing {

// KVSPARSE_SHARED overrides the compiled-in location (the checkout's ../shared).
inline std::optional<std::string> SharedPath(const std::string& rel) {
  const char* env = std::getenv("KVSPARSE_SHARED");
  std::filesystem::path root = env ? env : KVS_SHARED_DIR;
  std::filesystem::path p = root / rel;
  if (!std::filesystem::exists(p)) return std::nullopt;
  return p.string();
}

// The process's scratch folder, removed when the process exits (by the process that made it,
// not by a forked child), so the thousands of test processes ctest runs leave nothing behind.
struct ProcessTempDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / "kvsparse_tests" / std::to_string(static_cast<long>(getpid()));
  pid_t owner = getpid();
  ~ProcessTempDir() {
    std::error_code ignored;
    if (getpid() == owner) std::filesystem::remove_all(path, ignored);
  }
};

// Scratch path for a file a test writes. The folder is unique per process, because ctest
// runs the tests of one binary as parallel processes that would otherwise share file names.
inline std::string TempPath(const std::string& name) {
  static ProcessTempDir dir;
  std::filesystem::create_directories(dir.path);
  return (dir.path / name).string();
}

}  // namespace kvsparse::testing

#define KVS_SKIP_IF_NO_SHARED(var, rel)                                                     \
  auto var##_opt = ::kvsparse::testing::SharedPath(rel);                                    \
  if (!var##_opt) GTEST_SKIP() << "test data " << (rel) << " not found under ../shared "    \
                               "(set KVSPARSE_SHARED to its folder); skipping";             \
  const std::string var = *var##_opt
