// AdaKV's allocation (adakv.h). kvpress's rule: the heads keep the layer's budget in all, each its
// protected tokens and its floor, and the rest goes to the best scores of all heads together.
// The reference rule: each head's capacity from its count in the unconstrained top. Either way
// heads that spread their attention get more than heads that concentrate it.
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

AdaptiveSplit Kvpress(double floor) { return {AdaptiveRule::kKvpress, 0.2, floor}; }
AdaptiveSplit Reference(double alpha) { return {AdaptiveRule::kReference, alpha, 0.5}; }

TEST(AdaKvTest, KvpressBudgetSumsToTheLayersAndRespectsProtectionAndFloor) {
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
      AdaptiveHeadKeep(heads.tokens, budget, Kvpress(floor), &keeps);
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
  for (const AdaptiveSplit& split : {Kvpress(0.5), Reference(0.2)}) {  // both rules
    AdaptiveHeadKeep(heads.tokens, 10, split, &keeps);
    EXPECT_EQ(Count(keeps[0]) + Count(keeps[1]), 20) << AdaptiveRuleName(split.rule);
    EXPECT_LT(Count(keeps[0]), 10) << AdaptiveRuleName(split.rule);
    EXPECT_GT(Count(keeps[1]), 10) << AdaptiveRuleName(split.rule);
    EXPECT_TRUE(keeps[0][5] && keeps[0][11] && keeps[0][20]) << AdaptiveRuleName(split.rule);
  }
  // A floor of 1 is the uniform split.
  AdaptiveHeadKeep(heads.tokens, 10, Kvpress(1.0), &keeps);
  EXPECT_EQ(Count(keeps[0]), 10);
  EXPECT_EQ(Count(keeps[1]), 10);
}

TEST(AdaKvTest, KvpressFewerLiveTokensThanTheBudgetKeepsThemAll) {
  Heads heads;
  heads.Add(std::vector<float>(6, 0.5f), 0, 2);
  heads.Add(std::vector<float>(3, 0.1f), 0, 2);
  std::vector<std::vector<uint8_t>> keeps;
  AdaptiveHeadKeep(heads.tokens, 8, Kvpress(0.5), &keeps);
  EXPECT_EQ(Count(keeps[0]), 6);
  EXPECT_EQ(Count(keeps[1]), 3);
  // A short head's unused share goes to the others.
  Heads uneven;
  uneven.Add(std::vector<float>(30, 0.5f), 0, 1);
  uneven.Add(std::vector<float>(2, 0.1f), 0, 1);
  AdaptiveHeadKeep(uneven.tokens, 8, Kvpress(0.5), &keeps);
  EXPECT_EQ(Count(keeps[1]), 2);
  EXPECT_EQ(Count(keeps[0]), 14);
}

// The conformance case: a 12 / 8 split of the unconstrained top at B = 10 scored tokens
// per head and alpha 0.5 gives capacities round(0.5 x 12 + 5) = 11 and round(0.5 x 8 + 5) = 9
// (AdaKV's snapkv_utils.py); each head keeps its best ones, plus its protected newest token.
TEST(AdaKvTest, ReferenceRuleCapacities) {
  std::vector<float> a(30, 0.01f), b(30, 0.001f);
  for (int t = 0; t < 12; ++t) a[t] = 0.9f - 0.01f * t;
  for (int t = 0; t < 8; ++t) b[3 * t] = 0.5f - 0.01f * t;
  Heads heads;
  heads.Add(a, 0, 1);  // the newest token is protected: B = 11 leaves 10 scored tokens each
  heads.Add(b, 0, 1);
  std::vector<std::vector<uint8_t>> keeps;
  AdaptiveHeadKeep(heads.tokens, 11, Reference(0.5), &keeps);
  EXPECT_EQ(Count(keeps[0]), 11 + 1);
  EXPECT_EQ(Count(keeps[1]), 9 + 1);
  for (int t = 0; t < 11; ++t) EXPECT_TRUE(keeps[0][t]) << "head 0's best: token " << t;
  for (int t = 0; t < 8; ++t) EXPECT_TRUE(keeps[1][3 * t]) << "head 1's best: token " << 3 * t;
  // alpha 0: the unconstrained top itself (12 and 8); alpha 1: the uniform split (10 and 10).
  AdaptiveHeadKeep(heads.tokens, 11, Reference(0.0), &keeps);
  EXPECT_EQ(Count(keeps[0]), 12 + 1);
  EXPECT_EQ(Count(keeps[1]), 8 + 1);
  AdaptiveHeadKeep(heads.tokens, 11, Reference(1.0), &keeps);
  EXPECT_EQ(Count(keeps[0]), 10 + 1);
  EXPECT_EQ(Count(keeps[1]), 10 + 1);
}

// On random ragged heads the reference rule keeps every head's protected tokens and its best
// scored ones (a prefix of its ranking), its guaranteed floor(alpha B_h) where it has them, and
// exactly the layer's H·B in all (the roundings' excess given back, their shortfall filled).
TEST(AdaKvTest, ReferenceRuleKeepsEachHeadsBestWithinTheLayersBudget) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (const double alpha : {0.0, 0.2, 0.5, 1.0}) {
    for (const int32_t budget : {4, 10, 25}) {
      Heads heads;
      const std::vector<int32_t> lengths = {30, 41, 17, 60, 33};
      for (int32_t n : lengths) {
        std::vector<float> s(n);
        for (float& x : s) x = std::pow(u(rng), 3.f);
        heads.Add(s, /*n_sink=*/1, /*n_recent=*/2);
      }
      std::vector<std::vector<uint8_t>> keeps;
      AdaptiveHeadKeep(heads.tokens, budget, Reference(alpha), &keeps);
      int32_t total = 0;
      for (size_t h = 0; h < lengths.size(); ++h) {
        const int32_t n = lengths[h];
        const std::vector<uint8_t>& keep = keeps[h];
        total += Count(keep);
        EXPECT_TRUE(keep[0]) << "sink";
        EXPECT_TRUE(keep[n - 1] && keep[n - 2]) << "window";
        float min_kept = 2.f, max_dropped = -1.f;
        int32_t scored = 0;
        for (int32_t t = 1; t < n - 2; ++t) {
          if (keep[t]) {
            min_kept = std::min(min_kept, heads.scores[h][t]);
            ++scored;
          } else {
            max_dropped = std::max(max_dropped, heads.scores[h][t]);
          }
        }
        EXPECT_GE(min_kept, max_dropped) << "head " << h << " keeps its best";
        const int32_t guaranteed = static_cast<int32_t>(std::floor(alpha * (budget - 3)));
        EXPECT_GE(scored, std::min(guaranteed - 1, n - 3)) << "head " << h;  // less at most one given back
      }
      EXPECT_EQ(total, static_cast<int32_t>(lengths.size()) * budget) << "alpha " << alpha << " budget " << budget;
    }
  }
}

}  // namespace
}  // namespace kvsparse::policy
