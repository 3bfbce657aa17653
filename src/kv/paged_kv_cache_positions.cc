// PagedKvCache::RenumberPositions: StreamingLLM's positions within the cache (Xiao et al.,
// ICLR 2024, §3.2). After an eviction the survivors of a table are renumbered 0..n-1 and each
// key is rotated by (new - old) position, so the cache reads as if its tokens had always been
// adjacent. Keys are stored after RoPE; RoPE composes, so rotating a stored key by the delta is
// exact up to float rounding (f16 / int8 storage add one rounding per renumbering).
//
// Positions ascend strictly from >= 0, so position[i] >= i; once a token sits above its index
// every later one does too. Renumbering therefore touches exactly the pages from the first
// token whose position is not its index: the sinks' pages (and shared prefixes) stay as they are.
#include <algorithm>
#include <cstring>
#include <string>

#include "ops/kv_quant.h"
#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "kvsparse/paged_kv_cache.h"

namespace kvsparse {

int32_t PagedKvCache::LastTokenPosition(int seq, int layer, int kv_head) const {
  CheckSeqLayer("LastTokenPosition", seq, layer);
  const Layer& L = LayerOf(seq, layer);
  KVS_CHECK_MSG(kv_head >= 0 && kv_head < geometry_.n_kv_heads,
                "LastTokenPosition: kv head " + std::to_string(kv_head) + " out of range");
  const int32_t* last = LastPosition(L, table(seq, layer, L.per_head ? kv_head : 0));
  return last != nullptr ? *last : -1;
}

int32_t PagedKvCache::FirstRenumbered(const Layer& L, const Table& t) const {
  for (size_t pi = 0; pi < t.pages.size(); ++pi) {
    const int32_t* pos =
        reinterpret_cast<const int32_t*>(PoolOf(L, t, pi)->data(t.pages[pi]) + LayoutOf(L, t, pi).positions_offset);
    const int32_t base = static_cast<int32_t>(pi) * page_size_;
    const int32_t fill = PageFill(t, pi);
    for (int32_t s = 0; s < fill; ++s) {
      if (pos[s] != base + s) return base + s;
    }
  }
  return t.n;
}

size_t PagedKvCache::RenumberBytes(const Layer& L, const Table& t, int32_t first, int64_t* pages) const {
  size_t bytes = 0;
  for (size_t pi = static_cast<size_t>(first / page_size_); pi < t.pages.size(); ++pi) {
    if (PoolOf(L, t, pi)->refcount(t.pages[pi]) > 1) {
      bytes += LayoutOf(L, t, pi).page_bytes;
      ++*pages;
    }
  }
  return bytes;
}

int64_t PagedKvCache::RenumberTable(Table& t, Layer& L, int32_t first, const KeyRotateFn& rotate) {
  const int32_t P = page_size_;
  const int D = geometry_.head_dim;
  const int rh = L.layout.row_heads;
  const size_t row_values = static_cast<size_t>(rh) * D;  // one slot's K: [row_heads, head_dim]
  rotate_k_.resize(static_cast<size_t>(P) * row_values);
  float* k32 = rotate_k_.data();  // [P, row_heads, head_dim]
  int64_t rotated = 0;
  for (size_t pi = static_cast<size_t>(first / P); pi < t.pages.size(); ++pi) {
    const bool residual = IsResidualPage(L, t, pi);
    const PageLayout& p = LayoutOf(L, t, pi);
    PagePool* pool = PoolOf(L, t, pi);
    const int32_t fill = PageFill(t, pi);
    if (pool->refcount(t.pages[pi]) > 1) {
      // Copy-on-write: the other tables sharing this page keep their positions and keys.
      const PageId shared = t.pages[pi];
      const PageId own = residual ? AllocateResidualPage(L) : AllocatePage(L);
      std::memcpy(pool->data(own), pool->data(shared), p.page_bytes);
      if (residual) {
        L.residual_slots += fill;
        ReleaseResidualPage(L, shared, fill);
      } else {
        L.live_slots += fill;
        ReleasePage(L, shared, fill);
      }
      t.pages[pi] = own;
      ++cow_pages_;
    }
    uint8_t* page = pool->data(t.pages[pi]);
    int32_t* pos = reinterpret_cast<int32_t*>(page + p.positions_offset);  // [fill]
    const int32_t base = static_cast<int32_t>(pi) * P;
    const KvStorage storage = residual ? kKiviResidualStorage : L.storage;
    // KIVI pages share one scale (and min) per channel over the page: the whole page is regrouped.
    const bool whole_page = IsKiviStorage(storage);
    const bool low_bit = IsLowBitKivi(storage);
    uint8_t* codes = page + p.k_offset;
    float* channel_scale = reinterpret_cast<float*>(page + p.k_channel_scale_offset);  // int8_kivi [rh, D]
    f16_bits* group_scale = reinterpret_cast<f16_bits*>(page + p.k_channel_scale_offset);  // int4 / int2 [rh, D]
    f16_bits* group_min = reinterpret_cast<f16_bits*>(page + p.k_channel_min_offset);
    if (low_bit) {
      ops::DequantizeKvColumnsAsym(KvStorageBits(storage), codes, group_scale, group_min, fill,
                                   static_cast<int>(row_values), k32);
    } else if (whole_page) {
      ops::DequantizeKvColumnsInt8(reinterpret_cast<const int8_t*>(codes), channel_scale, fill,
                                   static_cast<int>(row_values), k32);
    }
    // Runs of slots with the same delta rotate in one call (same angle for every row).
    for (int32_t s = 0; s < fill;) {
      const int32_t delta = base + s - pos[s];
      int32_t end = s + 1;
      while (end < fill && base + end - pos[end] == delta) ++end;
      if (delta != 0) {
        const int32_t count = end - s;
        const int64_t rows = static_cast<int64_t>(count) * rh;  // head_dim rows
        const size_t values = static_cast<size_t>(count) * row_values;
        uint8_t* k_dst = page + p.k_offset + static_cast<size_t>(s) * p.row_bytes;
        switch (storage) {
          case KvStorage::kF32:
            rotate(reinterpret_cast<float*>(k_dst), rows, delta);
            break;
          case KvStorage::kF16:
            ops::DequantizeRow(DType::kF16, k_dst, k32, static_cast<int64_t>(values));
            rotate(k32, rows, delta);
            ops::QuantizeRow(DType::kF16, k32, k_dst, static_cast<int64_t>(values));
            break;
          case KvStorage::kBf16:
            ops::DequantizeRow(DType::kBF16, k_dst, k32, static_cast<int64_t>(values));
            rotate(k32, rows, delta);
            ops::QuantizeRow(DType::kBF16, k32, k_dst, static_cast<int64_t>(values));
            break;
          case KvStorage::kInt8: {
            float* k_scale = reinterpret_cast<float*>(page + p.k_scale_offset) + static_cast<size_t>(s) * rh;
            ops::DequantizeKvRowsInt8(reinterpret_cast<const int8_t*>(k_dst), k_scale, rows, D, k32);
            rotate(k32, rows, delta);
            ops::QuantizeKvRowsInt8(k32, rows, D, reinterpret_cast<int8_t*>(k_dst), k_scale);
            break;
          }
          case KvStorage::kFp8E4M3:
          case KvStorage::kFp8E5M2: {
            float* k_scale = reinterpret_cast<float*>(page + p.k_scale_offset) + static_cast<size_t>(s) * rh;
            ops::DequantizeKvRowsFp8(storage, k_dst, k_scale, rows, D, k32);
            rotate(k32, rows, delta);
            ops::QuantizeKvRowsFp8(storage, k32, rows, D, k_dst, k_scale);
            break;
          }
          case KvStorage::kInt8Kivi:
          case KvStorage::kInt4Kivi:
          case KvStorage::kInt2Kivi:
            rotate(k32 + static_cast<size_t>(s) * row_values, rows, delta);
            break;
        }
        rotated += count;
      }
      s = end;
    }
    if (low_bit) {
      ops::QuantizeKvColumnsAsym(KvStorageBits(storage), k32, fill, static_cast<int>(row_values), codes, group_scale,
                                 group_min);
    } else if (whole_page) {
      ops::QuantizeKvColumnsInt8(k32, fill, static_cast<int>(row_values), reinterpret_cast<int8_t*>(codes),
                                 channel_scale);
    }
    for (int32_t s = 0; s < fill; ++s) pos[s] = base + s;
  }
  return rotated;
}

Status PagedKvCache::RenumberPositions(int seq, int layer, int kv_head, const KeyRotateFn& rotate, int64_t* rotated) {
  KVS_RETURN_IF_ERROR(CheckSeq("renumber-positions", seq));
  KVS_RETURN_IF_ERROR(CheckLayer("renumber-positions", layer));
  if (!rotate) return InvalidArgumentError("KV cache renumber-positions: no key rotation given");
  Layer& L = LayerOf(seq, layer);
  if (kv_head >= 0 && !L.per_head) {
    return InvalidArgumentError("KV cache renumber-positions: layer " + std::to_string(layer) +
                                " keeps the same tokens for every KV head; pass kv_head -1");
  }
  if (kv_head >= geometry_.n_kv_heads) {
    return InvalidArgumentError("KV cache renumber-positions: kv head " + std::to_string(kv_head) +
                                " out of range [0, " + std::to_string(geometry_.n_kv_heads) + ")");
  }
  const int h0 = kv_head >= 0 ? kv_head : 0;
  const int h1 = kv_head >= 0 ? kv_head + 1 : L.n_tables;
  // Plan every table first so that a budget failure leaves all of them unchanged.
  int64_t pages = 0;
  size_t bytes = 0;
  for (int h = h0; h < h1; ++h) {
    const Table& t = table(seq, layer, h);
    bytes += RenumberBytes(L, t, FirstRenumbered(L, t), &pages);
  }
  if (!budget_.CanAfford(bytes)) {
    return BudgetError("renumber-positions (copy of shared pages)", seq, layer, kv_head, pages, bytes);
  }
  int64_t total = 0;
  for (int h = h0; h < h1; ++h) {
    Table& t = table(seq, layer, h);
    const int32_t first = FirstRenumbered(L, t);  // a second scan of positions: cheaper than a buffer
    if (first < t.n) total += RenumberTable(t, L, first, rotate);
  }
  rerotated_tokens_ += total;
  if (rotated != nullptr) *rotated = total;
  return Status::Ok();
}

}  // namespace kvsparse
