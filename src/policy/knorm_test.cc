#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "ops/kv_quant.h"
#include "kvsparse/dtype.h"
#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

constexpr int kHeads = 2;
constexpr int kHeadDim = 4;

// Keys [n, kHeads, kHeadDim] whose head h of token t has L2 norm norms[t][h] (and a
// direction that varies, so the norm is not read off one element).
std::vector<float> KeysWithNorms(const std::vector<std::array<float, kHeads>>& norms) {
  std::vector<float> keys;
  for (size_t t = 0; t < norms.size(); ++t) {
    for (int h = 0; h < kHeads; ++h) {
      float direction[kHeadDim] = {1.f, -2.f, 0.5f + t, 1.5f - h};
      float length = 0.f;
      for (float d : direction) length += d * d;
      length = std::sqrt(length);
      for (float d : direction) keys.push_back(d / length * norms[t][h]);
    }
  }
  return keys;
}

// KNorm on a layer it compresses (the default leaves layers 0-1 whole; the harness drives layer 0).
LayerKvConfig Config(int32_t budget) {
  LayerKvConfig config = Layer(KvMethod::kKNorm, KvBudget::Tokens(budget));
  config.params.dense_layers = 0;
  return config;
}

const std::vector<std::array<float, kHeads>> kNorms = {
    {5.f, 5.f}, {1.f, 1.f}, {9.f, 8.f}, {2.f, 3.f}, {0.5f, 7.f}, {4.f, 4.f}, {3.f, 1.f}};
// Mean norms: 5, 1, 8.5, 2.5, 3.75, 4, 2 -> the 3 lowest: 1 (1), 6 (2), 3 (2.5).

// The keys split over two spans, as a paged cache would return them.
struct Spans {
  std::vector<KvSpan> spans;
  std::vector<int32_t> positions;
};

template <typename T>
Spans TwoSpans(const std::vector<T>& keys, const std::vector<float>& scales, int32_t n, const Positions& live) {
  Spans s;
  s.positions = live;
  const int32_t first = n / 2;
  for (auto [begin, count] : {std::pair{0, first}, std::pair{first, n - first}}) {
    KvSpan span;
    span.k = keys.data() + static_cast<size_t>(begin) * kHeads * kHeadDim;
    span.k_scale = scales.empty() ? nullptr : scales.data() + static_cast<size_t>(begin) * kHeads;
    span.positions = s.positions.data() + begin;
    span.n = count;
    s.spans.push_back(span);
  }
  return s;
}

TEST(KNormTest, DefaultsFollowThePaper) {
  const KvMethodParams p = DefaultMethodParams(KvMethod::kKNorm);
  EXPECT_EQ(p.dense_layers, 2);
  EXPECT_FALSE(p.decode_evict);
  EXPECT_TRUE(DefaultPerHead(KvMethod::kKNorm));
  Harness h(Config(3));
  EXPECT_FALSE(h.policy().EvictsDuringDecode());  // the prompt only, as the reference
  EXPECT_EQ(h.policy().EvictionTarget(40, 40, EvictionPoint::kDecodeStep, 1), 40);
  EXPECT_EQ(h.policy().EvictionTarget(40, 40, EvictionPoint::kPromptEnd, 1), 3);
}

TEST(KNormTest, KeepsTheLowestKeyNormsF32) {
  Harness h(Config(3));
  EXPECT_FALSE(h.policy().NeedsAttention());
  h.Append(7);
  const std::vector<float> keys = KeysWithNorms(kNorms);
  Spans s = TwoSpans(keys, {}, 7, h.live());
  EXPECT_EQ(h.Evict(3, false, s.spans.data(), 2, KvStorage::kF32, kHeads, kHeadDim), (Positions{1, 3, 6}));
}

TEST(KNormTest, KeepsTheLowestKeyNormsF16) {
  Harness h(Config(3));
  h.Append(7);
  std::vector<f16_bits> keys;
  for (float v : KeysWithNorms(kNorms)) keys.push_back(F32ToF16(v));
  Spans s = TwoSpans(keys, {}, 7, h.live());
  EXPECT_EQ(h.Evict(3, false, s.spans.data(), 2, KvStorage::kF16, kHeads, kHeadDim), (Positions{1, 3, 6}));
}

TEST(KNormTest, Int8NormsUseTheScales) {
  // Same quantized vector for every token; the per-(token, head) scale sets the norm.
  Harness h(Config(2));
  h.Append(4);
  std::vector<int8_t> keys;
  for (int i = 0; i < 4 * kHeads; ++i)
    for (int8_t q : {int8_t{127}, int8_t{-64}, int8_t{3}, int8_t{100}}) keys.push_back(q);
  const std::vector<float> scales = {0.5f, 0.5f, 0.01f, 0.02f, 0.3f, 0.1f, 0.04f, 0.01f};  // [4, kHeads]
  Spans s = TwoSpans(keys, scales, 4, h.live());
  EXPECT_EQ(h.Evict(2, false, s.spans.data(), 2, KvStorage::kInt8, kHeads, kHeadDim), (Positions{1, 3}));
}

// int8_kivi: the first span is a quantized page (K codes times per-(head, channel) scales), the
// second the full-precision (f16) residual; both are read in their own type.
TEST(KNormTest, Int8KiviReadsChannelScalesAndResidual) {
  Harness h(Config(3));
  h.Append(7);
  const std::vector<float> keys = KeysWithNorms(kNorms);
  const int page = 3, row_len = kHeads * kHeadDim;
  std::vector<int8_t> codes(static_cast<size_t>(page) * row_len);
  std::vector<float> channel_scale(row_len), v_scale(static_cast<size_t>(page) * kHeads, 1.f);
  ops::QuantizeKvColumnsInt8(keys.data(), page, row_len, codes.data(), channel_scale.data());
  std::vector<f16_bits> residual;
  for (size_t e = static_cast<size_t>(page) * row_len; e < keys.size(); ++e) residual.push_back(F32ToF16(keys[e]));
  Positions positions = h.live();
  KvSpan spans[2];
  spans[0].k = codes.data();
  spans[0].v = codes.data();
  spans[0].v_scale = v_scale.data();
  spans[0].k_channel_scale = channel_scale.data();
  spans[0].positions = positions.data();
  spans[0].n = page;
  spans[1].k = residual.data();
  spans[1].v = residual.data();
  spans[1].positions = positions.data() + page;
  spans[1].n = 7 - page;
  EXPECT_EQ(h.Evict(3, false, spans, 2, KvStorage::kInt8Kivi, kHeads, kHeadDim), (Positions{1, 3, 6}));
  // The page's norms follow its channel scales: a tenth of them makes the page's tokens (norms
  // 5, 1, 8.5 -> 0.5, 0.1, 0.85) the shortest; the newest token (6) always stays.
  for (float& x : channel_scale) x *= 0.1f;
  Harness h2(Config(3));
  h2.Append(7);
  EXPECT_EQ(h2.Evict(3, false, spans, 2, KvStorage::kInt8Kivi, kHeads, kHeadDim), (Positions{0, 1, 6}));
}

TEST(KNormTest, HeadReduceMaxKeepsATokenWithOneShortHead) {
  LayerKvConfig config = Config(3);
  config.params.head_reduce = HeadReduce::kMax;
  Harness h(config);
  h.Append(7);
  const std::vector<float> keys = KeysWithNorms(kNorms);
  Spans s = TwoSpans(keys, {}, 7, h.live());
  // Shortest head per token: 5, 1, 8, 2, 0.5, 4, 1 -> keep 4 (0.5), 1 and 6 (1).
  EXPECT_EQ(h.Evict(3, false, s.spans.data(), 2, KvStorage::kF32, kHeads, kHeadDim), (Positions{1, 4, 6}));
}

TEST(KNormTest, NormsStayAlignedAcrossEvictions) {
  Harness h(Config(3));
  h.Append(7);
  {
    const std::vector<float> keys = KeysWithNorms(kNorms);
    Spans s = TwoSpans(keys, {}, 7, h.live());
    ASSERT_EQ(h.Evict(3, false, s.spans.data(), 2, KvStorage::kF32, kHeads, kHeadDim), (Positions{1, 3, 6}));
  }
  // The cache now holds 1, 3, 6 and then 7, 8 with mean norms 0.2 and 9 (8, the newest, stays).
  // The old rows get different keys here: their norms were computed once and must follow them
  // (a policy that re-read them, or lost their alignment, would keep another set).
  h.Append(2);
  const std::vector<std::array<float, kHeads>> live_norms = {
      {100.f, 100.f}, {100.f, 100.f}, {100.f, 100.f}, {0.2f, 0.2f}, {9.f, 9.f}};
  const std::vector<float> keys = KeysWithNorms(live_norms);
  Spans s = TwoSpans(keys, {}, 5, h.live());
  EXPECT_EQ(h.Evict(3, false, s.spans.data(), 2, KvStorage::kF32, kHeads, kHeadDim), (Positions{1, 7, 8}));
}

}  // namespace
}  // namespace kvsparse::policy_test
