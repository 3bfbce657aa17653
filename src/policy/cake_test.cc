// CAKE's allocator: windows first, the rest in proportion to the preferences, capped at the
// tokens seen with the excess handed on, integer budgets that sum to the total; and the policy's
// eviction indicator (mean + gamma * variance over the window's queries).
#include "policy/cake.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "kvsparse/kv_config.h"
#include "policy/policy_test_util.h"

namespace kvsparse {
namespace {

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

TEST(CakeLayerBudgetsTest, ProportionalAboveTheWindows) {
  const std::vector<double> prefs = {1.0, 3.0};
  const std::vector<int32_t> windows = {8, 8};
  // 200 tokens: 8 + 8 windows, then 184 split 1:3.
  const auto b = CakeLayerBudgets(prefs, windows, /*room=*/1000, /*total=*/200);
  EXPECT_EQ(b, (std::vector<int64_t>{8 + 46, 8 + 138}));
}

TEST(CakeLayerBudgetsTest, RoomCapsAndTheExcessMovesOn) {
  // The preferred layer cannot hold more than the 100 tokens seen; the rest goes to the others.
  // The reference's adjust_budgets: 228 tokens above the windows, truncated shares 2, 223, 2;
  // layer 1 is cut to its room of 96 and its 127 go equally to the other two (64 and 63, the
  // remainder to the first), then the truncation's 1 token to the first below its room.
  EXPECT_EQ(CakeLayerBudgets(std::vector<double>{1, 100, 1}, std::vector<int32_t>{4, 4, 4}, 100, 240),
            (std::vector<int64_t>{4 + 67, 100, 4 + 65}));
  const auto b = CakeLayerBudgets(std::vector<double>{1, 100, 1}, std::vector<int32_t>{4, 4, 4}, 100, 240,
                                  CakeExcess::kPreference);
  EXPECT_EQ(b[1], 100);
  EXPECT_EQ(b[0] + b[2], 140);
  EXPECT_EQ(b[0], b[2]);
  // More than every layer can hold: all at the room.
  for (CakeExcess excess : {CakeExcess::kEqual, CakeExcess::kPreference}) {
    EXPECT_EQ(CakeLayerBudgets(std::vector<double>{1, 2}, std::vector<int32_t>{4, 4}, 50, 1000, excess),
              (std::vector<int64_t>{50, 50}));
  }
}

// The equal split differs from the preference split when a capped layer's excess moves: the
// reference hands it out equally, whatever the others' preferences.
TEST(CakeLayerBudgetsTest, EqualExcessIgnoresTheOthersPreferences) {
  // Shares above windows of 0: 9/10 of 100 = 90 -> capped at 40, its 50 split 25 + 25 although
  // layer 2 is preferred 0.09 to 0.01 over layer 0 (shares 1 and 9 before).
  EXPECT_EQ(CakeLayerBudgets(std::vector<double>{0.01, 0.9, 0.09}, std::vector<int32_t>{0, 0, 0}, 40, 100),
            (std::vector<int64_t>{26, 40, 34}));
  const auto by_preference = CakeLayerBudgets(std::vector<double>{0.01, 0.9, 0.09}, std::vector<int32_t>{0, 0, 0}, 40,
                                              100, CakeExcess::kPreference);
  EXPECT_EQ(by_preference, (std::vector<int64_t>{20, 40, 40}));
}

TEST(CakeLayerBudgetsTest, ZeroPreferencesSplitEquallyAndTinyTotalsSplitTheWindows) {
  EXPECT_EQ(CakeLayerBudgets(std::vector<double>{0, 0, 0}, std::vector<int32_t>{2, 2, 2}, 1000, 90),
            (std::vector<int64_t>{30, 30, 30}));
  EXPECT_EQ(CakeLayerBudgets(std::vector<double>{1, 1}, std::vector<int32_t>{32, 32}, 1000, 20),
            (std::vector<int64_t>{10, 10}));
  EXPECT_TRUE(CakeLayerBudgets({}, {}, 10, 10).empty());
}

TEST(CakeLayerBudgetsTest, RandomSplitsSumToTheTotalWithinTheRoom) {  // the preference rule
  std::mt19937 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = std::uniform_int_distribution<int>(1, 12)(rng);
    std::vector<double> prefs(n);
    std::vector<int32_t> windows(n);
    for (int k = 0; k < n; ++k) {
      prefs[k] = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0.0 : std::uniform_real_distribution<double>(0, 50)(rng);
      windows[k] = std::uniform_int_distribution<int32_t>(0, 40)(rng);
    }
    const int64_t room = std::uniform_int_distribution<int64_t>(1, 500)(rng);
    const int64_t total = std::uniform_int_distribution<int64_t>(0, 3000)(rng);
    const auto equal = CakeLayerBudgets(prefs, windows, room, total);
    EXPECT_LE(Sum(equal), std::min<int64_t>(total, room * n)) << "trial " << trial;
    for (int k = 0; k < n; ++k) EXPECT_TRUE(equal[k] >= 0 && equal[k] <= room) << "trial " << trial;
    const auto b = CakeLayerBudgets(prefs, windows, room, total, CakeExcess::kPreference);
    ASSERT_EQ(Sum(b), std::min<int64_t>(total, room * n)) << "trial " << trial;
    for (int k = 0; k < n; ++k) {
      EXPECT_GE(b[k], 0);
      EXPECT_LE(b[k], room);
    }
    // Once every window fits, a strictly preferred layer never gets less than a less preferred one
    // with the same window, unless the room caps it.
    int64_t windows_total = 0;
    for (int k = 0; k < n; ++k) windows_total += std::min<int64_t>(windows[k], room);
    if (total < windows_total) continue;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (prefs[i] > prefs[j] && windows[i] == windows[j] && b[i] < room) {
          EXPECT_GE(b[i] + 1, b[j]);
        }
      }
    }
  }
}

// One prompt call's observation: `q` window queries over n tokens, rows [q, heads, n].
AttentionObservation WindowObservation(int32_t n, int32_t q, int heads, const float* rows, const int32_t* positions) {
  AttentionObservation obs;
  obs.n_queries = q;
  obs.n_tokens = n;
  obs.n_kv_heads = 1;
  obs.n_heads = heads;
  obs.query_positions = positions;
  obs.n_window = q;
  obs.window_rows = rows;
  return obs;
}

// The keep mask of a selection right after a prompt: n live tokens at positions 0.., `target` kept.
std::vector<uint8_t> PromptKeep(KvPolicy& policy, const std::vector<int32_t>& positions, int32_t target) {
  SelectionContext ctx;
  ctx.n_live = static_cast<int32_t>(positions.size());
  ctx.target = target;
  ctx.positions = positions.data();
  ctx.current_position = ctx.n_live - 1;
  ctx.in_prefill = true;
  std::vector<uint8_t> keep;
  policy.SelectKeep(ctx, &keep);
  return keep;
}

TEST(CakePolicyTest, IndicatorIsMeanPlusGammaVarianceOfTheWindow) {
  LayerKvConfig config;
  config.method = KvMethod::kCake;
  config.params = DefaultMethodParams(KvMethod::kCake);
  config.params.obs_window = 4;
  config.params.kernel = 1;  // no pooling: the raw indicator decides
  config.params.gamma = 10;
  config.budget = KvBudget::Tokens(6);
  auto policy = std::move(CreatePolicy(config, 0, 1, 1)).value();
  // 8 tokens, one observation of 4 queries, one head. Token 1 gets a steady 0.1 from every query
  // (mean 0.1, variance 0); token 2 gets 0.3 from one query only (mean 0.075, variance 0.0225):
  // with gamma 10 token 2 scores 0.3 and wins, with gamma 0 token 1 would.
  const int32_t n = 8, q = 4;
  policy->OnAppend(n);
  std::vector<float> rows(static_cast<size_t>(q) * n, 0.f);  // [q, 1, n] oldest query first
  for (int w = 0; w < q; ++w) {
    rows[static_cast<size_t>(w) * n + 1] = 0.1f;
    if (w == 2) rows[static_cast<size_t>(w) * n + 2] = 0.3f;
    rows[static_cast<size_t>(w) * n + 0] = 0.02f;
  }
  std::vector<int32_t> qpos = {4, 5, 6, 7};
  policy->Observe(WindowObservation(n, q, 1, rows.data(), qpos.data()));
  std::vector<int32_t> positions(n);
  std::iota(positions.begin(), positions.end(), 0);
  // Kept: the 4-token window + one earlier token.
  EXPECT_EQ(PromptKeep(*policy, positions, 5), (std::vector<uint8_t>{0, 0, 1, 0, 1, 1, 1, 1}));
  // A decode step's eviction scores by its query alone (the reference's decoding cache): that
  // query gives token 1 the most, so token 1 is kept although token 2's indicator is higher.
  policy->OnAppend(1);
  std::vector<float> decode_row(static_cast<size_t>(n) + 1, 0.01f);
  decode_row[1] = 0.5f;
  std::vector<int32_t> decode_pos = {n};
  AttentionObservation step;
  step.n_queries = 1;
  step.n_tokens = n + 1;
  step.n_kv_heads = 1;
  step.query_positions = decode_pos.data();
  step.n_window = 1;
  step.window_rows = decode_row.data();
  policy->Observe(step);
  positions.push_back(n);
  SelectionContext ctx;
  ctx.n_live = n + 1;
  ctx.target = 5;
  ctx.positions = positions.data();
  ctx.current_position = n;
  ctx.in_prefill = false;
  std::vector<uint8_t> keep;
  policy->SelectKeep(ctx, &keep);
  EXPECT_EQ(keep, (std::vector<uint8_t>{0, 1, 0, 0, 0, 1, 1, 1, 1}));
}

// The reference scores per query head (after repeat_kv): mean + gamma * variance of each head's
// window attention, then the group's mean. With 4 query heads, token 1 draws 0.4 from one head's
// first window query and nothing else; token 2 draws 0.104 from every head's first query. The
// group's mean attention gives both the same series shape, token 2 slightly more (it wins the
// group-mean indicator); per query head, token 1's variance in its one head outweighs it.
TEST(CakePolicyTest, IndicatorIsPerQueryHeadThenTheGroupsMean) {
  constexpr int32_t n = 8, q = 4;
  constexpr int kHeads = 4;
  std::vector<float> heads_rows(static_cast<size_t>(q) * kHeads * n, 0.f);  // [q, heads, n]
  std::vector<float> mean_rows(static_cast<size_t>(q) * n, 0.f);            // [q, 1, n] the group's mean
  auto at = [&](int w, int h, int t) -> float& { return heads_rows[(static_cast<size_t>(w) * kHeads + h) * n + t]; };
  at(0, 0, 1) = 0.4f;
  for (int h = 0; h < kHeads; ++h) at(0, h, 2) = 0.104f;
  for (int w = 0; w < q; ++w) {
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < kHeads; ++h) mean_rows[static_cast<size_t>(w) * n + t] += at(w, h, t) / kHeads;
    }
  }
  std::vector<int32_t> qpos = {4, 5, 6, 7}, positions(n);
  std::iota(positions.begin(), positions.end(), 0);
  for (const bool query_heads : {true, false}) {
    LayerKvConfig config;
    config.method = KvMethod::kCake;
    config.params = DefaultMethodParams(KvMethod::kCake);
    config.params.obs_window = q;
    config.params.kernel = 1;
    config.params.gamma = 10;
    config.params.query_head_scores = query_heads;
    config.budget = KvBudget::Tokens(5);
    auto policy = std::move(CreatePolicy(config, 0, 1, 1)).value();
    EXPECT_EQ((policy->NeededObservations() & kObserveQueryHeads) != 0, query_heads);
    policy->OnAppend(n);
    policy->Observe(WindowObservation(n, q, query_heads ? kHeads : 1,
                                      query_heads ? heads_rows.data() : mean_rows.data(), qpos.data()));
    const std::vector<uint8_t> keep = PromptKeep(*policy, positions, 5);  // the window + one earlier token
    const int kept = query_heads ? 1 : 2;
    EXPECT_EQ(keep[kept], 1) << (query_heads ? "per query head" : "group mean");
    EXPECT_EQ(keep[3 - kept], 0) << (query_heads ? "per query head" : "group mean");
  }
}

}  // namespace
}  // namespace kvsparse
