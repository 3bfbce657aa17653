#include <gtest/gtest.h>

#include <set>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

Positions RunOnce(uint64_t seed, int32_t n, int32_t budget) {
  Harness h(Layer(KvMethod::kRandom, KvBudget::Tokens(budget)), 0, 1, seed);
  h.Append(n);
  return h.Evict(budget);
}

TEST(RandomTest, SameSeedSameSelection) {
  EXPECT_EQ(RunOnce(7, 100, 20), RunOnce(7, 100, 20));
  EXPECT_NE(RunOnce(7, 100, 20), RunOnce(8, 100, 20));
}

TEST(RandomTest, ProtectsTheRecentWindow) {
  const Positions kept = RunOnce(3, 100, 20);  // recent_ratio 0.5: the last 10 are kept
  ASSERT_EQ(kept.size(), 20u);
  for (int32_t p = 90; p < 100; ++p) EXPECT_TRUE(std::count(kept.begin(), kept.end(), p)) << p;
  for (size_t i = 0; i < 10; ++i) EXPECT_LT(kept[i], 90);
}

TEST(RandomTest, EveryCandidateCanBeChosen) {
  std::set<int32_t> seen;
  for (uint64_t seed = 0; seed < 200; ++seed)
    for (int32_t p : RunOnce(seed, 12, 4))
      if (p < 10) seen.insert(p);
  EXPECT_EQ(seen.size(), 10u);  // each of the 10 candidates was drawn at least once
}

TEST(RandomTest, SinksAndWindowBothProtected) {
  LayerKvConfig config = Layer(KvMethod::kRandom, KvBudget::Tokens(6));
  config.params.n_sink = 2;
  config.params.recent = 2;
  Harness h(config, 0, 1, 11);
  h.Append(30);
  const Positions kept = h.Evict(6);
  EXPECT_EQ(kept[0], 0);
  EXPECT_EQ(kept[1], 1);
  EXPECT_EQ(kept[4], 28);
  EXPECT_EQ(kept[5], 29);
}

}  // namespace
}  // namespace kvsparse::policy_test
