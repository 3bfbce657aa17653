// Vocabulary types shared by the KV cache, the attention kernels and the sparsity policies:
// how K/V are stored, a run of stored tokens (KvSpan), the cache's geometry, and how a KV head's
// query heads are folded. Kept apart so that ops/ and policy/ need not include the cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvsparse {

// kInt8: symmetric per-(token, kv head) quantization, value = scale * q, q in [-127, 127].
// kInt8Kivi (KIVI, Liu et al. 2024): K int8 with one scale per (page, kv head, channel), V int8
//   per (token, kv head) like kInt8; the tokens of a (seq, layer)'s last, not yet full page stay
//   in full precision (kKiviResidualStorage) and are quantized when their page fills.
// kFp8E4M3, kFp8E5M2: one fp8 code per value and one scale per (token, kv head), value = scale *
//   fp8(code); the layout is int8's (ops/kv_quant.h has the codes). The dynamic per-(token, head)
//   scale is our choice: vLLM's default fp8 cache has one per-tensor scale of 1.0.
// kInt4Kivi, kInt2Kivi (KIVI's own setting): asymmetric 4- or 2-bit codes with a zero point, value =
//   min + scale * code, code in [0, 2^bits - 1], packed several to a byte; K per (page, kv head,
//   channel), V per (token, kv head, group of v_group channels: 32 in KIVI's code), scales and
//   mins in f16; the newest tokens in full precision as kInt8Kivi.
// kBf16: bfloat16 (f32's exponent, 8 significant bits), no scales. Where the CPU has AVX512_BF16
//   the avx512 family computes q.K with bf16 dot products (vdpbf16ps, twice f32's rate; the
//   query is rounded to bf16 too); elsewhere it is widened to f32 like f16.
enum class KvStorage { kF32, kF16, kInt8, kInt8Kivi, kFp8E4M3, kFp8E5M2, kInt4Kivi, kInt2Kivi, kBf16 };
inline constexpr int kNumKvStorage = 9;
inline constexpr KvStorage kKiviResidualStorage = KvStorage::kF16;
// "f32", "f16", "int8", "int8_kivi", "fp8_e4m3", "fp8_e5m2", "int4_kivi", "int2_kivi", "bf16"
const char* KvStorageName(KvStorage s);
int KvStorageBits(KvStorage s);  // bits per stored value (32, 16, 8, 8, 8, 8, 4, 2, 16)
// Bytes of `values` stored values (a row of whole bytes: low-bit rows hold a multiple of 8 / bits values).
inline size_t KvRowBytes(KvStorage s, size_t values) { return values * KvStorageBits(s) / 8; }
// Whether s can hold (token, kv head) rows of head_dim values: packed codes must fill whole bytes.
inline bool KvStorageFits(KvStorage s, int head_dim) { return head_dim * KvStorageBits(s) % 8 == 0; }
// Whether the dense (contiguous) cache can hold s; the other types need the paged cache.
inline bool DenseCacheHolds(KvStorage s) {
  return s == KvStorage::kF32 || s == KvStorage::kF16 || s == KvStorage::kBf16;
}
// Storage with one byte per value and one scale per (token, kv head) for K and V (int8, fp8).
inline bool HasTokenScales(KvStorage s) {
  return s == KvStorage::kInt8 || s == KvStorage::kFp8E4M3 || s == KvStorage::kFp8E5M2;
}
inline bool IsFp8Storage(KvStorage s) { return s == KvStorage::kFp8E4M3 || s == KvStorage::kFp8E5M2; }
// KIVI's layout: K per (page, kv head, channel), V per (token, kv head), a full-precision residual.
inline bool IsKiviStorage(KvStorage s) {
  return s == KvStorage::kInt8Kivi || s == KvStorage::kInt4Kivi || s == KvStorage::kInt2Kivi;
}
// KIVI with a zero point and packed codes (4 and 2 bits).
inline bool IsLowBitKivi(KvStorage s) { return s == KvStorage::kInt4Kivi || s == KvStorage::kInt2Kivi; }
// Storage read as codes times scales (int8, fp8, every KIVI type).
inline bool IsScaledCodeStorage(KvStorage s) { return HasTokenScales(s) || IsKiviStorage(s); }

struct KvSpan {
  // Shared layers: [n, n_kv_heads, head_dim]; HeadSpans of a per-head layer: [n, 1, head_dim].
  const void* k = nullptr;             // [n, n_kv_heads, head_dim] in the cache's storage type
  const void* v = nullptr;             // [n, n_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [n] absolute positions, ascending across spans
  const float* k_scale = nullptr;      // [n, n_kv_heads] (HasTokenScales storage only)
  const float* v_scale = nullptr;      // [n, n_kv_heads] (HasTokenScales storage and int8_kivi pages)
  // int8_kivi quantized pages: K's per-channel scales, shared by the span's n tokens (value =
  // k_channel_scale[h, c] * q); V as kInt8. Null on a KIVI layer's residual span, whose K/V are
  // kKiviResidualStorage (see SpanStorage).
  const float* k_channel_scale = nullptr;  // [n_kv_heads, head_dim] ([1, head_dim] in HeadSpans)
  // int4 / int2 KIVI quantized pages, f16 bits: K value = k_group_min[h, c] + k_group_scale[h, c]
  // * code (shared by the span's tokens); V value = v_group_min[t, h, c / v_group] +
  // v_group_scale[t, h, c / v_group] * code. Null on the residual span.
  const uint16_t* k_group_scale = nullptr;  // [n_kv_heads, head_dim]
  const uint16_t* k_group_min = nullptr;    // [n_kv_heads, head_dim]
  const uint16_t* v_group_scale = nullptr;  // [n, n_kv_heads, head_dim / v_group]
  const uint16_t* v_group_min = nullptr;    // [n, n_kv_heads, head_dim / v_group]
  int32_t v_group = 0;                      // channels per V scale (divides head_dim)
  int32_t v_groups = 0;                     // V scales per (token, kv head): head_dim / v_group
  int32_t n = 0;
};

// The storage type of one span of a layer stored as `layer`: a KIVI layer's residual span (no
// channel scales) is full precision; every other span has the layer's type.
inline KvStorage SpanStorage(KvStorage layer, const KvSpan& span) {
  const bool quantized = span.k_channel_scale != nullptr || span.k_group_scale != nullptr;
  return IsKiviStorage(layer) && !quantized ? kKiviResidualStorage : layer;
}

// Token t of `span`'s K, dequantized to f32: out [n_kv_heads, head_dim] (n_kv_heads: heads per
// span row). `type` is the span's own storage (SpanStorage); scales apply per element, as in
// attention. A plain scalar reader for policies that score keys (Quest's bounds, the oracle).
void LoadSpanKeyRow(KvStorage type, const KvSpan& span, int32_t t, int n_kv_heads, int head_dim, float* out);
// The same for token t's V (razor's compensation token averages dropped values).
void LoadSpanValueRow(KvStorage type, const KvSpan& span, int32_t t, int n_kv_heads, int head_dim, float* out);
// `count` tokens of `span` from token `offset`, as a span of their own (same pages, shifted
// pointers; a kInt8Kivi page's channel scales stay shared).
KvSpan SubSpan(KvStorage layer_storage, const KvSpan& span, int32_t offset, int32_t count, int n_kv_heads,
               int head_dim);

struct KvGeometry {
  KvGeometry() = default;
  KvGeometry(int layers, int kv_heads, int head_size, std::vector<int32_t> windows = {})
      : n_layers(layers), n_kv_heads(kv_heads), head_dim(head_size), layer_window(std::move(windows)) {}
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  // MLA's latent cache (ModelConfig::IsMla): a token's value is its key row (the latent and the
  // rotated key part; attention uses the latent's channels of the output), so no V is stored:
  // spans' v and v_scale alias k and k_scale, and a token costs one row, not two.
  bool values_in_keys = false;
  // Rows of head_dim values a token stores per layer and KV head: K and V, or K alone.
  int StoredRows() const { return values_in_keys ? 1 : 2; }
  // [n_layers] each layer's attention window (sliding-window layers of gemma2/gemma3; 0: a
  // global layer); empty: every layer global. A windowed layer's older tokens are freed a page
  // at a time as the window moves (SparseKvController::TrimToWindow).
  std::vector<int32_t> layer_window;
  int32_t LayerWindow(int layer) const {
    return layer_window.empty() ? 0 : layer_window[static_cast<size_t>(layer)];
  }
};

// How per-query-head attention is folded into one score per KV head (GQA).
enum class GqaAggregation { kMean, kMax };

}  // namespace kvsparse
