#include "kvsparse/bench_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kvsparse {
namespace {

using Ids = std::vector<int32_t>;

TEST(AnswerMetrics, TokenIds) {
  EXPECT_TRUE(ExactMatchIds(Ids{1, 2, 3}, Ids{1, 2, 3}));
  EXPECT_FALSE(ExactMatchIds(Ids{1, 2}, Ids{1, 2, 3}));
  EXPECT_FALSE(ExactMatchIds(Ids{1, 2, 3, 4}, Ids{1, 2, 3}));
  EXPECT_TRUE(ContainsIds(Ids{5, 1, 2, 3, 9}, Ids{1, 2, 3}));
  EXPECT_FALSE(ContainsIds(Ids{5, 1, 2, 3, 9}, Ids{2, 1}));
  EXPECT_FALSE(ContainsIds(Ids{1, 9, 2}, Ids{1, 2}));  // contiguous only
  EXPECT_TRUE(ContainsIds(Ids{7}, Ids{}));
  // gen {1,2,2,3}, ans {2,2,4}: common 2, P = 2/4, R = 2/3, F1 = 2PR/(P+R) = 4/7.
  EXPECT_NEAR(TokenF1Ids(Ids{1, 2, 2, 3}, Ids{2, 2, 4}), 4.0 / 7.0, 1e-12);
  EXPECT_EQ(TokenF1Ids(Ids{1, 2}, Ids{3}), 0.0);
  EXPECT_EQ(TokenF1Ids(Ids{}, Ids{}), 1.0);
  EXPECT_EQ(TokenF1Ids(Ids{1}, Ids{}), 0.0);
  EXPECT_EQ(TokenF1Ids(Ids{3, 1}, Ids{1, 3}), 1.0);  // a bag: order does not matter
}

TEST(AnswerMetrics, Normalization) {
  EXPECT_EQ(NormalizeAnswer("The  Cat, sat on A mat!"), "cat sat on mat");
  EXPECT_EQ(NormalizeAnswer("  an\tApple.\n"), "apple");
  EXPECT_EQ(NormalizeAnswer("theater"), "theater");  // only whole-word articles go
  EXPECT_EQ(NormalizeAnswer("Café"), "café");        // UTF-8 bytes kept
  EXPECT_EQ(NormalizeAnswer("..."), "");
}

TEST(AnswerMetrics, Text) {
  EXPECT_TRUE(ExactMatchText("The answer: Paris.", "answer paris"));
  EXPECT_FALSE(ExactMatchText("Paris, France", "Paris"));
  EXPECT_TRUE(ContainsText("I live in New York City.", "new york"));
  EXPECT_TRUE(ContainsText("The magic number is 1234567.", "1234567"));
  EXPECT_FALSE(ContainsText("123", "12"));  // whole words only
  EXPECT_FALSE(ContainsText("york new", "new york"));
  EXPECT_TRUE(ContainsText("anything", "the"));  // normalizes to nothing
  // gen words {cat, sat}, ans {cat, sat, down}: P = 1, R = 2/3, F1 = 0.8.
  EXPECT_NEAR(TokenF1Text("the cat sat", "a cat sat down"), 0.8, 1e-12);
  EXPECT_EQ(TokenF1Text("dog", "cat"), 0.0);
}

TEST(ConfidenceIntervals, Wilson) {
  // Values from the closed form with z = 1.959963984540054.
  Interval a = WilsonInterval(8, 10);
  EXPECT_NEAR(a.low, 0.490162471537, 1e-9);
  EXPECT_NEAR(a.high, 0.943317848546, 1e-9);
  Interval b = WilsonInterval(0, 10);
  EXPECT_NEAR(b.low, 0.0, 1e-12);
  EXPECT_NEAR(b.high, 0.277532799863, 1e-9);
  Interval c = WilsonInterval(10, 10);
  EXPECT_NEAR(c.low, 0.722467200137, 1e-9);
  EXPECT_NEAR(c.high, 1.0, 1e-12);
  Interval d = WilsonInterval(0, 0);
  EXPECT_EQ(d.low, 0.0);
  EXPECT_EQ(d.high, 1.0);
}

TEST(ConfidenceIntervals, StudentT) {
  EXPECT_NEAR(StudentT975(1), 12.706204736, 1e-8);
  EXPECT_NEAR(StudentT975(10), 2.228138852, 1e-8);
  EXPECT_NEAR(StudentT975(30), 2.042272456, 1e-8);
  // Above the table: the expansion, against quantiles from numerical integration.
  EXPECT_NEAR(StudentT975(31), 2.039513446, 1e-4);
  EXPECT_NEAR(StudentT975(40), 2.021075390, 1e-4);
  EXPECT_NEAR(StudentT975(60), 2.000297822, 1e-5);
  EXPECT_NEAR(StudentT975(120), 1.979930405, 1e-6);
  EXPECT_NEAR(StudentT975(1000), 1.962339081, 1e-6);
  EXPECT_TRUE(std::isnan(StudentT975(0)));
}

TEST(ConfidenceIntervals, MeanWithT) {
  const std::vector<double> v = {1, 2, 3, 4};
  const MeanCi ci = MeanWithCi(v);
  // mean 2.5, s = sqrt(5/3), half = t(3) · s / 2.
  EXPECT_EQ(ci.n, 4);
  EXPECT_DOUBLE_EQ(ci.mean, 2.5);
  EXPECT_NEAR(ci.stddev, std::sqrt(5.0 / 3.0), 1e-12);
  EXPECT_NEAR(ci.low, 0.4457397434226116, 1e-8);
  EXPECT_NEAR(ci.high, 4.5542602565773884, 1e-8);
  const std::vector<double> one = {0.3};
  const MeanCi single = MeanWithCi(one);
  EXPECT_EQ(single.low, 0.3);
  EXPECT_EQ(single.high, 0.3);
  EXPECT_TRUE(std::isnan(MeanWithCi({}).mean));
}

TEST(Fidelity, KlTop1Perplexity) {
  const float ln3 = std::log(3.0f);
  const std::vector<float> full = {0.0f, ln3};     // p = (1/4, 3/4)
  const std::vector<float> sparse = {0.0f, 0.0f};  // q = (1/2, 1/2)
  // KL = 1/4 ln(1/2) + 3/4 ln(3/2).
  const double expected = 0.75 * std::log(1.5) - 0.25 * std::log(2.0);
  EXPECT_NEAR(KlDivergenceFromLogits(full, sparse), expected, 1e-7);
  // Shift invariance and stability at large magnitudes.
  const std::vector<float> full_big = {1000.0f, 1000.0f + ln3};
  const std::vector<float> sparse_big = {-1000.0f, -1000.0f};
  EXPECT_NEAR(KlDivergenceFromLogits(full_big, sparse_big), expected, 1e-4);
  EXPECT_EQ(KlDivergenceFromLogits(full, full), 0.0);

  const std::vector<double> ls = LogSoftmax(full);
  EXPECT_NEAR(ls[0], std::log(0.25), 1e-7);
  EXPECT_NEAR(ls[1], std::log(0.75), 1e-7);
  EXPECT_NEAR(TokenLogProb(full, 1), std::log(0.75), 1e-7);

  EXPECT_EQ(ArgMax(std::vector<float>{1, 3, 3}), 1);  // ties → lowest index
  EXPECT_TRUE(Top1Agrees(full, std::vector<float>{-5, 2}));
  EXPECT_FALSE(Top1Agrees(full, sparse));  // sparse tie → index 0

  const std::vector<double> lp = {std::log(0.5), std::log(0.25)};
  EXPECT_NEAR(Perplexity(lp), std::sqrt(8.0), 1e-12);  // exp(−(ln ½ + ln ¼)/2)
  EXPECT_TRUE(std::isnan(Perplexity({})));
}

TEST(Fidelity, Accumulator) {
  const float ln3 = std::log(3.0f);
  FidelityAccumulator acc;
  acc.Add(std::vector<float>{0, ln3}, std::vector<float>{0, ln3}, 1);  // identical: KL 0, agree
  acc.Add(std::vector<float>{0, ln3}, std::vector<float>{0, 0}, 0);    // KL as above, disagree
  acc.Add(std::vector<float>{2, 0}, std::vector<float>{3, 0}, -1);     // no next token: KL and top-1 only
  EXPECT_EQ(acc.positions(), 3);
  const double kl1 = 0.75 * std::log(1.5) - 0.25 * std::log(2.0);
  const double p2 = 1 / (1 + std::exp(-2.0)), q2 = 1 / (1 + std::exp(-3.0));
  const double kl2 = p2 * std::log(p2 / q2) + (1 - p2) * std::log((1 - p2) / (1 - q2));
  EXPECT_NEAR(acc.mean_kl(), (kl1 + kl2) / 3, 1e-6);
  EXPECT_NEAR(acc.top1_agreement(), 2.0 / 3.0, 1e-12);
  // full: log p = ln 3/4 (pos 0, token 1), ln 1/4 (pos 1, token 0); sparse: ln 3/4, ln 1/2.
  EXPECT_NEAR(acc.perplexity_full(), std::exp(-(std::log(0.75) + std::log(0.25)) / 2), 1e-6);
  EXPECT_NEAR(acc.perplexity_sparse(), std::exp(-(std::log(0.75) + std::log(0.5)) / 2), 1e-6);
  EXPECT_NEAR(acc.perplexity_change(), std::sqrt(0.25 / 0.5) - 1.0, 1e-6);
}

TEST(Generation, DistinctN) {
  const Ids loop = {1, 2, 1, 2, 1, 2};
  // bigrams (1,2) (2,1) (1,2) (2,1) (1,2): 2 distinct of 5.
  EXPECT_NEAR(DistinctN(loop, 2), 0.4, 1e-12);
  EXPECT_NEAR(RepetitionRate(loop, 2), 0.6, 1e-12);
  EXPECT_NEAR(DistinctN(loop, 1), 2.0 / 6.0, 1e-12);
  EXPECT_EQ(DistinctN(Ids{1, 2, 3, 4}, 3), 1.0);
  EXPECT_EQ(DistinctN(Ids{1, 2}, 3), 1.0);  // no trigram
  EXPECT_EQ(RepetitionRate(Ids{}, 2), 0.0);
}

TEST(Latency, PercentileType7) {
  const std::vector<double> v = {4, 1, 3, 2};  // sorted 1 2 3 4
  EXPECT_DOUBLE_EQ(Percentile(v, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.9), 3.7);  // h = 3 · 0.9 = 2.7 → 3 + 0.7 · 1
  EXPECT_DOUBLE_EQ(Percentile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(Percentile(v, 1.0), 4.0);
  const std::vector<double> five = {10, 20, 30, 40, 50};
  EXPECT_DOUBLE_EQ(Percentile(five, 0.9), 46.0);  // h = 3.6
  EXPECT_DOUBLE_EQ(Percentile(std::vector<double>{7}, 0.9), 7.0);
  EXPECT_TRUE(std::isnan(Percentile({}, 0.5)));
  const LatencySummary s = SummarizeLatency(five);
  EXPECT_EQ(s.n, 5);
  EXPECT_DOUBLE_EQ(s.mean, 30);
  EXPECT_DOUBLE_EQ(s.median, 30);
  EXPECT_DOUBLE_EQ(s.p90, 46);
  EXPECT_DOUBLE_EQ(s.min, 10);
  EXPECT_DOUBLE_EQ(s.max, 50);
}

TEST(Aggregator, KeysAndIntervals) {
  BenchAggregator agg;
  EXPECT_TRUE(agg.empty());
  for (int i = 0; i < 10; ++i) agg.Add("niah_single", "depth=0.5", "score", i < 8 ? 1.0 : 0.0);
  agg.Add("niah_single", "depth=0.25", "score", 1.0);
  agg.Add("copy", "span=16,depth=0.5", "f1", 0.5);
  agg.Add("copy", "span=16,depth=0.5", "f1", 1.0);

  const auto acc = agg.Get("niah_single", "depth=0.5", "score");
  ASSERT_TRUE(acc.has_value());
  EXPECT_EQ(acc->n, 10);
  EXPECT_DOUBLE_EQ(acc->mean, 0.8);
  EXPECT_TRUE(acc->binary);
  EXPECT_NEAR(acc->ci_low, 0.490162471537, 1e-9);  // Wilson 8/10
  EXPECT_NEAR(acc->ci_high, 0.943317848546, 1e-9);

  const auto f1 = agg.Get("copy", "span=16,depth=0.5", "f1");
  ASSERT_TRUE(f1.has_value());
  EXPECT_FALSE(f1->binary);
  EXPECT_DOUBLE_EQ(f1->mean, 0.75);
  const double half = StudentT975(1) * std::sqrt(0.125) / std::sqrt(2.0);  // s = sqrt(0.125)
  EXPECT_NEAR(f1->ci_low, 0.75 - half, 1e-9);
  EXPECT_NEAR(f1->ci_high, 0.75 + half, 1e-9);

  EXPECT_FALSE(agg.Get("copy", "span=16,depth=0.5", "score").has_value());
  const auto rows = agg.Rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].task, "copy");
  EXPECT_EQ(rows[1].subtask, "depth=0.25");
  EXPECT_EQ(rows[2].subtask, "depth=0.5");
  ASSERT_NE(agg.Values("niah_single", "depth=0.25", "score"), nullptr);
  EXPECT_EQ(agg.Values("niah_single", "depth=0.25", "score")->size(), 1u);
}

}  // namespace
}  // namespace kvsparse
