// The seam between attention and KV storage. Attention never indexes a cache
// directly: it asks for the live tokens of (sequence, layer) as a list of spans,
// each span a run of tokens stored contiguously. A contiguous cache returns one
// span; a paged cache returns one span per page; an evicting cache simply returns
// fewer tokens. Keys are stored after RoPE, so no span ever needs re-rotation.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvsparse/kv_types.h"
#include "kvsparse/status.h"

namespace kvsparse {

// One sequence's share of a forward step: n tokens at positions pos0 .. pos0 + n - 1, appended
// to every layer (every table of per-head layers).
struct KvAppendPlan {
  int seq = 0;
  int32_t n = 0;
  int32_t pos0 = 0;
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  virtual KvStorage storage() const = 0;
  // Storage type of one layer's K/V; caches that mix types per layer override it.
  virtual KvStorage layer_storage(int layer) const { return storage(); }
  // The storage of one sequence's layer: layer_storage(layer) unless the cache lets sequences
  // choose their own (PagedKvCache::SetSequenceStorage).
  virtual KvStorage sequence_storage(int seq, int layer) const { return layer_storage(layer); }
  virtual const KvGeometry& geometry() const = 0;

  // Stores n tokens of one layer. k, v: [n, n_kv_heads, head_dim] f32 (k already rotated);
  // positions: [n], each greater than any position already stored for (seq, layer).
  // Fails (ResourceExhausted) when the cache is full.
  virtual Status Append(int seq, int layer, int32_t n, const float* k, const float* v,
                        const int32_t* positions) = 0;
  // Checks, changing nothing, that every plan's Append to every layer would succeed, all plans
  // together (a step is all-or-nothing: this runs before any layer writes). Each seq at most
  // once. Layers with relative_positions[layer] != 0 (StreamingLLM cache positions: the engine
  // numbers them per layer) skip the position check; null checks every layer. Errors as Append's.
  virtual Status CheckAppend(std::span<const KvAppendPlan> plans, const uint8_t* relative_positions) const = 0;
  // Live tokens of (seq, layer), in ascending position order. Replaces *out's contents.
  // Aborts on a per-head layer (its heads keep different tokens): read those with HeadSpans.
  virtual void Spans(int seq, int layer, std::vector<KvSpan>* out) const = 0;
  // Live tokens of (seq, layer); on a per-head layer, the most any of its heads keeps.
  virtual int32_t NumTokens(int seq, int layer) const = 0;

  // ---- Per-KV-head layers (opt-in; a policy may keep different tokens per KV head) ----
  // True when `layer` keeps one token list per KV head instead of one for all heads.
  virtual bool per_head(int layer) const { return false; }
  // Live tokens of one KV head of a per-head layer, ascending positions; each span's k / v is
  // [n, 1, head_dim] (row stride head_dim) and k_scale / v_scale [n, 1]. Aborts on a shared layer.
  virtual void HeadSpans(int seq, int layer, int kv_head, std::vector<KvSpan>* out) const {
    KVS_CHECK_MSG(false, "HeadSpans: layer " + std::to_string(layer) +
                             " keeps the same tokens for every KV head; read it with Spans()");
  }
  // Live tokens of one KV head (on a shared layer every head has NumTokens).
  virtual int32_t NumHeadTokens(int seq, int layer, int kv_head) const { return NumTokens(seq, layer); }

  // Drops every token of seq.
  virtual void Clear(int seq) = 0;
  // Bytes of K/V storage allocated and bytes holding live tokens.
  virtual size_t AllocatedBytes() const = 0;
  virtual size_t LiveBytes() const = 0;
};

}  // namespace kvsparse
