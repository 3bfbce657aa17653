// AdaKV's allocation (adakv.h): the heads keep the layer's budget in all, each its protected
// tokens and its floor, and the rest goes to the best scores of all heads together; heads that
// spread their attention get more than heads that concentrate it.
#include "policy/adakv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvsparse::policy {
namespace {

struct Heads {
  std::vector<std::vector<float>> scores;
  std::vector<HeadTokens> tokens;
  void Add(std::vector<float> s, int32_t n_sink, int32_t n_recent) {
    scores.push_back(std::move(s));
    tokens.push_back({static_cast<int32_t>(scores.back().size()), {nullptr, n_sink, n_recent}});
    for (size_t h = 0; h < scores.size(); ++h) tokens[h].scoring.scores = scores[h].data();
  }
};

int32_t Count(const std::vector<uint8_t>& keep) { return static_cast<int32_t>(std::count(keep.begin(), keep.end(), 1)); }

TEST(AdaKvTest, BudgetSumsToTheLayersAndRespectsProtectionAndFloor) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (const double floor : {0.0, 0.5, 1.0}) {
    for (const int32_t budget : {4, 10, 25}) {
      Heads heads;
      const std::vector<int32_t> lengths = {30, 41, 17, 60};
      for (int32_t n : lengths) {
        std::vector<float> s(n);
        for (float& x : s) x = std::pow(u(rng), 3.f);  // skewed, ragged per head
        heads.Add(s, /*n_sink=*/1, /*n_recent=*/budget / 2);
      }
      std::vector<std::vector<uint8_t>> keeps;
      AdaptiveHeadKeep(heads.tokens, budget, floor, &keeps);
      int32_t total = 0;
      std::vector<float> picked, unpicked;  // scores beyond the protected tokens and floors
      for (size_t h = 0; h < lengths.size(); ++h) {
        const int32_t n = lengths[h];
        const std::vector<uint8_t>& keep = keeps[h];
        ASSERT_EQ(static_cast<int32_t>(keep.size()), n);
        total += Count(keep);
        const int32_t target = std::min(budget, n);
        const int32_t sinks = std::clamp(1, 0, target - 1), recent = std::clamp(std::max(budget / 2, 1), 0, target - sinks);
        for (int32_t t = 0; t < sinks; ++t) EXPECT_TRUE(keep[t]) << "sink";
        for (int32_t t = n - recent; t < n; ++t) EXPECT_TRUE(keep[t]) << "window";
        // The floor: at least floor·(B - protected) of the head's scored tokens.
        int32_t scored = 0;
        for (int32_t t = sinks; t < n - recent; ++t) scored += keep[t];
        const int32_t n_floor_min = std::min(static_cast<int32_t>(std::floor(floor * (budget - sinks - recent))),
                                             n - sinks - recent);  // a short head has fewer to keep
        EXPECT_GE(scored, n_floor_min) << "head " << h;
        // The head's floor is its best; beyond it, a kept token outranks a dropped one of any head.
        std::vector<float> kept_scores;
        for (int32_t t = sinks; t < n - recent; ++t) {
          if (keep[t]) kept_scores.push_back(heads.scores[h][t]);
          else unpicked.push_back(heads.scores[h][t]);
        }
        std::sort(kept_scores.begin(), kept_scores.end(), std::greater<>());
        const size_t n_floor = std::min<size_t>(kept_scores.size(),
                                                static_cast<size_t>(std::floor(floor * (budget - sinks - recent))));
        picked.insert(picked.end(), kept_scores.begin() + static_cast<std::ptrdiff_t>(n_floor), kept_scores.end());
      }
      EXPECT_EQ(total, static_cast<int32_t>(lengths.size()) * budget) << "floor " << floor << " budget " << budget;
      if (!picked.empty() && !unpicked.empty()) {
        EXPECT_GE(*std::min_element(picked.begin(), picked.end()), *std::max_element(unpicked.begin(), unpicked.end()));
      }
    }
  }
}

TEST(AdaKvTest, SpreadHeadsGetMoreThanConcentratedOnes) {
  // Head 0 puts its attention on 3 tokens; head 1 spreads it evenly.
  std::vector<float> concentrated(40, 0.001f), spread(40, 0.025f);
  concentrated[5] = concentrated[11] = concentrated[20] = 0.33f;
  Heads heads;
  heads.Add(concentrated, 0, 1);
  heads.Add(spread, 0, 1);
  std::vector<std::vector<uint8_t>> keeps;
  AdaptiveHeadKeep(heads.tokens, 10, 0.5, &keeps);
  EXPECT_EQ(Count(keeps[0]) + Count(keeps[1]), 20);
  EXPECT_LT(Count(keeps[0]), 10);
  EXPECT_GT(Count(keeps[1]), 10);
  EXPECT_TRUE(keeps[0][5] && keeps[0][11] && keeps[0][20]);
  // A floor of 1 is the uniform split.
  AdaptiveHeadKeep(heads.tokens, 10, 1.0, &keeps);
  EXPECT_EQ(Count(keeps[0]), 10);
  EXPECT_EQ(Count(keeps[1]), 10);
}

TEST(AdaKvTest, FewerLiveTokensThanTheBudgetKeepsThemAll) {
  Heads heads;
  heads.Add(std::vector<float>(6, 0.5f), 0, 2);
  heads.Add(std::vector<float>(3, 0.1f), 0, 2);
  std::vector<std::vector<uint8_t>> keeps;
  AdaptiveHeadKeep(heads.tokens, 8, 0.5, &keeps);
  EXPECT_EQ(Count(keeps[0]), 6);
  EXPECT_EQ(Count(keeps[1]), 3);
  // A short head's unused share goes to the others.
  Heads uneven;
  uneven.Add(std::vector<float>(30, 0.5f), 0, 1);
  uneven.Add(std::vector<float>(2, 0.1f), 0, 1);
  AdaptiveHeadKeep(uneven.tokens, 8, 0.5, &keeps);
  EXPECT_EQ(Count(keeps[1]), 2);
  EXPECT_EQ(Count(keeps[0]), 14);
}

}  // namespace
}  // namespace kvsparse::policy
