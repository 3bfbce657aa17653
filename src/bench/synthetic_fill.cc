#include "bench/synthetic_fill.h"

#include <algorithm>
#include <random>
#include <vector>

#include "kvsparse/sparse_kv_controller.h"

namespace kvsparse {

Status SyntheticFill(KvCache& cache, SparseKvController* controller, int seq, int32_t n_tokens, int chunk) {
  if (chunk <= 0) return InvalidArgumentError("SyntheticFill: the chunk must be positive");
  const KvGeometry& g = cache.geometry();
  const size_t row = static_cast<size_t>(g.n_kv_heads) * g.head_dim;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(static_cast<size_t>(chunk) * row), v(k.size());  // [chunk, n_kv_heads, head_dim]
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  std::vector<int32_t> positions(chunk);  // [chunk]
  for (int32_t done = 0; done < n_tokens; done += chunk) {
    const int32_t n = std::min<int32_t>(chunk, n_tokens - done);
    for (int32_t i = 0; i < n; ++i) positions[i] = done + i;
    for (int layer = 0; layer < g.n_layers; ++layer) {
      KVS_RETURN_IF_ERROR(cache.Append(seq, layer, n, k.data(), v.data(), positions.data()));
      if (controller == nullptr) continue;
      controller->OnAppend(seq, layer, n);
      const EvictionPoint point = done + n == n_tokens ? EvictionPoint::kPromptEnd : EvictionPoint::kPrefillChunk;
      KVS_RETURN_IF_ERROR(controller->AfterAttention(seq, layer, point, done + n, done + n - 1));
    }
  }
  return Status::Ok();
}

}  // namespace kvsparse
