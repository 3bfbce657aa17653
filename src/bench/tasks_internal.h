// Internals shared by the benchmark task generators (src/bench/tasks*.cc).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsparse/bench_tasks.h"
#include "kvsparse/status.h"

namespace kvsparse::bench_internal {

// SplitMix64: a tiny generator with a fully specified output, so a seed gives the same sample
// with every compiler and standard library (std:: distributions are implementation-defined).
class TaskRng {
 public:
  explicit TaskRng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0, by rejection (no modulo bias).
  uint64_t Below(uint64_t n) {
    KVS_CHECK(n > 0);
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = Next(); while (x >= limit);
    return x % n;
  }
  int32_t Index(size_t n) { return static_cast<int32_t>(Below(n)); }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  template <typename T>
  void Shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[Below(i)]);
  }

 private:
  uint64_t state_;
};

// Seed of one generator stream: the user's seed mixed with the task name and a stream number,
// so tasks (and streams within a task) sharing a seed are still independent.
inline uint64_t StreamSeed(uint64_t seed, std::string_view task, uint64_t stream) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a of the task name
  for (char c : task) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  TaskRng mix(seed ^ h ^ (stream * 0xD1B54A32D192ED03ull));
  return mix.Next();
}

// Option checks shared by the text and token generators (tasks.cc).
Status ValidateTaskOptions(BenchTask task, int32_t target_length, const BenchTaskOptions& options);

// Ids of `cont` as it follows `prefix` when both are encoded as one text (tasks_text.cc).
std::vector<int32_t> EncodeAfter(const Tokenizer& tok, std::string_view prefix, std::string_view cont);

}  // namespace kvsparse::bench_internal
