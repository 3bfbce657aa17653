#include "kvsparse/runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/head_probe.h"
#include "kvsparse/machine_memory.h"

namespace kvsparse {

KvGeometry ModelKvGeometry(const Model& model, bool with_windows) {
  const ModelConfig& c = model.config();
  KvGeometry g{c.n_layers, c.n_kv_heads, c.head_dim};
  g.values_in_keys = c.IsMla();
  if (with_windows && !c.sliding_layers.empty()) {
    for (int layer = 0; layer < c.n_layers; ++layer) g.layer_window.push_back(c.LayerWindow(layer));
  }
  return g;
}

Status ResolveSlidingLayers(const Model& model, KvSparsityConfig* config) {
  const ModelConfig& c = model.config();
  for (int layer = 0; layer < c.n_layers && layer < static_cast<int>(config->layers.size()); ++layer) {
    LayerKvConfig& l = config->layers[static_cast<size_t>(layer)];
    if (!c.IsSliding(layer) || l.method == KvMethod::kFull) continue;
    if (!l.named_by_layers_entry) {
      LayerKvConfig full;
      full.kv_type = l.kv_type;
      l = full;
      continue;
    }
    // Methods that keep every token and choose what to read (Quest, oracle, reuse, cumulative's
    // mask mode) cannot live with a window that frees pages under them.
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy, CreatePolicy(l, layer, c.n_layers, /*seed=*/0));
    if (policy->SelectsSpans()) {
      return InvalidArgumentError(fmt::format(
          "kv config: layer {} is a sliding-window layer ({}-token window) and method '{}' keeps every token to "
          "choose what to read, which the window's page freeing contradicts; name only global layers for it",
          layer, c.sliding_window, KvMethodName(l.method)));
    }
  }
  return Status::Ok();
}

namespace {

// The most rows one engine step can hold for n_seqs sequences of max_tokens tokens.
int32_t StepRowsBound(int n_seqs, int32_t max_tokens) {
  return static_cast<int32_t>(std::min<int64_t>(int64_t{n_seqs} * max_tokens, Engine::kMaxBatchRows));
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
  std::optional<KvSparsityConfig> windowed;
  if (config == nullptr && !model.config().sliding_layers.empty()) {
    KVS_ASSIGN_OR_RETURN(windowed, KvSparsityConfigFromFlags("full", "", KvStorageName(dense_storage),
                                                             model.config().n_layers));
    config = &*windowed;
  }
  const int32_t step_rows = StepRowsBound(n_seqs, max_tokens);
  if (config != nullptr) {
    KvSparsityConfig resolved = *config;
    KVS_RETURN_IF_ERROR(ResolveSlidingLayers(model, &resolved));
    KVS_RETURN_IF_ERROR(ResolveRetrievalHeads(model, n_threads, &resolved));
    // The paged cache reserves pages as they fill, up to the memory the scratch leaves.
    const size_t scratch_bytes = Engine::ScratchBytesFor(model.config(), step_rows);
    KVS_RETURN_IF_ERROR(
        CheckFitsInMemory(scratch_bytes, fmt::format("the engine's scratch for {}-row steps", step_rows)));
    KVS_ASSIGN_OR_RETURN(r->sparse, CreateSparseKv(ModelKvGeometry(model), resolved, n_seqs, max_tokens, seed,
                                                   scratch_bytes));
  } else {
    if (!DenseCacheHolds(dense_storage)) {
      return InvalidArgumentError(std::string("runtime: the dense cache stores f32, f16 or bf16; ") +
                                  KvStorageName(dense_storage) + " needs the paged cache (a KV config)");
    }
    const size_t cache_bytes = ContiguousKvCache::BytesFor(ModelKvGeometry(model), dense_storage, n_seqs, max_tokens);
    KVS_RETURN_IF_ERROR(CheckFitsInMemory(
        cache_bytes + Engine::ScratchBytesFor(model.config(), step_rows),
        fmt::format("the {} KV cache for {} sequence(s) of {} tokens ({} layers, {}) with the engine's scratch for "
                    "{}-row steps",
                    KvStorageName(dense_storage), n_seqs, max_tokens, model.config().n_layers,
                    FormatBytes(cache_bytes), step_rows)));
    r->dense_cache = std::make_unique<ContiguousKvCache>(ModelKvGeometry(model), dense_storage, n_seqs, max_tokens);
  }
  r->engine = std::make_unique<Engine>(model, &r->cache(), n_threads, r->controller());
  return r;
}

StatusOr<std::unique_ptr<Runtime>> CreateServingRuntime(const Model& model, const KvSparsityConfig& config,
                                                        size_t budget_bytes, int n_threads, uint64_t seed) {
  KVS_RETURN_IF_ERROR(CheckFitsInMemory(
      budget_bytes + Engine::ScratchBytesFor(model.config(), Engine::kMaxBatchRows),
      fmt::format("the KV page pool (--kv-memory, or --parallel x -c: {}) with the engine's scratch for {}-row steps",
                  FormatBytes(budget_bytes), Engine::kMaxBatchRows)));
  auto r = std::make_unique<Runtime>();
  KvSparsityConfig resolved = config;
  KVS_RETURN_IF_ERROR(ResolveSlidingLayers(model, &resolved));
  KVS_RETURN_IF_ERROR(ResolveRetrievalHeads(model, n_threads, &resolved));
  KVS_ASSIGN_OR_RETURN(r->sparse, CreateServingKv(ModelKvGeometry(model), resolved, budget_bytes, seed));
  r->engine = std::make_unique<Engine>(model, r->sparse.cache.get(), n_threads, r->controller());
  return r;
}

}  // namespace kvsparse
