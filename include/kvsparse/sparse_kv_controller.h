// The glue between the forward pass, the sparsity policies and the paged KV cache.
//
// A SparseKvController owns one KvPolicy per (sequence, layer), built from a
// KvSparsityConfig. The Engine calls it at fixed points of each layer:
//   1. after storing the chunk's K/V:   OnAppend       (the policy grows its per-token state)
//   2. around attention:                WantsScores → ObserveAttention (only for policies
//      that read attention: a QK-only second pass, ops::AttentionScores)
//   3. after attention:                 AfterAttention (eviction: SelectKeep →
//      PagedKvCache::Evict → OnEvict, when the policy's EvictionTarget says so)
// Evicting right after each layer's attention bounds every layer to budget + chunk tokens
// during prefill (and budget + evict_interval while decoding).
//
// Time spent in policy work is measured per layer: scoring (the gathering pass + Observe),
// selection (SelectKeep) and compaction (Evict + OnEvict).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct SparseKvLayerStats {
  int64_t evictions = 0;       // eviction events (SelectKeep + Evict calls)
  int64_t evicted_tokens = 0;  // tokens dropped by them
  int64_t observations = 0;    // gathering passes fed to the policy
  int32_t peak_live_tokens = 0;  // most live tokens seen by any attention call (before eviction)
  double score_s = 0;          // ops::AttentionScores + Observe
  double select_s = 0;         // SelectKeep
  double compact_s = 0;        // PagedKvCache::Evict + OnEvict
  double policy_s() const { return score_s + select_s + compact_s; }
};

class SparseKvController {
 public:
  // cache must outlive the controller; its geometry gives the layer count. `seed` feeds the
  // Random method (each (sequence, layer) derives its own).
  static StatusOr<std::unique_ptr<SparseKvController>> Create(const KvSparsityConfig& config, PagedKvCache* cache,
                                                              uint64_t seed = 0);
  SparseKvController(const SparseKvController&) = delete;
  SparseKvController& operator=(const SparseKvController&) = delete;

  const KvSparsityConfig& config() const { return config_; }
  PagedKvCache* cache() const { return cache_; }
  // Tokens per forward chunk for prompts (the config's prefill_chunk).
  int32_t prefill_chunk() const { return config_.prefill_chunk; }
  KvPolicy& policy(int seq, int layer) { return *policies_[Index(seq, layer)]; }

  // ---- Engine hooks (same seq / layer order as the forward pass) ----
  void OnAppend(int seq, int layer, int32_t n_new);
  // True when this layer's policy reads attention (the caller then asks ops::Attention for
  // row_max_sum and calls ObserveAttention).
  bool WantsScores(int seq, int layer) const;
  // Runs the gathering pass over the same inputs as the attention call and feeds the policy.
  void ObserveAttention(int seq, int layer, const AttentionShape& shape, const float* q, const int32_t* q_pos,
                        int32_t n_q, const KvSpan* spans, int32_t n_spans, const float* row_max_sum, int n_threads);
  // Evicts when the policy's schedule says so. n_seen: tokens of the sequence processed so
  // far (prompt + generated), which sizes fraction budgets.
  Status AfterAttention(int seq, int layer, EvictionPoint point, int32_t n_seen, int32_t current_position);

  // Drops every token of seq from the cache and restarts its policies.
  Status ResetSequence(int seq);

  const std::vector<SparseKvLayerStats>& layer_stats() const { return stats_; }
  void ResetStats();
  // Per-layer table: method, storage, allocated and live KV bytes, live tokens, evictions,
  // policy time; then totals.
  std::string FormatStats() const;

 private:
  SparseKvController(const KvSparsityConfig& config, PagedKvCache* cache, uint64_t seed);
  size_t Index(int seq, int layer) const { return static_cast<size_t>(seq) * n_layers_ + layer; }
  Status BuildPolicies(int seq);

  KvSparsityConfig config_;
  PagedKvCache* cache_;
  uint64_t seed_;
  int n_layers_;
  std::vector<std::unique_ptr<KvPolicy>> policies_;  // [n_seqs, n_layers]
  std::vector<uint64_t> generation_;                  // [n_seqs] restarts, varies the Random seed
  std::vector<SparseKvLayerStats> stats_;             // [n_layers], all sequences together

  // Reused buffers (no allocation in steady-state decode).
  std::vector<float> sum_all_, sum_window_, last_;  // each [n_kv_heads, n_tokens]
  std::vector<KvSpan> spans_;
  std::vector<int32_t> positions_;                  // [n_live]
  std::vector<uint8_t> keep_;                       // [n_live]
};

// A paged cache sized for max_tokens per sequence in every layer (storage per layer from the
// config), and its controller.
struct SparseKvSetup {
  std::unique_ptr<PagedKvCache> cache;
  std::unique_ptr<SparseKvController> controller;
};
StatusOr<SparseKvSetup> CreateSparseKv(const KvGeometry& geometry, const KvSparsityConfig& config, int n_seqs,
                                       int32_t max_tokens, uint64_t seed = 0);

}  // namespace kvsparse
