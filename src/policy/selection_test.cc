#include "policy/selection.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kvsparse::policy {
namespace {

std::vector<int32_t> Kept(const std::vector<uint8_t>& keep) {
  std::vector<int32_t> kept;
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i]) kept.push_back(static_cast<int32_t>(i));
  return kept;
}

TEST(SelectionTest, SinksWindowAndTopScores) {
  const std::vector<float> scores = {0.f, 9.f, 1.f, 5.f, 3.f, 4.f, 0.f, 0.f};
  std::vector<int32_t> scratch;
  std::vector<uint8_t> keep;
  KeepSinksRecentAndTop(scores.data(), 8, 5, 1, 2, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{0, 1, 3, 6, 7}));
}

TEST(SelectionTest, TiesKeepTheNewerAndNaNRanksLowest) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> scores = {nan, 1.f, 1.f, nan, 1.f, 0.5f};
  std::vector<int32_t> scratch;
  std::vector<uint8_t> keep;
  KeepSinksRecentAndTop(scores.data(), 6, 2, 0, 0, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{4, 5}));  // the newest token, then the newer of the tied
  KeepSinksRecentAndTop(scores.data(), 6, 5, 0, 0, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{1, 2, 3, 4, 5}));  // NaNs last, then the newer NaN
}

// The newest token survives any target >= 1 (the next step attends to it), then the real
// first tokens as sinks: a tiny target shrinks the window, never promotes later tokens to sinks.
TEST(SelectionTest, TinyTargetsKeepTheNewestThenTheSinks) {
  const std::vector<float> scores = {0.f, 0.f, 0.f, 0.f, 9.f, 9.f, 9.f, -1.f};
  std::vector<int32_t> scratch;
  std::vector<uint8_t> keep;
  KeepSinksRecentAndTop(scores.data(), 8, 1, 4, 0, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{7}));
  KeepSinksRecentAndTop(scores.data(), 8, 3, 4, 0, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{0, 1, 7}));
  KeepSinksRecentAndTop(scores.data(), 8, 6, 4, 3, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{0, 1, 2, 3, 6, 7}));
  KeepSinksRecentAndTop(scores.data(), 8, 2, 0, 0, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{6, 7}));  // top score among the rest, and the newest
}

TEST(SelectionTest, KeepsAllWhenTargetIsEverything) {
  const std::vector<float> scores = {3.f, 2.f, 1.f};
  std::vector<int32_t> scratch;
  std::vector<uint8_t> keep;
  KeepSinksRecentAndTop(scores.data(), 3, 3, 5, 5, &scratch, &keep);
  EXPECT_EQ(Kept(keep), (std::vector<int32_t>{0, 1, 2}));
}

TEST(SelectionTest, RecentWindowTokens) {
  KvMethodParams p;
  p.recent_ratio = 0.5;
  EXPECT_EQ(RecentWindowTokens(p, 7), 3);
  p.recent = 10;
  EXPECT_EQ(RecentWindowTokens(p, 7), 7);  // clamped
  p.recent = 2;
  EXPECT_EQ(RecentWindowTokens(p, 7), 2);
}

TEST(SelectionTest, ReduceHeadsMeanAndMax) {
  const std::vector<float> values = {1.f, 3.f, -2.f, 0.f};  // [2 tokens, 2 heads]
  std::vector<float> out(2);
  ReduceHeads(values.data(), 2, 2, HeadReduce::kMean, out.data());
  EXPECT_EQ(out, (std::vector<float>{2.f, -1.f}));
  ReduceHeads(values.data(), 2, 2, HeadReduce::kMax, out.data());
  EXPECT_EQ(out, (std::vector<float>{3.f, 0.f}));
}

}  // namespace
}  // namespace kvsparse::policy
