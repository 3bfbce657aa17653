// KIVI storage of PagedKvCache (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric
// 2bit Quantization for KV Cache"): keys quantized per channel over the tokens of a page (the
// paper's group), values per (token, kv head) row, the newest tokens in full precision (the
// paper's residual: the partly filled page and kivi_residual tokens of whole pages). int8_kivi is
// symmetric; int4_kivi and int2_kivi are asymmetric with a zero point per group, as in the paper,
// and pack 2 or 4 codes to a byte.
//
// A table of a KIVI layer is its quantized pages (quantized_pages of them) followed by residual
// pages in the f16 layout (from the f16 pool): whole ones for the window, then the partly filled
// one. Append fills the last residual page; when it fills, the residual page that the window
// leaves behind is quantized as one group (with no window: the page itself, and a run of whole
// pages in one call is quantized straight from the f32 input). Eviction stages every survivor
// from the first rewritten page on (K dequantized to f32, V keeping its codes), releases
// the old pages and writes new ones: pages the window has left requantized from their new group,
// the rest as residual pages. Writing fresh pages (never in place) makes shared pages
// copy-on-write for free; freed pages are reused first (LIFO), so this costs no extra memory.
#include <algorithm>
#include <cstring>
#include <string>

#include "ops/kv_quant.h"
#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "kvsparse/paged_kv_cache.h"
#include "common/align.h"

namespace kvsparse {

void PagedKvCache::SetKiviLayout(Layer* layer) const {
  const size_t P = static_cast<size_t>(page_size_);
  const size_t H = static_cast<size_t>(layer->layout.row_heads);
  const size_t D = static_cast<size_t>(geometry_.head_dim);
  layer->kivi = true;
  PageLayout& p = layer->layout;  // quantized page
  p.row_bytes = KvRowBytes(layer->storage, H * D);  // codes, packed below 8 bits
  p.k_offset = 0;
  p.v_offset = AlignTo64(P * p.row_bytes);
  p.positions_offset = p.v_offset + AlignTo64(P * p.row_bytes);
  p.v_scale_offset = p.positions_offset + AlignTo64(P * sizeof(int32_t));
  p.k_scale_offset = 0;  // no per-token K scales
  if (IsLowBitKivi(layer->storage)) {
    // f16 scales and zero points: V per (token, head, group of kivi_v_group_ channels), K per
    // (head, channel) for the page.
    const size_t v_groups = H * (D / static_cast<size_t>(kivi_v_group_));  // per token
    p.v_min_offset = p.v_scale_offset + AlignTo64(P * v_groups * sizeof(f16_bits));
    p.k_channel_scale_offset = p.v_min_offset + AlignTo64(P * v_groups * sizeof(f16_bits));
    p.k_channel_min_offset = p.k_channel_scale_offset + AlignTo64(H * D * sizeof(f16_bits));
    p.page_bytes = p.k_channel_min_offset + AlignTo64(H * D * sizeof(f16_bits));
    // The K scales and mins belong to the page, not to a token: live bytes add them per page.
    p.token_bytes = 2 * p.row_bytes + sizeof(int32_t) + 2 * v_groups * sizeof(f16_bits);
    p.page_scale_bytes = 2 * H * D * sizeof(f16_bits);
  } else {  // int8_kivi: f32 scales, V per (token, head)
    p.v_min_offset = 0;
    p.k_channel_scale_offset = p.v_scale_offset + AlignTo64(P * H * sizeof(float));
    p.k_channel_min_offset = 0;
    p.page_bytes = p.k_channel_scale_offset + AlignTo64(H * D * sizeof(float));
    p.token_bytes = 2 * p.row_bytes + sizeof(int32_t) + H * sizeof(float);
    p.page_scale_bytes = H * D * sizeof(float);
  }

  PageLayout& r = layer->residual_layout;  // the f16 layout, so the f16 pool can serve it
  r.row_heads = p.row_heads;
  r.row_bytes = KvRowBytes(kKiviResidualStorage, H * D);
  r.k_offset = 0;
  r.v_offset = AlignTo64(P * r.row_bytes);
  r.positions_offset = r.v_offset + AlignTo64(P * r.row_bytes);
  r.page_bytes = r.positions_offset + AlignTo64(P * sizeof(int32_t));
  r.token_bytes = 2 * r.row_bytes + sizeof(int32_t);
}

PageId PagedKvCache::AllocateResidualPage(Layer& L) { return AllocateFrom(*L.residual_pool, &L.residual_pages); }

void PagedKvCache::ReleaseResidualPage(Layer& L, PageId id, int32_t fill) {
  ReleaseTo(*L.residual_pool, id, fill, &L.residual_pages, &L.residual_slots);
}

size_t PagedKvCache::PlanBytes(const Layer& L, const EvictPlan& plan) const {
  return L.kivi ? plan.fresh_bytes : static_cast<size_t>(plan.fresh_pages) * L.layout.page_bytes;
}

size_t PagedKvCache::TableReserveBytes(int layer, int32_t max_tokens, KvStorage storage) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers && max_tokens >= 0);
  const Layer L = MakeLayer(layer, storage, layers_[layer].per_head);
  if (!L.kivi) {
    const size_t pages = static_cast<size_t>((max_tokens + page_size_ - 1) / page_size_) + 1;
    return pages * L.layout.page_bytes;
  }
  // Quantized pages, the residual window's whole pages and its partly filled one, and the page a
  // residual page is quantized into before it is freed.
  const size_t full_pages = static_cast<size_t>(max_tokens / page_size_) + 1;
  const size_t residual_pages = static_cast<size_t>(std::min(kivi_residual_pages_, max_tokens / page_size_)) + 1;
  return full_pages * L.layout.page_bytes + residual_pages * L.residual_layout.page_bytes;
}

void PagedKvCache::KiviStaging::Resize(int32_t tokens, int row_heads, int head_dim, size_t v_row_bytes,
                                       int v_scales_per_row) {
  const size_t n = static_cast<size_t>(tokens);
  const size_t values = n * static_cast<size_t>(row_heads) * head_dim;
  k.resize(values);
  v.resize(values);
  v_codes.resize(n * v_row_bytes);
  v_scale.resize(n * static_cast<size_t>(row_heads));
  v_group_scale.resize(n * static_cast<size_t>(v_scales_per_row));
  v_group_min.resize(n * static_cast<size_t>(v_scales_per_row));
  v_coded.resize(n);
  positions.resize(n);
}

void PagedKvCache::ReadKiviSlots(const Layer& L, const Table& t, size_t page_index, int32_t slot, int32_t count,
                                 KiviStaging* st, int32_t at) const {
  const bool residual = IsResidualPage(L, t, page_index);
  const PageLayout& p = residual ? L.residual_layout : L.layout;
  const uint8_t* page = PoolOf(L, t, page_index)->data(t.pages[page_index]);
  const int rh = p.row_heads, D = geometry_.head_dim;
  const size_t row_values = static_cast<size_t>(rh) * D;
  const size_t first = static_cast<size_t>(at) * row_values;  // staged values before `at`
  const size_t values = static_cast<size_t>(count) * row_values;
  std::memcpy(st->positions.data() + at, page + p.positions_offset + slot * sizeof(int32_t),
              count * sizeof(int32_t));
  if (residual) {
    ops::DequantizeRow(DType::kF16, page + p.k_offset + slot * p.row_bytes, st->k.data() + first,
                       static_cast<int64_t>(values));
    ops::DequantizeRow(DType::kF16, page + p.v_offset + slot * p.row_bytes, st->v.data() + first,
                       static_cast<int64_t>(values));
    std::fill(st->v_coded.begin() + at, st->v_coded.begin() + at + count, 0);
    return;
  }
  const uint8_t* k_codes = page + p.k_offset + slot * p.row_bytes;
  const uint8_t* v_codes = page + p.v_offset + slot * p.row_bytes;
  const int64_t v_rows = static_cast<int64_t>(count) * rh;
  if (IsLowBitKivi(L.storage)) {
    const int bits = KvStorageBits(L.storage);
    const int groups = D / kivi_v_group_;  // per (token, head)
    const f16_bits* channel_scale = reinterpret_cast<const f16_bits*>(page + p.k_channel_scale_offset);  // [rh, D]
    const f16_bits* channel_min = reinterpret_cast<const f16_bits*>(page + p.k_channel_min_offset);      // [rh, D]
    const size_t scales_from = static_cast<size_t>(slot) * rh * groups;
    const f16_bits* v_scale = reinterpret_cast<const f16_bits*>(page + p.v_scale_offset) + scales_from;
    const f16_bits* v_min = reinterpret_cast<const f16_bits*>(page + p.v_min_offset) + scales_from;
    ops::DequantizeKvColumnsAsym(bits, k_codes, channel_scale, channel_min, count, static_cast<int>(row_values),
                                 st->k.data() + first);
    ops::DequantizeKvRowsAsym(bits, v_codes, v_scale, v_min, v_rows, D, kivi_v_group_, st->v.data() + first);
    const size_t scales = static_cast<size_t>(v_rows) * groups, staged_at = static_cast<size_t>(at) * rh * groups;
    std::memcpy(st->v_group_scale.data() + staged_at, v_scale, scales * sizeof(f16_bits));
    std::memcpy(st->v_group_min.data() + staged_at, v_min, scales * sizeof(f16_bits));
  } else {
    const float* channel_scale = reinterpret_cast<const float*>(page + p.k_channel_scale_offset);  // [rh, D]
    const float* v_scale = reinterpret_cast<const float*>(page + p.v_scale_offset) + static_cast<size_t>(slot) * rh;
    ops::DequantizeKvColumnsInt8(reinterpret_cast<const int8_t*>(k_codes), channel_scale, count,
                                 static_cast<int>(row_values), st->k.data() + first);
    ops::DequantizeKvRowsInt8(reinterpret_cast<const int8_t*>(v_codes), v_scale, v_rows, D, st->v.data() + first);
    std::memcpy(st->v_scale.data() + static_cast<size_t>(at) * rh, v_scale, v_rows * sizeof(float));
  }
  std::memcpy(st->v_codes.data() + static_cast<size_t>(at) * p.row_bytes, v_codes, count * p.row_bytes);
  std::fill(st->v_coded.begin() + at, st->v_coded.begin() + at + count, 1);
}

void PagedKvCache::WriteKiviPage(const Layer& L, uint8_t* page, bool residual, int32_t slot, const KiviStaging& st,
                                 int32_t at, int32_t count) {
  const PageLayout& p = residual ? L.residual_layout : L.layout;
  const int rh = p.row_heads, D = geometry_.head_dim;
  const size_t row_values = static_cast<size_t>(rh) * D;
  const size_t first = static_cast<size_t>(at) * row_values;
  const size_t values = static_cast<size_t>(count) * row_values;
  std::memcpy(page + p.positions_offset + slot * sizeof(int32_t), st.positions.data() + at, count * sizeof(int32_t));
  if (residual) {
    ops::QuantizeRow(DType::kF16, st.k.data() + first, page + p.k_offset + slot * p.row_bytes,
                     static_cast<int64_t>(values));
    ops::QuantizeRow(DType::kF16, st.v.data() + first, page + p.v_offset + slot * p.row_bytes,
                     static_cast<int64_t>(values));
    return;
  }
  KVS_CHECK_MSG(slot == 0 && count == page_size_, "a KIVI page is quantized whole");
  uint8_t* k_codes = page + p.k_offset;
  uint8_t* v_codes = page + p.v_offset;
  if (IsLowBitKivi(L.storage)) {
    const int bits = KvStorageBits(L.storage);
    const int groups = D / kivi_v_group_;  // V scales per (token, head)
    f16_bits* channel_scale = reinterpret_cast<f16_bits*>(page + p.k_channel_scale_offset);  // [rh, D]
    f16_bits* channel_min = reinterpret_cast<f16_bits*>(page + p.k_channel_min_offset);      // [rh, D]
    f16_bits* v_scale = reinterpret_cast<f16_bits*>(page + p.v_scale_offset);                // [P, rh, groups]
    f16_bits* v_min = reinterpret_cast<f16_bits*>(page + p.v_min_offset);                    // [P, rh, groups]
    ops::QuantizeKvColumnsAsym(bits, st.k.data() + first, count, static_cast<int>(row_values), k_codes, channel_scale,
                               channel_min);
    const size_t row_scales = static_cast<size_t>(rh) * groups;
    for (int32_t j = 0; j < count; ++j) {
      const size_t scales_at = static_cast<size_t>(j) * row_scales;
      const size_t staged_at = static_cast<size_t>(at + j) * row_scales;
      if (st.v_coded[at + j]) {  // moved from a quantized page: keep its codes bit for bit
        std::memcpy(v_codes + j * p.row_bytes, st.v_codes.data() + static_cast<size_t>(at + j) * p.row_bytes,
                    p.row_bytes);
        std::memcpy(v_scale + scales_at, st.v_group_scale.data() + staged_at, row_scales * sizeof(f16_bits));
        std::memcpy(v_min + scales_at, st.v_group_min.data() + staged_at, row_scales * sizeof(f16_bits));
      } else {
        ops::QuantizeKvRowsAsym(bits, st.v.data() + first + static_cast<size_t>(j) * row_values, rh, D, kivi_v_group_,
                                v_codes + j * p.row_bytes, v_scale + scales_at, v_min + scales_at);
      }
    }
    return;
  }
  float* channel_scale = reinterpret_cast<float*>(page + p.k_channel_scale_offset);  // [rh, D]
  float* v_scale = reinterpret_cast<float*>(page + p.v_scale_offset);                 // [P, rh]
  ops::QuantizeKvColumnsInt8(st.k.data() + first, count, static_cast<int>(row_values),
                             reinterpret_cast<int8_t*>(k_codes), channel_scale);
  for (int32_t j = 0; j < count; ++j) {
    const size_t src = first + static_cast<size_t>(j) * row_values;
    const size_t scales_at = static_cast<size_t>(j) * rh, staged_scales_at = static_cast<size_t>(at + j) * rh;
    if (st.v_coded[at + j]) {  // moved from a quantized page: keep its codes bit for bit
      std::memcpy(v_codes + j * p.row_bytes, st.v_codes.data() + static_cast<size_t>(at + j) * p.row_bytes,
                  p.row_bytes);
      std::memcpy(v_scale + scales_at, st.v_scale.data() + staged_scales_at, rh * sizeof(float));
    } else {
      ops::QuantizeKvRowsInt8(st.v.data() + src, rh, D, reinterpret_cast<int8_t*>(v_codes + j * p.row_bytes),
                              v_scale + scales_at);
    }
  }
}

Status PagedKvCache::AppendKivi(int seq, int layer, int32_t n, const float* k, const float* v,
                                const int32_t* positions) {
  Layer& L = LayerOf(seq, layer);
  const int32_t P = page_size_;
  // Append checked the budget (TableAppendBytes walks the same steps as below).
  const int rh = L.layout.row_heads, D = geometry_.head_dim;
  const size_t row_values = static_cast<size_t>(rh) * D;
  const size_t in_stride = static_cast<size_t>(geometry_.n_kv_heads) * D;  // floats between input tokens
  KiviStaging& st = kivi_stage_;
  st.Resize(P, rh, D, L.layout.row_bytes, VScalesPerRow(L));
  for (int h = 0; h < L.n_tables; ++h) {
    Table& t = table(seq, layer, h);
    const size_t head_offset = L.per_head ? static_cast<size_t>(h) * D : 0;
    // Stages input tokens [from, from + count) at staged index `at`.
    auto stage_input = [&](int32_t from, int32_t count, int32_t at) {
      for (int32_t j = 0; j < count; ++j) {
        const size_t src = static_cast<size_t>(from + j) * in_stride + head_offset;
        const size_t dst = static_cast<size_t>(at + j) * row_values;
        std::memcpy(st.k.data() + dst, k + src, row_values * sizeof(float));
        std::memcpy(st.v.data() + dst, v + src, row_values * sizeof(float));
        st.v_coded[at + j] = 0;
        st.positions[at + j] = positions[from + j];
      }
    };
    for (int32_t done = 0; done < n;) {
      const int32_t r = t.n % P;
      const int32_t c = std::min(n - done, P - r);
      if (r + c == P && kivi_residual_pages_ == 0) {
        // The page fills: its residual tokens and the new ones are quantized as one group.
        if (r > 0) ReadKiviSlots(L, t, t.pages.size() - 1, 0, r, &st, 0);
        stage_input(done, c, r);
        const PageId id = AllocatePage(L);
        WriteKiviPage(L, L.pool->data(id), /*residual=*/false, 0, st, 0, P);
        if (r > 0) {
          ReleaseResidualPage(L, t.pages.back(), r);
          t.pages.back() = id;
        } else {
          t.pages.push_back(id);
        }
        L.live_slots += P;
        ++t.quantized_pages;
      } else {
        if (r == 0) {
          t.pages.push_back(AllocateResidualPage(L));
        } else if (L.residual_pool->refcount(t.pages.back()) > 1) {
          // Copy-on-write: the residual page is shared with another sequence.
          const PageId shared = t.pages.back();
          ReadKiviSlots(L, t, t.pages.size() - 1, 0, r, &st, 0);
          const PageId own = AllocateResidualPage(L);
          WriteKiviPage(L, L.residual_pool->data(own), /*residual=*/true, 0, st, 0, r);
          L.residual_slots += r;
          ReleaseResidualPage(L, shared, r);
          t.pages.back() = own;
          ++cow_pages_;
        }
        stage_input(done, c, 0);
        WriteKiviPage(L, L.residual_pool->data(t.pages.back()), /*residual=*/true, r, st, 0, c);
        L.residual_slots += c;
        // A whole f16 page stays in the window; the page kivi_residual tokens behind leaves it.
        if (r + c == P && QuantizedPagesFor(t.n + c) > t.quantized_pages) QuantizeOldestResidualPage(L, t);
      }
      t.n += c;
      done += c;
    }
  }
  return Status::Ok();
}

void PagedKvCache::QuantizeOldestResidualPage(Layer& L, Table& t) {
  const size_t index = static_cast<size_t>(t.quantized_pages);
  KVS_CHECK(IsResidualPage(L, t, index) && index + 1 < t.pages.size());
  KiviStaging& st = kivi_stage_;
  ReadKiviSlots(L, t, index, 0, page_size_, &st, 0);
  const PageId id = AllocatePage(L);
  WriteKiviPage(L, L.pool->data(id), /*residual=*/false, 0, st, 0, page_size_);
  ReleaseResidualPage(L, t.pages[index], page_size_);
  t.pages[index] = id;
  L.live_slots += page_size_;
  ++t.quantized_pages;
}

PagedKvCache::EvictPlan PagedKvCache::PlanEvictKivi(const Table& t, const Layer& L, const uint8_t* keep) const {
  EvictPlan plan = CountKept(t, keep);
  if (plan.first_drop < 0) return plan;
  // Pages from the first dropped token's on are released (exclusive ones free their bytes
  // first) and rewritten: quantized up to QuantizedPagesAfterEvict, the rest as residual pages.
  const int32_t P = page_size_;
  const int32_t first_page = plan.first_drop / P;
  const int32_t new_pages = (plan.n_keep + P - 1) / P;
  const int32_t quantized = std::max(first_page, QuantizedPagesAfterEvict(t, plan));
  plan.fresh_pages = new_pages - first_page;
  const size_t needed = static_cast<size_t>(quantized - first_page) * L.layout.page_bytes +
                        static_cast<size_t>(new_pages - quantized) * L.residual_layout.page_bytes;
  size_t freed = 0;
  for (size_t d = static_cast<size_t>(first_page); d < t.pages.size(); ++d) {
    if (PoolOf(L, t, d)->refcount(t.pages[d]) == 1) freed += LayoutOf(L, t, d).page_bytes;
  }
  plan.fresh_bytes = needed > freed ? needed - freed : 0;
  return plan;
}

void PagedKvCache::ApplyEvictKivi(Table& t, Layer& L, const uint8_t* keep, const EvictPlan& plan) {
  const int32_t P = page_size_;
  const int32_t n_old = t.n;
  const int32_t first_page = plan.first_drop / P;
  const int32_t quantized = QuantizedPagesAfterEvict(t, plan);

  // Stage the survivors of the rewritten pages, run by run within each page.
  KiviStaging& st = kivi_stage_;
  st.Resize(plan.n_keep - first_page * P, L.layout.row_heads, geometry_.head_dim, L.layout.row_bytes,
            VScalesPerRow(L));
  int32_t at = 0;
  for (int32_t i = first_page * P; i < n_old;) {
    if (!keep[i]) {
      ++i;
      continue;
    }
    int32_t run_end = i + 1;
    while (run_end < n_old && keep[run_end] && run_end % P != 0) ++run_end;
    ReadKiviSlots(L, t, static_cast<size_t>(i / P), i % P, run_end - i, &st, at);
    at += run_end - i;
    i = run_end;
  }
  KVS_CHECK(at == plan.n_keep - first_page * P);
  moved_tokens_ += plan.n_keep - plan.first_drop;

  // Release the old pages (shared ones stay for their other tables), then write new ones.
  const int32_t new_count = (plan.n_keep + P - 1) / P;
  for (size_t d = static_cast<size_t>(first_page); d < t.pages.size(); ++d) {
    const bool is_residual = IsResidualPage(L, t, d);
    if (static_cast<int32_t>(d) < new_count && PoolOf(L, t, d)->refcount(t.pages[d]) > 1) ++cow_pages_;
    if (is_residual) {
      ReleaseResidualPage(L, t.pages[d], PageFill(t, d));
    } else {
      ReleasePage(L, t.pages[d], P);
    }
  }
  t.pages.resize(first_page);
  t.n = first_page * P;
  t.quantized_pages = quantized;
  for (int32_t d = first_page; d < new_count; ++d) {
    const int32_t fill = std::min(P, plan.n_keep - d * P);
    const int32_t at = (d - first_page) * P;
    if (d < quantized) {
      const PageId id = AllocatePage(L);
      WriteKiviPage(L, L.pool->data(id), /*residual=*/false, 0, st, at, P);
      t.pages.push_back(id);
      L.live_slots += P;
    } else {
      const PageId id = AllocateResidualPage(L);
      WriteKiviPage(L, L.residual_pool->data(id), /*residual=*/true, 0, st, at, fill);
      t.pages.push_back(id);
      L.residual_slots += fill;
    }
    t.n += fill;
  }
  KVS_CHECK(t.n == plan.n_keep);
}

}  // namespace kvsparse
