// Element access into KvSpans for the scalar reference kernels (attention, score gathering).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvsparse/dtype.h"
#include "kvsparse/kv_cache.h"
#include "ops/kv_quant.h"

namespace kvsparse::ref {

// Reads K/V element (token t of the span, kv head, dim c) as f32, whatever the storage type.
// `storage` is the layer's type; each span's own type is SpanStorage(storage, span) (an
// int8_kivi layer's residual span is full precision).
struct KvElementReader {
  KvStorage storage;
  int n_kv_heads;
  int head_dim;

  double K(const KvSpan& span, int32_t t, int kv_head, int c) const {
    const KvStorage type = SpanStorage(storage, span);
    if (type == KvStorage::kInt8Kivi) {  // one scale per (page, kv head, channel)
      const size_t index = (static_cast<size_t>(t) * n_kv_heads + kv_head) * head_dim + c;
      return static_cast<double>(span.k_channel_scale[static_cast<size_t>(kv_head) * head_dim + c]) *
             static_cast<const int8_t*>(span.k)[index];
    }
    return Load(type, span.k, span.k_scale, t, kv_head, c);
  }
  double V(const KvSpan& span, int32_t t, int kv_head, int c) const {
    return Load(SpanStorage(storage, span), span.v, span.v_scale, t, kv_head, c);
  }

 private:
  double Load(KvStorage type, const void* base, const float* scale, int32_t t, int kv_head, int c) const {
    const size_t head_row = static_cast<size_t>(t) * n_kv_heads + kv_head;  // [n, n_kv_heads]
    const size_t index = head_row * head_dim + c;
    switch (type) {
      case KvStorage::kF32: return static_cast<const float*>(base)[index];
      case KvStorage::kF16: return F16ToF32(static_cast<const f16_bits*>(base)[index]);
      case KvStorage::kInt8:
      case KvStorage::kInt8Kivi:  // V: per (token, kv head) scale
        return static_cast<double>(scale[head_row]) * static_cast<const int8_t*>(base)[index];
      case KvStorage::kFp8E4M3:
      case KvStorage::kFp8E5M2:  // exact decode (a 256-entry table's worth of values)
        return static_cast<double>(scale[head_row]) * ops::DecodeFp8(type, static_cast<const uint8_t*>(base)[index]);
    }
    return 0.0;
  }
};

}  // namespace kvsparse::ref
