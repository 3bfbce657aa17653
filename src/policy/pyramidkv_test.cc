#include <gtest/gtest.h>

#include <numeric>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

TEST(PyramidBudgetsTest, MatchesThePaperScheduleWhenExact) {
  // S = 100 - 20 = 80: last layer 80/20 = 4, first 160 - 4 = 156, step 38; plus the window.
  EXPECT_EQ(PyramidBudgets(5, 100, 20, 20.0), (std::vector<int32_t>{176, 138, 100, 62, 24}));
}

TEST(PyramidBudgetsTest, SumsToTheAverageAndDecreasesWithDepth) {
  for (int n_layers : {1, 2, 3, 5, 7, 32, 80}) {
    for (int32_t average : {8, 33, 64, 100, 517, 2048}) {
      for (int32_t window : {0, 4, 32}) {
        for (double beta : {1.0, 2.0, 7.5, 20.0}) {
          const std::vector<int32_t> b = PyramidBudgets(n_layers, average, window, beta);
          SCOPED_TRACE(testing::Message() << "layers " << n_layers << " average " << average << " window " << window
                                          << " beta " << beta);
          ASSERT_EQ(std::accumulate(b.begin(), b.end(), int64_t{0}), int64_t{n_layers} * average);
          for (int l = 1; l < n_layers; ++l) ASSERT_LE(b[l], b[l - 1]);
          for (int l = 0; l < n_layers; ++l) ASSERT_GE(b[l], std::min(window, average));
          if (n_layers > 1 && average - window >= 2 * n_layers && beta > 1.0) {
            EXPECT_LT(b.back(), b.front());
          }
        }
      }
    }
  }
}

TEST(PyramidBudgetsTest, BetaOneIsUniform) {
  EXPECT_EQ(PyramidBudgets(4, 50, 10, 1.0), (std::vector<int32_t>{50, 50, 50, 50}));
}

TEST(PyramidBudgetsTest, BudgetWithinTheWindowIsUniform) {
  EXPECT_EQ(PyramidBudgets(3, 16, 32, 20.0), (std::vector<int32_t>{16, 16, 16}));
}

// KVCache-Factory's rule: the first layer never gets more than the prompt holds; the line
// pivots so the mean stays the average budget. Shorter prompts: uniform, or nothing to compress.
TEST(PyramidBudgetsTest, ClampsToThePromptAndRedistributes) {
  // S = 80: unclamped shares 156 .. 4, but 170 tokens hold at most 150 above the window.
  EXPECT_EQ(PyramidBudgets(5, 100, 20, 20.0, /*n_seen=*/170), (std::vector<int32_t>{170, 135, 100, 65, 30}));
  EXPECT_EQ(PyramidBudgets(5, 100, 20, 20.0, /*n_seen=*/200), PyramidBudgets(5, 100, 20, 20.0));
  EXPECT_EQ(PyramidBudgets(5, 100, 20, 20.0, /*n_seen=*/150), (std::vector<int32_t>{100, 100, 100, 100, 100}));
  EXPECT_EQ(PyramidBudgets(5, 100, 20, 20.0, /*n_seen=*/90), (std::vector<int32_t>{100, 100, 100, 100, 100}));
  for (int32_t n_seen = 160; n_seen < 400; n_seen += 7) {
    const std::vector<int32_t> b = PyramidBudgets(4, 100, 8, 20.0, n_seen);
    int64_t sum = 0;
    for (int32_t x : b) {
      EXPECT_LE(x, n_seen) << n_seen;  // every layer can hold its budget: the tokens kept are the budgets
      sum += x;
    }
    EXPECT_EQ(sum, 400) << n_seen;
  }
}

TEST(PyramidKvTest, DefaultsFollowTheReferenceRuns) {
  const KvMethodParams p = DefaultMethodParams(KvMethod::kPyramidKv);
  EXPECT_EQ(p.obs_window, 8);
  EXPECT_EQ(p.kernel, 7);
  EXPECT_EQ(p.pooling, VotePooling::kMax);
  EXPECT_EQ(p.beta, 20.0);
}

TEST(PyramidKvTest, EachLayerGetsItsShareOfTheResolvedBudget) {
  LayerKvConfig config = Layer(KvMethod::kPyramidKv, KvBudget::Fraction(0.5));
  config.params.obs_window = 20;
  const int32_t n_seen = 200;  // average budget 100
  const std::vector<int32_t> expected = PyramidBudgets(5, 100, 20, 20.0);
  for (int layer = 0; layer < 5; ++layer) {
    Harness h(config, layer, 5);
    EXPECT_EQ(h.policy().name(), "pyramidkv");
    EXPECT_EQ(h.policy().BudgetTokens(n_seen), expected[layer]) << "layer " << layer;
  }
}

TEST(PyramidKvTest, ScoresLikeSnapKv) {
  LayerKvConfig config = Layer(KvMethod::kPyramidKv, KvBudget::Tokens(6));
  config.params.obs_window = 2;
  config.params.kernel = 1;
  config.params.beta = 4.0;  // S = 4: shares {7, 1}, budgets {9, 3}
  Harness h(config, /*layer=*/1, /*n_layers=*/2);
  ASSERT_EQ(h.policy().BudgetTokens(100), 3);
  h.Append(10);
  std::vector<float> votes(10, 0.f);
  votes[4] = 0.7f, votes[2] = 0.5f;
  h.Observe(SameForAllHeads(votes, 2, 10));
  EXPECT_EQ(h.Evict(h.policy().EvictionTarget(10, 100, EvictionPoint::kPrefillChunk, 16), true),
            (Positions{4, 8, 9}));
}

}  // namespace
}  // namespace kvsparse::policy_test
