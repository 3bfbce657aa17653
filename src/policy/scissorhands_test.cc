#include <gtest/gtest.h>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

constexpr float kHigh = 0.5f;   // above 1/6
constexpr float kLow = 0.01f;   // below 1/6

LayerKvConfig Config(int32_t budget, int32_t history, int32_t recent) {
  LayerKvConfig config = Layer(KvMethod::kScissorhands, KvBudget::Tokens(budget));
  config.params.history_window = history;
  config.params.recent = recent;
  return config;
}

TEST(ScissorhandsTest, DropsTokensMostOftenBelowTheUniformShare) {
  Harness h(Config(3, 4, 0));
  h.Append(6);
  // Unimportant counts over 4 queries: t0 0, t1 4, t2 2, t3 1, t4 3, t5 0.
  h.Observe(SameForAllHeads({kHigh, kLow, kLow, kLow, kLow, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kLow, kLow, kHigh, kLow, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kLow, kHigh, kHigh, kLow, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kLow, kHigh, kHigh, kHigh, kHigh}));
  EXPECT_EQ(h.Evict(3), (Positions{0, 3, 5}));
}

TEST(ScissorhandsTest, HistoryWindowForgetsOlderQueries) {
  Harness h(Config(3, 2, 0));
  h.Append(5);
  // t1 was unimportant long ago only; t2 in the latest query only; t4 (the newest) always stays.
  h.Observe(SameForAllHeads({kHigh, kLow, kHigh, kHigh, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kLow, kHigh, kHigh, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kHigh, kHigh, kLow, kHigh}));
  h.Observe(SameForAllHeads({kHigh, kHigh, kLow, kLow, kHigh}));
  // Last 2 queries: t0 0, t1 0, t2 1, t3 2.
  EXPECT_EQ(h.Evict(3), (Positions{0, 1, 4}));
}

TEST(ScissorhandsTest, ThresholdIsOneOverTheVisibleTokens) {
  Harness h(Config(2, 8, 0));
  h.Append(5);
  // 1/5 = 0.2: 0.21 is important, 0.19 is not. Counts: t0 1, t1 0, t2 2, t3 1.
  h.Observe(SameForAllHeads({0.19f, 0.21f, 0.19f, 0.21f, 0.21f}));
  h.Observe(SameForAllHeads({0.21f, 0.21f, 0.19f, 0.19f, 0.21f}));
  EXPECT_EQ(h.Evict(2), (Positions{1, 4}));
}

// A prompt chunk's queries each judge the tokens they saw, with their own 1/t: query w of a
// call sees every token up to itself.
TEST(ScissorhandsTest, EveryQueryOfAChunkJudgesWhatItSaw) {
  Harness h(Config(3, 8, 0));
  h.Append(4);
  Observation o;
  o.n_heads = 1;
  o.n_tokens = 4;
  o.n_queries = 2;  // queries at tokens 2 and 3: they see 3 and 4 tokens
  o.n_window = 2;
  o.window_rows = {0.30f, 0.40f, 0.30f, 0.00f,   // query 2: 1/3 = 0.333: t0, t2 below; t3 unseen
                   0.20f, 0.30f, 0.26f, 0.24f};  // query 3: 1/4 = 0.25: t0, t3 below
  h.Observe(o);
  // Counts: t0 2, t1 0, t2 1, t3 1 (the newest, kept anyway).
  EXPECT_EQ(h.Evict(3), (Positions{1, 2, 3}));
}

TEST(ScissorhandsTest, RecentWindowIsProtected) {
  Harness h(Config(3, 4, 2));
  h.Append(5);
  h.Observe(SameForAllHeads({kHigh, kLow, kHigh, kLow, kLow}));
  h.Observe(SameForAllHeads({kLow, kLow, kHigh, kLow, kLow}));
  // Counts: t0 1, t1 2, t2 0, t3 2, t4 2; the last two (3, 4) are protected.
  EXPECT_EQ(h.Evict(3), (Positions{2, 3, 4}));
}

TEST(ScissorhandsTest, CountersFollowTheirTokensThroughEviction) {
  Harness h(Config(3, 8, 0));
  h.Append(5);
  h.Observe(SameForAllHeads({kLow, kHigh, kLow, kHigh, kLow}));
  h.Observe(SameForAllHeads({kLow, kHigh, kLow, kHigh, kHigh}));
  // Counts: t0 2, t1 0, t2 2, t3 0, t4 1 -> keep 1, 3, 4.
  ASSERT_EQ(h.Evict(3), (Positions{1, 3, 4}));
  h.Append(2);  // live: 1 3 4 5 6 (5 and 6 start with no marks)
  h.Observe(SameForAllHeads({kLow, kHigh, kLow, kHigh, kHigh}));
  // Counts: 1: 1, 3: 0, 4: 2, 5: 0, 6: 0.
  EXPECT_EQ(h.Evict(3), (Positions{3, 5, 6}));
}

}  // namespace
}  // namespace kvsparse::policy_test
