// The seam between attention and KV storage. Attention never indexes a cache
// directly: it asks for the live tokens of (sequence, layer) as a list of spans,
// each span a run of tokens stored contiguously. A contiguous cache returns one
// span; a paged cache returns one span per page; an evicting cache simply returns
// fewer tokens. Keys are stored after RoPE, so no span ever needs re-rotation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse {

// kInt8: symmetric per-(token, kv head) quantization, value = scale * q, q in [-127, 127].
// kInt8Kivi (KIVI, Liu et al. 2024): K int8 with one scale per (page, kv head, channel), V int8
//   per (token, kv head) like kInt8; the tokens of a (seq, layer)'s last, not yet full page stay
//   in full precision (kKiviResidualStorage) and are quantized when their page fills.
enum class KvStorage { kF32, kF16, kInt8, kInt8Kivi };
inline constexpr int kNumKvStorage = 4;
inline constexpr KvStorage kKiviResidualStorage = KvStorage::kF16;
const char* KvStorageName(KvStorage s);  // "f32", "f16", "int8", "int8_kivi"
size_t KvStorageValueBytes(KvStorage s);  // bytes per stored value (4, 2, 1, 1)

struct KvSpan {
  // Shared layers: [n, n_kv_heads, head_dim]; HeadSpans of a per-head layer: [n, 1, head_dim].
  const void* k = nullptr;             // [n, n_kv_heads, head_dim] in the cache's storage type
  const void* v = nullptr;             // [n, n_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [n] absolute positions, ascending across spans
  const float* k_scale = nullptr;      // [n, n_kv_heads] (kInt8 only)
  const float* v_scale = nullptr;      // [n, n_kv_heads] (kInt8 only)
  // kInt8Kivi quantized pages: K's per-channel scales, shared by the span's n tokens (value =
  // k_channel_scale[h, c] * q); v_scale as kInt8. Null on a kInt8Kivi layer's residual span,
  // whose K/V are kKiviResidualStorage (see SpanStorage).
  const float* k_channel_scale = nullptr;  // [n_kv_heads, head_dim] ([1, head_dim] in HeadSpans)
  int32_t n = 0;
};

// The storage type of one span of a layer stored as `layer`: a kInt8Kivi layer's residual span
// (no channel scales) is full precision; every other span has the layer's type.
inline KvStorage SpanStorage(KvStorage layer, const KvSpan& span) {
  return layer == KvStorage::kInt8Kivi && span.k_channel_scale == nullptr ? kKiviResidualStorage : layer;
}

struct KvGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  virtual KvStorage storage() const = 0;
  // Storage type of one layer's K/V; caches that mix types per layer override it.
  virtual KvStorage layer_storage(int layer) const { return storage(); }
  virtual const KvGeometry& geometry() const = 0;

  // Stores n tokens of one layer. k, v: [n, n_kv_heads, head_dim] f32 (k already rotated);
  // positions: [n], each greater than any position already stored for (seq, layer).
  // Fails (ResourceExhausted) when the cache is full.
  virtual Status Append(int seq, int layer, int32_t n, const float* k, const float* v,
                        const int32_t* positions) = 0;
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
