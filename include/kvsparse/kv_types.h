// Vocabulary types shared by the KV cache, the attention kernels and the sparsity policies:
// how K/V are stored, a run of stored tokens (KvSpan), the cache's geometry, and how a KV head's
// query heads are folded. Kept apart so that ops/ and policy/ need not include the cache.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvsparse {

// kInt8: symmetric per-(token, kv head) quantization, value = scale * q, q in [-127, 127].
// kInt8Kivi (KIVI, Liu et al. 2024): K int8 with one scale per (page, kv head, channel), V int8
//   per (token, kv head) like kInt8; the tokens of a (seq, layer)'s last, not yet full page stay
//   in full precision (kKiviResidualStorage) and are quantized when their page fills.
// kFp8E4M3, kFp8E5M2: one fp8 code per value and one scale per (token, kv head), value = scale *
//   fp8(code), as serving engines store fp8 KV; the layout is int8's (ops/kv_quant.h has the codes).
enum class KvStorage { kF32, kF16, kInt8, kInt8Kivi, kFp8E4M3, kFp8E5M2 };
inline constexpr int kNumKvStorage = 6;
inline constexpr KvStorage kKiviResidualStorage = KvStorage::kF16;
const char* KvStorageName(KvStorage s);  // "f32", "f16", "int8", "int8_kivi", "fp8_e4m3", "fp8_e5m2"
size_t KvStorageValueBytes(KvStorage s);  // bytes per stored value (4, 2, 1, 1, 1, 1)
// Storage with one byte per value and one scale per (token, kv head) for K and V (int8, fp8).
inline bool HasTokenScales(KvStorage s) {
  return s == KvStorage::kInt8 || s == KvStorage::kFp8E4M3 || s == KvStorage::kFp8E5M2;
}
inline bool IsFp8Storage(KvStorage s) { return s == KvStorage::kFp8E4M3 || s == KvStorage::kFp8E5M2; }
// Storage read as one-byte codes times scales (int8, int8_kivi, fp8).
inline bool IsScaledCodeStorage(KvStorage s) { return HasTokenScales(s) || s == KvStorage::kInt8Kivi; }

struct KvSpan {
  // Shared layers: [n, n_kv_heads, head_dim]; HeadSpans of a per-head layer: [n, 1, head_dim].
  const void* k = nullptr;             // [n, n_kv_heads, head_dim] in the cache's storage type
  const void* v = nullptr;             // [n, n_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [n] absolute positions, ascending across spans
  const float* k_scale = nullptr;      // [n, n_kv_heads] (HasTokenScales storage only)
  const float* v_scale = nullptr;      // [n, n_kv_heads] (HasTokenScales storage and kInt8Kivi)
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

// Token t of `span`'s K, dequantized to f32: out [n_kv_heads, head_dim] (n_kv_heads: heads per
// span row). `type` is the span's own storage (SpanStorage); scales apply per element, as in
// attention. A plain scalar reader for policies that score keys (Quest's bounds, the oracle).
void LoadSpanKeyRow(KvStorage type, const KvSpan& span, int32_t t, int n_kv_heads, int head_dim, float* out);
// `count` tokens of `span` from token `offset`, as a span of their own (same pages, shifted
// pointers; a kInt8Kivi page's channel scales stay shared).
KvSpan SubSpan(KvStorage layer_storage, const KvSpan& span, int32_t offset, int32_t count, int n_kv_heads,
               int head_dim);

struct KvGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// How per-query-head attention is folded into one score per KV head (GQA).
enum class GqaAggregation { kMean, kMax };

}  // namespace kvsparse
