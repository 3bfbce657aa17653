#include <gtest/gtest.h>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

TEST(TovaTest, DropsTheLowestLastQueryToken) {
  Harness h(Layer(KvMethod::kTova, KvBudget::Tokens(5)));
  h.Append(6);
  h.Observe(SameForAllHeads({0.3f, 0.05f, 0.2f, 0.1f, 0.15f, 0.2f}));
  EXPECT_EQ(h.Evict(5), (Positions{0, 2, 3, 4, 5}));
}

TEST(TovaTest, OnlyTheLatestQueryCounts) {
  Harness h(Layer(KvMethod::kTova, KvBudget::Tokens(3)));
  h.Append(5);
  h.Observe(SameForAllHeads({0.01f, 0.3f, 0.3f, 0.39f, 0.f}));
  h.Observe(SameForAllHeads({0.4f, 0.3f, 0.2f, 0.1f, 0.f}));  // token 0 recovers, 3 falls
  EXPECT_EQ(h.Evict(3), (Positions{0, 1, 4}));  // and the newest token always stays
}

TEST(TovaTest, AveragesOverHeadsByDefault) {
  // Token 1: (0.0, 0.5) mean 0.25 max 0.5; token 2: (0.3, 0.3) mean 0.3 max 0.3; token 3 is the
  // newest, always kept.
  const Observation obs = PerHead({{0.7f, 0.0f, 0.3f, 0.0f}, {0.2f, 0.5f, 0.3f, 0.0f}});
  LayerKvConfig config = Layer(KvMethod::kTova, KvBudget::Tokens(3));
  Harness mean(config);
  mean.Append(4);
  mean.Observe(obs);
  EXPECT_EQ(mean.Evict(3), (Positions{0, 2, 3}));
  config.params.head_reduce = HeadReduce::kMax;
  Harness max(config);
  max.Append(4);
  max.Observe(obs);
  EXPECT_EQ(max.Evict(3), (Positions{0, 1, 3}));
}

TEST(TovaTest, EvictsIntervalAtOnceAndStaysAligned) {
  Harness h(Layer(KvMethod::kTova, KvBudget::Tokens(4)));
  h.Append(7);
  h.Observe(SameForAllHeads({0.3f, 0.02f, 0.2f, 0.01f, 0.25f, 0.03f, 0.19f}));
  EXPECT_EQ(h.policy().EvictionTarget(7, 7, EvictionPoint::kDecodeStep, 3), 4);
  ASSERT_EQ(h.Evict(4), (Positions{0, 2, 4, 6}));
  h.Append(2);  // live: 0 2 4 6 7 8
  h.Observe(SameForAllHeads({0.1f, 0.3f, 0.05f, 0.25f, 0.2f, 0.1f}));
  EXPECT_EQ(h.Evict(4), (Positions{2, 6, 7, 8}));  // drops 4 (0.05), then 0 (0.1, older than 8)
}

TEST(TovaTest, TokensNotYetObservedAreKept) {
  Harness h(Layer(KvMethod::kTova, KvBudget::Tokens(3)));
  h.Append(3);
  h.Observe(SameForAllHeads({0.5f, 0.2f, 0.3f}));
  h.Append(1);  // position 3 arrives without an observation
  EXPECT_EQ(h.Evict(3), (Positions{0, 2, 3}));
}

}  // namespace
}  // namespace kvsparse::policy_test
