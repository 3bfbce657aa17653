// Test helpers for the attention kernels: random K/V spans in any storage type (with the f32
// values they were made from), random queries.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/kv_cache.h"
#include "ops/kv_quant.h"

namespace kvsparse::testing {

// Symmetric int8 quantization of rows: scale = max|x| / 127, q = round(x / scale).
inline void QuantizeRowsInt8(const std::vector<float>& x, int row_len, std::vector<int8_t>* q,
                             std::vector<float>* scales) {
  const size_t n_rows = x.size() / row_len;
  q->resize(x.size());
  scales->resize(n_rows);
  for (size_t r = 0; r < n_rows; ++r) {
    float max_abs = 0.f;
    for (int c = 0; c < row_len; ++c) max_abs = std::max(max_abs, std::fabs(x[r * row_len + c]));
    const float scale = max_abs / 127.f;
    (*scales)[r] = scale;
    for (int c = 0; c < row_len; ++c) {
      const float v = scale > 0.f ? std::nearbyint(x[r * row_len + c] / scale) : 0.f;
      (*q)[r * row_len + c] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
    }
  }
}

// Symmetric int8 quantization of columns over all rows (int8_kivi keys: one page's tokens):
// scale[c] = max_r |x[r, c]| / 127, q = round(x / scale).
inline void QuantizeColumnsInt8(const std::vector<float>& x, int row_len, std::vector<int8_t>* q,
                                std::vector<float>* scales) {
  const size_t n_rows = x.size() / row_len;
  q->resize(x.size());
  scales->assign(row_len, 0.f);
  for (size_t r = 0; r < n_rows; ++r)
    for (int c = 0; c < row_len; ++c) (*scales)[c] = std::max((*scales)[c], std::fabs(x[r * row_len + c]));
  for (float& s : *scales) s /= 127.f;
  for (size_t r = 0; r < n_rows; ++r) {
    for (int c = 0; c < row_len; ++c) {
      const float scale = (*scales)[c];
      const float v = scale > 0.f ? std::nearbyint(x[r * row_len + c] / scale) : 0.f;
      (*q)[r * row_len + c] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
    }
  }
}

// Owns the K/V/position buffers behind a list of spans, in the given storage type.
// KIVI: every span is a quantized page (K per channel, V per token) except the last,
// which is the layer's full-precision residual (kKiviResidualStorage); MakeResidual turns
// another span into a residual one.
struct SpanSet {
  KvStorage storage = KvStorage::kF32;
  int n_kv_heads = 0, head_dim = 0;
  std::vector<std::vector<float>> k_f32, v_f32;  // each [n, n_kv_heads, head_dim]: the values before conversion
  std::vector<std::vector<f16_bits>> k_f16, v_f16;
  std::vector<std::vector<int8_t>> k_i8, v_i8;       // int8 codes, or fp8 codes' bytes
  std::vector<std::vector<float>> k_scale, v_scale;  // each [n, n_kv_heads] (int8, fp8; v_scale also int8_kivi)
  std::vector<std::vector<float>> k_channel_scale;   // each [n_kv_heads, head_dim] (int8_kivi)
  // int4 / int2 KIVI, f16: each [n_kv_heads, head_dim] (K) and [n, n_kv_heads, head_dim / v_group] (V).
  std::vector<std::vector<f16_bits>> k_group_scale, k_group_min, v_group_scale, v_group_min;
  int v_group = 0;  // int4 / int2 KIVI: the widest of 32, 16, 8 dividing head_dim (else head_dim)
  std::vector<std::vector<int32_t>> positions;
  std::vector<KvSpan> spans;

  // The same tokens as f32 spans (pre-conversion values): the unquantized twin of this set.
  std::vector<KvSpan> F32Spans() const {
    std::vector<KvSpan> out = spans;
    for (size_t s = 0; s < out.size(); ++s) {
      out[s].k = k_f32[s].data();
      out[s].v = v_f32[s].data();
      ClearScales(&out[s]);
    }
    return out;
  }

  // int8_kivi: span s becomes a full-precision residual span (f16 K/V, no scales).
  void MakeResidual(size_t s) {
    spans[s].k = k_f16[s].data();
    spans[s].v = v_f16[s].data();
    ClearScales(&spans[s]);
  }

  static void ClearScales(KvSpan* span) {
    span->k_scale = span->v_scale = span->k_channel_scale = nullptr;
    span->k_group_scale = span->k_group_min = span->v_group_scale = span->v_group_min = nullptr;
    span->v_group = span->v_groups = 0;
  }
};

// Spans of the given lengths; positions increase with random gaps (as after eviction).
inline SpanSet MakeSpans(KvStorage storage, const std::vector<int>& lengths, int n_kv_heads, int head_dim,
                         std::mt19937& rng, int32_t first_position = 0) {
  std::uniform_real_distribution<float> value(-1.5f, 1.5f);
  std::uniform_int_distribution<int> gap(1, 4);
  SpanSet set;
  set.storage = storage;
  set.n_kv_heads = n_kv_heads;
  set.head_dim = head_dim;
  set.v_group = head_dim % 32 == 0 ? 32 : head_dim % 16 == 0 ? 16 : head_dim % 8 == 0 ? 8 : head_dim;
  int32_t pos = first_position;
  for (int n : lengths) {
    const size_t elems = static_cast<size_t>(n) * n_kv_heads * head_dim;
    std::vector<float> k(elems), v(elems);
    for (float& x : k) do x = value(rng); while (x == 0.f);
    for (float& x : v) do x = value(rng); while (x == 0.f);
    std::vector<int32_t> p(n);
    for (int t = 0; t < n; ++t) {
      p[t] = pos;
      pos += gap(rng) == 1 ? 3 : 1;  // mostly consecutive, sometimes a hole
    }
    set.positions.push_back(std::move(p));
    std::vector<f16_bits> kh, vh;
    std::vector<int8_t> kq, vq;
    std::vector<float> ks, vs, kc;
    std::vector<f16_bits> kgs, kgm, vgs, vgm;
    if (storage == KvStorage::kF16 || IsKiviStorage(storage)) {
      kh.resize(elems);
      vh.resize(elems);
      for (size_t i = 0; i < elems; ++i) {
        kh[i] = F32ToF16(k[i]);
        vh[i] = F32ToF16(v[i]);
      }
    } else if (storage == KvStorage::kBf16) {  // bf16 bits kept in the f16 vectors
      kh.resize(elems);
      vh.resize(elems);
      for (size_t i = 0; i < elems; ++i) {
        kh[i] = F32ToBF16(k[i]);
        vh[i] = F32ToBF16(v[i]);
      }
    }
    if (storage == KvStorage::kInt8) {
      QuantizeRowsInt8(k, head_dim, &kq, &ks);
      QuantizeRowsInt8(v, head_dim, &vq, &vs);
    } else if (IsFp8Storage(storage)) {  // fp8 codes kept in the int8 vectors (one byte each)
      const int64_t rows = static_cast<int64_t>(n) * n_kv_heads;
      kq.resize(elems);
      vq.resize(elems);
      ks.resize(rows);
      vs.resize(rows);
      ops::QuantizeKvRowsFp8(storage, k.data(), rows, head_dim, reinterpret_cast<uint8_t*>(kq.data()), ks.data());
      ops::QuantizeKvRowsFp8(storage, v.data(), rows, head_dim, reinterpret_cast<uint8_t*>(vq.data()), vs.data());
    } else if (storage == KvStorage::kInt8Kivi) {
      QuantizeColumnsInt8(k, n_kv_heads * head_dim, &kq, &kc);
      QuantizeRowsInt8(v, head_dim, &vq, &vs);
    } else if (IsLowBitKivi(storage)) {  // packed codes kept in the int8 vectors
      const int bits = KvStorageBits(storage), row = n_kv_heads * head_dim;
      const int64_t rows = static_cast<int64_t>(n) * n_kv_heads;
      kq.resize(KvRowBytes(storage, elems));
      vq.resize(KvRowBytes(storage, elems));
      kgs.resize(row);
      kgm.resize(row);
      vgs.resize(rows * (head_dim / set.v_group));
      vgm.resize(vgs.size());
      ops::QuantizeKvColumnsAsym(bits, k.data(), n, row, reinterpret_cast<uint8_t*>(kq.data()), kgs.data(), kgm.data());
      ops::QuantizeKvRowsAsym(bits, v.data(), rows, head_dim, set.v_group, reinterpret_cast<uint8_t*>(vq.data()),
                              vgs.data(), vgm.data());
    }
    set.k_f32.push_back(std::move(k));
    set.v_f32.push_back(std::move(v));
    set.k_f16.push_back(std::move(kh));
    set.v_f16.push_back(std::move(vh));
    set.k_i8.push_back(std::move(kq));
    set.v_i8.push_back(std::move(vq));
    set.k_scale.push_back(std::move(ks));
    set.v_scale.push_back(std::move(vs));
    set.k_channel_scale.push_back(std::move(kc));
    set.k_group_scale.push_back(std::move(kgs));
    set.k_group_min.push_back(std::move(kgm));
    set.v_group_scale.push_back(std::move(vgs));
    set.v_group_min.push_back(std::move(vgm));
  }
  for (size_t s = 0; s < lengths.size(); ++s) {
    KvSpan span;
    switch (storage) {
      case KvStorage::kF32:
        span.k = set.k_f32[s].data();
        span.v = set.v_f32[s].data();
        break;
      case KvStorage::kF16:
      case KvStorage::kBf16:
        span.k = set.k_f16[s].data();
        span.v = set.v_f16[s].data();
        break;
      case KvStorage::kInt8:
      case KvStorage::kFp8E4M3:
      case KvStorage::kFp8E5M2:
        span.k = set.k_i8[s].data();
        span.v = set.v_i8[s].data();
        span.k_scale = set.k_scale[s].data();
        span.v_scale = set.v_scale[s].data();
        break;
      case KvStorage::kInt8Kivi:
        span.k = set.k_i8[s].data();
        span.v = set.v_i8[s].data();
        span.v_scale = set.v_scale[s].data();
        span.k_channel_scale = set.k_channel_scale[s].data();
        break;
      case KvStorage::kInt4Kivi:
      case KvStorage::kInt2Kivi:
        span.k = set.k_i8[s].data();
        span.v = set.v_i8[s].data();
        span.k_group_scale = set.k_group_scale[s].data();
        span.k_group_min = set.k_group_min[s].data();
        span.v_group_scale = set.v_group_scale[s].data();
        span.v_group_min = set.v_group_min[s].data();
        span.v_group = set.v_group;
        span.v_groups = head_dim / set.v_group;
        break;
    }
    span.positions = set.positions[s].data();
    span.n = lengths[s];
    set.spans.push_back(span);
  }
  if (IsKiviStorage(storage) && !lengths.empty()) set.MakeResidual(lengths.size() - 1);
  return set;
}

// The set's values before storage as kF32 spans over the same positions (the exact reference a
// storage type's error is measured against).
inline std::vector<KvSpan> OriginalSpans(const SpanSet& set) {
  std::vector<KvSpan> spans(set.spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    spans[i].k = set.k_f32[i].data();
    spans[i].v = set.v_f32[i].data();
    spans[i].positions = set.spans[i].positions;
    spans[i].n = set.spans[i].n;
  }
  return spans;
}

inline std::vector<float> RandomQueries(size_t n, std::mt19937& rng, float amplitude) {
  std::uniform_real_distribution<float> value(-amplitude, amplitude);
  std::vector<float> q(n);
  for (float& x : q) do x = value(rng); while (x == 0.f);
  return q;
}

inline int32_t LastPosition(const SpanSet& set) {
  int32_t last = -1;
  for (const KvSpan& s : set.spans)
    if (s.n > 0) last = s.positions[s.n - 1];
  return last;
}

}  // namespace kvsparse::testing
