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
//
// Per-head layers (opt-in, layer_per_head): one table per (sequence, layer, kv head), so a
// policy may keep different tokens per head. Their pages hold a single head, H = 1 above:
//   K [P, 1, D], V [P, 1, D], positions [P], (int8) k_scale, v_scale [P, 1]
// Append splits each token's [n_kv_heads, head_dim] row into the head tables; every head
// table stores its own positions. Such a layer counts slots per (token, head): its
// token_bytes is one head's K + V + position (+ 2 scales), so live bytes stay exact and
// include the n_kv_heads position copies a token costs there.
// KIVI layers (int8_kivi, int4_kivi, int2_kivi; Liu et al. 2024) store full pages quantized and
// the last, partly filled page in full precision, with the whole pages of the newest
// kivi_residual tokens (the residual window):
//   int8_kivi page: K int8 [P, H, D], V int8 [P, H, D], positions [P], v_scale [P, H] f32,
//                   k_channel_scale [H, D] f32 (K value = k_channel_scale[h, d] * q: one scale
//                   per (page, kv head, channel)); V is per (token, kv head) as int8.
//   int4 / int2 page: K, V codes [P, H, D * bits / 8] packed, positions [P], v_scale and v_min
//                   [P, H, D / G] f16, k_scale and k_min [H, D] f16 (G = kivi_v_group channels
//                   per V group; K is per (page, kv head, channel), its group the page's P tokens).
//   residual page: the f16 layout above (kKiviResidualStorage), from the f16 pool.
// A residual page is quantized, as one group, once kivi_residual newer tokens follow it (with
// kivi_residual 0: when it fills); every key is quantized once with the scales of its whole
// page. Eviction compaction regroups tokens: the rewritten pages
// are dequantized and requantized (per-channel K) from their new group, which adds at most half
// a step of the new scale per K element (and at most f16 rounding to a V moved back into the
// residual); tokens before the first dropped one keep their pages and codes.
// Pages shared by several tables hold the same filled slots for all of them and are never
// written: an append into, or an eviction inside, a shared page copies it first.
//
// Memory: one PagePool per storage type in use (page sizes differ), all charged to one
// PageBudget (budget_bytes), so the budget bounds every layer's pages together.
//
// Storage per sequence: a sequence may store its layers in other types than the cache's
// (SetSequenceStorage, while it holds no token), e.g. one request on int8 pages beside others
// on f16. Each distinct list of layer types is a storage profile (profile 0: the options');
// a profile's layers have their own layouts and counters and draw on the shared pools and
// budget. per-head flags are the cache's for every profile. Pages are shared (Fork) only
// between sequences of one profile: Fork gives the destination its source's profile.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/page_pool.h"
#include "kvsparse/status.h"

namespace kvsparse {

// Rotates n_rows key rows in place by `delta` RoPE positions (delta may be negative). RoPE
// composes, so a key rotated at p and then by delta is the key rotated at p + delta. The cache
// knows no model: the engine passes its RoPE (frequencies, style) in this callback.
// k: [n_rows, head_dim] f32.
using KeyRotateFn = std::function<void(float* k, int64_t n_rows, int32_t delta)>;

struct PagedKvCacheOptions {
  int n_seqs = 1;  // sequences at creation (0 allowed: AddSequence adds more)
  int32_t page_size = 16;  // tokens per page
  size_t budget_bytes = 0;  // every page of every layer together (K, V, positions, scales)
  // One storage type per layer, or a single entry for all layers.
  std::vector<KvStorage> layer_storage = {KvStorage::kF16};
  // Per layer, or a single entry for all layers (empty: none): nonzero makes the layer
  // per-head (one table per kv head, single-head pages; see above).
  std::vector<uint8_t> layer_per_head = {0};
  // KIVI layers: the newest kivi_residual tokens of a table stay in f16 on whole pages besides
  // the partly filled one (a multiple of page_size; 0: only the partly filled page). KIVI's
  // residual length R: a page is quantized once R newer tokens follow it.
  int32_t kivi_residual = 0;
  // int4 / int2 KIVI: channels of a (token, kv head) V row sharing one scale and min (KIVI's
  // group size, 32 in its code); it must divide head_dim and be a multiple of 4. 0: the whole row.
  int32_t kivi_v_group = 0;
};

// In a per-head layer a slot is one (token, kv head): token_bytes, live_tokens and the
// evicted / removed counts are per head slot, summed over the layer's heads. Counts and bytes
// cover every storage profile; storage, page_bytes and token_bytes are the cache's own (profile 0).
struct PagedKvLayerStats {
  KvStorage storage = KvStorage::kF16;
  bool per_head = false;
  int32_t tables_per_seq = 1;   // 1, or n_kv_heads for a per-head layer
  size_t page_bytes = 0;
  size_t token_bytes = 0;       // K + V + position (+ scales) of one slot
  int64_t pages = 0;            // distinct pages in use by this layer
  int64_t live_tokens = 0;      // distinct filled slots (a shared page counts once)
  size_t allocated_bytes = 0;   // pages * page_bytes
  size_t live_bytes = 0;        // live_tokens * token_bytes (int8_kivi: see residual_* below)
  // int8_kivi: full-precision residual pages and slots (included in pages, live_tokens and the
  // bytes); live bytes also count each quantized page's K channel scales.
  int64_t residual_pages = 0;
  int64_t residual_tokens = 0;
  int64_t evicted_tokens = 0;   // dropped by Evict
  int64_t removed_tokens = 0;   // dropped by RemoveRange
};

// Live bytes by what they hold. Quantized and full-precision slots count their K and V elements
// (codes, or f16 / f32 values), their scales and zero points (per (token, head), and a KIVI
// page's per-channel K scales and mins) and their int32 position; a KIVI layer's f16 residual
// slots count whole (K, V and position).
struct KvLiveBytesByPart {
  size_t values = 0;
  size_t scales = 0;
  size_t positions = 0;
  size_t residual = 0;
  size_t total() const { return values + scales + positions + residual; }
  void Add(const KvLiveBytesByPart& other) {
    values += other.values;
    scales += other.scales;
    positions += other.positions;
    residual += other.residual;
  }
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
  int64_t rerotated_tokens = 0;    // slots whose key RenumberPositions re-rotated
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
  KvStorage sequence_storage(int seq, int layer) const override;
  // Stores seq's layers in `layer_storage` (one type per layer, or one for all) from now on.
  // seq must hold no token; InvalidArgument otherwise, or on a bad list.
  Status SetSequenceStorage(int seq, std::span<const KvStorage> layer_storage);
  const KvGeometry& geometry() const override { return geometry_; }
  // ResourceExhausted (cache unchanged) when the pages it needs exceed the budget. A per-head
  // layer stores head h of every token in table h; positions must follow each head's last.
  Status Append(int seq, int layer, int32_t n, const float* k, const float* v, const int32_t* positions) override;
  // Sums the pages every plan needs (as Append counts them, int8_kivi at its peak) against the budget.
  Status CheckAppend(std::span<const KvAppendPlan> plans, const uint8_t* relative_positions) const override;
  // Bytes appending n tokens to every table of seq would allocate now (int8_kivi: the peak).
  size_t AppendBytes(int seq, int32_t n) const;
  // One span per page, n = the page's filled slots; no allocation beyond *out's capacity.
  // Aborts on a per-head layer (use HeadSpans).
  void Spans(int seq, int layer, std::vector<KvSpan>* out) const override;
  // On a per-head layer: the largest head table.
  int32_t NumTokens(int seq, int layer) const override;
  bool per_head(int layer) const override;
  // One span per page of head kv_head's table ([n, 1, head_dim]); aborts on a shared layer.
  void HeadSpans(int seq, int layer, int kv_head, std::vector<KvSpan>* out) const override;
  int32_t NumHeadTokens(int seq, int layer, int kv_head) const override;
  void Clear(int seq) override;
  size_t AllocatedBytes() const override;
  size_t LiveBytes() const override;

  // Keeps token i of (seq, layer)'s live list iff keep[i] != 0 (keep.size() == NumTokens,
  // else InvalidArgument). Survivors keep their order and positions and are compacted so every
  // page but the last is full; emptied pages return to the pool. Copying a shared page can need
  // new pages: ResourceExhausted then, with the cache unchanged.
  // InvalidArgument on a per-head layer (evict each head with the overload below).
  Status Evict(int seq, int layer, const std::vector<uint8_t>& keep);
  // The same for one head table of a per-head layer (keep.size() == NumHeadTokens);
  // InvalidArgument on a shared layer.
  Status Evict(int seq, int layer, int kv_head, const std::vector<uint8_t>& keep);
  // Drops tokens with position in [p0, p1) from every table (layer, and head of per-head
  // layers) of seq (p0 < 0: from 0; p1 < 0: to the end).
  Status RemoveRange(int seq, int32_t p0, int32_t p1);
  // dst becomes a copy of src (dst's own tokens are dropped first) sharing src's pages, in
  // every table, and takes src's storage profile.
  Status Fork(int src, int dst);
  // Drops every sequence but seq.
  Status KeepOnly(int seq);
  // A new, empty sequence (id n_seqs() before the call) in the cache's storage types. Empty
  // tables cost no pages.
  int AddSequence();
  // Renumbers the tokens of a table to positions 0..n-1 in order (StreamingLLM's positions
  // within the cache) and rotates each renumbered token's K by (new - old) position with
  // `rotate`; V is untouched. kv_head < 0: every table of the layer; kv_head >= 0: that head's
  // table of a per-head layer. f16 / int8 keys are converted to f32, rotated and stored back
  // (int8: a fresh per-row scale; int8_kivi: the page's channel scales are recomputed), which
  // costs one more rounding each time. Pages before the first renumbered token are untouched;
  // a shared page that changes is copied first (ResourceExhausted, cache unchanged, when the
  // copies exceed the budget). *rotated (optional) gets the number of slots rotated.
  Status RenumberPositions(int seq, int layer, int kv_head, const KeyRotateFn& rotate, int64_t* rotated = nullptr);
  // Position of the last token of (seq, layer)'s table (head kv_head's in a per-head layer),
  // -1 when it is empty.
  int32_t LastTokenPosition(int seq, int layer, int kv_head = 0) const;

  // Every profile's pages of the layer together.
  size_t LayerAllocatedBytes(int layer) const;
  size_t LayerLiveBytes(int layer) const;  // LayerLiveBytesByPart(layer).total()
  KvLiveBytesByPart LayerLiveBytesByPart(int layer) const;
  KvLiveBytesByPart LiveBytesByPart() const;  // every layer's
  // Live bytes of seq's tables (a page shared with other sequences counts in each), in its
  // own storage: slots × token bytes, int8_kivi channel scales per quantized page.
  size_t SequenceLiveBytes(int seq) const;
  size_t FragmentationBytes() const { return AllocatedBytes() - LiveBytes(); }
  PagedKvStats Stats() const;

  int n_seqs() const { return n_seqs_; }
  int32_t page_size() const { return page_size_; }
  // The cache's own layout (profile 0).
  size_t page_bytes(int layer) const;
  size_t token_bytes(int layer) const;     // per (token, head) slot in a per-head layer
  // Bytes one table of `layer` stored as `storage` may hold for max_tokens tokens: its full
  // pages, a partly filled (int8_kivi: residual) page and one more page in flight while a page
  // is rewritten.
  size_t TableReserveBytes(int layer, int32_t max_tokens, KvStorage storage) const;
  size_t TableReserveBytes(int layer, int32_t max_tokens) const {
    return TableReserveBytes(layer, max_tokens, layer_storage(layer));
  }
  int32_t tables_per_seq(int layer) const;  // 1, or n_kv_heads for a per-head layer
  const PageBudget& budget() const { return budget_; }
  int64_t pages_in_use() const { return pages_in_use_; }

  // Test hook: walks every table and aborts (KVS_CHECK) unless pool reference counts equal the
  // table references, pool usage equals the distinct pages referenced, per-layer counters match,
  // no page is shared between tables of different (layer, head), and positions ascend.
  void CheckInvariants() const;

 private:
  struct PageLayout {
    size_t k_offset = 0, v_offset = 0, positions_offset = 0, k_scale_offset = 0, v_scale_offset = 0;
    size_t k_channel_scale_offset = 0;  // KIVI: [row_heads, head_dim] f32 (int4 / int2: f16)
    size_t k_channel_min_offset = 0;    // int4 / int2 KIVI: [row_heads, head_dim] f16
    size_t v_min_offset = 0;            // int4 / int2 KIVI: [page_size, row_heads, head_dim / G] f16
    size_t page_scale_bytes = 0;        // KIVI: bytes per quantized page for K's channel scales (and mins)
    size_t page_bytes = 0;
    int row_heads = 0;       // heads in one stored row: n_kv_heads, or 1 in a per-head layer
    size_t row_bytes = 0;    // one slot's K (or V): row_heads * head_dim values
    size_t token_bytes = 0;  // K + V + position + scales of one slot
  };
  // One layer of one storage profile.
  struct Layer {
    int index = 0;            // the model layer
    KvStorage storage = KvStorage::kF16;
    bool per_head = false;
    int n_tables = 1;         // tables per sequence: 1, or n_kv_heads when per_head
    size_t first_table = 0;   // index of the layer's first table among a sequence's tables
    int pool_index = 0;       // into pools_
    PagePool* pool = nullptr;
    PageLayout layout;
    int64_t pages = 0;        // distinct pages held
    int64_t live_slots = 0;   // distinct filled slots
    int64_t evicted_tokens = 0;
    int64_t removed_tokens = 0;
    // int8_kivi: the residual pages' pool and layout (f16), and their counters.
    bool kivi = false;
    int residual_pool_index = -1;
    PagePool* residual_pool = nullptr;
    PageLayout residual_layout;
    int64_t residual_pages = 0;
    int64_t residual_slots = 0;
  };
  struct Table {
    std::vector<PageId> pages;  // [ceil(n / page_size)]
    int32_t n = 0;
    // KIVI layers: pages [0, quantized_pages) are quantized, the rest residual (f16), with
    // QuantizedPagesFor(n) <= quantized_pages <= n / page_size (an eviction may leave the
    // window shorter than kivi_residual; it never requantizes a page to lengthen it).
    int32_t quantized_pages = 0;
  };
  // What an eviction of one table will do, computed before anything changes.
  struct EvictPlan {
    int32_t first_drop = -1;  // -1: nothing to drop
    int32_t n_keep = 0;
    int64_t fresh_pages = 0;  // shared pages that must be copied (int8_kivi: every new page)
    size_t fresh_bytes = 0;   // int8_kivi: bytes the rewrite needs beyond those it frees first
    // > 0: the drop is exactly the table's first leading_pages whole pages (a sliding window
    // moving on), released without moving a token.
    int32_t leading_pages = 0;
  };

  PagedKvCache(const KvGeometry& geometry, const PagedKvCacheOptions& options, size_t budget_bytes);
  // Layer `layer` stored as `storage` (layout only: pools are attached by AttachPools).
  Layer MakeLayer(int layer, KvStorage storage, bool per_head) const;
  StatusOr<int> PoolFor(KvStorage storage, bool per_head, size_t page_bytes);
  Status AttachPools(Layer* layer);
  // The profile storing its layers as `storage` ([n_layers]), created on first use.
  StatusOr<int> ProfileFor(const std::vector<KvStorage>& storage);
  int n_profiles() const { return static_cast<int>(layers_.size()) / geometry_.n_layers; }
  Layer& LayerOf(int seq, int layer) { return layers_[seq_profile_[seq] * geometry_.n_layers + layer]; }
  const Layer& LayerOf(int seq, int layer) const {
    return layers_[seq_profile_[seq] * geometry_.n_layers + layer];
  }
  // head: 0 for a shared layer. Every profile has the same tables (per_head is cache-wide).
  Table& table(int seq, int layer, int head = 0) {
    return tables_[static_cast<size_t>(seq) * tables_per_seq_ + layers_[layer].first_table + head];
  }
  const Table& table(int seq, int layer, int head = 0) const {
    return tables_[static_cast<size_t>(seq) * tables_per_seq_ + layers_[layer].first_table + head];
  }
  Status CheckSeq(const char* op, int seq) const;
  Status CheckLayer(const char* op, int layer) const;
  void CheckSeqLayer(const char* op, int seq, int layer) const;  // aborts when out of range
  int32_t PageFill(const Table& t, size_t page_index) const;
  const int32_t* LastPosition(const Layer& L, const Table& t) const;  // null when empty
  // positions[0, n) (positions null: the run pos0, pos0 + 1, ...) ascend, are >= 0 and follow
  // the table's last (InvalidArgument naming the table otherwise).
  Status CheckPositions(int seq, int layer, int head, const int32_t* positions, int32_t n, int32_t pos0 = 0) const;
  // Pages (and their bytes) an append of n tokens to table t allocates; int8_kivi: the peak of
  // bytes allocated minus freed (a residual is freed right after its page is quantized).
  size_t TableAppendBytes(const Layer& L, const Table& t, int32_t n, int64_t* pages) const;
  // A page from `pool` (budget already checked), counted in *layer_pages and the cache totals;
  // ReleaseTo undoes it once no other table shares the page.
  PageId AllocateFrom(PagePool& pool, int64_t* layer_pages);
  void ReleaseTo(PagePool& pool, PageId id, int32_t fill, int64_t* layer_pages, int64_t* layer_slots);
  PageId AllocatePage(Layer& L);  // budget already checked
  void ReleasePage(Layer& L, PageId id, int32_t fill);
  Status BudgetError(const char* op, int seq, int layer, int head, int64_t pages, size_t bytes) const;
  // Moves `count` slots between pages (memmove: ranges may overlap within one page).
  void CopySlots(const Layer& L, PageId src, int32_t src_slot, PageId dst, int32_t dst_slot, int32_t count);
  // Stores `count` tokens into slots [slot, slot + count) of a page: head `head` of each
  // token (per-head layer) or all heads (head < 0). k, v: [count, n_kv_heads, head_dim].
  void StoreRows(const Layer& L, uint8_t* page, int32_t slot, int32_t count, const float* k, const float* v,
                 int head);
  void FillSpans(const Layer& L, const Table& t, std::vector<KvSpan>* out) const;
  // The first dropped index and the survivors of `keep` (first_drop -1: nothing dropped).
  static EvictPlan CountKept(const Table& t, const uint8_t* keep);
  EvictPlan PlanEvict(const Table& t, const Layer& L, const uint8_t* keep) const;
  void ApplyEvict(Table& t, Layer& L, const uint8_t* keep, const EvictPlan& plan);
  Status EvictTable(int seq, int layer, int head, const std::vector<uint8_t>& keep);
  void ClearTable(Table& t, Layer& L);
  void ClearLayer(int seq, int layer);  // every table of the layer
  // Bytes an eviction plan allocates beyond what it frees first.
  size_t PlanBytes(const Layer& L, const EvictPlan& plan) const;

  // ---- RenumberPositions (paged_kv_cache_positions.cc) ----
  // Index of the first token whose position is not its index (t.n when none).
  int32_t FirstRenumbered(const Layer& L, const Table& t) const;
  // Bytes the copies of shared pages from token `first` on need.
  size_t RenumberBytes(const Layer& L, const Table& t, int32_t first, int64_t* pages) const;
  // Renumbers t from token `first` on (budget already checked); returns the slots rotated.
  int64_t RenumberTable(Table& t, Layer& L, int32_t first, const KeyRotateFn& rotate);

  // ---- KIVI storage (paged_kv_cache_kivi.cc) ----
  // A KIVI table's pages from quantized_pages on are residual pages (residual pool and layout):
  // the partly filled last one and the kivi_residual tokens' whole ones; the others have the layer's.
  bool IsResidualPage(const Layer& L, const Table& t, size_t page_index) const {
    return L.kivi && static_cast<int64_t>(page_index) >= t.quantized_pages;
  }
  // The pages of an n-token KIVI table that must be quantized: those kivi_residual tokens behind the last.
  int32_t QuantizedPagesFor(int32_t n) const { return std::max(0, n / page_size_ - kivi_residual_pages_); }
  // V scales (and mins) per staged token of a KIVI layer: one per head (int8_kivi) or per group.
  int VScalesPerRow(const Layer& L) const {
    return L.layout.row_heads * (IsLowBitKivi(L.storage) ? geometry_.head_dim / kivi_v_group_ : 1);
  }
  // Quantizes residual page t.quantized_pages (whole) into a fresh page and frees the f16 one.
  void QuantizeOldestResidualPage(Layer& L, Table& t);
  // A KIVI table's quantized pages after an eviction: the pages before the first rewritten one
  // keep their form; the rewritten ones are quantized as far as the window requires.
  int32_t QuantizedPagesAfterEvict(const Table& t, const EvictPlan& plan) const {
    return std::max(QuantizedPagesFor(plan.n_keep), std::min(t.quantized_pages, plan.first_drop / page_size_));
  }
  PagePool* PoolOf(const Layer& L, const Table& t, size_t page_index) const {
    return IsResidualPage(L, t, page_index) ? L.residual_pool : L.pool;
  }
  const PageLayout& LayoutOf(const Layer& L, const Table& t, size_t page_index) const {
    return IsResidualPage(L, t, page_index) ? L.residual_layout : L.layout;
  }
  void SetKiviLayout(Layer* layer) const;  // quantized page and residual page layouts
  PageId AllocateResidualPage(Layer& L);  // budget already checked
  void ReleaseResidualPage(Layer& L, PageId id, int32_t fill);
  // The rest of Append for an int8_kivi layer, after validation.
  Status AppendKivi(int seq, int layer, int32_t n, const float* k, const float* v, const int32_t* positions);
  EvictPlan PlanEvictKivi(const Table& t, const Layer& L, const uint8_t* keep) const;
  void ApplyEvictKivi(Table& t, Layer& L, const uint8_t* keep, const EvictPlan& plan);
  // Tokens on their way into int8_kivi pages. V keeps its int8 codes when it has them, so a
  // moved token's V stays bit-identical; K is always regrouped from f32.
  struct KiviStaging {
    std::vector<float> k, v;         // [tokens, row_heads, head_dim] f32
    std::vector<uint8_t> v_codes;    // [tokens, V row bytes] codes as stored (where v_coded)
    std::vector<float> v_scale;      // [tokens, row_heads] (where v_coded; int8_kivi)
    // [tokens, row_heads, head_dim / v_group] f16 (where v_coded; int4 / int2 KIVI)
    std::vector<uint16_t> v_group_scale, v_group_min;  // f16 bits
    std::vector<uint8_t> v_coded;    // [tokens] 1: V read from a quantized page
    std::vector<int32_t> positions;  // [tokens]
    void Resize(int32_t tokens, int row_heads, int head_dim, size_t v_row_bytes, int v_scales_per_row);
  };
  // Writes staged tokens [at, at + count) as one full quantized page (slot 0, count ==
  // page_size) or into slots [slot, slot + count) of a residual page.
  void WriteKiviPage(const Layer& L, uint8_t* page, bool residual, int32_t slot, const KiviStaging& st,
                     int32_t at, int32_t count);
  // Stages slots [slot, slot + count) of page i of t at staged index `at` (K dequantized).
  void ReadKiviSlots(const Layer& L, const Table& t, size_t page_index, int32_t slot, int32_t count,
                     KiviStaging* st, int32_t at) const;

  KvGeometry geometry_;
  int n_seqs_;
  int32_t page_size_;
  int32_t kivi_residual_pages_ = 0;               // options.kivi_residual / page_size
  int32_t kivi_v_group_ = 0;                      // int4 / int2 KIVI V group (channels), resolved
  PageBudget budget_;                             // declared before pools_: they refund into it
  // One pool per distinct page layout in use: (storage type, per-head or not).
  std::vector<std::unique_ptr<PagePool>> pools_;
  std::vector<Layer> layers_;                     // [n_profiles, n_layers]; profile 0: the options'
  std::vector<int> seq_profile_;                  // [n_seqs]
  size_t tables_per_seq_ = 0;                     // Σ layers' n_tables
  std::vector<Table> tables_;                     // [n_seqs, tables_per_seq_]
  int64_t pages_in_use_ = 0;
  int64_t peak_pages_in_use_ = 0;
  int64_t moved_tokens_ = 0;
  int64_t cow_pages_ = 0;
  std::vector<PageId> scratch_dest_;              // Evict: destination pages
  std::vector<uint8_t> scratch_keep_;             // RemoveRange: keep masks of every table of a sequence
  KiviStaging kivi_stage_;                        // int8_kivi: Append / Evict staging
  std::vector<float> rotate_k_;                   // RenumberPositions: [page_size, row_heads, head_dim] K in f32
  int64_t rerotated_tokens_ = 0;
};

}  // namespace kvsparse
