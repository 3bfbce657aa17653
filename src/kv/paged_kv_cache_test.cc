#include "kvsparse/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_quant.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/dtype.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

std::vector<float> RandomVector(size_t n, std::mt19937& rng) { return testing::RandomNonZeroFloats(n, rng); }

std::unique_ptr<PagedKvCache> MakeCache(const KvGeometry& geo, std::vector<KvStorage> storage, int n_seqs,
                                        int32_t page_size, size_t budget) {
  PagedKvCacheOptions options;
  options.n_seqs = n_seqs;
  options.page_size = page_size;
  options.budget_bytes = budget;
  options.layer_storage = std::move(storage);
  auto cache = PagedKvCache::Create(geo, options);
  KVS_CHECK_MSG(cache.ok(), cache.status().ToString());
  return std::move(cache).value();
}

// The reference model: the live tokens of one (seq, layer), in order.
struct ModelToken {
  int32_t pos;
  std::vector<float> k, v;  // [n_kv_heads, head_dim] as appended (f32)
};
using ModelTable = std::vector<ModelToken>;

// What the cache must hold for one row (K or V of one token) in `storage`: exact bytes.
struct EncodedRow {
  std::vector<uint8_t> values;  // [n_kv_heads, head_dim] in storage
  std::vector<float> scales;    // [n_kv_heads] (int8 only)
};

EncodedRow Encode(const std::vector<float>& x, KvStorage storage, int n_kv_heads, int head_dim) {
  EncodedRow e;
  e.values.resize(x.size() * KvStorageValueBytes(storage));
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
    case KvStorage::kInt8:
      e.scales.resize(n_kv_heads);
      ref::QuantizeKvRowsInt8(x.data(), n_kv_heads, head_dim, reinterpret_cast<int8_t*>(e.values.data()),
                              e.scales.data());
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
  if (storage == KvStorage::kInt8) {
    if (scales == nullptr) return ::testing::AssertionFailure() << "int8 span without scales";
    if (std::memcmp(scales, e.scales.data(), e.scales.size() * sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "int8 scales differ";
    }
  } else if (scales != nullptr) {
    return ::testing::AssertionFailure() << "scales on a non-int8 span";
  }
  return ::testing::AssertionSuccess();
}

// Spans equal the model token by token; every span but the last is a full page.
::testing::AssertionResult MatchesModel(const PagedKvCache& cache, int seq, int layer, const ModelTable& model) {
  const KvGeometry& geo = cache.geometry();
  const KvStorage storage = cache.layer_storage(layer);
  const size_t row_bytes = static_cast<size_t>(geo.n_kv_heads) * geo.head_dim * KvStorageValueBytes(storage);
  std::vector<KvSpan> spans;
  cache.Spans(seq, layer, &spans);
  if (cache.NumTokens(seq, layer) != static_cast<int32_t>(model.size())) {
    return ::testing::AssertionFailure() << "seq " << seq << " layer " << layer << ": NumTokens "
                                         << cache.NumTokens(seq, layer) << ", model " << model.size();
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

// Appends n random tokens at positions after `next_pos` to the cache and (on success) the model.
Status AppendRandom(PagedKvCache& cache, ModelTable& model, int seq, int layer, int32_t n, std::mt19937& rng) {
  const KvGeometry& geo = cache.geometry();
  const size_t row = static_cast<size_t>(geo.n_kv_heads) * geo.head_dim;
  const std::vector<float> k = RandomVector(n * row, rng), v = RandomVector(n * row, rng);
  std::vector<int32_t> pos(n);
  int32_t p = model.empty() ? static_cast<int32_t>(rng() % 3) : model.back().pos + 1;
  for (int32_t i = 0; i < n; ++i) {
    pos[i] = p;
    p += 1 + static_cast<int32_t>(rng() % 2);  // sometimes skip a position
  }
  Status st = cache.Append(seq, layer, n, k.data(), v.data(), pos.data());
  if (st.ok()) {
    for (int32_t i = 0; i < n; ++i) {
      model.push_back(ModelToken{pos[i], std::vector<float>(k.begin() + i * row, k.begin() + (i + 1) * row),
                                 std::vector<float>(v.begin() + i * row, v.begin() + (i + 1) * row)});
    }
  }
  return st;
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
  auto cache = MakeCache(geo, {GetParam()}, 2, 4, 1 << 20);
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
  auto cache = MakeCache(geo, {GetParam()}, 1, 4, 1 << 20);
  const size_t vb = KvStorageValueBytes(GetParam());
  const bool int8 = GetParam() == KvStorage::kInt8;
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
  if (GetParam() == KvStorage::kInt8) GTEST_SKIP() << "ContiguousKvCache stores f32/f16 only";
  const KvGeometry geo{2, 3, 10};
  auto paged = MakeCache(geo, {GetParam()}, 1, 5, 1 << 20);
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
  const size_t row_bytes = row * KvStorageValueBytes(GetParam());
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
  auto cache = MakeCache(geo, {GetParam()}, 3, 4, 1 << 20);
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
  auto cache = MakeCache(geo, {GetParam()}, 1, 3, 1 << 20);
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
                         ::testing::Values(KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8),
                         [](const ::testing::TestParamInfo<KvStorage>& info) {
                           return std::string(KvStorageName(info.param));
                         });

// ---------------------------------------------------------------------------------------------

TEST(PagedKvCacheTest, MixedStoragePerLayer) {
  const KvGeometry geo{3, 2, 16};
  auto cache = MakeCache(geo, {KvStorage::kF16, KvStorage::kF16, KvStorage::kInt8}, 1, 16, 1 << 20);
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

TEST(PagedKvCacheTest, SpansReusesTheOutputVector) {
  const KvGeometry geo{1, 1, 4};
  auto cache = MakeCache(geo, {KvStorage::kF32}, 1, 2, 1 << 20);
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
  auto probe = MakeCache(geo, {KvStorage::kF32}, 2, 4, 1 << 20);
  const size_t page = probe->page_bytes(0);
  auto cache = MakeCache(geo, {KvStorage::kF32}, 2, 4, 5 * page);
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
  auto cache = MakeCache(geo, {KvStorage::kF16}, 2, 4, 1 << 16);
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
  options.n_seqs = 0;
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
  auto cache = MakeCache(geo, {KvStorage::kF32}, 1, 3, 1 << 16);
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
// Property test: random operations over several sequences and layers, checked after every
// operation against the model, with the pool accounting verified by CheckInvariants.

struct PropertyConfig {
  std::vector<KvStorage> storage;
  int32_t page_size;
  bool with_fork;
};

std::string StorageName(const std::vector<KvStorage>& s);

void PrintTo(const PropertyConfig& c, std::ostream* os) {
  *os << StorageName(c.storage) << " page " << c.page_size << (c.with_fork ? " fork" : " no-fork");
}

class PagedKvCachePropertyTest : public ::testing::TestWithParam<PropertyConfig> {};

TEST_P(PagedKvCachePropertyTest, RandomOperationsMatchTheModel) {
  const PropertyConfig& cfg = GetParam();
  const int n_seqs = 3;
  const KvGeometry geo{3, 2, 5};  // odd head_dim: ragged rows for every kernel
  const int32_t P = cfg.page_size;
  auto probe = MakeCache(geo, cfg.storage, n_seqs, P, 1 << 24);
  size_t budget = 0;
  for (int l = 0; l < geo.n_layers; ++l) budget += probe->page_bytes(l) * n_seqs * ((20 + P - 1) / P);
  auto cache = MakeCache(geo, cfg.storage, n_seqs, P, budget);

  std::mt19937 rng(1000 + P * 7 + static_cast<int>(cfg.storage.size()) + (cfg.with_fork ? 1 : 0));
  std::vector<ModelTable> model(static_cast<size_t>(n_seqs) * geo.n_layers);
  auto M = [&](int seq, int layer) -> ModelTable& { return model[static_cast<size_t>(seq) * geo.n_layers + layer]; };
  int exhausted = 0, succeeded = 0;

  auto check_all = [&](const std::string& op) {
    for (int s = 0; s < n_seqs; ++s) {
      for (int l = 0; l < geo.n_layers; ++l) ASSERT_TRUE(MatchesModel(*cache, s, l, M(s, l))) << "after " << op;
    }
    cache->CheckInvariants();
    EXPECT_LE(cache->LiveBytes(), cache->AllocatedBytes());
    EXPECT_LE(cache->budget().used_bytes(), budget);
    for (int l = 0; l < geo.n_layers; ++l) {
      // Memory tracks live tokens: no layer holds more pages than its tables need, and
      // without sharing exactly that many.
      int64_t needed = 0;
      for (int s = 0; s < n_seqs; ++s) needed += (cache->NumTokens(s, l) + P - 1) / P;
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
        st = AppendRandom(*cache, M(seq, layer), seq, layer, n, rng);
      } else {  // the engine's pattern: the same positions into every layer
        op = "append-all-layers";
        for (int l = 0; l < geo.n_layers && st.ok(); ++l) st = AppendRandom(*cache, M(seq, l), seq, l, n, rng);
      }
    } else if (r < 70) {
      op = "evict";
      ModelTable& m = M(seq, layer);
      std::vector<uint8_t> keep(m.size());
      const int kind = static_cast<int>(rng() % 4);
      for (size_t i = 0; i < keep.size(); ++i) {
        if (kind == 0) keep[i] = rng() % 10 < 7;                  // scattered
        if (kind == 1) keep[i] = i < keep.size() / 2;             // drop the tail
        if (kind == 2) keep[i] = i >= keep.size() / 3;            // drop the head
        if (kind == 3) keep[i] = i != keep.size() / 2;            // drop one in the middle
      }
      st = cache->Evict(seq, layer, keep);
      if (st.ok()) {
        ModelTable kept;
        for (size_t i = 0; i < keep.size(); ++i) {
          if (keep[i]) kept.push_back(m[i]);
        }
        m = std::move(kept);
      }
    } else if (r < 80) {
      op = "remove-range";
      const int32_t p0 = static_cast<int32_t>(rng() % 120) - 5;
      const int32_t p1 = rng() % 5 == 0 ? -1 : p0 + static_cast<int32_t>(rng() % 30);
      st = cache->RemoveRange(seq, p0, p1);
      if (st.ok()) {
        const int32_t begin = std::max(p0, 0), end = p1 < 0 ? INT32_MAX : p1;
        for (int l = 0; l < geo.n_layers; ++l) {
          ModelTable& m = M(seq, l);
          m.erase(std::remove_if(m.begin(), m.end(),
                                 [&](const ModelToken& t) { return t.pos >= begin && t.pos < end; }),
                  m.end());
        }
      }
    } else if (r < 90) {
      if (!cfg.with_fork) continue;
      op = "fork";
      const int dst = static_cast<int>(rng() % n_seqs);
      st = cache->Fork(seq, dst);
      if (st.ok()) {
        for (int l = 0; l < geo.n_layers; ++l) M(dst, l) = M(seq, l);
      }
    } else if (r < 93) {
      op = "keep-only";
      st = cache->KeepOnly(seq);
      for (int s = 0; s < n_seqs; ++s) {
        for (int l = 0; l < geo.n_layers; ++l) {
          if (s != seq) M(s, l).clear();
        }
      }
    } else {
      op = "clear";
      cache->Clear(seq);
      for (int l = 0; l < geo.n_layers; ++l) M(seq, l).clear();
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
      for (int l = 0; l < geo.n_layers; ++l) M(victim, l).clear();
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
                      PropertyConfig{{KvStorage::kInt8}, 16, false},
                      PropertyConfig{{KvStorage::kF16, KvStorage::kInt8, KvStorage::kF32}, 3, true}),
    [](const ::testing::TestParamInfo<PropertyConfig>& info) {
      return StorageName(info.param.storage) + "_page" + std::to_string(info.param.page_size) +
             (info.param.with_fork ? "_fork" : "_nofork");
    });

}  // namespace
}  // namespace kvsparse
