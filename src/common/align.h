#pragma once
// Rounding sizes up to a cache line, for the sections of a KV page.
#include <cstddef>

namespace kvsparse {

constexpr size_t AlignTo64(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace kvsparse
