#include <gtest/gtest.h>

#include "policy/policy_test_util.h"
#include "policy/snapkv.h"

namespace kvsparse::policy_test {
namespace {

LayerKvConfig Config(int32_t budget, int32_t window, int kernel, VotePooling pooling = VotePooling::kMax) {
  LayerKvConfig config = Layer(KvMethod::kSnapKv, KvBudget::Tokens(budget));
  config.params.obs_window = window;
  config.params.kernel = kernel;
  config.params.pooling = pooling;
  return config;
}

TEST(SnapKvTest, DefaultsFollowThePaper) {
  const KvMethodParams p = DefaultMethodParams(KvMethod::kSnapKv);
  EXPECT_EQ(p.obs_window, 32);
  EXPECT_EQ(p.kernel, 7);
  EXPECT_EQ(p.pooling, VotePooling::kMax);
  EXPECT_FALSE(p.decode_evict);
}

TEST(SnapKvTest, PoolVotesMaxAndAvg) {
  const std::vector<float> votes = {0.f, 0.f, 3.f, 0.f, 0.f, 1.f};
  std::vector<float> out(votes.size());
  policy::PoolVotes(votes.data(), 6, 3, VotePooling::kMax, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.f, 3.f, 3.f, 3.f, 1.f, 1.f}));
  policy::PoolVotes(votes.data(), 6, 3, VotePooling::kAvg, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.f, 1.f, 1.f, 1.f, 1.f / 3, 1.f / 3}));  // zero padded like avg_pool1d
}

TEST(SnapKvTest, KeepsTheWindowPlusTopVotedTokens) {
  Harness h(Config(8, 4, 1));  // kernel 1: no smoothing
  h.Append(16);
  std::vector<float> votes(16, 0.01f);
  votes[2] = 0.9f, votes[5] = 0.8f, votes[9] = 0.7f, votes[11] = 0.6f, votes[14] = 5.f;  // 14 is in the window
  h.Observe(SameForAllHeads(votes, 2, /*n_queries=*/16));
  EXPECT_EQ(h.Evict(8, /*in_prefill=*/true), (Positions{2, 5, 9, 11, 12, 13, 14, 15}));
}

TEST(SnapKvTest, MaxPoolingKeepsTheNeighboursOfAVotedToken) {
  Harness h(Config(7, 4, 3));
  h.Append(16);
  std::vector<float> votes(16, 0.f);
  votes[6] = 1.f, votes[1] = 0.2f;
  h.Observe(SameForAllHeads(votes, 2, 16));
  // Max-pooled (kernel 3): 5, 6, 7 score 1.0; 0, 1, 2 only 0.2.
  EXPECT_EQ(h.Evict(7, true), (Positions{5, 6, 7, 12, 13, 14, 15}));
}

TEST(SnapKvTest, AvgPoolingFavoursClusters) {
  Harness h(Config(5, 2, 3, VotePooling::kAvg));
  h.Append(12);
  // A lone vote of 0.9 at 1 pools to 0.3; the cluster 6-7-8 (0.4 each) pools to 0.4 at 7.
  std::vector<float> votes(12, 0.f);
  votes[1] = 0.9f, votes[6] = 0.4f, votes[7] = 0.4f, votes[8] = 0.4f;
  h.Observe(SameForAllHeads(votes, 1, 12));
  // Avg-pooled: 7 -> 0.4; 0, 1, 2 -> 0.3 (ties keep the newer: 2, 1); 6, 8 -> 0.27.
  EXPECT_EQ(h.Evict(5, true), (Positions{1, 2, 7, 10, 11}));
}

// window_rows of queries (oldest first), one head.
Observation Rows(const std::vector<std::vector<float>>& rows) {
  Observation o;
  o.n_heads = 1;
  o.n_tokens = static_cast<int32_t>(rows[0].size());
  o.n_queries = static_cast<int32_t>(rows.size());
  o.n_window = o.n_queries;
  for (const auto& row : rows) o.window_rows.insert(o.window_rows.end(), row.begin(), row.end());
  return o;
}

// The votes come from exactly the latest `window` queries, whatever calls delivered them: a
// short last chunk is completed by the previous chunk's last queries.
TEST(SnapKvTest, TheWindowIsTheLatestQueriesWhateverTheChunking) {
  Harness h(Config(4, 2, 1));
  h.Append(8);
  h.Observe(Rows({{5.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f},        // chunk 1's last two queries
                  {0.f, 0.3f, 0.f, 0.2f, 0.f, 0.f, 0.f, 0.f}}));
  h.Observe(Rows({{0.f, 0.f, 0.f, 0.f, 0.25f, 0.f, 0.f, 0.f}}));  // a one-query last chunk
  // Votes: 1 -> 0.3, 3 -> 0.2, 4 -> 0.25; token 0's vote came from a query outside the window.
  EXPECT_EQ(h.Evict(4, true), (Positions{1, 4, 6, 7}));
}

// A target no larger than the window (a fraction budget of a short prompt) shrinks the window to
// half the target, so votes still choose earlier tokens.
TEST(SnapKvTest, SmallBudgetsShrinkTheWindowInsteadOfKeepingOnlyTheLast) {
  EXPECT_EQ(policy::SnapKvPolicy::EffectiveWindow(32, 33), 32);
  EXPECT_EQ(policy::SnapKvPolicy::EffectiveWindow(32, 32), 16);
  EXPECT_EQ(policy::SnapKvPolicy::EffectiveWindow(32, 5), 2);
  EXPECT_EQ(policy::SnapKvPolicy::EffectiveWindow(32, 1), 1);
  LayerKvConfig config = Layer(KvMethod::kSnapKv, KvBudget::Fraction(0.25));
  config.params.kernel = 1;
  Harness h(config);
  h.Append(16);  // target 4 <= window 32: window 2, two voted tokens
  std::vector<float> votes(16, 0.f);
  votes[3] = 0.9f, votes[8] = 0.5f, votes[12] = 0.1f;
  h.Observe(Rows({votes, votes}));
  EXPECT_EQ(h.Evict(h.policy().BudgetTokens(16), true), (Positions{3, 8, 14, 15}));
}

TEST(SnapKvTest, CompressesThePromptOnlyUnlessAskedToEvictDuringDecode) {
  Harness prompt_only(Config(8, 4, 1));
  EXPECT_FALSE(prompt_only.policy().EvictsDuringDecode());
  EXPECT_EQ(prompt_only.policy().EvictionTarget(40, 40, EvictionPoint::kDecodeStep, 1), 40);
  EXPECT_EQ(prompt_only.policy().EvictionTarget(40, 40, EvictionPoint::kPrefillChunk, 1), 8);
  EXPECT_EQ(prompt_only.policy().ObservationWindow(), 4);
  EXPECT_EQ(prompt_only.policy().NeededObservations(), kObserveWindowRows);

  LayerKvConfig config = Config(8, 4, 1);
  config.params.decode_evict = true;
  Harness decode(config);
  EXPECT_EQ(decode.policy().EvictionTarget(40, 40, EvictionPoint::kDecodeStep, 1), 8);
}

TEST(SnapKvTest, VotesStayAlignedAfterPromptCompression) {
  LayerKvConfig config = Config(5, 2, 1);
  config.params.decode_evict = true;
  Harness h(config);
  h.Append(10);
  std::vector<float> votes(10, 0.f);
  votes[1] = 0.5f, votes[3] = 0.4f, votes[6] = 0.3f, votes[7] = 0.1f;
  h.Observe(SameForAllHeads(votes, 2, 10));
  ASSERT_EQ(h.Evict(5, true), (Positions{1, 3, 6, 8, 9}));
  h.Append(1);  // decode: live 1 3 6 8 9 10
  h.Observe(SameForAllHeads({0.f, 0.f, 0.3f, 0.f, 0.f, 0.f}, 2, 1));  // with the prompt's last query: 6 gets 0.6
  // Window: 9, 10. Votes: 1 0.5, 3 0.4, 6 0.6, 8 0.
  EXPECT_EQ(h.Evict(5, false), (Positions{1, 3, 6, 9, 10}));
  // The window stays the latest two queries: this one and the previous decode step's.
  h.Append(1);  // live 1 3 6 9 10 11
  h.Observe(SameForAllHeads({0.f, 0.2f, 0.f, 0.1f, 0.f, 0.f}, 2, 1));
  // Votes: 1 0, 3 0.2, 6 0.3 (the previous step's), 9 0.1.
  EXPECT_EQ(h.Evict(4, false), (Positions{3, 6, 10, 11}));
}

}  // namespace
}  // namespace kvsparse::policy_test
