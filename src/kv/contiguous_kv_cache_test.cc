#include "kvsparse/contiguous_kv_cache.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvsparse/dtype.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

std::vector<float> RandomVector(size_t n, std::mt19937& rng) { return testing::RandomNonZeroFloats(n, rng); }

class ContiguousKvCacheTest : public ::testing::TestWithParam<KvStorage> {};

TEST_P(ContiguousKvCacheTest, AppendThenSpansReturnsStoredRows) {
  const KvGeometry geo{3, 2, 24};
  ContiguousKvCache cache(geo, GetParam(), 2, 16);
  std::mt19937 rng(7);
  const size_t row = geo.n_kv_heads * geo.head_dim;
  std::vector<float> k1 = RandomVector(5 * row, rng), v1 = RandomVector(5 * row, rng);
  std::vector<float> k2 = RandomVector(3 * row, rng), v2 = RandomVector(3 * row, rng);
  std::vector<int32_t> p1 = {0, 1, 2, 4, 9}, p2 = {10, 20, 21};
  ASSERT_TRUE(cache.Append(1, 2, 5, k1.data(), v1.data(), p1.data()).ok());
  ASSERT_TRUE(cache.Append(1, 2, 3, k2.data(), v2.data(), p2.data()).ok());
  EXPECT_EQ(cache.NumTokens(1, 2), 8);

  std::vector<KvSpan> spans;
  cache.Spans(1, 2, &spans);
  ASSERT_EQ(spans.size(), 1u);
  ASSERT_EQ(spans[0].n, 8);
  std::vector<float> k_all = k1, v_all = v1;
  k_all.insert(k_all.end(), k2.begin(), k2.end());
  v_all.insert(v_all.end(), v2.begin(), v2.end());
  std::vector<int32_t> p_all = p1;
  p_all.insert(p_all.end(), p2.begin(), p2.end());
  for (int t = 0; t < 8; ++t) EXPECT_EQ(spans[0].positions[t], p_all[t]);
  for (size_t i = 0; i < k_all.size(); ++i) {
    float k_got, v_got, k_want = k_all[i], v_want = v_all[i];
    if (GetParam() == KvStorage::kF16) {
      k_got = F16ToF32(static_cast<const f16_bits*>(spans[0].k)[i]);
      v_got = F16ToF32(static_cast<const f16_bits*>(spans[0].v)[i]);
      k_want = F16ToF32(F32ToF16(k_want));  // the cache must round exactly like F32ToF16
      v_want = F16ToF32(F32ToF16(v_want));
    } else {
      k_got = static_cast<const float*>(spans[0].k)[i];
      v_got = static_cast<const float*>(spans[0].v)[i];
    }
    ASSERT_EQ(k_got, k_want) << "element " << i;
    ASSERT_EQ(v_got, v_want) << "element " << i;
  }
}

TEST_P(ContiguousKvCacheTest, SequencesAndLayersAreIndependent) {
  const KvGeometry geo{2, 1, 16};
  ContiguousKvCache cache(geo, GetParam(), 3, 8);
  std::mt19937 rng(11);
  std::vector<float> k = RandomVector(4 * 16, rng), v = RandomVector(4 * 16, rng);
  std::vector<int32_t> pos = {3, 4, 5, 6};
  ASSERT_TRUE(cache.Append(0, 1, 4, k.data(), v.data(), pos.data()).ok());
  ASSERT_TRUE(cache.Append(2, 0, 2, k.data(), v.data(), pos.data()).ok());
  EXPECT_EQ(cache.NumTokens(0, 0), 0);
  EXPECT_EQ(cache.NumTokens(0, 1), 4);
  EXPECT_EQ(cache.NumTokens(1, 0), 0);
  EXPECT_EQ(cache.NumTokens(1, 1), 0);
  EXPECT_EQ(cache.NumTokens(2, 0), 2);
  EXPECT_EQ(cache.NumTokens(2, 1), 0);
  // Positions are per (seq, layer): restarting at 0 in another slot is fine.
  std::vector<int32_t> pos0 = {0};
  EXPECT_TRUE(cache.Append(1, 1, 1, k.data(), v.data(), pos0.data()).ok());

  std::vector<KvSpan> spans = {KvSpan{}};
  cache.Spans(1, 0, &spans);
  EXPECT_TRUE(spans.empty());  // replaces previous contents; an empty slot has no spans

  cache.Clear(0);
  EXPECT_EQ(cache.NumTokens(0, 1), 0);
  EXPECT_EQ(cache.NumTokens(2, 0), 2);
  // After Clear the sequence starts over at any position.
  EXPECT_TRUE(cache.Append(0, 1, 1, k.data(), v.data(), pos0.data()).ok());
}

TEST_P(ContiguousKvCacheTest, FullCacheIsResourceExhaustedAndUnchanged) {
  const KvGeometry geo{4, 2, 8};
  ContiguousKvCache cache(geo, GetParam(), 2, 4);
  std::mt19937 rng(3);
  std::vector<float> k = RandomVector(5 * 16, rng), v = RandomVector(5 * 16, rng);
  std::vector<int32_t> pos = {0, 1, 2, 3, 4};
  ASSERT_TRUE(cache.Append(1, 3, 3, k.data(), v.data(), pos.data()).ok());
  Status st = cache.Append(1, 3, 2, k.data(), v.data(), pos.data() + 3);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("seq 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("layer 3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("4"), std::string::npos) << st.message();
  EXPECT_EQ(cache.NumTokens(1, 3), 3);
  EXPECT_TRUE(cache.Append(1, 3, 1, k.data(), v.data(), pos.data() + 3).ok());
  EXPECT_EQ(cache.Append(1, 3, 1, k.data(), v.data(), pos.data() + 4).code(), StatusCode::kResourceExhausted);
}

TEST_P(ContiguousKvCacheTest, NonIncreasingPositionsAreRejected) {
  const KvGeometry geo{1, 1, 4};
  ContiguousKvCache cache(geo, GetParam(), 1, 8);
  std::mt19937 rng(5);
  std::vector<float> k = RandomVector(3 * 4, rng), v = RandomVector(3 * 4, rng);
  std::vector<int32_t> ok_pos = {5, 7};
  ASSERT_TRUE(cache.Append(0, 0, 2, k.data(), v.data(), ok_pos.data()).ok());
  std::vector<int32_t> repeat = {7};
  EXPECT_EQ(cache.Append(0, 0, 1, k.data(), v.data(), repeat.data()).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> lower = {6};
  EXPECT_EQ(cache.Append(0, 0, 1, k.data(), v.data(), lower.data()).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> unsorted_batch = {9, 8};
  EXPECT_EQ(cache.Append(0, 0, 2, k.data(), v.data(), unsorted_batch.data()).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> negative = {-1};
  ContiguousKvCache fresh(geo, GetParam(), 1, 8);
  EXPECT_EQ(fresh.Append(0, 0, 1, k.data(), v.data(), negative.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.NumTokens(0, 0), 2);  // failed appends store nothing
}

TEST_P(ContiguousKvCacheTest, BadIndicesAreInvalidArgument) {
  const KvGeometry geo{2, 1, 4};
  ContiguousKvCache cache(geo, GetParam(), 2, 8);
  std::vector<float> k(4, 1.f), v(4, 1.f);
  std::vector<int32_t> pos = {0};
  EXPECT_EQ(cache.Append(2, 0, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(-1, 0, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(0, 2, 1, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(0, 0, -3, k.data(), v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(0, 0, 1, nullptr, v.data(), pos.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(cache.Append(0, 0, 0, nullptr, nullptr, nullptr).ok());  // nothing to store
}

TEST_P(ContiguousKvCacheTest, ByteAccounting) {
  const KvGeometry geo{3, 2, 32};
  const int n_seqs = 2;
  const int32_t max_tokens = 10;
  ContiguousKvCache cache(geo, GetParam(), n_seqs, max_tokens);
  const size_t elem = GetParam() == KvStorage::kF16 ? 2 : 4;
  const size_t row_bytes = geo.n_kv_heads * geo.head_dim * elem;
  EXPECT_EQ(cache.AllocatedBytes(), n_seqs * geo.n_layers * max_tokens * row_bytes * 2);
  EXPECT_EQ(cache.LiveBytes(), 0u);
  std::mt19937 rng(9);
  std::vector<float> k = RandomVector(7 * 64, rng), v = RandomVector(7 * 64, rng);
  std::vector<int32_t> pos = {0, 1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(cache.Append(0, 0, 7, k.data(), v.data(), pos.data()).ok());
  ASSERT_TRUE(cache.Append(1, 2, 3, k.data(), v.data(), pos.data()).ok());
  EXPECT_EQ(cache.LiveBytes(), 10 * row_bytes * 2);
  cache.Clear(0);
  EXPECT_EQ(cache.LiveBytes(), 3 * row_bytes * 2);
  EXPECT_EQ(cache.AllocatedBytes(), n_seqs * geo.n_layers * max_tokens * row_bytes * 2);
}

// int8 needs per-row scales: the dense cache refuses it with an error instead of misbehaving.
TEST(ContiguousKvCacheInt8Test, Int8IsUnimplemented) {
  const KvGeometry geo{2, 2, 8};
  ContiguousKvCache cache(geo, KvStorage::kInt8, 1, 4);
  std::vector<float> k(16, 1.f), v(16, 1.f);
  std::vector<int32_t> pos = {0};
  Status st = cache.Append(0, 0, 1, k.data(), v.data(), pos.data());
  EXPECT_EQ(st.code(), StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("int8"), std::string::npos) << st.message();
  EXPECT_EQ(cache.NumTokens(0, 0), 0);
  EXPECT_EQ(cache.AllocatedBytes(), 0u);
  std::vector<KvSpan> spans;
  cache.Spans(0, 0, &spans);
  EXPECT_TRUE(spans.empty());
}

INSTANTIATE_TEST_SUITE_P(Storage, ContiguousKvCacheTest, ::testing::Values(KvStorage::kF32, KvStorage::kF16),
                         [](const ::testing::TestParamInfo<KvStorage>& info) {
                           return info.param == KvStorage::kF16 ? std::string("F16") : std::string("F32");
                         });

}  // namespace
}  // namespace kvsparse
