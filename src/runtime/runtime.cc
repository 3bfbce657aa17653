#include "kvsparse/runtime.h"

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/head_probe.h"

namespace kvsparse {

namespace {

KvGeometry GeometryOf(const Model& model) {
  const ModelConfig& c = model.config();
  return KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim};
}

}  // namespace

StatusOr<std::unique_ptr<Runtime>> CreateRuntime(const Model& model, const KvSparsityConfig* config,
                                                 KvStorage dense_storage, int n_seqs, int32_t max_tokens,
                                                 int n_threads, uint64_t seed) {
  if (n_seqs < 1 || max_tokens < 1) {
    return InvalidArgumentError("runtime: need at least one sequence of at least one token (got " +
                                std::to_string(n_seqs) + " of " + std::to_string(max_tokens) + ")");
  }
  auto r = std::make_unique<Runtime>();
  if (config != nullptr) {
    KvSparsityConfig resolved = *config;
    KVS_RETURN_IF_ERROR(ResolveRetrievalHeads(model, n_threads, &resolved));
    KVS_ASSIGN_OR_RETURN(r->sparse, CreateSparseKv(GeometryOf(model), resolved, n_seqs, max_tokens, seed));
  } else {
    if (dense_storage != KvStorage::kF32 && dense_storage != KvStorage::kF16) {
      return InvalidArgumentError(std::string("runtime: the dense cache stores f32 or f16; ") +
                                  KvStorageName(dense_storage) + " needs the paged cache (a KV config)");
    }
    r->dense_cache = std::make_unique<ContiguousKvCache>(GeometryOf(model), dense_storage, n_seqs, max_tokens);
  }
  r->engine = std::make_unique<Engine>(model, &r->cache(), n_threads, r->controller());
  return r;
}

StatusOr<std::unique_ptr<Runtime>> CreateServingRuntime(const Model& model, const KvSparsityConfig& config,
                                                        size_t budget_bytes, int n_threads, uint64_t seed) {
  auto r = std::make_unique<Runtime>();
  KvSparsityConfig resolved = config;
  KVS_RETURN_IF_ERROR(ResolveRetrievalHeads(model, n_threads, &resolved));
  KVS_ASSIGN_OR_RETURN(r->sparse, CreateServingKv(GeometryOf(model), resolved, budget_bytes, seed));
  r->engine = std::make_unique<Engine>(model, r->sparse.cache.get(), n_threads, r->controller());
  return r;
}

}  // namespace kvsparse
