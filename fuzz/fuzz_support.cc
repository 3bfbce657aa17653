#include <filesystem>

#include "fuzz_target.h"

namespace kvsparse::fuzz {

std::string SharedDir() {
  if (const char* env = std::getenv("KVS_SHARED_DIR"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  return std::filesystem::is_directory(KVS_SHARED_DIR, ec) ? std::string(KVS_SHARED_DIR) : std::string();
}

}  // namespace kvsparse::fuzz
