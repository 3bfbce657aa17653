#pragma once
// The process's peak resident memory (Linux), for the benchmarks' "peak memory" columns.
#include <cstddef>

namespace kvsparse {

// Peak resident bytes since the process started or since the last ResetPeakRss (VmHWM).
size_t PeakRssBytes();
// Restarts the peak at the current resident size (clear_refs "5"); a no-op where unsupported.
void ResetPeakRss();

}  // namespace kvsparse
