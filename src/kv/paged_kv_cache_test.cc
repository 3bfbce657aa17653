#include "kvsparse/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/kv_quant.h"
#include "kv/paged_kv_cache_test_util.h"
#include "kvsparse/attention.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/dtype.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

std::vector<float> RandomVector(size_t n, std::mt19937& rng) { return testing::RandomNonZeroFloats(n, rng); }

using testing::MakePagedCache;

// The reference model: the live tokens of one (seq, layer), in order.
struct ModelToken {
  int32_t pos;
  std::vector<float> k, v;  // [n_kv_heads, head_dim] as appended (f32)
};
using ModelTable = std::vector<ModelToken>;

// What the cache must hold for one row (K or V of one token) in `storage`: exact bytes.
struct EncodedRow {
  std::vector<uint8_t> values;  // [n_kv_heads, head_dim] in storage
  std::vector<float> scales;    // [n_kv_heads] (int8 and fp8)
};

EncodedRow Encode(const std::vector<float>& x, KvStorage storage, int n_kv_heads, int head_dim) {
  EncodedRow e;
  e.values.resize(KvRowBytes(storage, x.size()));
  switch (storage) {
    case KvStorage::kF32:
      std::memcpy(e.values.data(), x.data(), x.size() * sizeof(float));
      break;
    case KvStorage::kF16:
      for (size_t i = 0; i < x.size(); ++i) {
        const f16_bits h = F32ToF16(x[i]);
        std::memcpy(e.values.data() + 2 * i, &h, 2);
      }
      break;
    case KvStorage::kBf16:
      for (size_t i = 0; i < x.size(); ++i) {
        const bf16_bits h = F32ToBF16(x[i]);
        std::memcpy(e.values.data() + 2 * i, &h, 2);
      }
      break;
    case KvStorage::kInt8:
      e.scales.resize(n_kv_heads);
      ref::QuantizeKvRowsInt8(x.data(), n_kv_heads, head_dim, reinterpret_cast<int8_t*>(e.values.data()),
                              e.scales.data());
      break;
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2:
      e.scales.resize(n_kv_heads);
      ops::QuantizeKvRowsFp8(storage, x.data(), n_kv_heads, head_dim, e.values.data(), e.scales.data());
      break;
    case KvStorage::kInt8Kivi:  // groups of tokens, not rows: paged_kv_cache_kivi_test.cc
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi:
      ADD_FAILURE() << "int8_kivi rows are not encoded one by one";
      break;
  }
  return e;
}

::testing::AssertionResult RowMatches(const void* stored, const float* scales, const std::vector<float>& want,
                                      KvStorage storage, const KvGeometry& geo) {
  const EncodedRow e = Encode(want, storage, geo.n_kv_heads, geo.head_dim);
  if (std::memcmp(stored, e.values.data(), e.values.size()) != 0) {
    return ::testing::AssertionFailure() << "stored values differ (" << KvStorageName(storage) << ")";
  }
  if (HasTokenScales(storage)) {
    if (scales == nullptr) return ::testing::AssertionFailure() << "int8 / fp8 span without scales";
    if (std::memcmp(scales, e.scales.data(), e.scales.size() * sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "int8 / fp8 scales differ";
    }
  } else if (scales != nullptr) {
    return ::testing::AssertionFailure() << "scales on a non-int8 span";
  }
  return ::testing::AssertionSuccess();
}

// Spans equal the model token by token; every span but the last is a full page. head >= 0:
// one head table of a per-head layer (HeadSpans), compared with that head's slice of the rows.
::testing::AssertionResult MatchesTable(const PagedKvCache& cache, int seq, int layer, int head,
                                        const ModelTable& full_model) {
  KvGeometry geo = cache.geometry();
  const KvStorage storage = cache.sequence_storage(seq, layer);
  std::vector<KvSpan> spans;
  ModelTable head_model;
  int32_t n_cached = 0;
  if (head >= 0) {
    cache.HeadSpans(seq, layer, head, &spans);
    n_cached = cache.NumHeadTokens(seq, layer, head);
    for (const ModelToken& t : full_model) {
      const auto first = static_cast<size_t>(head) * geo.head_dim;
      head_model.push_back(ModelToken{t.pos, std::vector<float>(t.k.begin() + first, t.k.begin() + first + geo.head_dim),
                                      std::vector<float>(t.v.begin() + first, t.v.begin() + first + geo.head_dim)});
    }
    geo.n_kv_heads = 1;  // head spans hold [n, 1, head_dim]
  } else {
    cache.Spans(seq, layer, &spans);
    n_cached = cache.NumTokens(seq, layer);
  }
  const ModelTable& model = head >= 0 ? head_model : full_model;
  const size_t row_bytes = KvRowBytes(storage, static_cast<size_t>(geo.n_kv_heads) * geo.head_dim);
  if (n_cached != static_cast<int32_t>(model.size())) {
    return ::testing::AssertionFailure() << "seq " << seq << " layer " << layer << " head " << head << ": "
                                         << n_cached << " tokens cached, model " << model.size();
  }
  size_t t = 0;
  for (size_t si = 0; si < spans.size(); ++si) {
    const KvSpan& s = spans[si];
    if (s.n <= 0 || s.n > cache.page_size() || (si + 1 < spans.size() && s.n != cache.page_size())) {
      return ::testing::AssertionFailure() << "seq " << seq << " layer " << layer << ": span " << si << " has n "
                                           << s.n << " (page size " << cache.page_size() << ", " << spans.size()
                                           << " spans): not compacted";
    }
    for (int32_t i = 0; i < s.n; ++i, ++t) {
      if (t >= model.size()) return ::testing::AssertionFailure() << "more tokens in spans than in the model";
      const ModelToken& m = model[t];
      if (s.positions[i] != m.pos) {
        return ::testing::AssertionFailure() << "seq " << seq << " layer " << layer << " token " << t
                                             << ": position " << s.positions[i] << ", model " << m.pos;
      }
      const float* ks = s.k_scale ? s.k_scale + static_cast<size_t>(i) * geo.n_kv_heads : nullptr;
      const float* vs = s.v_scale ? s.v_scale + static_cast<size_t>(i) * geo.n_kv_heads : nullptr;
      auto k_ok = RowMatches(static_cast<const uint8_t*>(s.k) + i * row_bytes, ks, m.k, storage, geo);
      if (!k_ok) return k_ok << " in K of seq " << seq << " layer " << layer << " token " << t;
      auto v_ok = RowMatches(static_cast<const uint8_t*>(s.v) + i * row_bytes, vs, m.v, storage, geo);
      if (!v_ok) return v_ok << " in V of seq " << seq << " layer " << layer << " token " << t;
    }
  }
  if (t != model.size()) return ::testing::AssertionFailure() << "spans hold " << t << " of " << model.size();
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MatchesModel(const PagedKvCache& cache, int seq, int layer, const ModelTable& model) {
  return MatchesTable(cache, seq, layer, -1, model);
}
::testing::AssertionResult MatchesHeadModel(const PagedKvCache& cache, int seq, int layer, int head,
                                            const ModelTable& model) {
  return MatchesTable(cache, seq, layer, head, model);
}

// Appends n random tokens at positions after the last one of every table to the cache and
// (on success) to each table: one table for a shared layer, one per head for a per-head layer
// (every head gets the same tokens, as the engine appends).
Status AppendRandomTables(PagedKvCache& cache, const std::vector<ModelTable*>& tables, int seq, int layer, int32_t n,
                          std::mt19937& rng) {
  const KvGeometry& geo = cache.geometry();
  const size_t row = static_cast<size_t>(geo.n_kv_heads) * geo.head_dim;
  const std::vector<float> k = RandomVector(n * row, rng), v = RandomVector(n * row, rng);
  std::vector<int32_t> pos(n);
  int32_t last = -1;
  for (const ModelTable* m : tables) last = std::max(last, m->empty() ? -1 : m->back().pos);
  int32_t p = last < 0 ? static_cast<int32_t>(rng() % 3) : last + 1;
  for (int32_t i = 0; i < n; ++i) {
    pos[i] = p;
    p += 1 + static_cast<int32_t>(rng() % 2);  // sometimes skip a position
  }
  Status st = cache.Append(seq, layer, n, k.data(), v.data(), pos.data());
  if (st.ok()) {
    for (ModelTable* model : tables) {
      for (int32_t i = 0; i < n; ++i) {
        model->push_back(ModelToken{pos[i], std::vector<float>(k.begin() + i * row, k.begin() + (i + 1) * row),
                                    std::vector<float>(v.begin() + i * row, v.begin() + (i + 1) * row)});
      }
    }
  }
  return st;
}

Status AppendRandom(PagedKvCache& cache, ModelTable& model, int seq, int layer, int32_t n, std::mt19937& rng) {
  return AppendRandomTables(cache, {&model}, seq, layer, n, rng);
}

ModelTable KeepRows(const ModelTable& m, const std::vector<uint8_t>& keep) {
  ModelTable kept;
  for (size_t i = 0; i < keep.size(); ++i) {
    if (keep[i]) kept.push_back(m[i]);
  }
  return kept;
}

std::string StorageName(const std::vector<KvStorage>& s) {
  std::string name;
  for (KvStorage x : s) name += KvStorageName(x);
  return name;
}

// ---------------------------------------------------------------------------------------------

class PagedKvCacheStorageTest : public ::testing::TestWithParam<KvStorage> {};

TEST_P(PagedKvCacheStorageTest, AppendGivesOneSpanPerPage) {
  const KvGeometry geo{2, 2, 12};
  auto cache = MakePagedCache(geo, {GetParam()}, 2, 4, 1 << 20);
  std::mt19937 rng(1);
  ModelTable model;
  ASSERT_TRUE(AppendRandom(*cache, model, 1, 1, 3, rng).ok());
  ASSERT_TRUE(AppendRandom(*cache, model, 1, 1, 7, rng).ok());
  ASSERT_TRUE(AppendRandom(*cache, model, 1, 1, 1, rng).ok());
  EXPECT_TRUE(MatchesModel(*cache, 1, 1, model));
  std::vector<KvSpan> spans;
  cache->Spans(1, 1, &spans);
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0].n, 4);
  EXPECT_EQ(spans[1].n, 4);
  EXPECT_EQ(spans[2].n, 3);
  EXPECT_EQ(cache->NumTokens(0, 1), 0);
  EXPECT_EQ(cache->NumTokens(1, 0), 0);
  cache->Spans(0, 0, &spans);
  EXPECT_TRUE(spans.empty());
  EXPECT_EQ(cache->pages_in_use(), 3);
  cache->CheckInvariants();
  cache->Clear(1);
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->budget().used_bytes(), 0u);
}

TEST_P(PagedKvCacheStorageTest, ByteAccountingIsExact) {
  const KvGeometry geo{2, 2, 8};
  auto cache = MakePagedCache(geo, {GetParam()}, 1, 4, 1 << 20);
  const size_t vb = KvStorageBits(GetParam()) / 8;
  const bool int8 = HasTokenScales(GetParam());
  const size_t row_bytes = 2 * 8 * vb;
  auto align = [](size_t n) { return (n + 63) / 64 * 64; };
  const size_t page_bytes =
      2 * align(4 * row_bytes) + align(4 * sizeof(int32_t)) + (int8 ? 2 * align(4 * 2 * sizeof(float)) : 0);
  const size_t token_bytes = 2 * row_bytes + sizeof(int32_t) + (int8 ? 2 * 2 * sizeof(float) : 0);
  EXPECT_EQ(cache->page_bytes(0), page_bytes);
  EXPECT_EQ(cache->token_bytes(1), token_bytes);
  std::mt19937 rng(2);
  ModelTable m0, m1;
  ASSERT_TRUE(AppendRandom(*cache, m0, 0, 0, 6, rng).ok());
  ASSERT_TRUE(AppendRandom(*cache, m1, 0, 1, 1, rng).ok());
  EXPECT_EQ(cache->LayerAllocatedBytes(0), 2 * page_bytes);
  EXPECT_EQ(cache->LayerLiveBytes(0), 6 * token_bytes);
  EXPECT_EQ(cache->LayerAllocatedBytes(1), page_bytes);
  EXPECT_EQ(cache->LayerLiveBytes(1), token_bytes);
  EXPECT_EQ(cache->AllocatedBytes(), 3 * page_bytes);
  EXPECT_EQ(cache->LiveBytes(), 7 * token_bytes);
  const KvLiveBytesByPart parts = cache->LayerLiveBytesByPart(0);  // 6 slots
  EXPECT_EQ(parts.values, 6 * 2 * row_bytes);
  EXPECT_EQ(parts.scales, int8 ? 6 * 2 * 2 * sizeof(float) : 0);  // K and V, per (token, head)
  EXPECT_EQ(parts.positions, 6 * sizeof(int32_t));
  EXPECT_EQ(parts.residual, 0u);
  EXPECT_EQ(parts.total(), cache->LayerLiveBytes(0));
  EXPECT_EQ(cache->FragmentationBytes(), 3 * page_bytes - 7 * token_bytes);
  EXPECT_EQ(cache->budget().used_bytes(), 3 * page_bytes);

  // Evicting 3 of layer 0's 6 tokens frees its second page.
  ASSERT_TRUE(cache->Evict(0, 0, {1, 0, 1, 0, 0, 1}).ok());
  m0 = {m0[0], m0[2], m0[5]};
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, m0));
  EXPECT_EQ(cache->LayerAllocatedBytes(0), page_bytes);
  EXPECT_EQ(cache->LayerLiveBytes(0), 3 * token_bytes);
  const PagedKvStats stats = cache->Stats();
  ASSERT_EQ(stats.layers.size(), 2u);
  EXPECT_EQ(stats.layers[0].evicted_tokens, 3);
  EXPECT_EQ(stats.layers[0].pages, 1);
  EXPECT_EQ(stats.layers[0].live_tokens, 3);
  EXPECT_EQ(stats.layers[0].storage, GetParam());
  EXPECT_EQ(stats.layers[1].evicted_tokens, 0);
  EXPECT_EQ(stats.evicted_tokens, 3);
  EXPECT_EQ(stats.moved_tokens, 2);  // positions 2 and 5 moved down
  EXPECT_EQ(stats.pages_in_use, 2);
  EXPECT_EQ(stats.peak_pages_in_use, 3);
  EXPECT_EQ(stats.peak_allocated_bytes, 3 * page_bytes);
  EXPECT_EQ(stats.allocated_bytes, 2 * page_bytes);
  EXPECT_EQ(stats.live_bytes, 4 * token_bytes);
  EXPECT_EQ(stats.fragmentation_bytes, 2 * page_bytes - 4 * token_bytes);
  EXPECT_EQ(stats.budget_bytes, size_t{1} << 20);
  cache->CheckInvariants();
}

// With no eviction, the paged spans concatenate to ContiguousKvCache's single span.
TEST_P(PagedKvCacheStorageTest, ConcatenatedSpansEqualContiguousCache) {
  if (!DenseCacheHolds(GetParam())) GTEST_SKIP() << "ContiguousKvCache stores f32, f16 and bf16 only";
  const KvGeometry geo{2, 3, 10};
  auto paged = MakePagedCache(geo, {GetParam()}, 1, 5, 1 << 20);
  ContiguousKvCache dense(geo, GetParam(), 1, 64);
  std::mt19937 rng(3);
  const size_t row = 3 * 10;
  int32_t pos = 0;
  for (int32_t n : {1, 4, 7, 5, 1, 13}) {
    const std::vector<float> k = RandomVector(n * row, rng), v = RandomVector(n * row, rng);
    std::vector<int32_t> p(n);
    for (int32_t& x : p) x = pos++;
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE(paged->Append(0, layer, n, k.data(), v.data(), p.data()).ok());
      ASSERT_TRUE(dense.Append(0, layer, n, k.data(), v.data(), p.data()).ok());
    }
  }
  const size_t row_bytes = KvRowBytes(GetParam(), row);
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<KvSpan> dense_spans, paged_spans;
    dense.Spans(0, layer, &dense_spans);
    paged->Spans(0, layer, &paged_spans);
    ASSERT_EQ(dense_spans.size(), 1u);
    std::vector<uint8_t> k_cat, v_cat;
    std::vector<int32_t> p_cat;
    for (const KvSpan& s : paged_spans) {
      k_cat.insert(k_cat.end(), static_cast<const uint8_t*>(s.k), static_cast<const uint8_t*>(s.k) + s.n * row_bytes);
      v_cat.insert(v_cat.end(), static_cast<const uint8_t*>(s.v), static_cast<const uint8_t*>(s.v) + s.n * row_bytes);
      p_cat.insert(p_cat.end(), s.positions, s.positions + s.n);
    }
    const KvSpan& d = dense_spans[0];
    ASSERT_EQ(p_cat.size(), static_cast<size_t>(d.n));
    EXPECT_EQ(0, std::memcmp(k_cat.data(), d.k, k_cat.size()));
    EXPECT_EQ(0, std::memcmp(v_cat.data(), d.v, v_cat.size()));
    EXPECT_EQ(0, std::memcmp(p_cat.data(), d.positions, p_cat.size() * sizeof(int32_t)));
  }
}

TEST_P(PagedKvCacheStorageTest, ForkSharesPagesAndCopiesOnWrite) {
  const KvGeometry geo{1, 2, 4};
  auto cache = MakePagedCache(geo, {GetParam()}, 3, 4, 1 << 20);
  std::mt19937 rng(4);
  ModelTable src;
  ASSERT_TRUE(AppendRandom(*cache, src, 0, 0, 10, rng).ok());  // pages: 4, 4, 2
  EXPECT_EQ(cache->pages_in_use(), 3);
  ASSERT_TRUE(cache->Fork(0, 1).ok());
  ModelTable dst = src;
  EXPECT_EQ(cache->pages_in_use(), 3);  // shared, not copied
  EXPECT_EQ(cache->LiveBytes(), 10 * cache->token_bytes(0));  // a shared slot counts once
  cache->CheckInvariants();

  // Appending to the source copies only its partly filled (shared) last page.
  ASSERT_TRUE(AppendRandom(*cache, src, 0, 0, 1, rng).ok());
  EXPECT_EQ(cache->pages_in_use(), 4);
  EXPECT_EQ(cache->Stats().cow_pages, 1);
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, src));
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, dst));
  // The fork now owns the old last page alone: it appends in place.
  ASSERT_TRUE(AppendRandom(*cache, dst, 1, 0, 2, rng).ok());
  EXPECT_EQ(cache->pages_in_use(), 4);
  EXPECT_EQ(cache->Stats().cow_pages, 1);
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, src));
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, dst));
  cache->CheckInvariants();

  // Evicting in the second (shared) page of the fork copies it; the first page stays shared.
  std::vector<uint8_t> keep(dst.size(), 1);
  keep[5] = 0;
  ASSERT_TRUE(cache->Evict(1, 0, keep).ok());
  dst.erase(dst.begin() + 5);
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, src));
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, dst));
  EXPECT_EQ(cache->Stats().cow_pages, 2);
  EXPECT_EQ(cache->pages_in_use(), 5);  // shared page 0, src 1 and 2, dst's copy of 1 and its own 2
  cache->CheckInvariants();

  // A fork of a fork, then clearing everything: no leaks.
  ASSERT_TRUE(cache->Fork(1, 2).ok());
  EXPECT_TRUE(MatchesModel(*cache, 2, 0, dst));
  ASSERT_TRUE(cache->KeepOnly(2).ok());
  EXPECT_EQ(cache->NumTokens(0, 0), 0);
  EXPECT_EQ(cache->NumTokens(1, 0), 0);
  EXPECT_TRUE(MatchesModel(*cache, 2, 0, dst));
  cache->CheckInvariants();
  cache->Clear(2);
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->budget().used_bytes(), 0u);
  cache->CheckInvariants();
}

TEST_P(PagedKvCacheStorageTest, RemoveRangeDropsPositionsFromEveryLayer) {
  const KvGeometry geo{3, 1, 8};
  auto cache = MakePagedCache(geo, {GetParam()}, 1, 3, 1 << 20);
  std::mt19937 rng(5);
  const size_t row = 8;
  std::vector<ModelTable> model(3);
  const std::vector<float> k = RandomVector(10 * row, rng), v = RandomVector(10 * row, rng);
  std::vector<int32_t> pos(10);
  for (int i = 0; i < 10; ++i) pos[i] = 2 * i;  // 0, 2, ..., 18
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(cache->Append(0, l, 10, k.data(), v.data(), pos.data()).ok());
    for (int i = 0; i < 10; ++i) {
      model[l].push_back({pos[i], std::vector<float>(k.begin() + i * row, k.begin() + (i + 1) * row),
                          std::vector<float>(v.begin() + i * row, v.begin() + (i + 1) * row)});
    }
  }
  ASSERT_TRUE(cache->RemoveRange(0, 3, 9).ok());  // drops 4, 6, 8
  for (auto& m : model) m.erase(m.begin() + 2, m.begin() + 5);
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(MatchesModel(*cache, 0, l, model[l]));
  ASSERT_TRUE(cache->RemoveRange(0, 14, -1).ok());  // to the end: drops 14, 16, 18
  for (auto& m : model) m.resize(4);
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(MatchesModel(*cache, 0, l, model[l]));
  EXPECT_EQ(cache->pages_in_use(), 3 * 2);
  EXPECT_EQ(cache->Stats().removed_tokens, 3 * 6);
  EXPECT_EQ(cache->Stats().evicted_tokens, 0);
  ASSERT_TRUE(cache->RemoveRange(0, 50, 60).ok());  // nothing there
  ASSERT_TRUE(cache->RemoveRange(0, 9, 9).ok());    // empty range
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(MatchesModel(*cache, 0, l, model[l]));
  // The tail is free again: appending after the last remaining position works.
  std::vector<int32_t> next = {13};
  ASSERT_TRUE(cache->Append(0, 0, 1, k.data(), v.data(), next.data()).ok());
  ASSERT_TRUE(cache->RemoveRange(0, -1, -1).ok());
  for (int l = 0; l < 3; ++l) EXPECT_EQ(cache->NumTokens(0, l), 0);
  EXPECT_EQ(cache->pages_in_use(), 0);
  cache->CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Storage, PagedKvCacheStorageTest,
                         ::testing::Values(KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kFp8E4M3,
                                           KvStorage::kFp8E5M2, KvStorage::kBf16),
                         [](const ::testing::TestParamInfo<KvStorage>& info) {
                           return std::string(KvStorageName(info.param));
                         });

// ---------------------------------------------------------------------------------------------

TEST(PagedKvCacheTest, MixedStoragePerLayer) {
  const KvGeometry geo{3, 2, 16};
  auto cache = MakePagedCache(geo, {KvStorage::kF16, KvStorage::kF16, KvStorage::kInt8}, 1, 16, 1 << 20);
  EXPECT_EQ(cache->storage(), KvStorage::kF16);
  EXPECT_EQ(cache->layer_storage(0), KvStorage::kF16);
  EXPECT_EQ(cache->layer_storage(2), KvStorage::kInt8);
  EXPECT_LT(cache->page_bytes(2), cache->page_bytes(0));
  std::mt19937 rng(6);
  std::vector<ModelTable> model(3);
  for (int l = 0; l < 3; ++l) ASSERT_TRUE(AppendRandom(*cache, model[l], 0, l, 20, rng).ok());
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(MatchesModel(*cache, 0, l, model[l]));
  std::vector<KvSpan> spans;
  cache->Spans(0, 2, &spans);
  ASSERT_FALSE(spans.empty());
  EXPECT_NE(spans[0].k_scale, nullptr);
  EXPECT_NE(spans[0].v_scale, nullptr);
  cache->Spans(0, 0, &spans);
  EXPECT_EQ(spans[0].k_scale, nullptr);
  EXPECT_EQ(cache->budget().used_bytes(), 2 * 2 * cache->page_bytes(0) + 2 * cache->page_bytes(2));
  cache->CheckInvariants();

  // A uniform cache's KvCache::layer_storage default answers storage() for every layer.
  ContiguousKvCache dense(geo, KvStorage::kF32, 1, 4);
  EXPECT_EQ(static_cast<const KvCache&>(dense).layer_storage(2), KvStorage::kF32);
}

// Sequences with their own storage (a request's kv_type): each holds exactly its own encoding
// beside the others, shares the one budget, forks within its profile, and frees every page.
TEST(PagedKvCacheTest, SequencesWithTheirOwnStorage) {
  const KvGeometry geo{2, 2, 16};
  auto cache = MakePagedCache(geo, {KvStorage::kF16}, 0, 8, 1 << 20);
  const int f16 = cache->AddSequence();
  const int int8 = cache->AddSequence();
  const int mixed = cache->AddSequence();
  const std::vector<KvStorage> all_int8 = {KvStorage::kInt8};
  const std::vector<KvStorage> per_layer = {KvStorage::kF32, KvStorage::kInt8Kivi};
  ASSERT_TRUE(cache->SetSequenceStorage(int8, all_int8).ok());
  ASSERT_TRUE(cache->SetSequenceStorage(mixed, per_layer).ok());
  EXPECT_EQ(cache->sequence_storage(f16, 1), KvStorage::kF16);
  EXPECT_EQ(cache->sequence_storage(int8, 0), KvStorage::kInt8);
  EXPECT_EQ(cache->sequence_storage(mixed, 0), KvStorage::kF32);
  EXPECT_EQ(cache->sequence_storage(mixed, 1), KvStorage::kInt8Kivi);
  EXPECT_EQ(cache->layer_storage(1), KvStorage::kF16) << "the cache's own storage is unchanged";
  EXPECT_LT(cache->TableReserveBytes(0, 100, KvStorage::kInt8), cache->TableReserveBytes(0, 100));

  std::mt19937 rng(11);
  std::vector<ModelTable> f16_model(2), int8_model(2);
  for (int l = 0; l < 2; ++l) {
    ASSERT_TRUE(AppendRandom(*cache, f16_model[l], f16, l, 13, rng).ok());
    ASSERT_TRUE(AppendRandom(*cache, int8_model[l], int8, l, 13, rng).ok());
  }
  ModelTable f32_model, unused;
  ASSERT_TRUE(AppendRandom(*cache, f32_model, mixed, 0, 13, rng).ok());
  ASSERT_TRUE(AppendRandom(*cache, unused, mixed, 1, 13, rng).ok());
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(MatchesModel(*cache, f16, l, f16_model[l]));
    EXPECT_TRUE(MatchesModel(*cache, int8, l, int8_model[l]));
  }
  EXPECT_TRUE(MatchesModel(*cache, mixed, 0, f32_model));
  std::vector<KvSpan> spans;
  cache->Spans(mixed, 1, &spans);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_NE(spans[0].k_channel_scale, nullptr) << "a full int8_kivi page";
  EXPECT_EQ(spans[1].k_channel_scale, nullptr) << "the residual";
  cache->CheckInvariants();
  // Layer bytes count every profile; the int8 sequence's pages are smaller.
  const size_t f16_page = cache->page_bytes(0);
  const size_t int8_page = cache->TableReserveBytes(0, 1, KvStorage::kInt8) / 2;
  EXPECT_LT(int8_page, f16_page);
  EXPECT_EQ(cache->LayerAllocatedBytes(0), 2 * f16_page + 2 * int8_page + 2 * cache->TableReserveBytes(0, 1, KvStorage::kF32) / 2);
  EXPECT_EQ(cache->AllocatedBytes(), cache->budget().used_bytes());
  EXPECT_EQ(cache->Stats().layers[0].pages, 6);
  EXPECT_EQ(cache->SequenceLiveBytes(f16) + cache->SequenceLiveBytes(int8) + cache->SequenceLiveBytes(mixed),
            cache->LiveBytes());
  EXPECT_LT(cache->SequenceLiveBytes(int8), cache->SequenceLiveBytes(f16));

  // A storage change needs an empty sequence.
  EXPECT_EQ(cache->SetSequenceStorage(f16, all_int8).code(), StatusCode::kInvalidArgument);
  const std::vector<KvStorage> two_of_three = {KvStorage::kF16, KvStorage::kF16, KvStorage::kF16};
  EXPECT_EQ(cache->SetSequenceStorage(cache->AddSequence(), two_of_three).code(), StatusCode::kInvalidArgument);

  // A fork takes the source's storage and shares its pages.
  const int forked = cache->AddSequence();
  ASSERT_TRUE(cache->Fork(int8, forked).ok());
  EXPECT_EQ(cache->sequence_storage(forked, 0), KvStorage::kInt8);
  ModelTable forked_model = int8_model[0];
  ASSERT_TRUE(AppendRandom(*cache, forked_model, forked, 0, 5, rng).ok());  // copy-on-write of the last page
  EXPECT_TRUE(MatchesModel(*cache, forked, 0, forked_model));
  EXPECT_TRUE(MatchesModel(*cache, int8, 0, int8_model[0]));
  std::vector<uint8_t> keep(13, 1);
  keep[2] = keep[9] = 0;
  ASSERT_TRUE(cache->Evict(int8, 0, keep).ok());
  EXPECT_TRUE(MatchesModel(*cache, int8, 0, KeepRows(int8_model[0], keep)));
  EXPECT_TRUE(MatchesModel(*cache, forked, 0, forked_model));
  cache->CheckInvariants();

  // A cleared sequence may change storage; every page goes back.
  cache->Clear(f16);
  ASSERT_TRUE(cache->SetSequenceStorage(f16, all_int8).ok());
  EXPECT_EQ(cache->sequence_storage(f16, 0), KvStorage::kInt8);
  for (int seq = 0; seq < cache->n_seqs(); ++seq) cache->Clear(seq);
  cache->CheckInvariants();
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->budget().used_bytes(), 0u);
}

TEST(PagedKvCacheTest, SpansReusesTheOutputVector) {
  const KvGeometry geo{1, 1, 4};
  auto cache = MakePagedCache(geo, {KvStorage::kF32}, 1, 2, 1 << 20);
  std::mt19937 rng(7);
  ModelTable model;
  ASSERT_TRUE(AppendRandom(*cache, model, 0, 0, 9, rng).ok());
  std::vector<KvSpan> spans;
  cache->Spans(0, 0, &spans);
  ASSERT_EQ(spans.size(), 5u);
  const KvSpan* data = spans.data();
  for (int i = 0; i < 3; ++i) cache->Spans(0, 0, &spans);
  EXPECT_EQ(spans.data(), data);  // no reallocation on repeated calls
  EXPECT_EQ(spans.size(), 5u);
}

TEST(PagedKvCacheTest, BudgetExhaustionIsCleanAndLeavesTheCacheUnchanged) {
  const KvGeometry geo{2, 2, 8};
  auto probe = MakePagedCache(geo, {KvStorage::kF32}, 2, 4, 1 << 20);
  const size_t page = probe->page_bytes(0);
  auto cache = MakePagedCache(geo, {KvStorage::kF32}, 2, 4, 5 * page);
  std::mt19937 rng(8);
  ModelTable m00, m01;
  ASSERT_TRUE(AppendRandom(*cache, m00, 0, 0, 14, rng).ok());  // 4 pages
  ASSERT_TRUE(AppendRandom(*cache, m01, 0, 1, 2, rng).ok());   // 1 page: budget full
  EXPECT_EQ(cache->budget().used_bytes(), 5 * page);

  ModelTable before = m00;
  Status st = AppendRandom(*cache, m00, 0, 0, 3, rng);  // 2 fit in the last page, 1 needs a new page
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find(std::to_string(5 * page)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("seq 0 layer 0"), std::string::npos) << st.message();
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, m00));
  ASSERT_TRUE(AppendRandom(*cache, m00, 0, 0, 2, rng).ok());  // exactly fills the last page
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, m00));
  cache->CheckInvariants();

  // Fork, then evicting inside the shared pages needs copies the budget cannot pay for.
  ASSERT_TRUE(cache->Fork(0, 1).ok());
  std::vector<uint8_t> keep(m00.size(), 1);
  keep[0] = 0;
  st = cache->Evict(1, 0, keep);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, m00));
  st = cache->RemoveRange(1, m00[0].pos, m00[0].pos + 1);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, m00));
  EXPECT_TRUE(MatchesModel(*cache, 1, 1, m01));
  cache->CheckInvariants();
  // Dropping whole trailing pages needs no copy, even when shared.
  keep.assign(m00.size(), 1);
  for (size_t i = 8; i < keep.size(); ++i) keep[i] = 0;
  ASSERT_TRUE(cache->Evict(1, 0, keep).ok());
  ModelTable forked(m00.begin(), m00.begin() + 8);
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, forked));
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, m00));
  cache->CheckInvariants();
  cache->Clear(0);
  cache->Clear(1);
  EXPECT_EQ(cache->pages_in_use(), 0);
}

TEST(PagedKvCacheTest, BadArgumentsAreInvalidArgument) {
  const KvGeometry geo{2, 1, 4};
  auto cache = MakePagedCache(geo, {KvStorage::kF16}, 2, 4, 1 << 16);
  std::vector<float> k(8, 1.f), v(8, 1.f);
  std::vector<int32_t> pos = {0, 1};
  EXPECT_EQ(cache->Append(2, 0, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Append(-1, 0, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Append(0, 2, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Append(0, 0, -1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Append(0, 0, 1, k.data(), nullptr, pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(cache->Append(0, 0, 0, nullptr, nullptr, nullptr).ok());
  ASSERT_TRUE(cache->Append(0, 0, 2, k.data(), v.data(), pos.data()).ok());
  std::vector<int32_t> stale = {1};
  EXPECT_EQ(cache->Append(0, 0, 1, k.data(), v.data(), stale.data()).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> unsorted = {5, 4};
  EXPECT_EQ(cache->Append(0, 0, 2, k.data(), v.data(), unsorted.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->NumTokens(0, 0), 2);

  Status st = cache->Evict(0, 0, {1, 0, 1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("3 entries but 2 tokens"), std::string::npos) << st.message();
  EXPECT_EQ(cache->Evict(0, 5, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Evict(9, 0, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Fork(0, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Fork(-1, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->KeepOnly(3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->RemoveRange(2, 0, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(cache->Fork(0, 0).ok());
  EXPECT_EQ(cache->NumTokens(0, 0), 2);

  PagedKvCacheOptions options;
  options.budget_bytes = 1 << 16;
  EXPECT_EQ(PagedKvCache::Create(KvGeometry{0, 1, 4}, options).status().code(), StatusCode::kInvalidArgument);
  options.page_size = 0;
  EXPECT_EQ(PagedKvCache::Create(geo, options).status().code(), StatusCode::kInvalidArgument);
  options.page_size = 16;
  options.layer_storage = {KvStorage::kF16, KvStorage::kF16, KvStorage::kF16};
  EXPECT_EQ(PagedKvCache::Create(geo, options).status().code(), StatusCode::kInvalidArgument);
  options.layer_storage = {KvStorage::kF16};
  options.n_seqs = -1;
  EXPECT_EQ(PagedKvCache::Create(geo, options).status().code(), StatusCode::kInvalidArgument);
  options.n_seqs = 1;
  options.budget_bytes = 0;
  EXPECT_EQ(PagedKvCache::Create(geo, options).status().code(), StatusCode::kInvalidArgument);
  options.budget_bytes = 100;  // smaller than one page
  auto tiny = PagedKvCache::Create(geo, options);
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tiny.status().message().find("budget"), std::string::npos) << tiny.status().message();
}

TEST(PagedKvCacheTest, EvictEverythingAndNothing) {
  const KvGeometry geo{1, 1, 4};
  auto cache = MakePagedCache(geo, {KvStorage::kF32}, 1, 3, 1 << 16);
  std::mt19937 rng(9);
  ModelTable model;
  ASSERT_TRUE(AppendRandom(*cache, model, 0, 0, 7, rng).ok());
  ASSERT_TRUE(cache->Evict(0, 0, std::vector<uint8_t>(7, 1)).ok());
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, model));
  EXPECT_EQ(cache->Stats().evicted_tokens, 0);
  ASSERT_TRUE(cache->Evict(0, 0, std::vector<uint8_t>(7, 0)).ok());
  EXPECT_EQ(cache->NumTokens(0, 0), 0);
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->Stats().evicted_tokens, 7);
  ASSERT_TRUE(cache->Evict(0, 0, {}).ok());  // empty table, empty mask
  model.clear();
  ASSERT_TRUE(AppendRandom(*cache, model, 0, 0, 2, rng).ok());  // any position after clearing
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, model));
  cache->CheckInvariants();
}

// ---------------------------------------------------------------------------------------------
// Per-head layers: one table per (seq, layer, kv head), single-head pages.

class PagedKvCachePerHeadTest : public ::testing::TestWithParam<KvStorage> {};

// The same keep applied to every head table gives exactly the shared layer's attention: each
// (query, head) row sees the same tokens in the same page runs. 3 kv heads of 2 query heads,
// ~280 live tokens so the kernel also splits tokens into chunks (2 threads).
TEST_P(PagedKvCachePerHeadTest, SameKeepForEveryHeadGivesTheSharedAttention) {
  const int H = 3, group = 2, D = 8;
  const KvGeometry geo{1, H, D};
  auto shared = MakePagedCache(geo, {GetParam()}, 1, 16, 1 << 22);
  auto per_head = MakePagedCache(geo, {GetParam()}, 1, 16, 1 << 22, {1});
  ASSERT_FALSE(shared->per_head(0));
  ASSERT_TRUE(per_head->per_head(0));
  std::mt19937 rng(21);
  ModelTable model;
  for (int32_t n : {150, 1, 90, 159}) {
    const size_t before = model.size();
    ASSERT_TRUE(AppendRandom(*shared, model, 0, 0, n, rng).ok());
    std::vector<float> k, v;  // the same rows for the per-head cache
    std::vector<int32_t> pos;
    for (size_t i = before; i < model.size(); ++i) {
      k.insert(k.end(), model[i].k.begin(), model[i].k.end());
      v.insert(v.end(), model[i].v.begin(), model[i].v.end());
      pos.push_back(model[i].pos);
    }
    ASSERT_TRUE(per_head->Append(0, 0, n, k.data(), v.data(), pos.data()).ok());
  }
  std::vector<uint8_t> keep(model.size());
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = rng() % 10 < 7;
  ASSERT_TRUE(shared->Evict(0, 0, keep).ok());
  for (int h = 0; h < H; ++h) ASSERT_TRUE(per_head->Evict(0, 0, h, keep).ok());
  model = KeepRows(model, keep);
  ASSERT_GT(model.size(), 256u);
  EXPECT_TRUE(MatchesModel(*shared, 0, 0, model));
  for (int h = 0; h < H; ++h) EXPECT_TRUE(MatchesHeadModel(*per_head, 0, 0, h, model)) << "head " << h;
  shared->CheckInvariants();
  per_head->CheckInvariants();

  const AttentionShape shape{H * group, H, D, 1.0f / std::sqrt(static_cast<float>(D))};
  const AttentionShape head_shape{group, 1, D, shape.scale};
  std::vector<KvSpan> spans, head_spans;
  shared->Spans(0, 0, &spans);
  for (int32_t n_q : {1, 7}) {
    // Decode: one query after every token; a chunk: queries from the middle on (causal masks).
    std::vector<int32_t> q_pos(n_q);
    for (int32_t i = 0; i < n_q; ++i) q_pos[i] = n_q == 1 ? model.back().pos + 1 : model[model.size() / 2].pos + 3 * i;
    const size_t row = static_cast<size_t>(H) * group * D, group_values = static_cast<size_t>(group) * D;
    const std::vector<float> q = RandomVector(n_q * row, rng);
    std::vector<float> want(n_q * row), want_stats(n_q * H * group * 2);
    ops::Attention(shape, GetParam(), q.data(), q_pos.data(), n_q, spans.data(), static_cast<int32_t>(spans.size()),
                   want.data(), 2, want_stats.data());
    std::vector<float> got(n_q * row), got_stats(n_q * H * group * 2);
    std::vector<float> q_head(n_q * group_values), out_head(n_q * group_values), stats_head(n_q * group * 2);
    for (int h = 0; h < H; ++h) {
      for (int32_t i = 0; i < n_q; ++i) {
        std::copy_n(q.data() + i * row + h * group_values, group_values, q_head.data() + i * group_values);
      }
      per_head->HeadSpans(0, 0, h, &head_spans);
      ops::Attention(head_shape, GetParam(), q_head.data(), q_pos.data(), n_q, head_spans.data(),
                     static_cast<int32_t>(head_spans.size()), out_head.data(), 2, stats_head.data());
      for (int32_t i = 0; i < n_q; ++i) {
        std::copy_n(out_head.data() + i * group_values, group_values, got.data() + i * row + h * group_values);
        std::copy_n(stats_head.data() + i * group * 2, group * 2, got_stats.data() + (i * H + h) * group * 2);
      }
    }
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << n_q << " queries";
    EXPECT_EQ(0, std::memcmp(got_stats.data(), want_stats.data(), got_stats.size() * sizeof(float)))
        << n_q << " queries";
  }
}

// Different keeps per head: each head holds its own tokens; pages, live bytes and the stats
// count every head table exactly; fork, remove-range, append and clear cover every table.
TEST_P(PagedKvCachePerHeadTest, HeadsKeepDifferentTokensWithExactAccounting) {
  const int H = 3, D = 8;
  const int32_t P = 4;
  const KvGeometry geo{2, H, D};
  auto cache = MakePagedCache(geo, {GetParam()}, 2, P, 1 << 20, {0, 1});  // layer 1 per-head
  const size_t vb = KvStorageBits(GetParam()) / 8;
  const bool int8 = HasTokenScales(GetParam());
  auto align = [](size_t n) { return (n + 63) / 64 * 64; };
  const size_t shared_page = 2 * align(P * H * D * vb) + align(P * sizeof(int32_t)) +
                             (int8 ? 2 * align(P * H * sizeof(float)) : 0);
  const size_t head_page = 2 * align(P * D * vb) + align(P * sizeof(int32_t)) + (int8 ? 2 * align(P * sizeof(float)) : 0);
  const size_t head_slot = 2 * D * vb + sizeof(int32_t) + (int8 ? 2 * sizeof(float) : 0);  // incl. its position copy
  EXPECT_EQ(cache->page_bytes(0), shared_page);
  EXPECT_EQ(cache->page_bytes(1), head_page);
  EXPECT_EQ(cache->token_bytes(1), head_slot);
  EXPECT_EQ(cache->tables_per_seq(0), 1);
  EXPECT_EQ(cache->tables_per_seq(1), H);
  EXPECT_FALSE(cache->per_head(0));
  EXPECT_TRUE(cache->per_head(1));

  std::mt19937 rng(22);
  ModelTable m0;
  std::vector<ModelTable> heads(H);
  auto head_ptrs = [&](std::vector<ModelTable>& tables) {
    std::vector<ModelTable*> ptrs;
    for (ModelTable& t : tables) ptrs.push_back(&t);
    return ptrs;
  };
  ASSERT_TRUE(AppendRandom(*cache, m0, 0, 0, 10, rng).ok());
  ASSERT_TRUE(AppendRandomTables(*cache, head_ptrs(heads), 0, 1, 10, rng).ok());
  for (int h = 0; h < H; ++h) EXPECT_TRUE(MatchesHeadModel(*cache, 0, 1, h, heads[h]));
  EXPECT_EQ(cache->LayerAllocatedBytes(1), 3 * 3 * head_page);
  EXPECT_EQ(cache->LayerLiveBytes(1), 30 * head_slot);
  cache->CheckInvariants();

  // Head 0 keeps all, head 1 the first 5, head 2 every third token.
  std::vector<std::vector<uint8_t>> keeps(H, std::vector<uint8_t>(10, 1));
  for (int i = 5; i < 10; ++i) keeps[1][i] = 0;
  for (int i = 0; i < 10; ++i) keeps[2][i] = i % 3 == 0;
  for (int h = 0; h < H; ++h) {
    ASSERT_TRUE(cache->Evict(0, 1, h, keeps[h]).ok());
    heads[h] = KeepRows(heads[h], keeps[h]);
  }
  EXPECT_EQ(cache->NumHeadTokens(0, 1, 0), 10);
  EXPECT_EQ(cache->NumHeadTokens(0, 1, 1), 5);
  EXPECT_EQ(cache->NumHeadTokens(0, 1, 2), 4);
  EXPECT_EQ(cache->NumTokens(0, 1), 10);      // the largest head
  EXPECT_EQ(cache->NumHeadTokens(0, 0, 2), 10);  // a shared layer: every head has all tokens
  for (int h = 0; h < H; ++h) EXPECT_TRUE(MatchesHeadModel(*cache, 0, 1, h, heads[h]));
  EXPECT_EQ(cache->LayerAllocatedBytes(1), (3 + 2 + 1) * head_page);
  EXPECT_EQ(cache->LayerLiveBytes(1), 19 * head_slot);
  EXPECT_EQ(cache->AllocatedBytes(), 3 * shared_page + 6 * head_page);
  EXPECT_EQ(cache->budget().used_bytes(), cache->AllocatedBytes());
  EXPECT_EQ(cache->LiveBytes(), 10 * cache->token_bytes(0) + 19 * head_slot);
  PagedKvStats stats = cache->Stats();
  EXPECT_FALSE(stats.layers[0].per_head);
  EXPECT_TRUE(stats.layers[1].per_head);
  EXPECT_EQ(stats.layers[1].tables_per_seq, H);
  EXPECT_EQ(stats.layers[1].pages, 6);
  EXPECT_EQ(stats.layers[1].live_tokens, 19);
  EXPECT_EQ(stats.layers[1].evicted_tokens, 5 + 6);
  EXPECT_EQ(stats.layers[1].live_bytes, 19 * head_slot);
  cache->CheckInvariants();

  // Wrong entry points and sizes are InvalidArgument naming the head.
  EXPECT_EQ(cache->Evict(0, 1, std::vector<uint8_t>(10, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Evict(0, 0, 0, std::vector<uint8_t>(10, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Evict(0, 1, H, {}).code(), StatusCode::kInvalidArgument);
  Status st = cache->Evict(0, 1, 1, std::vector<uint8_t>(10, 1));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("kv head 1"), std::string::npos) << st.message();
  // An append must follow every head's last position; a failure leaves every head unchanged.
  const std::vector<float> kv(H * D, 0.5f);
  const int32_t between = heads[1].back().pos + 1;  // after head 1's last, before head 0's
  ASSERT_LT(between, heads[0].back().pos);
  st = cache->Append(0, 1, 1, kv.data(), kv.data(), &between);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("kv head 0"), std::string::npos) << st.message();
  for (int h = 0; h < H; ++h) EXPECT_TRUE(MatchesHeadModel(*cache, 0, 1, h, heads[h]));

  // Fork shares every head table; appending to the fork copies only the shared last pages.
  ASSERT_TRUE(cache->Fork(0, 1).ok());
  std::vector<ModelTable> forked = heads;
  ModelTable m0_forked = m0;
  EXPECT_EQ(cache->AllocatedBytes(), 3 * shared_page + 6 * head_page);  // nothing copied
  ASSERT_TRUE(AppendRandomTables(*cache, head_ptrs(forked), 1, 1, 3, rng).ok());
  for (int h = 0; h < H; ++h) {
    EXPECT_TRUE(MatchesHeadModel(*cache, 0, 1, h, heads[h]));
    EXPECT_TRUE(MatchesHeadModel(*cache, 1, 1, h, forked[h]));
  }
  EXPECT_GT(cache->Stats().cow_pages, 0);
  cache->CheckInvariants();

  // RemoveRange drops the positions from every table of the sequence, shared or per head.
  const int32_t p0 = m0[2].pos, p1 = m0[7].pos;
  ASSERT_TRUE(cache->RemoveRange(1, p0, p1).ok());
  auto drop = [&](ModelTable& m) {
    m.erase(std::remove_if(m.begin(), m.end(), [&](const ModelToken& t) { return t.pos >= p0 && t.pos < p1; }),
            m.end());
  };
  drop(m0_forked);
  for (ModelTable& m : forked) drop(m);
  EXPECT_TRUE(MatchesModel(*cache, 1, 0, m0_forked));
  EXPECT_TRUE(MatchesModel(*cache, 0, 0, m0));
  for (int h = 0; h < H; ++h) {
    EXPECT_TRUE(MatchesHeadModel(*cache, 1, 1, h, forked[h]));
    EXPECT_TRUE(MatchesHeadModel(*cache, 0, 1, h, heads[h]));
  }
  EXPECT_GT(cache->Stats().layers[1].removed_tokens, 0);
  cache->CheckInvariants();

  ASSERT_TRUE(cache->KeepOnly(1).ok());
  for (int h = 0; h < H; ++h) EXPECT_EQ(cache->NumHeadTokens(0, 1, h), 0);
  cache->CheckInvariants();
  cache->Clear(1);
  cache->CheckInvariants();
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->budget().used_bytes(), 0u);
  EXPECT_EQ(cache->LiveBytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Storage, PagedKvCachePerHeadTest,
                         ::testing::Values(KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kFp8E4M3,
                                           KvStorage::kFp8E5M2, KvStorage::kBf16),
                         [](const ::testing::TestParamInfo<KvStorage>& info) {
                           return std::string(KvStorageName(info.param));
                         });

TEST(PagedKvCachePerHeadDeathTest, SpansOfTheWrongKindAbortWithAHint) {
  const KvGeometry geo{2, 2, 4};
  auto cache = MakePagedCache(geo, {KvStorage::kF32}, 1, 4, 1 << 16, {0, 1});
  std::vector<KvSpan> spans;
  EXPECT_DEATH(cache->Spans(0, 1, &spans), "HeadSpans");
  EXPECT_DEATH(cache->HeadSpans(0, 0, 0, &spans), "Spans\\(\\)");
  PagedKvCacheOptions options;
  options.budget_bytes = 1 << 16;
  options.layer_per_head = {1, 0, 1};  // neither 1 nor n_layers entries
  auto bad = PagedKvCache::Create(geo, options);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("layer_per_head"), std::string::npos) << bad.status().message();
}

// ---------------------------------------------------------------------------------------------
// Property test: random operations over several sequences and layers, checked after every
// operation against the model, with the pool accounting verified by CheckInvariants.

struct PropertyConfig {
  std::vector<KvStorage> storage;
  int32_t page_size;
  bool with_fork;
  std::vector<uint8_t> per_head = {};  // PagedKvCacheOptions::layer_per_head
};

std::string PerHeadName(const std::vector<uint8_t>& per_head) {
  std::string name;
  for (uint8_t x : per_head) name += x ? "H" : "S";
  return name.empty() ? name : "_" + name;
}

std::string StorageName(const std::vector<KvStorage>& s);

void PrintTo(const PropertyConfig& c, std::ostream* os) {
  *os << StorageName(c.storage) << " page " << c.page_size << (c.with_fork ? " fork" : " no-fork")
      << PerHeadName(c.per_head);
}

class PagedKvCachePropertyTest : public ::testing::TestWithParam<PropertyConfig> {};

TEST_P(PagedKvCachePropertyTest, RandomOperationsMatchTheModel) {
  const PropertyConfig& cfg = GetParam();
  const int n_seqs = 3;
  const KvGeometry geo{3, 2, 5};  // odd head_dim: ragged rows for every kernel
  const int32_t P = cfg.page_size;
  auto probe = MakePagedCache(geo, cfg.storage, n_seqs, P, 1 << 24, cfg.per_head);
  size_t budget = 0;
  for (int l = 0; l < geo.n_layers; ++l) {
    budget += probe->page_bytes(l) * probe->tables_per_seq(l) * n_seqs * ((20 + P - 1) / P);
  }
  auto cache = MakePagedCache(geo, cfg.storage, n_seqs, P, budget, cfg.per_head);

  std::mt19937 rng(1000 + P * 7 + static_cast<int>(cfg.storage.size()) + (cfg.with_fork ? 1 : 0) +
                   static_cast<int>(cfg.per_head.size()) * 13);
  // The model: one table per cache table, per sequence: layer l's tables are [first[l], first[l] + n_tables(l)).
  std::vector<int> first(geo.n_layers);
  int tables_per_seq = 0;
  for (int l = 0; l < geo.n_layers; ++l) {
    first[l] = tables_per_seq;
    tables_per_seq += cache->tables_per_seq(l);
  }
  std::vector<ModelTable> model(static_cast<size_t>(n_seqs) * tables_per_seq);
  auto T = [&](int seq, int layer, int head) -> ModelTable& {
    return model[static_cast<size_t>(seq) * tables_per_seq + first[layer] + head];
  };
  auto layer_tables = [&](int seq, int layer) {
    std::vector<ModelTable*> tables;
    for (int h = 0; h < cache->tables_per_seq(layer); ++h) tables.push_back(&T(seq, layer, h));
    return tables;
  };
  auto clear_layer = [&](int seq, int layer) {
    for (ModelTable* t : layer_tables(seq, layer)) t->clear();
  };
  int exhausted = 0, succeeded = 0, head_evictions = 0;

  auto check_all = [&](const std::string& op) {
    for (int s = 0; s < n_seqs; ++s) {
      for (int l = 0; l < geo.n_layers; ++l) {
        if (!cache->per_head(l)) {
          ASSERT_TRUE(MatchesModel(*cache, s, l, T(s, l, 0))) << "after " << op;
          continue;
        }
        for (int h = 0; h < geo.n_kv_heads; ++h) {
          ASSERT_TRUE(MatchesHeadModel(*cache, s, l, h, T(s, l, h))) << "after " << op;
        }
      }
    }
    cache->CheckInvariants();
    EXPECT_LE(cache->LiveBytes(), cache->AllocatedBytes());
    EXPECT_LE(cache->budget().used_bytes(), budget);
    for (int l = 0; l < geo.n_layers; ++l) {
      // Memory tracks live tokens: no layer holds more pages than its tables need, and
      // without sharing exactly that many.
      int64_t needed = 0;
      for (int s = 0; s < n_seqs; ++s) {
        for (int h = 0; h < cache->tables_per_seq(l); ++h) needed += (cache->NumHeadTokens(s, l, h) + P - 1) / P;
      }
      const int64_t pages = static_cast<int64_t>(cache->LayerAllocatedBytes(l) / cache->page_bytes(l));
      if (cfg.with_fork) {
        EXPECT_LE(pages, needed) << "after " << op;
      } else {
        EXPECT_EQ(pages, needed) << "after " << op;
      }
    }
  };

  for (int step = 0; step < 600; ++step) {
    const int seq = static_cast<int>(rng() % n_seqs);
    const int layer = static_cast<int>(rng() % geo.n_layers);
    const int r = static_cast<int>(rng() % 100);
    std::string op;
    Status st;
    if (r < 45) {
      op = "append";
      const int32_t n = 1 + static_cast<int32_t>(rng() % std::max(12, 2 * P + 2));
      if (rng() % 2 == 0) {
        st = AppendRandomTables(*cache, layer_tables(seq, layer), seq, layer, n, rng);
      } else {  // the engine's pattern: the same positions into every layer
        op = "append-all-layers";
        for (int l = 0; l < geo.n_layers && st.ok(); ++l) {
          st = AppendRandomTables(*cache, layer_tables(seq, l), seq, l, n, rng);
        }
      }
    } else if (r < 70) {
      op = "evict";
      // A per-head layer evicts one head at a time: its heads drift apart.
      const int head = cache->per_head(layer) ? static_cast<int>(rng() % geo.n_kv_heads) : -1;
      ModelTable& m = T(seq, layer, std::max(head, 0));
      std::vector<uint8_t> keep(m.size());
      const int kind = static_cast<int>(rng() % 4);
      for (size_t i = 0; i < keep.size(); ++i) {
        if (kind == 0) keep[i] = rng() % 10 < 7;                  // scattered
        if (kind == 1) keep[i] = i < keep.size() / 2;             // drop the tail
        if (kind == 2) keep[i] = i >= keep.size() / 3;            // drop the head
        if (kind == 3) keep[i] = i != keep.size() / 2;            // drop one in the middle
      }
      st = head >= 0 ? cache->Evict(seq, layer, head, keep) : cache->Evict(seq, layer, keep);
      if (st.ok()) {
        m = KeepRows(m, keep);
        head_evictions += head >= 0 ? 1 : 0;
      }
    } else if (r < 80) {
      op = "remove-range";
      const int32_t p0 = static_cast<int32_t>(rng() % 120) - 5;
      const int32_t p1 = rng() % 5 == 0 ? -1 : p0 + static_cast<int32_t>(rng() % 30);
      st = cache->RemoveRange(seq, p0, p1);
      if (st.ok()) {
        const int32_t begin = std::max(p0, 0), end = p1 < 0 ? INT32_MAX : p1;
        for (int l = 0; l < geo.n_layers; ++l) {
          for (ModelTable* m : layer_tables(seq, l)) {
            m->erase(std::remove_if(m->begin(), m->end(),
                                    [&](const ModelToken& t) { return t.pos >= begin && t.pos < end; }),
                     m->end());
          }
        }
      }
    } else if (r < 90) {
      if (!cfg.with_fork) continue;
      op = "fork";
      const int dst = static_cast<int>(rng() % n_seqs);
      st = cache->Fork(seq, dst);
      if (st.ok() && dst != seq) {
        for (int l = 0; l < geo.n_layers; ++l) {
          for (int h = 0; h < cache->tables_per_seq(l); ++h) T(dst, l, h) = T(seq, l, h);
        }
      }
    } else if (r < 93) {
      op = "keep-only";
      st = cache->KeepOnly(seq);
      for (int s = 0; s < n_seqs; ++s) {
        for (int l = 0; l < geo.n_layers; ++l) {
          if (s != seq) clear_layer(s, l);
        }
      }
    } else {
      op = "clear";
      cache->Clear(seq);
      for (int l = 0; l < geo.n_layers; ++l) clear_layer(seq, l);
    }
    if (st.ok()) {
      ++succeeded;
    } else {
      ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << op << ": " << st.ToString();
      ++exhausted;
    }
    // Tables grow until the budget pushes back; relieve pressure now and then.
    if (cache->budget().available_bytes() < budget / 10 && rng() % 4 == 0) {
      const int victim = static_cast<int>(rng() % n_seqs);
      cache->Clear(victim);
      for (int l = 0; l < geo.n_layers; ++l) clear_layer(victim, l);
    }
    check_all(op);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(succeeded, 300);
  EXPECT_GT(exhausted, 0) << "the budget never pushed back; the test lost its teeth";
  const PagedKvStats stats = cache->Stats();
  EXPECT_GT(stats.evicted_tokens, 0);
  EXPECT_GT(stats.moved_tokens, 0);
  if (cfg.with_fork) {
    EXPECT_GT(stats.cow_pages, 0);
  }
  bool any_per_head = false;
  for (int l = 0; l < geo.n_layers; ++l) any_per_head |= cache->per_head(l);
  if (any_per_head) {
    EXPECT_GT(head_evictions, 0);
  }
  for (int s = 0; s < n_seqs; ++s) cache->Clear(s);
  cache->CheckInvariants();
  EXPECT_EQ(cache->pages_in_use(), 0);
  EXPECT_EQ(cache->budget().used_bytes(), 0u);
  EXPECT_EQ(cache->AllocatedBytes(), 0u);
  EXPECT_EQ(cache->LiveBytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PagedKvCachePropertyTest,
    ::testing::Values(PropertyConfig{{KvStorage::kF32}, 1, true}, PropertyConfig{{KvStorage::kF32}, 3, true},
                      PropertyConfig{{KvStorage::kF32}, 16, true}, PropertyConfig{{KvStorage::kF32}, 4, false},
                      PropertyConfig{{KvStorage::kF16}, 4, true}, PropertyConfig{{KvStorage::kInt8}, 5, true},
                      PropertyConfig{{KvStorage::kInt8}, 16, false}, PropertyConfig{{KvStorage::kFp8E4M3}, 5, true},
                      PropertyConfig{{KvStorage::kF16, KvStorage::kInt8, KvStorage::kF32}, 3, true},
                      // Per-head layers, alone and mixed with shared ones.
                      PropertyConfig{{KvStorage::kF32}, 1, true, {1}}, PropertyConfig{{KvStorage::kInt8}, 4, true, {1}},
                      PropertyConfig{{KvStorage::kF16}, 5, false, {0, 1, 0}},
                      PropertyConfig{{KvStorage::kF16, KvStorage::kInt8, KvStorage::kF32}, 3, true, {1, 0, 1}}),
    [](const ::testing::TestParamInfo<PropertyConfig>& info) {
      return StorageName(info.param.storage) + "_page" + std::to_string(info.param.page_size) +
             (info.param.with_fork ? "_fork" : "_nofork") + PerHeadName(info.param.per_head);
    });

}  // namespace
}  // namespace kvsparse
