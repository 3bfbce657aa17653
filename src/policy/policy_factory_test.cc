#include <gtest/gtest.h>

#include <limits>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

TEST(PolicyFactoryTest, BuildsEveryMethodWithItsName) {
  for (KvMethod method : {KvMethod::kFull, KvMethod::kStreamingLlm, KvMethod::kH2O, KvMethod::kTova,
                          KvMethod::kScissorhands, KvMethod::kSnapKv, KvMethod::kPyramidKv, KvMethod::kKNorm,
                          KvMethod::kRandom, KvMethod::kQuest}) {
    auto policy = CreatePolicy(Layer(method, KvBudget::Tokens(64)), 2, 4, 123);  // above KNorm's and Quest's dense layers
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    EXPECT_EQ((*policy)->name(), KvMethodName(method));
    EXPECT_EQ(KvMethodFromName(KvMethodName(method)), method);
  }
}

TEST(PolicyFactoryTest, AttentionNeedsPerMethod) {
  auto needs = [](KvMethod m) { return (*CreatePolicy(Layer(m, KvBudget::Tokens(64)), 0, 1, 0))->NeededObservations(); };
  EXPECT_EQ(needs(KvMethod::kFull), 0u);
  EXPECT_EQ(needs(KvMethod::kStreamingLlm), 0u);
  EXPECT_EQ(needs(KvMethod::kKNorm), 0u);
  EXPECT_EQ(needs(KvMethod::kRandom), 0u);
  EXPECT_EQ(needs(KvMethod::kQuest), 0u);
  EXPECT_EQ(needs(KvMethod::kH2O), kObserveSumAll);
  EXPECT_EQ(needs(KvMethod::kTova), kObserveLast);
  EXPECT_EQ(needs(KvMethod::kScissorhands), kObserveWindowRows);
  EXPECT_EQ(needs(KvMethod::kSnapKv), kObserveWindowRows);
  EXPECT_EQ(needs(KvMethod::kPyramidKv), kObserveWindowRows);
}

// KNorm and Quest leave their first `dense_layers` layers (2, as both papers) whole.
TEST(PolicyFactoryTest, DenseFirstLayersRunFull) {
  for (KvMethod method : {KvMethod::kKNorm, KvMethod::kQuest}) {
    for (int layer = 0; layer < 4; ++layer) {
      auto policy = CreatePolicy(Layer(method, KvBudget::Tokens(64)), layer, 4, 0);
      ASSERT_TRUE(policy.ok());
      EXPECT_EQ((*policy)->name(), layer < 2 ? "full" : KvMethodName(method)) << KvMethodName(method) << layer;
    }
    LayerKvConfig none = Layer(method, KvBudget::Tokens(64));
    none.params.dense_layers = 0;
    EXPECT_EQ((*CreatePolicy(none, 0, 4, 0))->name(), KvMethodName(method));
  }
}

TEST(PolicyFactoryTest, RejectsInvalidConfigAndLayer) {
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Tokens(0));
  auto bad_budget = CreatePolicy(config, 2, 4, 0);
  ASSERT_FALSE(bad_budget.ok());
  EXPECT_NE(bad_budget.status().message().find("layer 2"), std::string::npos);
  EXPECT_NE(bad_budget.status().message().find("budget"), std::string::npos);
  EXPECT_FALSE(CreatePolicy(Layer(KvMethod::kH2O, KvBudget::Tokens(8)), 4, 4, 0).ok());
}

TEST(FullPolicyTest, NeverEvictsAndKeepsAll) {
  Harness h(Layer(KvMethod::kFull, KvBudget::Tokens(1)));
  EXPECT_EQ(h.policy().BudgetTokens(1000), std::numeric_limits<int32_t>::max());
  h.Append(50);
  EXPECT_EQ(h.policy().EvictionTarget(50, 50, EvictionPoint::kDecodeStep, 1), 50);
  EXPECT_EQ(h.policy().EvictionTarget(50, 50, EvictionPoint::kPrefillChunk, 1), 50);
  EXPECT_EQ(h.Evict(50).size(), 50u);
}

TEST(EvictionTargetTest, DecodeGrowsToBudgetPlusIntervalPrefillTrimsAtOnce) {
  Harness h(Layer(KvMethod::kH2O, KvBudget::Tokens(8)));
  const KvPolicy& p = h.policy();
  EXPECT_EQ(p.EvictionTarget(8, 100, EvictionPoint::kDecodeStep, 4), 8);
  EXPECT_EQ(p.EvictionTarget(11, 100, EvictionPoint::kDecodeStep, 4), 11);
  EXPECT_EQ(p.EvictionTarget(12, 100, EvictionPoint::kDecodeStep, 4), 8);
  EXPECT_EQ(p.EvictionTarget(9, 100, EvictionPoint::kDecodeStep, 1), 8);
  EXPECT_EQ(p.EvictionTarget(9, 100, EvictionPoint::kPrefillChunk, 16), 8);
  EXPECT_EQ(p.EvictionTarget(7, 100, EvictionPoint::kPrefillChunk, 16), 7);
}

TEST(EvictionTargetTest, FractionBudgetFollowsTokensSeen) {
  Harness h(Layer(KvMethod::kTova, KvBudget::Fraction(0.5)));
  const KvPolicy& p = h.policy();
  EXPECT_EQ(p.BudgetTokens(100), 50);
  EXPECT_EQ(p.EvictionTarget(60, 100, EvictionPoint::kPrefillChunk, 16), 50);
  EXPECT_EQ(p.EvictionTarget(60, 100, EvictionPoint::kDecodeStep, 16), 60);  // 10 over, interval 16
  EXPECT_EQ(p.EvictionTarget(60, 88, EvictionPoint::kDecodeStep, 16), 44);   // 16 over
}

TEST(SelectionTest, ClampsWindowsToTheTarget) {
  LayerKvConfig config = Layer(KvMethod::kH2O, KvBudget::Fraction(0.1));
  config.params.n_sink = 3;
  config.params.recent = 5;
  Harness h(config);
  h.Append(20);  // budget 2: the newest token, then one sink; no room for the window
  EXPECT_EQ(h.Evict(2), (Positions{0, 19}));
}

}  // namespace
}  // namespace kvsparse::policy_test
