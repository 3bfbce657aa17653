#include "kvsparse/logprob.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvsparse {
namespace {

TEST(Logprob, LogSoftmaxAndTopAlternatives) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> logits(37);
  for (float& x : logits) x = normal(rng);
  double z = 0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  for (int32_t t : {0, 11, 36}) {
    const TokenLogprob lp = LogprobOf(logits.data(), 37, t, 5);
    EXPECT_EQ(lp.token, t);
    EXPECT_NEAR(lp.logprob, logits[t] - std::log(z), 1e-5);
    ASSERT_EQ(lp.top.size(), 5u);
    for (size_t i = 0; i < lp.top.size(); ++i) {
      EXPECT_NEAR(lp.top[i].second, logits[lp.top[i].first] - std::log(z), 1e-5);
      if (i > 0) EXPECT_GE(lp.top[i - 1].second, lp.top[i].second);
    }
    int better = 0;
    for (float x : logits) better += x > logits[lp.top[4].first];
    EXPECT_EQ(better, 4);  // the fifth is the fifth best
  }
  EXPECT_TRUE(LogprobOf(logits.data(), 37, 3, 0).top.empty());
  EXPECT_EQ(LogprobOf(logits.data(), 37, 3, 100).top.size(), 37u);
}

TEST(Logprob, TiesNanAndInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {1.f, 1.f, std::nanf(""), -inf};
  const TokenLogprob lp = LogprobOf(logits.data(), 4, 1, 2);
  EXPECT_NEAR(lp.logprob, std::log(0.5f), 1e-6);
  EXPECT_EQ(lp.top[0].first, 0);  // the lower id first on ties
  EXPECT_EQ(lp.top[1].first, 1);
  EXPECT_EQ(LogprobOf(logits.data(), 4, 2, 0).logprob, -inf);  // NaN counts as -inf
  const std::vector<float> none = {-inf, -inf};
  EXPECT_EQ(LogprobOf(none.data(), 2, 0, 1).logprob, -inf);
}

}  // namespace
}  // namespace kvsparse
