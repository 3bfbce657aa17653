#include "kvsparse/kv_cache.h"

#include <cstring>

#include "kvsparse/dtype.h"
#include "ops/kv_quant.h"

namespace kvsparse {

const char* KvStorageName(KvStorage s) {
  switch (s) {
    case KvStorage::kF32: return "f32";
    case KvStorage::kF16: return "f16";
    case KvStorage::kInt8: return "int8";
    case KvStorage::kInt8Kivi: return "int8_kivi";
    case KvStorage::kFp8E4M3: return "fp8_e4m3";
    case KvStorage::kFp8E5M2: return "fp8_e5m2";
    case KvStorage::kInt4Kivi:
      return "int4_kivi";
    case KvStorage::kInt2Kivi:
      return "int2_kivi";
    case KvStorage::kBf16: return "bf16";
  }
  return "?";
}

int KvStorageBits(KvStorage s) {
  switch (s) {
    case KvStorage::kF32:
      return 32;
    case KvStorage::kF16:
    case KvStorage::kBf16:
      return 16;
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi:
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2:
      return 8;
    case KvStorage::kInt4Kivi:
      return 4;
    case KvStorage::kInt2Kivi:
      return 2;
  }
  return 0;
}

// Token t of `span` as stored, dequantized to f32: out [n_kv_heads, head_dim]. `type` is the
// span's own storage (SpanStorage). Scales are applied per element, as attention does.
void LoadSpanKeyRow(KvStorage type, const KvSpan& span, int32_t t, int n_kv_heads, int head_dim, float* out) {
  const size_t row = static_cast<size_t>(n_kv_heads) * head_dim;
  const size_t at = static_cast<size_t>(t) * row;  // k: [n, n_kv_heads, head_dim]
  switch (type) {
    case KvStorage::kF32: std::memcpy(out, static_cast<const float*>(span.k) + at, row * sizeof(float)); return;
    case KvStorage::kF16: {
      const f16_bits* k = static_cast<const f16_bits*>(span.k) + at;
      for (size_t i = 0; i < row; ++i) out[i] = F16ToF32(k[i]);
      return;
    }
    case KvStorage::kBf16: {
      const bf16_bits* k = static_cast<const bf16_bits*>(span.k) + at;
      for (size_t i = 0; i < row; ++i) out[i] = BF16ToF32(k[i]);
      return;
    }
    case KvStorage::kInt8: {
      const int8_t* k = static_cast<const int8_t*>(span.k) + at;
      for (int h = 0; h < n_kv_heads; ++h) {
        const float scale = span.k_scale[static_cast<size_t>(t) * n_kv_heads + h];  // [n, n_kv_heads]
        for (int c = 0; c < head_dim; ++c) out[h * head_dim + c] = scale * k[h * head_dim + c];
      }
      return;
    }
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2: {
      const uint8_t* k = static_cast<const uint8_t*>(span.k) + at;
      for (int h = 0; h < n_kv_heads; ++h) {
        const float scale = span.k_scale[static_cast<size_t>(t) * n_kv_heads + h];  // [n, n_kv_heads]
        for (int c = 0; c < head_dim; ++c) out[h * head_dim + c] = scale * ops::DecodeFp8(type, k[h * head_dim + c]);
      }
      return;
    }
    case KvStorage::kInt8Kivi: {  // one scale per (page, kv head, channel)
      const int8_t* k = static_cast<const int8_t*>(span.k) + at;
      for (size_t i = 0; i < row; ++i) out[i] = span.k_channel_scale[i] * k[i];
      return;
    }
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi:  // min + scale * code, per (page, kv head, channel)
      ops::DequantizeKvColumnsAsym(KvStorageBits(type), static_cast<const uint8_t*>(span.k) + KvRowBytes(type, at),
                                   span.k_group_scale, span.k_group_min, 1, static_cast<int>(row), out);
      return;
  }
}

// Token t of `span`'s V as stored, dequantized to f32: out [n_kv_heads, head_dim].
void LoadSpanValueRow(KvStorage type, const KvSpan& span, int32_t t, int n_kv_heads, int head_dim, float* out) {
  const size_t row = static_cast<size_t>(n_kv_heads) * head_dim;
  const size_t at = static_cast<size_t>(t) * row;  // v: [n, n_kv_heads, head_dim]
  const int64_t head_rows = static_cast<int64_t>(t) * n_kv_heads;  // first (token, head) row of token t
  switch (type) {
    case KvStorage::kF32: std::memcpy(out, static_cast<const float*>(span.v) + at, row * sizeof(float)); return;
    case KvStorage::kF16:
      for (size_t i = 0; i < row; ++i) out[i] = F16ToF32(static_cast<const f16_bits*>(span.v)[at + i]);
      return;
    case KvStorage::kBf16:
      for (size_t i = 0; i < row; ++i) out[i] = BF16ToF32(static_cast<const bf16_bits*>(span.v)[at + i]);
      return;
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi:  // one scale per (token, kv head)
      ops::DequantizeKvRowsInt8(static_cast<const int8_t*>(span.v) + at, span.v_scale + head_rows, n_kv_heads,
                                head_dim, out);
      return;
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2:
      ops::DequantizeKvRowsFp8(type, static_cast<const uint8_t*>(span.v) + at, span.v_scale + head_rows, n_kv_heads,
                               head_dim, out);
      return;
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi: {  // min + scale * code per (token, kv head, group)
      const size_t groups = static_cast<size_t>(head_rows) * span.v_groups;
      ops::DequantizeKvRowsAsym(KvStorageBits(type), static_cast<const uint8_t*>(span.v) + KvRowBytes(type, at),
                                span.v_group_scale + groups, span.v_group_min + groups, n_kv_heads, head_dim,
                                span.v_group, out);
      return;
    }
  }
}

// `count` tokens of `span` from token `offset`, as a span of their own.
KvSpan SubSpan(KvStorage layer_storage, const KvSpan& span, int32_t offset, int32_t count, int n_kv_heads,
               int head_dim) {
  const size_t skip_rows = static_cast<size_t>(offset) * n_kv_heads;
  const size_t skip_bytes = KvRowBytes(SpanStorage(layer_storage, span), skip_rows * head_dim);  // K and V alike
  KvSpan out = span;
  out.k = static_cast<const uint8_t*>(span.k) + skip_bytes;
  out.v = static_cast<const uint8_t*>(span.v) + skip_bytes;
  out.positions = span.positions + offset;
  if (span.k_scale != nullptr) out.k_scale = span.k_scale + skip_rows;
  if (span.v_scale != nullptr) out.v_scale = span.v_scale + skip_rows;
  if (span.v_group_scale != nullptr) {  // [n, n_kv_heads, head_dim / v_group]
    const size_t skip_groups = skip_rows * static_cast<size_t>(span.v_groups);
    out.v_group_scale = span.v_group_scale + skip_groups;
    out.v_group_min = span.v_group_min + skip_groups;
  }
  // k_channel_scale, k_group_scale and k_group_min belong to the whole page: unchanged.
  out.n = count;
  return out;
}

}  // namespace kvsparse
