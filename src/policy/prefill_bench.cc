// Sparse prefill estimation cost (sparse_prefill.h) for one kv head of the TinyLlama-1.1B shape
// (group 8, head_dim 64): a 512-query chunk at the end of `depth` tokens, on one thread as the
// engine runs it (one kv head per thread). Compare with
// attention_bench's BM_SparsePrefillChunk (all 4 kv heads: divide its time by 4).
// Args: method (1 vertical_slash, 2 block_sparse, 3 xattention), depth, bits (the estimate's
// products: 8 int8 where the family has integer dots, 32 f32), group_shared (0: a selection per
// query head, the default; 1: one per kv head).
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvsparse/sparse_prefill.h"

namespace kvsparse {
namespace {

void BM_PrefillEstimate(benchmark::State& state) {
  const auto method = static_cast<PrefillMethod>(state.range(0));
  const int64_t depth = state.range(1);
  const int bits = static_cast<int>(state.range(2));
  constexpr int32_t kChunk = 512;
  constexpr int kGroup = 8, kHeadDim = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> value(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(kChunk) * kGroup * kHeadDim);
  std::vector<float> keys(static_cast<size_t>(depth + 16) * kHeadDim, 0.f);
  for (float& x : q) x = value(rng);
  for (int64_t i = 0; i < depth * kHeadDim; ++i) keys[i] = value(rng);
  std::vector<int64_t> visible(kChunk);
  for (int32_t i = 0; i < kChunk; ++i) visible[i] = depth - kChunk + i + 1;
  PrefillSparsity config = DefaultPrefillSparsity(method);
  config.estimate_bits = bits;
  config.group_shared = static_cast<int>(state.range(3));
  const AttentionShape shape{kGroup, 1, kHeadDim, 0.125f};
  PrefillSelector selector;
  std::vector<PrefillSelection> selections(kGroup);
  for (auto _ : state) {
    selector.Select(config, shape, q.data(), visible.data(), kChunk, keys.data(), depth, /*n_threads=*/1,
                    selections.data());
    benchmark::DoNotOptimize(selections[0].ranges.data());
  }
}

BENCHMARK(BM_PrefillEstimate)
    ->ArgNames({"method", "depth", "bits", "group_shared"})
    ->ArgsProduct({{1, 2, 3}, {8192}, {8, 32}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvsparse
