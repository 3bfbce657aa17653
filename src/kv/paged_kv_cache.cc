#include "kvsparse/paged_kv_cache.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "ops/kv_quant.h"
#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "common/align.h"

namespace kvsparse {

namespace {

constexpr int32_t kMaxPageSize = 1 << 16;

bool IsKnownStorage(KvStorage s) { return static_cast<int>(s) >= 0 && static_cast<int>(s) < kNumKvStorage; }

// Storage `s` can hold rows of head_dim values: packed codes must fill whole bytes per (token,
// kv head) row.
Status CheckStorageFits(KvStorage s, const KvGeometry& geometry, const char* where) {
  const int head_dim = geometry.head_dim;
  if (!IsKnownStorage(s)) return InvalidArgumentError(std::string(where) + ": unknown KV storage type");
  // KIVI's rule quantizes keys per channel and values per token; an MLA latent row is both, and
  // the attention kernels read values per token only.
  if (geometry.values_in_keys && IsKiviStorage(s)) {
    return UnimplementedError(std::string(where) + ": " + KvStorageName(s) +
                              " cannot store an MLA latent cache (KIVI quantizes keys per channel and values per "
                              "token, and a latent row is both key and value); use int8, fp8_e4m3, fp8_e5m2, bf16 or "
                              "f16");
  }
  if (!KvStorageFits(s, head_dim)) {
    const int per_byte = 8 / KvStorageBits(s);
    return InvalidArgumentError(std::string(where) + ": " + KvStorageName(s) + " packs " + std::to_string(per_byte) +
                                " values per byte, so head_dim must be a multiple of " + std::to_string(per_byte) +
                                " (found " + std::to_string(head_dim) + ")");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(const KvGeometry& geometry,
                                                             const PagedKvCacheOptions& options) {
  if (geometry.n_layers <= 0 || geometry.n_kv_heads <= 0 || geometry.head_dim <= 0) {
    return InvalidArgumentError("paged KV cache: geometry needs positive n_layers, n_kv_heads and head_dim (got " +
                                std::to_string(geometry.n_layers) + ", " + std::to_string(geometry.n_kv_heads) +
                                ", " + std::to_string(geometry.head_dim) + ")");
  }
  if (!geometry.layer_window.empty() &&
      (geometry.layer_window.size() != static_cast<size_t>(geometry.n_layers) ||
       std::any_of(geometry.layer_window.begin(), geometry.layer_window.end(), [](int32_t w) { return w < 0; }))) {
    return InvalidArgumentError("paged KV cache: layer_window needs one window >= 0 per layer (got " +
                                std::to_string(geometry.layer_window.size()) + " for " +
                                std::to_string(geometry.n_layers) + " layers)");
  }
  if (options.n_seqs < 0) {
    return InvalidArgumentError("paged KV cache: n_seqs must be >= 0 (got " + std::to_string(options.n_seqs) +
                                ")");
  }
  if (options.page_size <= 0 || options.page_size > kMaxPageSize) {
    return InvalidArgumentError("paged KV cache: page size must be in [1, " + std::to_string(kMaxPageSize) +
                                "] tokens (got " + std::to_string(options.page_size) + ")");
  }
  if (options.kivi_residual < 0 || options.kivi_residual % options.page_size != 0) {
    return InvalidArgumentError("paged KV cache: the KIVI residual must be a multiple of the page size (" +
                                std::to_string(options.page_size) + " tokens) and >= 0 (got " +
                                std::to_string(options.kivi_residual) + ")");
  }
  if (options.kivi_v_group < 0 ||
      (options.kivi_v_group > 0 && (geometry.head_dim % options.kivi_v_group != 0 || options.kivi_v_group % 4 != 0))) {
    return InvalidArgumentError("paged KV cache: the KIVI V group must divide head_dim (" +
                                std::to_string(geometry.head_dim) + ") and be a multiple of 4 channels, or 0 for "
                                "the whole row (got " + std::to_string(options.kivi_v_group) + ")");
  }
  const size_t n_storage = options.layer_storage.size();
  if (n_storage != 1 && n_storage != static_cast<size_t>(geometry.n_layers)) {
    return InvalidArgumentError("paged KV cache: layer_storage lists " + std::to_string(n_storage) +
                                " storage types; expected 1 (all layers) or " + std::to_string(geometry.n_layers) +
                                " (one per layer)");
  }
  for (KvStorage s : options.layer_storage) {
    KVS_RETURN_IF_ERROR(CheckStorageFits(s, geometry, "paged KV cache"));
  }
  const size_t n_per_head = options.layer_per_head.size();
  if (n_per_head > 1 && n_per_head != static_cast<size_t>(geometry.n_layers)) {
    return InvalidArgumentError("paged KV cache: layer_per_head lists " + std::to_string(n_per_head) +
                                " flags; expected none, 1 (all layers) or " + std::to_string(geometry.n_layers) +
                                " (one per layer)");
  }
  if (options.budget_bytes == 0) {
    return InvalidArgumentError("paged KV cache: the KV budget is 0 bytes; give it room for at least one page");
  }
  std::unique_ptr<PagedKvCache> cache(new PagedKvCache(geometry, options, options.budget_bytes));
  for (Layer& layer : cache->layers_) KVS_RETURN_IF_ERROR(cache->AttachPools(&layer));
  return cache;
}

PagedKvCache::PagedKvCache(const KvGeometry& geometry, const PagedKvCacheOptions& options, size_t budget_bytes)
    : geometry_(geometry),
      n_seqs_(options.n_seqs),
      page_size_(options.page_size),
      kivi_residual_pages_(options.kivi_residual / options.page_size),
      kivi_v_group_(options.kivi_v_group > 0 ? options.kivi_v_group : geometry.head_dim),
      budget_(budget_bytes) {
  layers_.reserve(geometry.n_layers);
  for (int l = 0; l < geometry.n_layers; ++l) {
    const KvStorage storage = options.layer_storage.size() == 1 ? options.layer_storage[0] : options.layer_storage[l];
    const std::vector<uint8_t>& ph = options.layer_per_head;
    const bool per_head = !ph.empty() && (ph.size() == 1 ? ph[0] : ph[l]) != 0;
    Layer layer = MakeLayer(l, storage, per_head);
    layer.first_table = tables_per_seq_;
    tables_per_seq_ += static_cast<size_t>(layer.n_tables);
    layers_.push_back(layer);
  }
  tables_.resize(static_cast<size_t>(n_seqs_) * tables_per_seq_);
  seq_profile_.assign(static_cast<size_t>(n_seqs_), 0);
}

PagedKvCache::Layer PagedKvCache::MakeLayer(int l, KvStorage storage, bool per_head) const {
  const size_t P = static_cast<size_t>(page_size_);
  Layer layer;
  layer.index = l;
  layer.storage = storage;
  layer.per_head = per_head;
  layer.n_tables = per_head ? geometry_.n_kv_heads : 1;
  PageLayout& p = layer.layout;
  // A per-head layer's pages hold one head: the same sections with H = 1.
  p.row_heads = per_head ? 1 : geometry_.n_kv_heads;
  const size_t H = static_cast<size_t>(p.row_heads);
  p.row_bytes = KvRowBytes(storage, H * static_cast<size_t>(geometry_.head_dim));
  const bool int8 = HasTokenScales(storage);  // int8 or fp8: a scale per (token, kv head)
  // A latent layer (values_in_keys) has no V section: V and its scales are K's.
  const bool latent = geometry_.values_in_keys;
  const size_t rows = static_cast<size_t>(geometry_.StoredRows());
  p.k_offset = 0;
  p.v_offset = latent ? p.k_offset : AlignTo64(P * p.row_bytes);
  p.positions_offset = p.v_offset + AlignTo64(P * p.row_bytes);
  size_t end = p.positions_offset + AlignTo64(P * sizeof(int32_t));
  if (int8) {
    p.k_scale_offset = end;
    p.v_scale_offset = latent ? p.k_scale_offset : p.k_scale_offset + AlignTo64(P * H * sizeof(float));
    end = p.v_scale_offset + AlignTo64(P * H * sizeof(float));
  }
  p.page_bytes = end;
  p.token_bytes = rows * p.row_bytes + sizeof(int32_t) + (int8 ? rows * H * sizeof(float) : 0);
  if (IsKiviStorage(storage)) SetKiviLayout(&layer);
  return layer;
}

// Layers with the same page layout share a pool: "kv-f16", "kv-int8-head", ...
StatusOr<int> PagedKvCache::PoolFor(KvStorage storage, bool per_head, size_t page_bytes) {
  const std::string name = std::string("kv-") + KvStorageName(storage) + (per_head ? "-head" : "");
  size_t index = 0;
  while (index < pools_.size() && pools_[index]->name() != name) ++index;
  if (index == pools_.size()) {
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> pool, PagePool::Create(page_bytes, &budget_, name));
    pools_.push_back(std::move(pool));
  }
  KVS_CHECK(pools_[index]->page_bytes() == page_bytes);
  return static_cast<int>(index);
}

Status PagedKvCache::AttachPools(Layer* layer) {
  KVS_ASSIGN_OR_RETURN(layer->pool_index, PoolFor(layer->storage, layer->per_head, layer->layout.page_bytes));
  layer->pool = pools_[layer->pool_index].get();
  if (layer->kivi) {  // residual pages have the f16 layout: the f16 pool serves them
    KVS_ASSIGN_OR_RETURN(layer->residual_pool_index,
                         PoolFor(kKiviResidualStorage, layer->per_head, layer->residual_layout.page_bytes));
    layer->residual_pool = pools_[layer->residual_pool_index].get();
  }
  return Status::Ok();
}

StatusOr<int> PagedKvCache::ProfileFor(const std::vector<KvStorage>& storage) {
  const int n_layers = geometry_.n_layers;
  KVS_CHECK(static_cast<int>(storage.size()) == n_layers);
  for (int profile = 0; profile < n_profiles(); ++profile) {
    bool same = true;
    for (int l = 0; l < n_layers && same; ++l) same = layers_[profile * n_layers + l].storage == storage[l];
    if (same) return profile;
  }
  std::vector<Layer> added;
  for (int l = 0; l < n_layers; ++l) {
    Layer layer = MakeLayer(l, storage[l], layers_[l].per_head);
    layer.first_table = layers_[l].first_table;
    KVS_RETURN_IF_ERROR(AttachPools(&layer));
    added.push_back(layer);
  }
  const int profile = n_profiles();
  layers_.insert(layers_.end(), added.begin(), added.end());
  return profile;
}

Status PagedKvCache::SetSequenceStorage(int seq, std::span<const KvStorage> layer_storage) {
  KVS_RETURN_IF_ERROR(CheckSeq("set-storage", seq));
  const size_t n = layer_storage.size();
  if (n != 1 && n != static_cast<size_t>(geometry_.n_layers)) {
    return InvalidArgumentError("KV cache set-storage: seq " + std::to_string(seq) + ": " + std::to_string(n) +
                                " storage types; expected 1 (all layers) or " + std::to_string(geometry_.n_layers));
  }
  for (KvStorage st : layer_storage) {
    KVS_RETURN_IF_ERROR(CheckStorageFits(st, geometry_, "KV cache set-storage"));
  }
  for (size_t ti = 0; ti < tables_per_seq_; ++ti) {
    if (tables_[static_cast<size_t>(seq) * tables_per_seq_ + ti].n != 0) {
      return InvalidArgumentError("KV cache set-storage: seq " + std::to_string(seq) +
                                     " holds tokens; clear it before changing its storage");
    }
  }
  std::vector<KvStorage> storage(static_cast<size_t>(geometry_.n_layers));
  for (int l = 0; l < geometry_.n_layers; ++l) storage[l] = n == 1 ? layer_storage[0] : layer_storage[l];
  KVS_ASSIGN_OR_RETURN(seq_profile_[seq], ProfileFor(storage));
  return Status::Ok();
}

KvStorage PagedKvCache::layer_storage(int layer) const {
  KVS_CHECK_MSG(layer >= 0 && layer < geometry_.n_layers, "layer " + std::to_string(layer) + " out of range");
  return layers_[layer].storage;
}

KvStorage PagedKvCache::sequence_storage(int seq, int layer) const {
  CheckSeqLayer("sequence_storage", seq, layer);
  return LayerOf(seq, layer).storage;
}

size_t PagedKvCache::page_bytes(int layer) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers);
  return layers_[layer].layout.page_bytes;
}

size_t PagedKvCache::token_bytes(int layer) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers);
  return layers_[layer].layout.token_bytes;
}

int32_t PagedKvCache::tables_per_seq(int layer) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers);
  return layers_[layer].n_tables;
}

bool PagedKvCache::per_head(int layer) const {
  KVS_CHECK_MSG(layer >= 0 && layer < geometry_.n_layers, "layer " + std::to_string(layer) + " out of range");
  return layers_[layer].per_head;
}

Status PagedKvCache::CheckSeq(const char* op, int seq) const {
  if (seq < 0 || seq >= n_seqs_) {
    return InvalidArgumentError(std::string("KV cache ") + op + ": seq " + std::to_string(seq) +
                                " out of range [0, " + std::to_string(n_seqs_) + ")");
  }
  return Status::Ok();
}

Status PagedKvCache::CheckLayer(const char* op, int layer) const {
  if (layer < 0 || layer >= geometry_.n_layers) {
    return InvalidArgumentError(std::string("KV cache ") + op + ": layer " + std::to_string(layer) +
                                " out of range [0, " + std::to_string(geometry_.n_layers) + ")");
  }
  return Status::Ok();
}

void PagedKvCache::CheckSeqLayer(const char* op, int seq, int layer) const {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_ && layer >= 0 && layer < geometry_.n_layers,
                std::string(op) + ": seq " + std::to_string(seq) + " layer " + std::to_string(layer) +
                    " out of range");
}

const int32_t* PagedKvCache::LastPosition(const Layer& L, const Table& t) const {
  if (t.n == 0) return nullptr;
  const size_t last = t.pages.size() - 1;
  return reinterpret_cast<const int32_t*>(PoolOf(L, t, last)->data(t.pages[last]) +
                                          LayoutOf(L, t, last).positions_offset) +
         (PageFill(t, last) - 1);
}

int32_t PagedKvCache::PageFill(const Table& t, size_t page_index) const {
  if (page_index + 1 < t.pages.size()) return page_size_;
  return t.n - static_cast<int32_t>(t.pages.size() - 1) * page_size_;
}

PageId PagedKvCache::AllocateFrom(PagePool& pool, int64_t* layer_pages) {
  StatusOr<PageId> id = pool.Allocate();
  KVS_CHECK_MSG(id.ok(), "page allocation failed after the budget check: " + id.status().ToString());
  ++*layer_pages;
  ++pages_in_use_;
  peak_pages_in_use_ = std::max(peak_pages_in_use_, pages_in_use_);
  return *id;
}

void PagedKvCache::ReleaseTo(PagePool& pool, PageId id, int32_t fill, int64_t* layer_pages, int64_t* layer_slots) {
  if (!pool.Release(id)) return;  // still shared: its slots stay live for the other tables
  --*layer_pages;
  --pages_in_use_;
  *layer_slots -= fill;
  KVS_CHECK(*layer_pages >= 0 && *layer_slots >= 0);
}

PageId PagedKvCache::AllocatePage(Layer& L) { return AllocateFrom(*L.pool, &L.pages); }

void PagedKvCache::ReleasePage(Layer& L, PageId id, int32_t fill) { ReleaseTo(*L.pool, id, fill, &L.pages, &L.live_slots); }

Status PagedKvCache::BudgetError(const char* op, int seq, int layer, int head, int64_t pages, size_t bytes) const {
  std::string where = "seq " + std::to_string(seq) + (layer >= 0 ? " layer " + std::to_string(layer) : "") +
                      (head >= 0 ? " kv head " + std::to_string(head) : "");
  return ResourceExhaustedError("KV cache budget exhausted: " + std::string(op) + " on " + where + " needs " +
                                std::to_string(pages) + " more page(s) (" + std::to_string(bytes) +
                                " bytes), but the budget of " + std::to_string(budget_.limit_bytes()) +
                                " bytes has " + std::to_string(budget_.used_bytes()) + " bytes in use (" +
                                std::to_string(pages_in_use_) + " pages) and " +
                                std::to_string(budget_.available_bytes()) +
                                " free; raise the KV budget or evict tokens");
}

void PagedKvCache::CopySlots(const Layer& L, PageId src, int32_t src_slot, PageId dst, int32_t dst_slot,
                             int32_t count) {
  const PageLayout& p = L.layout;
  const uint8_t* s = L.pool->data(src);
  uint8_t* d = L.pool->data(dst);
  const size_t n = static_cast<size_t>(count);
  std::memmove(d + p.k_offset + dst_slot * p.row_bytes, s + p.k_offset + src_slot * p.row_bytes, n * p.row_bytes);
  const bool own_v = p.v_offset != p.k_offset;  // (a latent layer's V is its K: moved once)
  if (own_v) {
    std::memmove(d + p.v_offset + dst_slot * p.row_bytes, s + p.v_offset + src_slot * p.row_bytes, n * p.row_bytes);
  }
  std::memmove(d + p.positions_offset + dst_slot * sizeof(int32_t), s + p.positions_offset + src_slot * sizeof(int32_t),
               n * sizeof(int32_t));
  if (HasTokenScales(L.storage)) {
    const size_t scale_row = static_cast<size_t>(p.row_heads) * sizeof(float);  // [row_heads] f32
    std::memmove(d + p.k_scale_offset + dst_slot * scale_row, s + p.k_scale_offset + src_slot * scale_row,
                 n * scale_row);
    if (own_v) {
      std::memmove(d + p.v_scale_offset + dst_slot * scale_row, s + p.v_scale_offset + src_slot * scale_row,
                   n * scale_row);
    }
  }
}

void PagedKvCache::StoreRows(const Layer& L, uint8_t* page, int32_t slot, int32_t count, const float* k,
                             const float* v, int head) {
  const PageLayout& p = L.layout;
  const int D = geometry_.head_dim;
  const size_t src_stride = static_cast<size_t>(geometry_.n_kv_heads) * D;  // floats between tokens of k, v
  // All heads of a run of tokens are contiguous in k / v: one call for the run. A single head
  // is strided there: one row per token.
  const int32_t tokens_per_call = head < 0 ? count : 1;
  const int32_t calls = head < 0 ? 1 : count;
  const size_t head_offset = head < 0 ? 0 : static_cast<size_t>(head) * D;
  const int64_t rows = static_cast<int64_t>(tokens_per_call) * p.row_heads;  // rows of head_dim values
  for (int32_t c = 0; c < calls; ++c) {
    const int32_t s = slot + c;
    const float* k_src = k + c * src_stride + head_offset;  // [tokens_per_call, row_heads, head_dim]
    const float* v_src = v + c * src_stride + head_offset;
    const int64_t values = rows * D;
    // One row group of K (or V) into its section; scales at scale_offset (int8, fp8).
    auto store = [&](const float* src, size_t offset, size_t scale_offset) {
      uint8_t* dst = page + offset + s * p.row_bytes;
      float* scale = reinterpret_cast<float*>(page + scale_offset) + s * p.row_heads;  // [rows]
      switch (L.storage) {
        case KvStorage::kF32:
          std::memcpy(dst, src, values * sizeof(float));
          break;
        case KvStorage::kF16:
          ops::QuantizeRow(DType::kF16, src, dst, values);
          break;
        case KvStorage::kBf16:
          ops::QuantizeRow(DType::kBF16, src, dst, values);
          break;
        case KvStorage::kInt8:
          ops::QuantizeKvRowsInt8(src, rows, D, reinterpret_cast<int8_t*>(dst), scale);
          break;
        case KvStorage::kFp8E4M3:
        case KvStorage::kFp8E5M2:
          ops::QuantizeKvRowsFp8(L.storage, src, rows, D, dst, scale);
          break;
        case KvStorage::kInt8Kivi:
        case KvStorage::kInt4Kivi:
        case KvStorage::kInt2Kivi:
          KVS_CHECK_MSG(false, "KIVI pages are written by AppendKivi");
          break;
      }
    };
    store(k_src, p.k_offset, p.k_scale_offset);
    if (p.v_offset != p.k_offset) store(v_src, p.v_offset, p.v_scale_offset);  // a latent row is its own V
  }
}

Status PagedKvCache::CheckPositions(int seq, int layer, int head, const int32_t* positions, int32_t n,
                                    int32_t pos0) const {
  const Layer& L = LayerOf(seq, layer);
  const Table& t = table(seq, layer, head);
  // Built on the error paths only: this runs for every table of every step.
  auto where = [&] {
    return "seq " + std::to_string(seq) + " layer " + std::to_string(layer) +
           (L.per_head ? " kv head " + std::to_string(head) : std::string());
  };
  if (n > INT32_MAX - t.n) return ResourceExhaustedError("KV cache append: " + where() + " would exceed 2^31 tokens");
  const int32_t* last_pos = LastPosition(L, t);
  if (positions == nullptr && n > 0 && pos0 > INT32_MAX - n) {
    return InvalidArgumentError("KV cache append: " + where() + ": positions " + std::to_string(pos0) + " + " +
                                std::to_string(n) + " overflow int32");
  }
  // A run pos0, pos0 + 1, ... ascends by itself: only its first position needs checking.
  const int32_t checked = positions == nullptr ? std::min(n, 1) : n;
  for (int32_t i = 0; i < checked; ++i) {
    const bool has_prev = i > 0 || last_pos != nullptr;
    const int32_t pos = positions == nullptr ? pos0 : positions[i];
    const int32_t prev = i > 0 ? positions[i - 1] : (last_pos ? *last_pos : 0);
    if (pos < 0 || (has_prev && pos <= prev)) {
      return InvalidArgumentError("KV cache append: " + where() + ": position " + std::to_string(pos) +
                                  " (token " + std::to_string(i) +
                                  " of the batch) must be >= 0 and greater than the previous position " +
                                  (has_prev ? std::to_string(prev) : std::string("(none)")));
    }
  }
  return Status::Ok();
}

size_t PagedKvCache::TableAppendBytes(const Layer& L, const Table& t, int32_t n, int64_t* pages) const {
  const int32_t P = page_size_;
  if (!L.kivi) {
    const int32_t room = static_cast<int32_t>(t.pages.size()) * P - t.n;
    const bool copy_last = room > 0 && L.pool->refcount(t.pages.back()) > 1;
    const int64_t fresh = (static_cast<int64_t>(std::max(0, n - room)) + P - 1) / P + (copy_last ? 1 : 0);
    *pages += fresh;
    return static_cast<size_t>(fresh) * L.layout.page_bytes;
  }
  // KIVI: walk the steps AppendKivi takes.
  const int64_t page_bytes = static_cast<int64_t>(L.layout.page_bytes);
  const int64_t residual_bytes = static_cast<int64_t>(L.residual_layout.page_bytes);
  int64_t extra = 0, peak = 0;
  auto allocate = [&](int64_t bytes) {
    extra += bytes;
    peak = std::max(peak, extra);
    ++*pages;
  };
  int32_t r = t.n % P, n_now = t.n, quantized = t.quantized_pages;
  bool shared = r > 0 && L.residual_pool->refcount(t.pages.back()) > 1;
  for (int32_t left = n; left > 0;) {
    const int32_t c = std::min(left, P - r);
    if (r + c == P && kivi_residual_pages_ == 0) {  // a page fills: quantize it, free the residual
      allocate(page_bytes);
      if (r > 0 && !shared) extra -= residual_bytes;
      ++quantized;
    } else {  // into the residual page: a new one, or a copy of a shared one
      if (r == 0 || shared) allocate(residual_bytes);
      if (r + c == P && QuantizedPagesFor(n_now + c) > quantized) {
        // The oldest residual page leaves the window: quantized, its f16 page freed unless shared.
        allocate(page_bytes);
        const size_t leaving = static_cast<size_t>(quantized++);
        if (leaving >= t.pages.size() || L.residual_pool->refcount(t.pages[leaving]) == 1) extra -= residual_bytes;
      }
    }
    r = (r + c) % P;
    shared = false;
    n_now += c;
    left -= c;
  }
  return static_cast<size_t>(peak);
}

size_t PagedKvCache::AppendBytes(int seq, int32_t n) const {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_ && n >= 0, "AppendBytes: seq " + std::to_string(seq) + " n " + std::to_string(n));
  size_t bytes = 0;
  int64_t pages = 0;
  for (int l = 0; l < geometry_.n_layers; ++l) {
    const Layer& L = LayerOf(seq, l);
    for (int h = 0; h < L.n_tables; ++h) bytes += TableAppendBytes(L, table(seq, l, h), n, &pages);
  }
  return bytes;
}

Status PagedKvCache::CheckAppend(std::span<const KvAppendPlan> plans, const uint8_t* relative_positions) const {
  size_t bytes = 0;
  int64_t pages = 0;
  for (const KvAppendPlan& plan : plans) {
    KVS_RETURN_IF_ERROR(CheckSeq("append", plan.seq));
    if (plan.n < 0) return InvalidArgumentError("KV cache append: negative token count " + std::to_string(plan.n));
    for (int l = 0; l < geometry_.n_layers; ++l) {
      const Layer& L = LayerOf(plan.seq, l);
      for (int h = 0; h < L.n_tables; ++h) {
        if (relative_positions == nullptr || relative_positions[l] == 0) {
          KVS_RETURN_IF_ERROR(CheckPositions(plan.seq, l, h, /*positions=*/nullptr, plan.n, plan.pos0));
        }
        bytes += TableAppendBytes(L, table(plan.seq, l, h), plan.n, &pages);
      }
    }
  }
  if (!budget_.CanAfford(bytes)) {
    return ResourceExhaustedError("KV cache: the step needs " + std::to_string(pages) + " more pages (" +
                                  std::to_string(bytes) + " bytes) for " + std::to_string(plans.size()) +
                                  " sequences but the KV budget has " + std::to_string(budget_.available_bytes()) +
                                  " of " + std::to_string(budget_.limit_bytes()) + " bytes left");
  }
  return Status::Ok();
}

Status PagedKvCache::Append(int seq, int layer, int32_t n, const float* k, const float* v,
                            const int32_t* positions) {
  KVS_RETURN_IF_ERROR(CheckSeq("append", seq));
  KVS_RETURN_IF_ERROR(CheckLayer("append", layer));
  if (n < 0) return InvalidArgumentError("KV cache append: negative token count " + std::to_string(n));
  if (n == 0) return Status::Ok();
  if (k == nullptr || v == nullptr || positions == nullptr) {
    return InvalidArgumentError("KV cache append: null k, v or positions for " + std::to_string(n) + " tokens");
  }
  Layer& L = LayerOf(seq, layer);
  const int32_t P = page_size_;
  // Validate every table (one per head in a per-head layer) and count the pages before
  // writing anything, so a failed append leaves the cache unchanged.
  int64_t new_pages = 0;
  size_t new_bytes = 0;
  for (int h = 0; h < L.n_tables; ++h) {
    KVS_RETURN_IF_ERROR(CheckPositions(seq, layer, h, positions, n));
    new_bytes += TableAppendBytes(L, table(seq, layer, h), n, &new_pages);
  }
  if (!budget_.CanAfford(new_bytes)) return BudgetError("append", seq, layer, -1, new_pages, new_bytes);
  if (L.kivi) return AppendKivi(seq, layer, n, k, v, positions);

  const size_t row_values = static_cast<size_t>(geometry_.n_kv_heads) * geometry_.head_dim;
  for (int h = 0; h < L.n_tables; ++h) {
    Table& t = table(seq, layer, h);
    const int32_t room = static_cast<int32_t>(t.pages.size()) * P - t.n;
    if (room > 0 && L.pool->refcount(t.pages.back()) > 1) {
      // Copy-on-write: the partly filled last page is shared with another sequence.
      const PageId shared = t.pages.back();
      const int32_t fill = PageFill(t, t.pages.size() - 1);
      const PageId own = AllocatePage(L);
      CopySlots(L, shared, 0, own, 0, fill);
      L.live_slots += fill;
      ReleasePage(L, shared, fill);
      t.pages.back() = own;
      ++cow_pages_;
    }
    for (int32_t done = 0; done < n;) {
      if (t.n == static_cast<int32_t>(t.pages.size()) * P) t.pages.push_back(AllocatePage(L));
      const int32_t slot = t.n - static_cast<int32_t>(t.pages.size() - 1) * P;
      const int32_t chunk = std::min(n - done, P - slot);
      uint8_t* page = L.pool->data(t.pages.back());
      StoreRows(L, page, slot, chunk, k + done * row_values, v + done * row_values, L.per_head ? h : -1);
      std::memcpy(page + L.layout.positions_offset + slot * sizeof(int32_t), positions + done,
                  chunk * sizeof(int32_t));
      t.n += chunk;
      L.live_slots += chunk;
      done += chunk;
    }
  }
  return Status::Ok();
}

void PagedKvCache::FillSpans(const Layer& L, const Table& t, std::vector<KvSpan>* out) const {
  const bool int8 = HasTokenScales(L.storage);  // int8 or fp8
  out->clear();
  for (size_t i = 0; i < t.pages.size(); ++i) {
    const PageLayout& p = LayoutOf(L, t, i);
    const uint8_t* page = PoolOf(L, t, i)->data(t.pages[i]);
    const bool kivi_page = L.kivi && !IsResidualPage(L, t, i);  // the residual span has no scales
    KvSpan s;
    s.k = page + p.k_offset;
    s.v = page + p.v_offset;
    s.positions = reinterpret_cast<const int32_t*>(page + p.positions_offset);
    s.k_scale = int8 ? reinterpret_cast<const float*>(page + p.k_scale_offset) : nullptr;
    if (kivi_page && IsLowBitKivi(L.storage)) {  // f16 scales and mins
      s.k_group_scale = reinterpret_cast<const f16_bits*>(page + p.k_channel_scale_offset);
      s.k_group_min = reinterpret_cast<const f16_bits*>(page + p.k_channel_min_offset);
      s.v_group_scale = reinterpret_cast<const f16_bits*>(page + p.v_scale_offset);
      s.v_group_min = reinterpret_cast<const f16_bits*>(page + p.v_min_offset);
      s.v_group = kivi_v_group_;
      s.v_groups = geometry_.head_dim / kivi_v_group_;
    } else {
      s.v_scale = int8 || kivi_page ? reinterpret_cast<const float*>(page + p.v_scale_offset) : nullptr;
      s.k_channel_scale = kivi_page ? reinterpret_cast<const float*>(page + p.k_channel_scale_offset) : nullptr;
    }
    s.n = PageFill(t, i);
    out->push_back(s);
  }
}

void PagedKvCache::Spans(int seq, int layer, std::vector<KvSpan>* out) const {
  CheckSeqLayer("Spans", seq, layer);
  KVS_CHECK_MSG(!layers_[layer].per_head, "Spans: layer " + std::to_string(layer) +
                                              " keeps different tokens per KV head; read it with "
                                              "HeadSpans(seq, layer, kv_head)");
  FillSpans(LayerOf(seq, layer), table(seq, layer), out);
}

void PagedKvCache::HeadSpans(int seq, int layer, int kv_head, std::vector<KvSpan>* out) const {
  CheckSeqLayer("HeadSpans", seq, layer);
  KVS_CHECK_MSG(layers_[layer].per_head, "HeadSpans: layer " + std::to_string(layer) +
                                             " keeps the same tokens for every KV head; read it with Spans()");
  KVS_CHECK_MSG(kv_head >= 0 && kv_head < geometry_.n_kv_heads,
                "HeadSpans: kv head " + std::to_string(kv_head) + " out of range");
  FillSpans(LayerOf(seq, layer), table(seq, layer, kv_head), out);
}

int32_t PagedKvCache::NumTokens(int seq, int layer) const {
  CheckSeqLayer("NumTokens", seq, layer);
  int32_t most = 0;
  for (int h = 0; h < layers_[layer].n_tables; ++h) most = std::max(most, table(seq, layer, h).n);
  return most;
}

int32_t PagedKvCache::NumHeadTokens(int seq, int layer, int kv_head) const {
  CheckSeqLayer("NumHeadTokens", seq, layer);
  KVS_CHECK_MSG(kv_head >= 0 && kv_head < geometry_.n_kv_heads,
                "NumHeadTokens: kv head " + std::to_string(kv_head) + " out of range");
  return table(seq, layer, layers_[layer].per_head ? kv_head : 0).n;
}

void PagedKvCache::ClearTable(Table& t, Layer& L) {
  for (size_t i = 0; i < t.pages.size(); ++i) {
    if (IsResidualPage(L, t, i)) {
      ReleaseResidualPage(L, t.pages[i], PageFill(t, i));
    } else {
      ReleasePage(L, t.pages[i], PageFill(t, i));
    }
  }
  t.pages.clear();
  t.n = 0;
  t.quantized_pages = 0;
}

void PagedKvCache::ClearLayer(int seq, int layer) {
  Layer& L = LayerOf(seq, layer);
  for (int h = 0; h < L.n_tables; ++h) ClearTable(table(seq, layer, h), L);
}

void PagedKvCache::Clear(int seq) {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_, "Clear: seq " + std::to_string(seq) + " out of range");
  for (int layer = 0; layer < geometry_.n_layers; ++layer) ClearLayer(seq, layer);
}

PagedKvCache::EvictPlan PagedKvCache::CountKept(const Table& t, const uint8_t* keep) {
  EvictPlan plan;
  int32_t i = 0;
  while (i < t.n && keep[i]) ++i;
  if (i == t.n) return plan;  // keeps everything
  plan.first_drop = i;
  plan.n_keep = i;
  for (; i < t.n; ++i) plan.n_keep += keep[i] ? 1 : 0;
  return plan;
}

PagedKvCache::EvictPlan PagedKvCache::PlanEvict(const Table& t, const Layer& L, const uint8_t* keep) const {
  if (L.kivi) return PlanEvictKivi(t, L, keep);
  EvictPlan plan = CountKept(t, keep);
  if (plan.first_drop < 0) return plan;
  const int32_t dropped = t.n - plan.n_keep;
  if (plan.first_drop == 0 && dropped % page_size_ == 0 &&
      std::none_of(keep, keep + dropped, [](uint8_t k) { return k != 0; })) {
    plan.leading_pages = dropped / page_size_;
    return plan;
  }
  // Pages before the first dropped token are untouched (shared prefixes stay shared); each
  // page from there on that survives is rewritten, and must be copied first if shared.
  const int32_t P = page_size_;
  const int32_t new_count = (plan.n_keep + P - 1) / P;
  for (int32_t d = plan.first_drop / P; d < new_count; ++d) {
    if (L.pool->refcount(t.pages[d]) > 1) ++plan.fresh_pages;
  }
  return plan;
}

void PagedKvCache::ApplyEvict(Table& t, Layer& L, const uint8_t* keep, const EvictPlan& plan) {
  if (plan.first_drop < 0) return;
  if (L.kivi) return ApplyEvictKivi(t, L, keep, plan);
  const int32_t P = page_size_;
  if (plan.leading_pages > 0) {
    for (int32_t d = 0; d < plan.leading_pages; ++d) ReleasePage(L, t.pages[d], P);
    t.pages.erase(t.pages.begin(), t.pages.begin() + plan.leading_pages);
    t.n = plan.n_keep;
    return;
  }
  const int32_t n_old = t.n;
  const int32_t f = plan.first_drop;
  const int32_t first_page = f / P;
  const int32_t old_count = static_cast<int32_t>(t.pages.size());
  const int32_t new_count = (plan.n_keep + P - 1) / P;
  scratch_dest_.assign(t.pages.begin(), t.pages.end());  // old pages, read while t.pages is rewritten
  const std::vector<PageId>& old = scratch_dest_;

  // Destinations: exclusive pages are rewritten in place; shared ones are replaced by a copy
  // (only the untouched leading slots of the first page need copying; the rest is overwritten).
  for (int32_t d = first_page; d < new_count; ++d) {
    if (L.pool->refcount(old[d]) == 1) continue;
    const PageId own = AllocatePage(L);
    if (d == first_page && f % P > 0) CopySlots(L, old[d], 0, own, 0, f % P);
    t.pages[d] = own;
    ++cow_pages_;
  }

  // Stable compaction, run by run: destination index j never passes source index i, so a
  // forward copy never overwrites a survivor it has not moved yet.
  int32_t i = f, j = f;
  while (i < n_old) {
    if (!keep[i]) {
      ++i;
      continue;
    }
    int32_t run_end = i + 1;
    while (run_end < n_old && keep[run_end]) ++run_end;
    while (i < run_end) {
      const int32_t chunk = std::min({run_end - i, P - i % P, P - j % P});
      CopySlots(L, old[i / P], i % P, t.pages[j / P], j % P, chunk);
      i += chunk;
      j += chunk;
      moved_tokens_ += chunk;
    }
  }
  KVS_CHECK(j == plan.n_keep);

  auto old_fill = [&](int32_t d) { return d + 1 < old_count ? P : n_old - (old_count - 1) * P; };
  auto new_fill = [&](int32_t d) { return d + 1 < new_count ? P : plan.n_keep - (new_count - 1) * P; };
  for (int32_t d = first_page; d < old_count; ++d) {
    if (d < new_count) {
      if (t.pages[d] == old[d]) {
        L.live_slots += new_fill(d) - old_fill(d);
        continue;
      }
      L.live_slots += new_fill(d);  // the copy; the shared original keeps its slots for others
    }
    ReleasePage(L, old[d], old_fill(d));
  }
  t.pages.resize(new_count);
  t.n = plan.n_keep;
}

Status PagedKvCache::EvictTable(int seq, int layer, int head, const std::vector<uint8_t>& keep) {
  Layer& L = LayerOf(seq, layer);
  Table& t = table(seq, layer, head);
  const std::string where = "seq " + std::to_string(seq) + " layer " + std::to_string(layer) +
                            (L.per_head ? " kv head " + std::to_string(head) : std::string());
  if (keep.size() != static_cast<size_t>(t.n)) {
    return InvalidArgumentError("KV cache evict: " + where + ": keep mask has " + std::to_string(keep.size()) +
                                " entries but " + std::to_string(t.n) + " tokens are cached");
  }
  const EvictPlan plan = PlanEvict(t, L, keep.data());
  const size_t bytes = PlanBytes(L, plan);
  if (!budget_.CanAfford(bytes)) {
    return BudgetError("evict (copy of shared pages)", seq, layer, L.per_head ? head : -1, plan.fresh_pages, bytes);
  }
  ApplyEvict(t, L, keep.data(), plan);
  if (plan.first_drop >= 0) L.evicted_tokens += keep.size() - plan.n_keep;
  return Status::Ok();
}

Status PagedKvCache::Evict(int seq, int layer, const std::vector<uint8_t>& keep) {
  KVS_RETURN_IF_ERROR(CheckSeq("evict", seq));
  KVS_RETURN_IF_ERROR(CheckLayer("evict", layer));
  if (layers_[layer].per_head) {
    return InvalidArgumentError("KV cache evict: layer " + std::to_string(layer) +
                                " keeps tokens per KV head; evict each head with Evict(seq, layer, kv_head, keep)");
  }
  return EvictTable(seq, layer, 0, keep);
}

Status PagedKvCache::Evict(int seq, int layer, int kv_head, const std::vector<uint8_t>& keep) {
  KVS_RETURN_IF_ERROR(CheckSeq("evict", seq));
  KVS_RETURN_IF_ERROR(CheckLayer("evict", layer));
  if (!layers_[layer].per_head) {
    return InvalidArgumentError("KV cache evict: layer " + std::to_string(layer) +
                                " keeps the same tokens for every KV head; evict it with Evict(seq, layer, keep)");
  }
  if (kv_head < 0 || kv_head >= geometry_.n_kv_heads) {
    return InvalidArgumentError("KV cache evict: kv head " + std::to_string(kv_head) + " out of range [0, " +
                                std::to_string(geometry_.n_kv_heads) + ")");
  }
  return EvictTable(seq, layer, kv_head, keep);
}

Status PagedKvCache::RemoveRange(int seq, int32_t p0, int32_t p1) {
  KVS_RETURN_IF_ERROR(CheckSeq("remove-range", seq));
  const int32_t begin = std::max(p0, 0);
  const int32_t end = p1 < 0 ? INT32_MAX : p1;
  if (begin >= end) return Status::Ok();
  // Plan every table (every layer, every head of per-head layers) first so that a budget
  // failure leaves all of them unchanged. Tables are visited in their storage order.
  const size_t n_tables = tables_per_seq_;
  Table* tables = &tables_[static_cast<size_t>(seq) * tables_per_seq_];
  std::vector<EvictPlan> plans(n_tables);
  std::vector<size_t> mask_offset(n_tables);
  size_t total = 0;
  for (size_t i = 0; i < n_tables; ++i) {
    mask_offset[i] = total;
    total += tables[i].n;
  }
  scratch_keep_.resize(total);
  int64_t fresh_pages = 0;
  size_t fresh_bytes = 0;
  for (int l = 0; l < geometry_.n_layers; ++l) {
    const Layer& L = LayerOf(seq, l);
    for (int h = 0; h < L.n_tables; ++h) {
      const size_t ti = L.first_table + h;
      const Table& t = tables[ti];
      uint8_t* keep = scratch_keep_.data() + mask_offset[ti];
      for (size_t pi = 0; pi < t.pages.size(); ++pi) {
        const int32_t* pos = reinterpret_cast<const int32_t*>(PoolOf(L, t, pi)->data(t.pages[pi]) +
                                                              LayoutOf(L, t, pi).positions_offset);
        const int32_t fill = PageFill(t, pi);
        for (int32_t s = 0; s < fill; ++s) keep[pi * page_size_ + s] = (pos[s] < begin || pos[s] >= end) ? 1 : 0;
      }
      plans[ti] = PlanEvict(t, L, keep);
      fresh_pages += plans[ti].fresh_pages;
      fresh_bytes += PlanBytes(L, plans[ti]);
    }
  }
  if (!budget_.CanAfford(fresh_bytes)) {
    return BudgetError("remove-range (copy of shared pages)", seq, -1, -1, fresh_pages, fresh_bytes);
  }
  for (int l = 0; l < geometry_.n_layers; ++l) {
    Layer& L = LayerOf(seq, l);
    for (int h = 0; h < L.n_tables; ++h) {
      const size_t ti = L.first_table + h;
      const int32_t n_before = tables[ti].n;
      ApplyEvict(tables[ti], L, scratch_keep_.data() + mask_offset[ti], plans[ti]);
      L.removed_tokens += n_before - tables[ti].n;
    }
  }
  return Status::Ok();
}

Status PagedKvCache::Fork(int src, int dst) {
  KVS_RETURN_IF_ERROR(CheckSeq("fork (source)", src));
  KVS_RETURN_IF_ERROR(CheckSeq("fork (destination)", dst));
  if (src == dst) return Status::Ok();
  for (int l = 0; l < geometry_.n_layers; ++l) ClearLayer(dst, l);
  seq_profile_[dst] = seq_profile_[src];
  for (int l = 0; l < geometry_.n_layers; ++l) {
    const Layer& L = LayerOf(src, l);
    for (int h = 0; h < L.n_tables; ++h) {
      const Table& from = table(src, l, h);
      Table& to = table(dst, l, h);
      to.pages = from.pages;
      to.n = from.n;
      to.quantized_pages = from.quantized_pages;
      for (size_t i = 0; i < to.pages.size(); ++i) PoolOf(L, to, i)->Retain(to.pages[i]);
    }
  }
  return Status::Ok();
}

int PagedKvCache::AddSequence() {
  KVS_CHECK_MSG(n_seqs_ < INT32_MAX / 2, "AddSequence: too many sequences");
  ++n_seqs_;
  tables_.resize(static_cast<size_t>(n_seqs_) * tables_per_seq_);
  seq_profile_.push_back(0);
  return n_seqs_ - 1;
}

Status PagedKvCache::KeepOnly(int seq) {
  KVS_RETURN_IF_ERROR(CheckSeq("keep-only", seq));
  for (int s = 0; s < n_seqs_; ++s) {
    if (s != seq) Clear(s);
  }
  return Status::Ok();
}

size_t PagedKvCache::LayerAllocatedBytes(int layer) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers);
  size_t bytes = 0;
  for (int profile = 0; profile < n_profiles(); ++profile) {
    const Layer& L = layers_[profile * geometry_.n_layers + layer];
    bytes += static_cast<size_t>(L.pages) * L.layout.page_bytes +
             static_cast<size_t>(L.residual_pages) * L.residual_layout.page_bytes;
  }
  return bytes;
}

size_t PagedKvCache::LayerLiveBytes(int layer) const { return LayerLiveBytesByPart(layer).total(); }

KvLiveBytesByPart PagedKvCache::LayerLiveBytesByPart(int layer) const {
  KVS_CHECK(layer >= 0 && layer < geometry_.n_layers);
  KvLiveBytesByPart bytes;
  for (int profile = 0; profile < n_profiles(); ++profile) {
    const Layer& L = layers_[profile * geometry_.n_layers + layer];
    const size_t slots = static_cast<size_t>(L.live_slots);
    const size_t values = static_cast<size_t>(geometry_.StoredRows()) * L.layout.row_bytes, position = sizeof(int32_t);
    bytes.values += slots * values;
    bytes.positions += slots * position;
    // Per-slot scales (int8, fp8: K and V; KIVI: V's scale and min), and each quantized KIVI
    // page's K channel scales (and mins), live with it.
    bytes.scales +=
        slots * (L.layout.token_bytes - values - position) + static_cast<size_t>(L.pages) * L.layout.page_scale_bytes;
    bytes.residual += static_cast<size_t>(L.residual_slots) * L.residual_layout.token_bytes;
  }
  return bytes;
}

KvLiveBytesByPart PagedKvCache::LiveBytesByPart() const {
  KvLiveBytesByPart bytes;
  for (int l = 0; l < geometry_.n_layers; ++l) bytes.Add(LayerLiveBytesByPart(l));
  return bytes;
}

size_t PagedKvCache::SequenceLiveBytes(int seq) const {
  KVS_CHECK_MSG(seq >= 0 && seq < n_seqs_, "SequenceLiveBytes: seq " + std::to_string(seq) + " out of range");
  size_t bytes = 0;
  for (int l = 0; l < geometry_.n_layers; ++l) {
    const Layer& L = LayerOf(seq, l);
    const size_t channel_scale_bytes = L.layout.page_scale_bytes;  // KIVI quantized pages
    for (int h = 0; h < L.n_tables; ++h) {
      const Table& t = table(seq, l, h);
      for (size_t i = 0; i < t.pages.size(); ++i) {
        const bool residual = IsResidualPage(L, t, i);
        bytes += static_cast<size_t>(PageFill(t, i)) * (residual ? L.residual_layout : L.layout).token_bytes +
                 (residual ? 0 : channel_scale_bytes);
      }
    }
  }
  return bytes;
}

size_t PagedKvCache::AllocatedBytes() const {
  size_t bytes = 0;
  for (int l = 0; l < geometry_.n_layers; ++l) bytes += LayerAllocatedBytes(l);
  return bytes;
}

size_t PagedKvCache::LiveBytes() const {
  size_t bytes = 0;
  for (int l = 0; l < geometry_.n_layers; ++l) bytes += LayerLiveBytes(l);
  return bytes;
}

PagedKvStats PagedKvCache::Stats() const {
  PagedKvStats s;
  s.page_size = page_size_;
  s.budget_bytes = budget_.limit_bytes();
  for (int l = 0; l < geometry_.n_layers; ++l) {
    const Layer& L = layers_[l];
    PagedKvLayerStats ls;
    ls.storage = L.storage;
    ls.per_head = L.per_head;
    ls.tables_per_seq = L.n_tables;
    ls.page_bytes = L.layout.page_bytes;
    ls.token_bytes = L.layout.token_bytes;
    for (int profile = 0; profile < n_profiles(); ++profile) {
      const Layer& P = layers_[profile * geometry_.n_layers + l];
      ls.pages += P.pages + P.residual_pages;
      ls.live_tokens += P.live_slots + P.residual_slots;
      ls.residual_pages += P.residual_pages;
      ls.residual_tokens += P.residual_slots;
      ls.evicted_tokens += P.evicted_tokens;
      ls.removed_tokens += P.removed_tokens;
    }
    ls.allocated_bytes = LayerAllocatedBytes(l);
    ls.live_bytes = LayerLiveBytes(l);
    s.allocated_bytes += ls.allocated_bytes;
    s.live_bytes += ls.live_bytes;
    s.evicted_tokens += ls.evicted_tokens;
    s.removed_tokens += ls.removed_tokens;
    s.layers.push_back(ls);
  }
  s.fragmentation_bytes = s.allocated_bytes - s.live_bytes;
  s.pages_in_use = pages_in_use_;
  s.peak_pages_in_use = peak_pages_in_use_;
  s.peak_allocated_bytes = budget_.peak_bytes();
  s.moved_tokens = moved_tokens_;
  s.cow_pages = cow_pages_;
  s.rerotated_tokens = rerotated_tokens_;
  return s;
}

void PagedKvCache::CheckInvariants() const {
  // Per pool: references found in the tables, the fill each referencer sees, and the owning
  // table (its index among a sequence's tables: one (layer, head)).
  struct PoolView {
    std::vector<int32_t> refs, fill;
    std::vector<int64_t> owner;
  };
  std::vector<PoolView> views(pools_.size());
  for (size_t i = 0; i < pools_.size(); ++i) {
    const size_t touched = static_cast<size_t>(pools_[i]->pages_touched());
    views[i].refs.assign(touched, 0);
    views[i].fill.assign(touched, -1);
    views[i].owner.assign(touched, -1);
  }
  const int n_layers = geometry_.n_layers;
  std::vector<int> table_layer(tables_per_seq_);
  for (int l = 0; l < n_layers; ++l) {
    for (int h = 0; h < layers_[l].n_tables; ++h) table_layer[layers_[l].first_table + h] = l;
  }
  for (size_t fl = 0; fl < layers_.size(); ++fl) {
    const Layer& L = layers_[fl];
    const Layer& base = layers_[L.index];
    KVS_CHECK(L.index == static_cast<int>(fl) % n_layers);
    KVS_CHECK(L.n_tables == (L.per_head ? geometry_.n_kv_heads : 1));
    KVS_CHECK(L.per_head == base.per_head && L.first_table == base.first_table);
    KVS_CHECK(L.pool == pools_[L.pool_index].get());
  }
  KVS_CHECK(seq_profile_.size() == static_cast<size_t>(n_seqs_));
  for (int seq = 0; seq < n_seqs_; ++seq) {
    const int profile = seq_profile_[seq];
    KVS_CHECK(profile >= 0 && profile < n_profiles());
    for (size_t ti = 0; ti < tables_per_seq_; ++ti) {
      const Table& t = tables_[static_cast<size_t>(seq) * tables_per_seq_ + ti];
      const int l = table_layer[ti];
      const Layer& L = LayerOf(seq, l);
      // A page belongs to one (profile, layer, head) table position.
      const int64_t owner = static_cast<int64_t>(profile) * static_cast<int64_t>(tables_per_seq_) +
                            static_cast<int64_t>(ti);
      KVS_CHECK(t.n >= 0);
      KVS_CHECK(t.pages.size() == static_cast<size_t>((t.n + page_size_ - 1) / page_size_));
      KVS_CHECK(L.kivi ? t.quantized_pages >= QuantizedPagesFor(t.n) && t.quantized_pages <= t.n / page_size_
                       : t.quantized_pages == 0);
      bool has_prev = false;
      int32_t prev = 0;
      for (size_t i = 0; i < t.pages.size(); ++i) {
        PoolView& view = views[IsResidualPage(L, t, i) ? L.residual_pool_index : L.pool_index];
        const PageId id = t.pages[i];
        KVS_CHECK(id < view.refs.size());
        const int32_t fill = PageFill(t, i);
        KVS_CHECK(fill >= 1 && fill <= page_size_);
        ++view.refs[id];
        KVS_CHECK_MSG(view.fill[id] < 0 || view.fill[id] == fill, "shared page seen with different fills");
        KVS_CHECK_MSG(view.owner[id] < 0 || view.owner[id] == owner,
                      "page shared across tables of different (storage profile, layer, kv head)");
        view.fill[id] = fill;
        view.owner[id] = owner;
        const int32_t* pos =
            reinterpret_cast<const int32_t*>(PoolOf(L, t, i)->data(id) + LayoutOf(L, t, i).positions_offset);
        for (int32_t s = 0; s < fill; ++s) {
          KVS_CHECK_MSG(pos[s] >= 0 && (!has_prev || pos[s] > prev), "positions not ascending");
          prev = pos[s];
          has_prev = true;
        }
      }
    }
  }
  // Indexed by flat layer (profile * n_layers + layer), as layers_.
  std::vector<int64_t> layer_pages(layers_.size(), 0), layer_slots(layers_.size(), 0);
  std::vector<int64_t> residual_pages(layers_.size(), 0), residual_slots(layers_.size(), 0);
  int64_t total_in_use = 0;
  size_t total_bytes = 0;
  for (size_t i = 0; i < pools_.size(); ++i) {
    int64_t distinct = 0;
    for (size_t id = 0; id < views[i].refs.size(); ++id) {
      KVS_CHECK_MSG(views[i].refs[id] == pools_[i]->refcount(static_cast<PageId>(id)),
                    "pool '" + pools_[i]->name() + "' page " + std::to_string(id) + ": refcount " +
                        std::to_string(pools_[i]->refcount(static_cast<PageId>(id))) + " but " +
                        std::to_string(views[i].refs[id]) + " table references");
      if (views[i].refs[id] == 0) continue;
      ++distinct;
      const int64_t owner = views[i].owner[id];
      const size_t tables = tables_per_seq_;
      const size_t l = static_cast<size_t>(owner) / tables * static_cast<size_t>(n_layers) +
                       static_cast<size_t>(table_layer[static_cast<size_t>(owner) % tables]);
      const bool residual = layers_[l].kivi && static_cast<int>(i) == layers_[l].residual_pool_index;
      ++(residual ? residual_pages : layer_pages)[l];
      (residual ? residual_slots : layer_slots)[l] += views[i].fill[id];
    }
    KVS_CHECK(distinct == pools_[i]->pages_in_use());
    total_in_use += distinct;
    total_bytes += pools_[i]->bytes_in_use();
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    KVS_CHECK_MSG(layer_pages[l] == layers_[l].pages, "layer " + std::to_string(l) + " page count");
    KVS_CHECK_MSG(layer_slots[l] == layers_[l].live_slots, "layer " + std::to_string(l) + " live slots");
    KVS_CHECK_MSG(residual_pages[l] == layers_[l].residual_pages, "layer " + std::to_string(l) + " residual pages");
    KVS_CHECK_MSG(residual_slots[l] == layers_[l].residual_slots, "layer " + std::to_string(l) + " residual slots");
  }
  KVS_CHECK(total_in_use == pages_in_use_);
  KVS_CHECK(total_bytes == budget_.used_bytes());
}

}  // namespace kvsparse
