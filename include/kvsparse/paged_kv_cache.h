// PagedKvCache: the KvCache that really shrinks. Tokens of each (sequence, layer) live in
// fixed-size pages listed by a page table; eviction frees slots and compacts the table so
// memory in use follows the live tokens. Sequences can share pages (Fork) with copy-on-write.
//
// Page layout (one layer, page_size P tokens, H kv heads, D head_dim, storage type s),
// each section 64-byte aligned:
//   K        [P, H, D] in s         V        [P, H, D] in s
//   positions [P] int32
//   k_scale  [P, H] f32             v_scale  [P, H] f32      (int8 layers only)
// Invariant per table: pages = ceil(n / P); every page but the last is full; positions ascend.
// Pages shared by several tables hold the same filled slots for all of them and are never
// written: an append into, or an eviction inside, a shared page copies it first.
//
// Memory: one PagePool per storage type in use (page sizes differ), all charged to one
// PageBudget (budget_bytes), so the budget bounds every layer's pages together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/page_pool.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct PagedKvCacheOptions {
  int n_seqs = 1;
  int32_t page_size = 16;  // tokens per page
  size_t budget_bytes = 0;  // every page of every layer together (K, V, positions, scales)
  // One storage type per layer, or a single entry for all layers.
  std::vector<KvStorage> layer_storage = {KvStorage::kF16};
};

struct PagedKvLayerStats {
  KvStorage storage = KvStorage::kF16;
  size_t page_bytes = 0;
  size_t token_bytes = 0;       // K + V + position (+ scales) of one token
  int64_t pages = 0;            // distinct pages in use by this layer
  int64_t live_tokens = 0;      // distinct filled slots (a shared page counts once)
  size_t allocated_bytes = 0;   // pages * page_bytes
  size_t live_bytes = 0;        // live_tokens * token_bytes
  int64_t evicted_tokens = 0;   // dropped by Evict
  int64_t removed_tokens = 0;   // dropped by RemoveRange
};

struct PagedKvStats {
  std::vector<PagedKvLayerStats> layers;
  int32_t page_size = 0;
  size_t budget_bytes = 0;
  size_t allocated_bytes = 0;
  size_t live_bytes = 0;
  size_t fragmentation_bytes = 0;  // allocated - live: unfilled slots of last pages + section padding
  int64_t pages_in_use = 0;
  int64_t peak_pages_in_use = 0;   // over all pools together
  size_t peak_allocated_bytes = 0;
  int64_t evicted_tokens = 0;
  int64_t removed_tokens = 0;
  int64_t moved_tokens = 0;        // copied by compaction
  int64_t cow_pages = 0;           // pages copied because they were shared
};

class PagedKvCache final : public KvCache {
 public:
  static StatusOr<std::unique_ptr<PagedKvCache>> Create(const KvGeometry& geometry,
                                                        const PagedKvCacheOptions& options);
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  // Layer 0's storage (every layer's when uniform); mixed caches answer per layer_storage().
  KvStorage storage() const override { return layers_[0].storage; }
  KvStorage layer_storage(int layer) const override;
  const KvGeometry& geometry() const override { return geometry_; }
  // ResourceExhausted (cache unchanged) when the pages it needs exceed the budget.
  Status Append(int seq, int layer, int32_t n, const float* k, const float* v, const int32_t* positions) override;
  // One span per page, n = the page's filled slots; no allocation beyond *out's capacity.
  void Spans(int seq, int layer, std::vector<KvSpan>* out) const override;
  int32_t NumTokens(int seq, int layer) const override;
  void Clear(int seq) override;
  size_t AllocatedBytes() const override;
  size_t LiveBytes() const override;

  // Keeps token i of (seq, layer)'s live list iff keep[i] != 0 (keep.size() == NumTokens,
  // else InvalidArgument). Survivors keep their order and positions and are compacted so every
  // page but the last is full; emptied pages return to the pool. Copying a shared page can need
  // new pages: ResourceExhausted then, with the cache unchanged.
  Status Evict(int seq, int layer, const std::vector<uint8_t>& keep);
  // Drops tokens with position in [p0, p1) from every layer of seq (p0 < 0: from 0; p1 < 0: to the end).
  Status RemoveRange(int seq, int32_t p0, int32_t p1);
  // dst becomes a copy of src (dst's own tokens are dropped first) sharing src's pages.
  Status Fork(int src, int dst);
  // Drops every sequence but seq.
  Status KeepOnly(int seq);

  size_t LayerAllocatedBytes(int layer) const;
  size_t LayerLiveBytes(int layer) const;
  size_t FragmentationBytes() const { return AllocatedBytes() - LiveBytes(); }
  PagedKvStats Stats() const;

  int n_seqs() const { return n_seqs_; }
  int32_t page_size() const { return page_size_; }
  size_t page_bytes(int layer) const;
  size_t token_bytes(int layer) const;
  const PageBudget& budget() const { return budget_; }
  int64_t pages_in_use() const { return pages_in_use_; }

  // Test hook: walks every table and aborts (KVS_CHECK) unless pool reference counts equal the
  // table references, pool usage equals the distinct pages referenced, per-layer counters match
  // and positions ascend.
  void CheckInvariants() const;

 private:
  struct PageLayout {
    size_t k_offset = 0, v_offset = 0, positions_offset = 0, k_scale_offset = 0, v_scale_offset = 0;
    size_t page_bytes = 0;
    size_t row_bytes = 0;    // one token's K (or V): n_kv_heads * head_dim values
    size_t token_bytes = 0;  // K + V + position + scales of one token
  };
  struct Layer {
    KvStorage storage = KvStorage::kF16;
    PagePool* pool = nullptr;
    PageLayout layout;
    int64_t pages = 0;        // distinct pages held
    int64_t live_slots = 0;   // distinct filled slots
    int64_t evicted_tokens = 0;
    int64_t removed_tokens = 0;
  };
  struct Table {
    std::vector<PageId> pages;  // [ceil(n / page_size)]
    int32_t n = 0;
  };
  // What an eviction of one table will do, computed before anything changes.
  struct EvictPlan {
    int32_t first_drop = -1;  // -1: nothing to drop
    int32_t n_keep = 0;
    int64_t fresh_pages = 0;  // shared pages that must be copied
  };

  PagedKvCache(const KvGeometry& geometry, const PagedKvCacheOptions& options, size_t budget_bytes);
  Table& table(int seq, int layer) { return tables_[static_cast<size_t>(seq) * geometry_.n_layers + layer]; }
  const Table& table(int seq, int layer) const {
    return tables_[static_cast<size_t>(seq) * geometry_.n_layers + layer];
  }
  Status CheckSeq(const char* op, int seq) const;
  int32_t PageFill(const Table& t, size_t page_index) const;
  PageId AllocatePage(int layer);  // budget already checked
  void ReleasePage(int layer, PageId id, int32_t fill);
  Status BudgetError(const char* op, int seq, int layer, int64_t pages, size_t bytes) const;
  // Moves `count` slots between pages (memmove: ranges may overlap within one page).
  void CopySlots(const Layer& L, PageId src, int32_t src_slot, PageId dst, int32_t dst_slot, int32_t count);
  EvictPlan PlanEvict(const Table& t, const Layer& L, const uint8_t* keep) const;
  void ApplyEvict(int seq, int layer, const uint8_t* keep, const EvictPlan& plan);
  void ClearTable(int seq, int layer);

  KvGeometry geometry_;
  int n_seqs_;
  int32_t page_size_;
  PageBudget budget_;                             // declared before pools_: they refund into it
  std::unique_ptr<PagePool> pools_[3];            // indexed by KvStorage
  std::vector<Layer> layers_;                     // [n_layers]
  std::vector<Table> tables_;                     // [n_seqs, n_layers]
  int64_t pages_in_use_ = 0;
  int64_t peak_pages_in_use_ = 0;
  int64_t moved_tokens_ = 0;
  int64_t cow_pages_ = 0;
  std::vector<PageId> scratch_dest_;              // Evict: destination pages
  std::vector<uint8_t> scratch_keep_;             // RemoveRange: keep mask of one layer
};

}  // namespace kvsparse
