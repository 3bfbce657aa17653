// The seam between attention and KV storage. Attention never indexes a cache
// directly: it asks for the live tokens of (sequence, layer) as a list of spans,
// each span a run of tokens stored contiguously. A contiguous cache returns one
// span; a paged cache returns one span per page; an evicting cache simply returns
// fewer tokens. Keys are stored after RoPE, so no span ever needs re-rotation.
#pragma once

#include <cstdint>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse {

// kInt8: symmetric per-(token, kv head) quantization, value = scale * q, q in [-127, 127].
enum class KvStorage { kF32, kF16, kInt8 };
const char* KvStorageName(KvStorage s);  // "f32", "f16", "int8"
size_t KvStorageValueBytes(KvStorage s);  // bytes per stored value (4, 2, 1)

struct KvSpan {
  const void* k = nullptr;             // [n, n_kv_heads, head_dim] in the cache's storage type
  const void* v = nullptr;             // [n, n_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [n] absolute positions, ascending across spans
  const float* k_scale = nullptr;      // [n, n_kv_heads] (kInt8 only)
  const float* v_scale = nullptr;      // [n, n_kv_heads] (kInt8 only)
  int32_t n = 0;
};

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
  virtual void Spans(int seq, int layer, std::vector<KvSpan>* out) const = 0;
  virtual int32_t NumTokens(int seq, int layer) const = 0;
  // Drops every token of seq.
  virtual void Clear(int seq) = 0;
  // Bytes of K/V storage allocated and bytes holding live tokens.
  virtual size_t AllocatedBytes() const = 0;
  virtual size_t LiveBytes() const = 0;
};

}  // namespace kvsparse
