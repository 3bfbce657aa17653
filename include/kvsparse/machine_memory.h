// How much memory this process may still take, read before large allocations (KV caches, page
// pools, batches) so that a size that cannot fit is refused with the numbers instead of ending
// in the kernel's OOM killer. Linux: /proc/meminfo and the cgroup (v2 or v1) limit.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "kvsparse/status.h"

namespace kvsparse {

struct MachineMemory {
  // The least of MemAvailable, the cgroup's limit minus its usage, and KVSPARSE_MEMORY_LIMIT_MIB
  // (a user's cap, e.g. on a shared machine; tests use it too). SIZE_MAX when nothing is known.
  size_t available_bytes = 0;
  std::string source;  // which of them bounds it, for messages
};
MachineMemory ReadMachineMemory();

// ResourceExhausted when `bytes` exceed what the machine has available, naming `what` (e.g.
// "the KV cache for 1 sequence of 100000000 tokens"), the bytes it needs and what is available.
Status CheckFitsInMemory(size_t bytes, std::string_view what);

// "1.50 GiB", "12.0 MiB", "512 B": sizes in messages.
std::string FormatBytes(size_t bytes);

}  // namespace kvsparse
