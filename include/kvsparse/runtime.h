// The setup every front end shares: a model's KV cache (dense, or paged with its sparsity
// controller) and the Engine over them. `generate`, `bench`, `bench-speed`, `bench-serve` and
// `serve` build their runtime here instead of wiring caches, controllers and engines each.
#pragma once

#include <cstdint>
#include <memory>

#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct Runtime {
  std::unique_ptr<KvCache> dense_cache;  // set when there is no sparsity config
  SparseKvSetup sparse;                  // paged cache + controller otherwise
  std::unique_ptr<Engine> engine;

  KvCache& cache() const { return dense_cache ? *dense_cache : *sparse.cache; }
  PagedKvCache* paged_cache() const { return sparse.cache.get(); }  // null when dense
  SparseKvController* controller() const { return sparse.controller.get(); }
};

// The model's KV shape (MLA's latent rows included), with its sliding-window layers' windows
// unless with_windows is false.
KvGeometry ModelKvGeometry(const Model& model, bool with_windows = true);

// On a model with sliding-window layers, a config's default method (and --kv-method) is for
// the global layers: a sliding layer without an explicit JSON entry is reset to "full" (its
// window already bounds it), keeping its kv_type. A no-op on models without sliding layers.
// Error (InvalidArgument): an entry names a sliding layer for a method that keeps every token to
// select what to read (quest, oracle, reuse, cumulative mask mode).
Status ResolveSlidingLayers(const Model& model, KvSparsityConfig* config);

// config null: a ContiguousKvCache of dense_storage (f32, f16 or bf16) holding n_seqs sequences of
// max_tokens; on a model with sliding-window layers, the paged cache with "full" on every layer
// instead, so that the sliding layers free their pages as the window moves. Otherwise the paged cache sized for n_seqs × max_tokens (CreateSparseKv) and its
// controller, seeded with `seed` (the Random method). Razor layers get their retrieval heads
// here (ResolveRetrievalHeads: the heads file, or a probe of the model).
StatusOr<std::unique_ptr<Runtime>> CreateRuntime(const Model& model, const KvSparsityConfig* config,
                                                 KvStorage dense_storage, int n_seqs, int32_t max_tokens,
                                                 int n_threads, uint64_t seed = 0);

// A serving runtime: a paged cache with no sequence yet and a budget of budget_bytes for every
// page of every sequence together (CreateServingKv), its controller and the Engine.
StatusOr<std::unique_ptr<Runtime>> CreateServingRuntime(const Model& model, const KvSparsityConfig& config,
                                                        size_t budget_bytes, int n_threads, uint64_t seed = 0);

}  // namespace kvsparse
