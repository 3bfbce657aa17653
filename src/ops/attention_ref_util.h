// Element access into KvSpans for the scalar reference kernels (attention, score gathering).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvsparse/dtype.h"
#include "kvsparse/kv_cache.h"
#include "ops/kv_quant.h"

namespace kvsparse::ref {

// Whether a query at q_pos attends to a token at pos under the causal mask and the shape's
// sliding window (AttentionShape::window: masked when q_pos - pos >= window).
inline bool AttendsPosition(int32_t q_pos, int32_t pos, int32_t window) {
  if (pos > q_pos) return false;
  return window <= 0 || static_cast<int64_t>(q_pos) - pos < window;
}

// A score scale * q.k (natural-log domain) after the shape's softcap (AttentionShape::softcap).
inline double CapScore(double score, float softcap) {
  return softcap > 0.f ? softcap * std::tanh(score / softcap) : score;
}

// Reads K/V element (token t of the span, kv head, dim c) as f32, whatever the storage type.
// `storage` is the layer's type; each span's own type is SpanStorage(storage, span) (an
// int8_kivi layer's residual span is full precision).
struct KvElementReader {
  KvStorage storage;
  int n_kv_heads;
  int head_dim;

  double K(const KvSpan& span, int32_t t, int kv_head, int c) const {
    const KvStorage type = SpanStorage(storage, span);
    const size_t index = (static_cast<size_t>(t) * n_kv_heads + kv_head) * head_dim + c;
    const size_t channel = static_cast<size_t>(kv_head) * head_dim + c;
    if (type == KvStorage::kInt8Kivi) {  // one scale per (page, kv head, channel)
      return static_cast<double>(span.k_channel_scale[channel]) * static_cast<const int8_t*>(span.k)[index];
    }
    if (IsLowBitKivi(type)) {  // min + scale * code per (page, kv head, channel), f16
      return F16ToF32(span.k_group_min[channel]) +
             static_cast<double>(F16ToF32(span.k_group_scale[channel])) * Code(type, span.k, index);
    }
    return Load(type, span.k, span.k_scale, t, kv_head, c);
  }
  double V(const KvSpan& span, int32_t t, int kv_head, int c) const {
    const KvStorage type = SpanStorage(storage, span);
    if (IsLowBitKivi(type)) {  // min + scale * code per (token, kv head, group of v_group channels), f16
      const size_t head_row = static_cast<size_t>(t) * n_kv_heads + kv_head;
      const size_t group = head_row * span.v_groups + c / span.v_group;
      return F16ToF32(span.v_group_min[group]) +
             static_cast<double>(F16ToF32(span.v_group_scale[group])) * Code(type, span.v, head_row * head_dim + c);
    }
    return Load(type, span.v, span.v_scale, t, kv_head, c);
  }

 private:
  // Code `index` of a packed low-bit array (low bits first, ops/kv_quant.h).
  static int Code(KvStorage type, const void* base, size_t index) {
    const int bits = KvStorageBits(type);
    const size_t bit = index * bits;
    return (static_cast<const uint8_t*>(base)[bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
  }
  double Load(KvStorage type, const void* base, const float* scale, int32_t t, int kv_head, int c) const {
    const size_t head_row = static_cast<size_t>(t) * n_kv_heads + kv_head;  // [n, n_kv_heads]
    const size_t index = head_row * head_dim + c;
    switch (type) {
      case KvStorage::kF32: return static_cast<const float*>(base)[index];
      case KvStorage::kF16: return F16ToF32(static_cast<const f16_bits*>(base)[index]);
      case KvStorage::kBf16: return BF16ToF32(static_cast<const bf16_bits*>(base)[index]);
      case KvStorage::kInt8:
      case KvStorage::kInt8Kivi:  // V: per (token, kv head) scale
        return static_cast<double>(scale[head_row]) * static_cast<const int8_t*>(base)[index];
      case KvStorage::kFp8E4M3:
      case KvStorage::kFp8E5M2:  // exact decode (a 256-entry table's worth of values)
        return static_cast<double>(scale[head_row]) * ops::DecodeFp8(type, static_cast<const uint8_t*>(base)[index]);
      case KvStorage::kInt4Kivi:
      case KvStorage::kInt2Kivi:  // read by K() and V() above
        break;
    }
    return 0.0;
  }
};

}  // namespace kvsparse::ref
