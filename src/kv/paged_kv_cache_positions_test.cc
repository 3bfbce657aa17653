// PagedKvCache::RenumberPositions (StreamingLLM's positions within the cache):
// - ops::Rope with a negative position undoes a positive one, and matches its scalar twin;
// - after an eviction, every survivor sits at position = its index and its key equals its
//   unrotated key rotated at that new position: f32 within float rounding, f16 / int8 /
//   int8_kivi within the bound their extra rounding allows (stated per test); V is untouched,
//   tokens already in place keep their bytes;
// - per-head layers renumber each head table on its own;
// - a forked (shared) sequence is copied first and its sibling is unchanged, and copies that
//   do not fit the budget fail with the cache unchanged.
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
#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

constexpr int kHeads = 2;
constexpr int kHeadDim = 16;

std::vector<float> InvFreq(int head_dim, float base = 10000.f) {
  std::vector<float> f(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) f[i] = std::pow(base, -2.f * i / head_dim);
  return f;
}

const std::vector<float>& TestInvFreq() {
  static const std::vector<float> f = InvFreq(kHeadDim);
  return f;
}

KeyRotateFn Rotation(RopeStyle style) {
  return [style](float* k, int64_t n_rows, int32_t delta) {
    ops::Rope(k, static_cast<int>(n_rows), kHeadDim, delta, TestInvFreq().data(), style);
  };
}

std::unique_ptr<PagedKvCache> MakeCache(KvStorage storage, bool per_head, int n_seqs, int32_t page_size,
                                        size_t budget = size_t{64} << 20) {
  return testing::MakePagedCache(KvGeometry{1, kHeads, kHeadDim}, {storage}, n_seqs, page_size, budget,
                                 {static_cast<uint8_t>(per_head ? 1 : 0)});
}

// One table as f32: keys [n, rows, head_dim], positions, and V's stored bytes (values and scales).
struct TableView {
  std::vector<float> k;
  std::vector<int32_t> positions;
  std::vector<uint8_t> v_bytes;
  std::vector<std::vector<uint8_t>> k_page_bytes;  // per span: K values as stored
};

TableView Read(const PagedKvCache& cache, int seq, int head) {
  const KvStorage layer_storage = cache.layer_storage(0);
  std::vector<KvSpan> spans;
  int rows = kHeads;
  if (cache.per_head(0)) {
    cache.HeadSpans(seq, 0, head, &spans);
    rows = 1;
  } else {
    cache.Spans(seq, 0, &spans);
  }
  TableView view;
  for (const KvSpan& s : spans) {
    const KvStorage storage = SpanStorage(layer_storage, s);
    const size_t values = static_cast<size_t>(s.n) * rows * kHeadDim;
    std::vector<float> k(values);
    switch (storage) {
      case KvStorage::kF32: std::memcpy(k.data(), s.k, values * sizeof(float)); break;
      case KvStorage::kF16: ops::DequantizeRow(DType::kF16, s.k, k.data(), static_cast<int64_t>(values)); break;
      case KvStorage::kBf16: ops::DequantizeRow(DType::kBF16, s.k, k.data(), static_cast<int64_t>(values)); break;
      case KvStorage::kInt8:
        ops::DequantizeKvRowsInt8(static_cast<const int8_t*>(s.k), s.k_scale, static_cast<int64_t>(s.n) * rows,
                                  kHeadDim, k.data());
        break;
      case KvStorage::kInt8Kivi:
        ops::DequantizeKvColumnsInt8(static_cast<const int8_t*>(s.k), s.k_channel_scale, s.n, rows * kHeadDim,
                                     k.data());
        break;
      case KvStorage::kFp8E4M3:
      case KvStorage::kFp8E5M2:
        ops::DequantizeKvRowsFp8(storage, static_cast<const uint8_t*>(s.k), s.k_scale, static_cast<int64_t>(s.n) * rows,
                                 kHeadDim, k.data());
        break;
      case KvStorage::kInt4Kivi:
      case KvStorage::kInt2Kivi:
        ops::DequantizeKvColumnsAsym(KvStorageBits(storage), static_cast<const uint8_t*>(s.k), s.k_group_scale,
                                     s.k_group_min, s.n, rows * kHeadDim, k.data());
        break;
    }
    view.k.insert(view.k.end(), k.begin(), k.end());
    view.positions.insert(view.positions.end(), s.positions, s.positions + s.n);
    const size_t value_bytes = KvRowBytes(storage, values);
    const auto* v = static_cast<const uint8_t*>(s.v);
    view.v_bytes.insert(view.v_bytes.end(), v, v + value_bytes);
    if (s.v_scale != nullptr) {
      const auto* vs = reinterpret_cast<const uint8_t*>(s.v_scale);
      view.v_bytes.insert(view.v_bytes.end(), vs, vs + static_cast<size_t>(s.n) * rows * sizeof(float));
    }
    if (s.v_group_scale != nullptr) {  // int4 / int2 KIVI: V's f16 group scales and mins
      const size_t bytes = static_cast<size_t>(s.n) * rows * s.v_groups * sizeof(f16_bits);
      const auto* vs = reinterpret_cast<const uint8_t*>(s.v_group_scale);
      const auto* vm = reinterpret_cast<const uint8_t*>(s.v_group_min);
      view.v_bytes.insert(view.v_bytes.end(), vs, vs + bytes);
      view.v_bytes.insert(view.v_bytes.end(), vm, vm + bytes);
    }
    const auto* kb = static_cast<const uint8_t*>(s.k);
    view.k_page_bytes.emplace_back(kb, kb + value_bytes);
  }
  return view;
}

// Unrotated keys of the test tokens, and the stored (rotated at their position) inputs.
struct Tokens {
  std::vector<float> raw;  // [n, kHeads, kHeadDim] before RoPE
  std::vector<float> k;    // [n, kHeads, kHeadDim] after RoPE at positions[i]
  std::vector<float> v;
  std::vector<int32_t> positions;
};

Tokens MakeTokens(int32_t n, int32_t first_position, RopeStyle style, std::mt19937& rng) {
  Tokens t;
  const size_t row = static_cast<size_t>(kHeads) * kHeadDim;
  t.raw = testing::RandomNonZeroFloats(n * row, rng);
  t.v = testing::RandomNonZeroFloats(n * row, rng);
  t.k = t.raw;
  for (int32_t i = 0; i < n; ++i) {
    t.positions.push_back(first_position + i);
    ref::Rope(t.k.data() + i * row, kHeads, kHeadDim, first_position + i, TestInvFreq().data(), style);
  }
  return t;
}

// Largest norm of a rotated pair in head `head` of the raw keys: a bound on every element of
// that head's keys at any position.
float MaxPairNorm(const Tokens& t, int head) {
  const size_t row = static_cast<size_t>(kHeads) * kHeadDim;
  float m = 0;
  for (size_t i = 0; i < t.positions.size(); ++i) {
    const float* x = t.raw.data() + i * row + head * kHeadDim;
    for (int d = 0; d < kHeadDim / 2; ++d) {
      // Both styles pair each element with one other; the larger pairing bounds both.
      m = std::max(m, std::hypot(x[2 * d], x[2 * d + 1]));
      m = std::max(m, std::hypot(x[d], x[d + kHeadDim / 2]));
    }
  }
  return m;
}

// Per-element error bound, relative to the head's largest pair norm M, after one eviction
// and one renumbering, by storage:
//   f32: float rounding of the angles (positions < 200): 1e-4 M.
//   f16: two roundings of a value <= M by 2^-11 relative, the first rotated (pair norm kept):
//        (sqrt2 + 1) 2^-11 M < 1.5e-3 M; with the f32 part, 2e-3 M.
//   int8: two quantizations with scales <= M / 127 (half a step each, the first rotated):
//        (sqrt2 + 1) M / 254 < 0.0096 M; 0.012 M.
//   int8_kivi: eviction regroups (requantizes) keys once more: 3 half steps rotated: 0.02 M.
//   fp8: two roundings by at most 2^-(M+1) relative (ops/kv_quant.h), the first rotated:
//        (sqrt2 + 1) 2^-4 M < 0.151 M (e4m3), (sqrt2 + 1) 2^-3 M < 0.302 M (e5m2); subnormal
//        steps are far smaller.
//   int4 / int2 KIVI: as int8_kivi (about 5 half steps), with steps of up to 2M / 15 and 2M / 3:
//        0.34 M and 1.7 M -- 2 bits keep little of a key.
float Tolerance(KvStorage storage) {
  switch (storage) {
    case KvStorage::kF32: return 1e-4f;
    case KvStorage::kF16: return 2e-3f;
    case KvStorage::kBf16: return 8e-3f;  // as f16 with 2^-9 for 2^-11: (sqrt2 + 1) 2^-9 M < 0.0048 M
    case KvStorage::kInt8: return 0.012f;
    case KvStorage::kInt8Kivi: return 0.02f;
    case KvStorage::kFp8E4M3: return 0.16f;
    case KvStorage::kFp8E5M2: return 0.31f;
    case KvStorage::kInt4Kivi:
      return 0.34f;
    case KvStorage::kInt2Kivi:
      return 1.7f;
  }
  return 0;
}

// keep mask of StreamingLLM type (sinks + recent) or a scattered one.
std::vector<uint8_t> KeepMask(int32_t n, int32_t sinks, int32_t recent, int scatter_seed) {
  std::vector<uint8_t> keep(n, 0);
  for (int32_t i = 0; i < std::min(sinks, n); ++i) keep[i] = 1;
  for (int32_t i = std::max(0, n - recent); i < n; ++i) keep[i] = 1;
  if (scatter_seed > 0) {
    std::mt19937 rng(scatter_seed);
    for (int32_t i = sinks; i < n - recent; ++i) keep[i] = rng() % 3 == 0;
  }
  return keep;
}

// Checks table (seq, head) after renumbering: positions 0..n-1 and each key = raw key of the
// original token rotated at its new index, within the storage's tolerance.
void ExpectRenumbered(const PagedKvCache& cache, int seq, int head, const Tokens& tokens,
                      const std::vector<int32_t>& survivors, RopeStyle style, const std::string& what) {
  const TableView view = Read(cache, seq, head);
  ASSERT_EQ(view.positions.size(), survivors.size()) << what;
  const int rows = cache.per_head(0) ? 1 : kHeads;
  const size_t in_row = static_cast<size_t>(kHeads) * kHeadDim;
  const float tol = Tolerance(cache.layer_storage(0));
  std::vector<float> want(kHeadDim);
  for (size_t j = 0; j < survivors.size(); ++j) {
    ASSERT_EQ(view.positions[j], static_cast<int32_t>(j)) << what;
    for (int r = 0; r < rows; ++r) {
      const int h = cache.per_head(0) ? head : r;
      const float* raw = tokens.raw.data() + survivors[j] * in_row + h * kHeadDim;
      std::copy(raw, raw + kHeadDim, want.begin());
      ref::Rope(want.data(), 1, kHeadDim, static_cast<int32_t>(j), TestInvFreq().data(), style);
      const float bound = tol * MaxPairNorm(tokens, h);
      const float* got = view.k.data() + (j * rows + r) * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) {
        ASSERT_NEAR(got[d], want[d], bound) << what << ": token " << j << " (was " << survivors[j] << ") head " << h
                                            << " dim " << d;
      }
    }
  }
}

TEST(RopeNegativePosition, UndoesPositiveAndMatchesReference) {
  std::mt19937 rng(3);
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kNeox}) {
    for (int32_t pos : {1, 7, 130, 4097}) {
      const std::vector<float> x = testing::RandomNonZeroFloats(3 * kHeadDim, rng);
      std::vector<float> fast = x, ref_out = x;
      ops::Rope(fast.data(), 3, kHeadDim, -pos, TestInvFreq().data(), style);
      ref::Rope(ref_out.data(), 3, kHeadDim, -pos, TestInvFreq().data(), style);
      for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(fast[i], ref_out[i], 1e-6f) << "pos " << -pos;
      ops::Rope(fast.data(), 3, kHeadDim, pos, TestInvFreq().data(), style);
      for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(fast[i], x[i], 1e-5f * (1 + pos / 100.f)) << "pos " << pos;
      // Composition: rotate at 11, then by pos - 11 == rotate at pos.
      std::vector<float> composed = x, direct = x;
      ops::Rope(composed.data(), 3, kHeadDim, 11, TestInvFreq().data(), style);
      ops::Rope(composed.data(), 3, kHeadDim, pos - 11, TestInvFreq().data(), style);
      ops::Rope(direct.data(), 3, kHeadDim, pos, TestInvFreq().data(), style);
      for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(composed[i], direct[i], 1e-5f * (1 + pos / 100.f));
    }
  }
}

// Every storage type, both RoPE styles, pages of 5 (ragged), StreamingLLM and scattered masks.
TEST(PagedKvCacheRenumber, SurvivorsAreRotatedToTheirNewPositions) {
  const int32_t n = 47;
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kNeox}) {
      for (int scatter : {0, 9}) {
        const std::string what = std::string(KvStorageName(storage)) +
                                 (style == RopeStyle::kNeox ? " neox" : " adjacent") +
                                 (scatter ? " scattered" : " sinks+recent");
        std::mt19937 rng(17 + scatter);
        const Tokens tokens = MakeTokens(n, 0, style, rng);
        auto cache = MakeCache(storage, false, 1, 5);
        ASSERT_TRUE(cache->Append(0, 0, n, tokens.k.data(), tokens.v.data(), tokens.positions.data()).ok());
        const TableView before = Read(*cache, 0, 0);
        const std::vector<uint8_t> keep = KeepMask(n, 4, 13, scatter);
        std::vector<int32_t> survivors;
        for (int32_t i = 0; i < n; ++i)
          if (keep[i]) survivors.push_back(i);
        ASSERT_TRUE(cache->Evict(0, 0, keep).ok()) << what;
        const TableView evicted = Read(*cache, 0, 0);
        int64_t rotated = -1;
        ASSERT_TRUE(cache->RenumberPositions(0, 0, -1, Rotation(style), &rotated).ok()) << what;
        cache->CheckInvariants();
        ExpectRenumbered(*cache, 0, 0, tokens, survivors, style, what);
        int32_t in_place = 0;
        while (in_place < static_cast<int32_t>(survivors.size()) && survivors[in_place] == in_place) ++in_place;
        EXPECT_EQ(rotated, static_cast<int64_t>(survivors.size()) - in_place) << what;
        EXPECT_EQ(cache->Stats().rerotated_tokens, rotated) << what;
        const TableView after = Read(*cache, 0, 0);
        EXPECT_EQ(after.v_bytes, evicted.v_bytes) << what << ": V must not change";
        // The sinks' page keeps its bytes (pages of 5, 4 sinks: page 0 starts with them, and
        // with no scattered survivors nothing before the recent window moves).
        if (!scatter && !IsKiviStorage(storage)) {
          EXPECT_EQ(std::memcmp(after.k_page_bytes[0].data(), before.k_page_bytes[0].data(),
                                KvRowBytes(storage, 4 * kHeads * kHeadDim)),
                    0)
              << what;
        }
        // A second renumbering finds nothing to do.
        ASSERT_TRUE(cache->RenumberPositions(0, 0, -1, Rotation(style), &rotated).ok());
        EXPECT_EQ(rotated, 0) << what;
        EXPECT_EQ(Read(*cache, 0, 0).k, after.k) << what;
      }
    }
  }
}

// Per-head layers: heads keep different tokens, and each head table is renumbered on its own.
TEST(PagedKvCacheRenumber, PerHeadTablesRenumberEachHead) {
  const int32_t n = 40;
  const RopeStyle style = RopeStyle::kNeox;
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    std::mt19937 rng(5);
    const Tokens tokens = MakeTokens(n, 0, style, rng);
    auto cache = MakeCache(storage, true, 1, 8);
    ASSERT_TRUE(cache->Append(0, 0, n, tokens.k.data(), tokens.v.data(), tokens.positions.data()).ok());
    std::vector<std::vector<int32_t>> survivors(kHeads);
    for (int h = 0; h < kHeads; ++h) {
      const std::vector<uint8_t> keep = KeepMask(n, 2 + h, 9, 3 + h);
      for (int32_t i = 0; i < n; ++i)
        if (keep[i]) survivors[h].push_back(i);
      ASSERT_TRUE(cache->Evict(0, 0, h, keep).ok());
    }
    ASSERT_NE(survivors[0], survivors[1]);
    // One head alone first, then the whole layer (the other head).
    ASSERT_TRUE(cache->RenumberPositions(0, 0, 1, Rotation(style)).ok());
    EXPECT_NE(Read(*cache, 0, 0).positions.back(), static_cast<int32_t>(survivors[0].size()) - 1);
    ASSERT_TRUE(cache->RenumberPositions(0, 0, -1, Rotation(style)).ok());
    cache->CheckInvariants();
    for (int h = 0; h < kHeads; ++h) {
      ExpectRenumbered(*cache, 0, h, tokens, survivors[h], style, std::string(KvStorageName(storage)) + " head " +
                                                                       std::to_string(h));
      EXPECT_EQ(cache->LastTokenPosition(0, 0, h), static_cast<int32_t>(survivors[h].size()) - 1);
    }
  }
}

// A forked sequence shares its pages: renumbering one copies the pages it changes and leaves
// the other's keys and positions bit for bit; with no room for the copies it fails cleanly.
TEST(PagedKvCacheRenumber, SharedPagesAreCopiedFirst) {
  const int32_t n = 30;
  const RopeStyle style = RopeStyle::kAdjacentPairs;
  for (KvStorage storage : {KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi, KvStorage::kFp8E4M3,
                            KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi, KvStorage::kInt2Kivi}) {
    const std::string what(KvStorageName(storage));
    std::mt19937 rng(11);
    const Tokens tokens = MakeTokens(n, 0, style, rng);
    auto cache = MakeCache(storage, false, 2, 8);
    ASSERT_TRUE(cache->Append(0, 0, n, tokens.k.data(), tokens.v.data(), tokens.positions.data()).ok());
    ASSERT_TRUE(cache->Fork(0, 1).ok());
    const std::vector<uint8_t> keep = KeepMask(n, 4, 10, 0);
    std::vector<int32_t> survivors;
    for (int32_t i = 0; i < n; ++i)
      if (keep[i]) survivors.push_back(i);
    ASSERT_TRUE(cache->Evict(1, 0, keep).ok());
    const TableView original = Read(*cache, 0, 0);
    const int64_t cow_before = cache->Stats().cow_pages;
    ASSERT_TRUE(cache->RenumberPositions(1, 0, -1, Rotation(style)).ok()) << what;
    cache->CheckInvariants();
    ExpectRenumbered(*cache, 1, 0, tokens, survivors, style, what + " fork");
    const TableView sibling = Read(*cache, 0, 0);
    EXPECT_EQ(sibling.k_page_bytes, original.k_page_bytes) << what;
    EXPECT_EQ(sibling.positions, original.positions) << what;
    EXPECT_EQ(cache->Stats().cow_pages, cow_before) << what << ": the eviction already copied them";

    // Tokens appended at positions 5..24 (3 pages) all move; the fork's pages are all shared.
    const Tokens offset = MakeTokens(20, 5, style, rng);
    auto forked = MakeCache(storage, false, 2, 8);
    ASSERT_TRUE(forked->Append(0, 0, 20, offset.k.data(), offset.v.data(), offset.positions.data()).ok());
    ASSERT_TRUE(forked->Fork(0, 1).ok());
    const TableView shared = Read(*forked, 0, 0);
    ASSERT_TRUE(forked->RenumberPositions(1, 0, -1, Rotation(style)).ok()) << what;
    forked->CheckInvariants();
    EXPECT_EQ(forked->Stats().cow_pages, 3) << what;
    std::vector<int32_t> all(20);
    for (int32_t i = 0; i < 20; ++i) all[i] = i;
    ExpectRenumbered(*forked, 1, 0, offset, all, style, what + " offset fork");
    EXPECT_EQ(Read(*forked, 0, 0).k_page_bytes, shared.k_page_bytes) << what;
    EXPECT_EQ(Read(*forked, 0, 0).positions, shared.positions) << what;
  }
  // Budget: tokens appended at positions 5.. all need renumbering; the fork's copies do not fit.
  std::mt19937 rng(2);
  const Tokens tokens = MakeTokens(20, 5, style, rng);
  auto probe = MakeCache(KvStorage::kF16, false, 2, 8);
  const size_t exact = 3 * probe->page_bytes(0);  // the 3 pages of 20 tokens
  auto cache = MakeCache(KvStorage::kF16, false, 2, 8, exact);
  ASSERT_TRUE(cache->Append(0, 0, 20, tokens.k.data(), tokens.v.data(), tokens.positions.data()).ok());
  ASSERT_TRUE(cache->Fork(0, 1).ok());
  const TableView before = Read(*cache, 1, 0);
  const Status s = cache->RenumberPositions(1, 0, -1, Rotation(style));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("renumber-positions"), std::string::npos) << s.message();
  const TableView after = Read(*cache, 1, 0);
  EXPECT_EQ(after.positions, before.positions);
  EXPECT_EQ(after.k_page_bytes, before.k_page_bytes);
  cache->CheckInvariants();
  // Without the fork it renumbers in place: 5..24 -> 0..19.
  ASSERT_TRUE(cache->KeepOnly(1).ok());
  ASSERT_TRUE(cache->RenumberPositions(1, 0, -1, Rotation(style)).ok());
  std::vector<int32_t> all(20);
  for (int32_t i = 0; i < 20; ++i) all[i] = i;
  ExpectRenumbered(*cache, 1, 0, tokens, all, style, "in place after KeepOnly");
}

TEST(PagedKvCacheRenumber, RejectsBadArguments) {
  auto cache = MakeCache(KvStorage::kF32, false, 1, 4);
  EXPECT_EQ(cache->RenumberPositions(1, 0, -1, Rotation(RopeStyle::kNeox)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->RenumberPositions(0, 2, -1, Rotation(RopeStyle::kNeox)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->RenumberPositions(0, 0, 0, Rotation(RopeStyle::kNeox)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->RenumberPositions(0, 0, -1, KeyRotateFn()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->LastTokenPosition(0, 0), -1);
}

}  // namespace
}  // namespace kvsparse
