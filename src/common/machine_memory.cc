#include "kvsparse/machine_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

namespace kvsparse {
namespace {

// The first number in a file ("max" and absent files give nothing).
std::optional<size_t> ReadNumberFile(const char* path) {
  std::ifstream f(path);
  std::string word;
  if (!(f >> word) || word.empty() || word.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return static_cast<size_t>(std::strtoull(word.c_str(), nullptr, 10));
}

std::optional<size_t> MemAvailableBytes() {
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return static_cast<size_t>(std::strtoull(line.c_str() + 13, nullptr, 10)) * 1024;
  }
  return std::nullopt;
}

// The cgroup's room: limit minus usage (v2's memory.max, else v1's limit_in_bytes).
std::optional<size_t> CgroupRoomBytes() {
  std::optional<size_t> limit = ReadNumberFile("/sys/fs/cgroup/memory.max");
  std::optional<size_t> usage = ReadNumberFile("/sys/fs/cgroup/memory.current");
  if (!limit) {
    limit = ReadNumberFile("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    usage = ReadNumberFile("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    if (limit && *limit >= (size_t{1} << 60)) return std::nullopt;  // v1's "no limit"
  }
  if (!limit) return std::nullopt;
  const size_t used = usage.value_or(0);
  return *limit > used ? *limit - used : 0;
}

}  // namespace

MachineMemory ReadMachineMemory() {
  MachineMemory m{SIZE_MAX, "unknown (no /proc/meminfo)"};
  auto consider = [&m](std::optional<size_t> bytes, const char* source) {
    if (bytes && *bytes < m.available_bytes) m = {*bytes, source};
  };
  consider(MemAvailableBytes(), "MemAvailable in /proc/meminfo");
  consider(CgroupRoomBytes(), "the cgroup's memory limit less its usage");
  if (const char* cap = std::getenv("KVSPARSE_MEMORY_LIMIT_MIB"); cap != nullptr && *cap != '\0') {
    char* end = nullptr;
    const double mib = std::strtod(cap, &end);
    if (end != cap && *end == '\0' && mib >= 0) {
      consider(static_cast<size_t>(std::min(mib * 1048576.0, 1e19)), "KVSPARSE_MEMORY_LIMIT_MIB");
    }
  }
  return m;
}

Status CheckFitsInMemory(size_t bytes, std::string_view what) {
  const MachineMemory m = ReadMachineMemory();
  if (bytes <= m.available_bytes) return Status::Ok();
  return ResourceExhaustedError(fmt::format("{} needs {} but this machine has {} available ({}); lower the size",
                                            what, FormatBytes(bytes), FormatBytes(m.available_bytes), m.source));
}

std::string FormatBytes(size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1048576.0) return fmt::format("{:.2f} GiB", b / (1024.0 * 1048576.0));
  if (b >= 1048576.0) return fmt::format("{:.1f} MiB", b / 1048576.0);
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

}  // namespace kvsparse
