// ops::MergeWeightedToken (attention.h): a token folded in with weight N after Attention gives
// what the reference attention gives over the same tokens plus N copies of it, with and without
// softcap, for decode and prompt rows; a row that saw nothing becomes the token's value.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvsparse/attention.h"
#include "ops/attention_test_util.h"

namespace kvsparse {
namespace {

TEST(MergeWeightedToken, EqualsAttentionOverCopiesOfTheToken) {
  std::mt19937 rng(11);
  const int head_dim = 24, n_heads = 4;  // one kv head: a per-head table's group
  for (const float softcap : {0.f, 5.f}) {
    for (const int32_t weight : {1, 7}) {
      const AttentionShape shape{n_heads, 1, head_dim, 0.3f, 0, softcap};
      // The copies come first (positions 0 .. weight-1), then the cached tokens.
      testing::SpanSet copies = testing::MakeSpans(KvStorage::kF32, {weight}, 1, head_dim, rng);
      for (int32_t t = 1; t < weight; ++t) {  // every copy the same (k, v)
        std::copy(copies.k_f32[0].begin(), copies.k_f32[0].begin() + head_dim,
                  copies.k_f32[0].begin() + static_cast<size_t>(t) * head_dim);
        std::copy(copies.v_f32[0].begin(), copies.v_f32[0].begin() + head_dim,
                  copies.v_f32[0].begin() + static_cast<size_t>(t) * head_dim);
      }
      const int32_t first = copies.positions[0].back() + 1;
      const testing::SpanSet cached = testing::MakeSpans(KvStorage::kF32, {9, 30}, 1, head_dim, rng, first);
      std::vector<KvSpan> all = copies.spans;
      all.insert(all.end(), cached.spans.begin(), cached.spans.end());
      const int32_t last = cached.positions.back().back();
      // Prompt rows, and one row that sees only the copies (out = v).
      const std::vector<int32_t> q_pos = {first - 1, first + 3, last - 7, last};
      const int32_t n_q = static_cast<int32_t>(q_pos.size());
      const std::vector<float> q = testing::RandomQueries(static_cast<size_t>(n_q) * n_heads * head_dim, rng, 2.f);
      std::vector<float> want(q.size()), got(q.size()), stats(static_cast<size_t>(n_q) * n_heads * 2);
      ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, all.data(), static_cast<int32_t>(all.size()),
                     want.data());
      ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, cached.spans.data(),
                     static_cast<int32_t>(cached.spans.size()), got.data(), 1, stats.data());
      ops::MergeWeightedToken(shape, q.data(), n_q * n_heads, stats.data(), copies.k_f32[0].data(),
                              copies.v_f32[0].data(), weight, got.data());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-5 * (1 + std::abs(want[i]))) << "softcap " << softcap << " weight " << weight
                                                                     << " element " << i;
      }
      for (int c = 0; c < head_dim; ++c) EXPECT_EQ(got[c], copies.v_f32[0][c]);  // query 0, head 0: v itself
    }
  }
}

}  // namespace
}  // namespace kvsparse
