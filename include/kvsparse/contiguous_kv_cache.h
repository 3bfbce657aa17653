// The simplest KvCache: per (sequence, layer) one contiguous buffer of max_tokens rows.
// Dense baseline for the foundation; the paged, evicting cache implements the same interface.
#pragma once

#include <vector>

#include "kvsparse/kv_cache.h"

namespace kvsparse {

class ContiguousKvCache final : public KvCache {
 public:
  // Reserves n_seqs * n_layers * max_tokens rows of K and V up front.
  ContiguousKvCache(const KvGeometry& geometry, KvStorage storage, int n_seqs, int32_t max_tokens);
  // The bytes that constructor allocates (K, V and positions), to check before it does.
  static size_t BytesFor(const KvGeometry& geometry, KvStorage storage, int n_seqs, int32_t max_tokens);

  KvStorage storage() const override { return storage_; }
  const KvGeometry& geometry() const override { return geometry_; }
  Status Append(int seq, int layer, int32_t n, const float* k, const float* v, const int32_t* positions) override;
  Status CheckAppend(std::span<const KvAppendPlan> plans, const uint8_t* relative_positions) const override;
  void Spans(int seq, int layer, std::vector<KvSpan>* out) const override;
  int32_t NumTokens(int seq, int layer) const override;
  void Clear(int seq) override;
  size_t AllocatedBytes() const override;
  size_t LiveBytes() const override;

 private:
  struct Slot {
    std::vector<uint8_t> k;          // [max_tokens, n_kv_heads, head_dim] in storage type
    std::vector<uint8_t> v;          // [max_tokens, n_kv_heads, head_dim]
    std::vector<int32_t> positions;  // [max_tokens]
    int32_t n = 0;
  };
  Slot& slot(int seq, int layer);
  const Slot& slot(int seq, int layer) const;

  KvGeometry geometry_;
  KvStorage storage_;
  int n_seqs_;
  int32_t max_tokens_;
  size_t row_bytes_;         // bytes of one token's K (or V) for one layer
  std::vector<Slot> slots_;  // [n_seqs, n_layers]
};

}  // namespace kvsparse
