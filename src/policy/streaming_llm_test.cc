#include <gtest/gtest.h>

#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

TEST(StreamingLlmTest, KeepsSinksAndTheTail) {
  Harness h(Layer(KvMethod::kStreamingLlm, KvBudget::Tokens(8)));  // 4 sinks + 4 recent
  EXPECT_FALSE(h.policy().NeedsAttention());
  h.Append(20);
  EXPECT_EQ(h.Evict(8), (Positions{0, 1, 2, 3, 16, 17, 18, 19}));
}

TEST(StreamingLlmTest, SinksSurviveRepeatedEvictions) {
  LayerKvConfig config = Layer(KvMethod::kStreamingLlm, KvBudget::Tokens(5));
  config.params.n_sink = 2;
  Harness h(config);
  h.Append(9);
  ASSERT_EQ(h.Evict(5), (Positions{0, 1, 6, 7, 8}));
  h.Append(4);
  EXPECT_EQ(h.Evict(5), (Positions{0, 1, 10, 11, 12}));
}

TEST(StreamingLlmTest, FractionBudgetResolvesAgainstTokensSeen) {
  Harness h(Layer(KvMethod::kStreamingLlm, KvBudget::Fraction(0.25)));
  h.Append(40);
  const int32_t target = h.policy().EvictionTarget(40, 40, EvictionPoint::kPrefillChunk, 16);
  ASSERT_EQ(target, 10);
  EXPECT_EQ(h.Evict(target), (Positions{0, 1, 2, 3, 34, 35, 36, 37, 38, 39}));
}

TEST(StreamingLlmTest, SinksClampToATinyBudget) {
  Harness h(Layer(KvMethod::kStreamingLlm, KvBudget::Fraction(0.1)));
  h.Append(20);  // budget 2 < 4 sinks: the newest token and the first sink
  EXPECT_EQ(h.Evict(2), (Positions{0, 19}));
  h.Append(1);
  EXPECT_EQ(h.Evict(2), (Positions{0, 20}));  // the real first token stays the sink
}

}  // namespace
}  // namespace kvsparse::policy_test
