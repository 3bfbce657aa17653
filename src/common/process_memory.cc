#include "common/process_memory.h"

#include <fstream>
#include <string>

namespace kvsparse {

void ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

size_t PeakRssBytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return static_cast<size_t>(std::stoull(line.substr(6))) * 1024;
  }
  return 0;
}

}  // namespace kvsparse
