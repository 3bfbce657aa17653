#include "kvsparse/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvsparse {
namespace {

SamplerParams Plain(float temperature, uint64_t seed = 7) {
  SamplerParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.repeat_penalty = 1.0f;
  p.seed = seed;
  return p;
}

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  double max = logits[0];
  for (float l : logits) max = std::max<double>(max, l);
  std::vector<double> p(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += p[i] = std::exp((logits[i] - max) / temperature);
  for (double& x : p) x /= total;
  return p;
}

std::vector<double> Frequencies(Sampler& sampler, const std::vector<float>& logits, int draws) {
  std::vector<double> counts(logits.size(), 0);
  for (int i = 0; i < draws; ++i) counts[sampler.Sample(logits.data(), static_cast<int32_t>(logits.size()))] += 1;
  for (double& c : counts) c /= draws;
  return counts;
}

TEST(Sampler, GreedyIsArgmaxWithLowestIndexOnTies) {
  Sampler sampler(Plain(0.0f));
  const std::vector<float> logits = {0.1f, 2.5f, -1.0f, 2.5f, 1.0f};
  EXPECT_EQ(sampler.Sample(logits.data(), 5), 1);
  const std::vector<float> negative = {-3.0f, -0.5f, -0.7f};
  EXPECT_EQ(sampler.Sample(negative.data(), 3), 1);
  Sampler negative_temp(Plain(-1.0f));
  EXPECT_EQ(negative_temp.Sample(logits.data(), 5), 1);
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> logits(1000);
  for (float& l : logits) l = dist(rng);
  Sampler greedy(Plain(0.0f));
  const int32_t best = greedy.Sample(logits.data(), 1000);
  for (float temperature : {0.1f, 1.0f, 5.0f, 100.0f}) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      SamplerParams p = Plain(temperature, seed);
      p.top_k = 1;
      Sampler sampler(p);
      for (int i = 0; i < 20; ++i) EXPECT_EQ(sampler.Sample(logits.data(), 1000), best) << temperature;
    }
  }
}

TEST(Sampler, SeededRunsAreReproducible) {
  const std::vector<float> logits = {1.0f, 1.2f, 0.8f, 1.1f, 0.9f, 1.05f};
  SamplerParams p;  // defaults: top-k 40, top-p 0.95, temperature 0.8
  p.seed = 42;
  Sampler a(p), b(p);
  std::vector<int32_t> first, second;
  for (int i = 0; i < 200; ++i) {
    first.push_back(a.Sample(logits.data(), 6));
    second.push_back(b.Sample(logits.data(), 6));
  }
  EXPECT_EQ(first, second);
  a.Reset();
  std::vector<int32_t> again;
  for (int i = 0; i < 200; ++i) again.push_back(a.Sample(logits.data(), 6));
  EXPECT_EQ(first, again) << "Reset restarts the stream";
  p.seed = 43;
  Sampler c(p);
  std::vector<int32_t> other;
  for (int i = 0; i < 200; ++i) other.push_back(c.Sample(logits.data(), 6));
  EXPECT_NE(first, other) << "a different seed gives a different stream";
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.5f, -1.0f};
  for (float temperature : {1.0f, 0.5f, 2.0f}) {
    Sampler sampler(Plain(temperature, 11));
    const std::vector<double> freq = Frequencies(sampler, logits, 40000);
    const std::vector<double> want = Softmax(logits, temperature);
    for (size_t i = 0; i < logits.size(); ++i) {
      EXPECT_NEAR(freq[i], want[i], 0.015) << "token " << i << " at temperature " << temperature;
    }
  }
}

TEST(Sampler, TopKRestrictsToTheBestK) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.5f, 2.9f};
  SamplerParams p = Plain(5.0f);
  p.top_k = 2;
  Sampler sampler(p);
  const std::vector<double> freq = Frequencies(sampler, logits, 5000);
  EXPECT_EQ(freq[0] + freq[1] + freq[3], 0.0);
  EXPECT_GT(freq[2], 0.3);
  EXPECT_GT(freq[4], 0.3);
}

TEST(Sampler, TopPExcludesTheTail) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: p = 0.75 keeps the first two (0.5 < 0.75 <= 0.8).
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplerParams p = Plain(1.0f);
  p.top_p = 0.75f;
  Sampler sampler(p);
  const std::vector<double> freq = Frequencies(sampler, logits, 20000);
  EXPECT_EQ(freq[2], 0.0);
  EXPECT_EQ(freq[3], 0.0);
  EXPECT_NEAR(freq[0], 0.5 / 0.8, 0.02);
  EXPECT_NEAR(freq[1], 0.3 / 0.8, 0.02);
  // A tiny p still keeps the single best token.
  p.top_p = 0.01f;
  Sampler tiny(p);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(tiny.Sample(logits.data(), 4), 0);
}

TEST(Sampler, RepetitionPenaltyFlipsANearTie) {
  SamplerParams p = Plain(0.0f);
  p.repeat_penalty = 1.1f;
  Sampler sampler(p);
  const std::vector<float> positive = {2.0f, 1.9f};
  EXPECT_EQ(sampler.Sample(positive.data(), 2), 0);
  sampler.Accept(0);
  EXPECT_EQ(sampler.Sample(positive.data(), 2), 1);  // 2.0 / 1.1 < 1.9
  // Negative logits are multiplied: -1.0 * 1.1 < -1.05.
  const std::vector<float> negative = {-1.0f, -1.05f};
  EXPECT_EQ(sampler.Sample(negative.data(), 2), 1);
  // Repeats count once.
  sampler.Accept(0);
  sampler.Accept(0);
  const std::vector<float> wider = {2.0f, 1.7f};
  EXPECT_EQ(sampler.Sample(wider.data(), 2), 0);  // 2.0 / 1.1 = 1.82 > 1.7 (not 2.0 / 1.1^3)
  sampler.Reset();
  EXPECT_EQ(sampler.Sample(positive.data(), 2), 0);
}

TEST(Sampler, PenaltyWindowForgetsOldTokens) {
  SamplerParams p = Plain(0.0f);
  p.repeat_penalty = 1.5f;
  p.repeat_last_n = 3;
  Sampler sampler(p);
  const std::vector<float> logits = {2.0f, 1.9f, 0.0f, 0.0f};
  sampler.Accept(0);
  EXPECT_EQ(sampler.Sample(logits.data(), 4), 1);
  for (int i = 0; i < 3; ++i) sampler.Accept(2);
  EXPECT_EQ(sampler.Sample(logits.data(), 4), 0) << "token 0 left the 3-token window";
  p.repeat_last_n = 0;
  Sampler off(p);
  off.Accept(0);
  EXPECT_EQ(off.Sample(logits.data(), 4), 0) << "repeat_last_n = 0 disables the penalty";
}

TEST(Sampler, LogitBiasComesFirst) {
  SamplerParams p = Plain(0.0f);
  p.logit_bias = {{0, -100.0f}, {3, 1.5f}, {99, 5.0f}};  // an id past the vocabulary is ignored
  Sampler sampler(p);
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  EXPECT_EQ(sampler.Sample(logits.data(), 4), 1);  // 0 banned; 3 gets 1.5 < 2.0
  p.logit_bias = {{3, 2.5f}};
  Sampler lifted(p);
  EXPECT_EQ(lifted.Sample(logits.data(), 4), 0);  // 2.5 < 3.0
  p.logit_bias = {{3, 3.5f}};
  Sampler over(p);
  EXPECT_EQ(over.Sample(logits.data(), 4), 3);  // 3.5 > 3.0
}

// OpenAI's penalties count generated tokens only: frequency per occurrence, presence once.
TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedTokens) {
  const std::vector<float> logits = {2.0f, 1.5f, 0.0f};
  SamplerParams p = Plain(0.0f);
  p.presence_penalty = 0.6f;
  Sampler presence(p);
  presence.Accept(0);  // a prompt token: not counted
  EXPECT_EQ(presence.Sample(logits.data(), 3), 0);
  presence.AcceptGenerated(0);
  EXPECT_EQ(presence.Sample(logits.data(), 3), 1);  // 2.0 - 0.6 < 1.5
  presence.AcceptGenerated(1);
  presence.AcceptGenerated(1);
  EXPECT_EQ(presence.Sample(logits.data(), 3), 0);  // 1.4 > 1.5 - 0.6 (once, however often)
  presence.Reset();
  EXPECT_EQ(presence.Sample(logits.data(), 3), 0);

  p = Plain(0.0f);
  p.frequency_penalty = 0.3f;
  Sampler frequency(p);
  frequency.AcceptGenerated(0);
  EXPECT_EQ(frequency.Sample(logits.data(), 3), 0);  // 1.7 > 1.5
  frequency.AcceptGenerated(0);
  EXPECT_EQ(frequency.Sample(logits.data(), 3), 1);  // 1.4 < 1.5
  // Negative penalties encourage repeats.
  p = Plain(0.0f);
  p.presence_penalty = -1.0f;
  Sampler encourage(p);
  encourage.AcceptGenerated(2);
  EXPECT_EQ(encourage.Sample(logits.data(), 3), 0);  // 0 + 1 < 2
  encourage.AcceptGenerated(1);
  EXPECT_EQ(encourage.Sample(logits.data(), 3), 1);  // 1.5 + 1 > 2
}

TEST(Sampler, MinPDropsTheUnlikely) {
  // Probabilities 0.6, 0.3, 0.08, 0.02; min_p 0.1 keeps p >= 0.06: the first three.
  const std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.08f), std::log(0.02f)};
  SamplerParams p = Plain(1.0f);
  p.min_p = 0.1f;
  Sampler sampler(p);
  const std::vector<double> freq = Frequencies(sampler, logits, 20000);
  EXPECT_EQ(freq[3], 0.0);
  EXPECT_NEAR(freq[0], 0.6 / 0.98, 0.02);
  EXPECT_NEAR(freq[2], 0.08 / 0.98, 0.01);
  p.min_p = 1.0f;  // only the best
  Sampler strict(p);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(strict.Sample(logits.data(), 4), 0);
}

TEST(Sampler, NanAndInfiniteLogitsAreHandled) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {nan, 1.0f, nan, 0.5f};
  Sampler sampler(Plain(1.0f));
  for (int i = 0; i < 200; ++i) {
    const int32_t t = sampler.Sample(logits.data(), 4);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  const std::vector<float> all_bad = {nan, -inf, nan};
  const int32_t t = sampler.Sample(all_bad.data(), 3);
  EXPECT_TRUE(t >= 0 && t < 3);
  const std::vector<float> with_inf = {0.0f, inf, 1.0f};
  EXPECT_EQ(sampler.Sample(with_inf.data(), 3), 1);
  // Out-of-range history entries are ignored.
  SamplerParams p = Plain(0.0f);
  p.repeat_penalty = 2.0f;
  Sampler penalized(p);
  penalized.Accept(-1);
  penalized.Accept(1000);
  EXPECT_EQ(penalized.Sample(logits.data(), 4), 1);
}

}  // namespace
}  // namespace kvsparse
