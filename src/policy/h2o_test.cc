#include <gtest/gtest.h>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

TEST(H2OTest, KeepsHeavyHittersPlusRecentWindow) {
  Harness h(Layer(KvMethod::kH2O, KvBudget::Tokens(6)));  // 3 recent + 3 heavy (recent_ratio 0.5)
  h.Append(12);
  std::vector<float> scores(12, 0.01f);
  scores[1] = 0.9f, scores[4] = 0.7f, scores[7] = 0.5f, scores[10] = 0.95f;  // 10 is recent anyway
  h.Observe(SameForAllHeads(scores));
  EXPECT_EQ(h.Evict(6), (Positions{1, 4, 7, 9, 10, 11}));
}

TEST(H2OTest, AccumulatesOverEveryObservedQuery) {
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Tokens(3));
  config.params.recent = 1;
  Harness h(config);
  h.Append(6);
  // Token 2 wins one query; token 3 is second in both and wins the sum.
  h.Observe(SameForAllHeads({0.f, 0.1f, 0.9f, 0.6f, 0.f, 0.f}));
  h.Observe(SameForAllHeads({0.f, 0.1f, 0.0f, 0.6f, 0.f, 0.f}));
  h.Observe(SameForAllHeads({0.f, 0.3f, 0.1f, 0.5f, 0.f, 0.f}));
  // Sums: t1 0.5, t2 1.0, t3 1.7 -> heavy hitters 3 and 2, recent 5.
  EXPECT_EQ(h.Evict(3), (Positions{2, 3, 5}));
}

TEST(H2OTest, HeadReduceMeanVersusMax) {
  // Token 1 matters to one head only (0.9, 0.0); token 2 to both (0.5, 0.5).
  const Observation obs = PerHead({{0.f, 0.9f, 0.5f, 0.f}, {0.f, 0.0f, 0.5f, 0.f}});
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Tokens(2));
  config.params.recent = 1;
  Harness mean(config);
  mean.Append(4);
  mean.Observe(obs);
  EXPECT_EQ(mean.Evict(2), (Positions{2, 3}));  // mean 0.5 beats 0.45
  config.params.head_reduce = HeadReduce::kMax;
  Harness max(config);
  max.Append(4);
  max.Observe(obs);
  EXPECT_EQ(max.Evict(2), (Positions{1, 3}));  // max 0.9 beats 0.5
}

TEST(H2OTest, CompactionKeepsScoresAlignedAcrossEvictions) {
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Tokens(4));  // 2 recent + 2 heavy
  Harness h(config);
  h.Append(8);
  std::vector<float> first(8, 0.01f);
  first[2] = 1.0f, first[5] = 0.8f;
  h.Observe(SameForAllHeads(first));
  ASSERT_EQ(h.Evict(4), (Positions{2, 5, 6, 7}));
  h.Append(4);  // live positions: 2 5 6 7 8 9 10 11
  // Indices now: 0->2, 1->5, 2->6, 3->7, 4->8, 5->9, 6->10, 7->11.
  h.Observe(SameForAllHeads({0.f, 0.f, 0.5f, 0.f, 2.0f, 0.f, 0.f, 0.f}));
  // Totals: 2: 1.0, 5: 0.8, 6: 0.51, 7: 0.01, 8: 2.0, 9: 0 -> heavy 8 and 2, recent 10 11.
  EXPECT_EQ(h.Evict(4), (Positions{2, 8, 10, 11}));
}

TEST(H2OTest, PromptVariantTrimsBetweenChunks) {
  // A 6-query prompt chunk sums attention over its queries; the layer is trimmed right away.
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Tokens(4));
  Harness h(config);
  h.Append(6);
  h.Observe(SameForAllHeads({3.0f, 0.5f, 1.2f, 0.4f, 0.6f, 0.3f}, 2, /*n_queries=*/6));
  const int32_t target = h.policy().EvictionTarget(h.n_live(), 6, EvictionPoint::kPrefillChunk, 16);
  ASSERT_EQ(target, 4);
  EXPECT_EQ(h.Evict(target, /*in_prefill=*/true), (Positions{0, 2, 4, 5}));
  h.Append(6);
  h.Observe(SameForAllHeads({1.0f, 0.1f, 0.2f, 0.1f, 0.9f, 0.8f, 0.1f, 0.3f, 0.2f, 0.1f}, 2, 6));
  // Totals: 0: 4.0, 2: 1.3, 4: 0.8, 5: 0.4, 6: 0.9, 7: 0.8, 8: 0.1, 9: 0.3 (+ recent 10, 11).
  EXPECT_EQ(h.Evict(4, true), (Positions{0, 2, 10, 11}));
}

}  // namespace
}  // namespace kvsparse::policy_test
