// Oracle (oracle.cc): the tokens each KV head reads equal a plainly written exact top-k of the
// group-folded softmax (mean and max) over ragged f32 spans (other storage types reach the
// oracle through LoadSpanKeyRow, Quest's tested key reader), the newest token among them; a
// budget covering the table reads it whole; the policy never evicts; its configuration.
// Reuse: linked layers' roles, and the reusing layers read the selection layer's tokens.
// Through the engine: tests/quest_engine_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

using testing::RandomNonZeroFloats;

// f32 keys [n_tokens, heads, d] cut into spans of ragged lengths.
struct RaggedSpans {
  std::vector<float> keys, values;
  std::vector<int32_t> positions;
  std::vector<KvSpan> spans;
  RaggedSpans(int32_t n_tokens, int heads, int d, const std::vector<int32_t>& lengths, std::mt19937& rng) {
    keys = RandomNonZeroFloats(static_cast<size_t>(n_tokens) * heads * d, rng, 2.f);
    values = RandomNonZeroFloats(keys.size(), rng);
    for (int32_t t = 0; t < n_tokens; ++t) positions.push_back(2 * t);
    for (int32_t t = 0, i = 0; t < n_tokens; ++i) {
      KvSpan s;
      s.k = keys.data() + static_cast<size_t>(t) * heads * d;
      s.v = values.data() + static_cast<size_t>(t) * heads * d;
      s.positions = positions.data() + t;
      s.n = std::min(lengths[i % lengths.size()], n_tokens - t);
      spans.push_back(s);
      t += s.n;
    }
  }
};

// The positions a list of runs covers, ascending.
std::vector<int32_t> Positions(const std::vector<KvSpan>& runs) {
  std::vector<int32_t> out;
  for (const KvSpan& s : runs)
    for (int32_t j = 0; j < s.n; ++j) out.push_back(s.positions[j]);
  return out;
}

// The top `budget` tokens by score ([n]), the newest token always among them (ties to the
// earlier token), as positions.
template <typename Score>
std::vector<int32_t> PlainTopK(const std::vector<Score>& score, const RaggedSpans& data, int32_t budget) {
  const int32_t n = static_cast<int32_t>(score.size());
  std::vector<int32_t> order(n - 1);
  for (int32_t t = 0; t < n - 1; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  std::vector<int32_t> kept(order.begin(), order.begin() + std::min(budget - 1, n - 1));
  kept.push_back(n - 1);
  std::sort(kept.begin(), kept.end());
  std::vector<int32_t> positions;
  for (int32_t t : kept) positions.push_back(data.positions[t]);
  return positions;
}

// The reference: per KV head, softmax(q·k * scale) per query head, averaged (or maxed) over the
// group; the newest token plus the best (budget - 1) of the others, ties to the earlier token.
// only_g >= 0: query head kv_head * group + only_g alone (a choice per query head).
std::vector<int32_t> ReferenceTopK(const RaggedSpans& data, const std::vector<float>& q, int n_q, int n_kv, int d,
                                   int kv_head, int32_t budget, bool max_fold, int only_g = -1) {
  const int32_t n = static_cast<int32_t>(data.positions.size());
  const int group = only_g >= 0 ? 1 : n_q / n_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> score(n, 0.0);
  for (int g = 0; g < group; ++g) {
    const int i = only_g >= 0 ? kv_head * (n_q / n_kv) + only_g : kv_head * group + g;
    std::vector<double> logit(n);
    for (int32_t t = 0; t < n; ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double{q[i * d + c]} * data.keys[(static_cast<size_t>(t) * n_kv + kv_head) * d + c];
      logit[t] = dot * scale;
    }
    const double m = *std::max_element(logit.begin(), logit.end());
    double sum = 0;
    for (double l : logit) sum += std::exp(l - m);
    for (int32_t t = 0; t < n; ++t) {
      const double p = std::exp(logit[t] - m) / sum;
      score[t] = max_fold ? std::max(score[t], p) : score[t] + p / group;
    }
  }
  return PlainTopK(score, data, budget);
}

// A decode query's context: q [n_q, d] over n_kv KV heads, pages of 16.
SpanSelectionContext QueryContext(const std::vector<float>& q, int n_q, int n_kv, int d) {
  SpanSelectionContext ctx;
  ctx.q = q.data();
  ctx.n_q_heads = n_q;
  ctx.n_kv_heads = n_kv;
  ctx.head_dim = d;
  ctx.cache_page_size = 16;
  return ctx;
}

std::unique_ptr<KvPolicy> MakeOracle(KvBudget budget, HeadReduce reduce = HeadReduce::kMean) {
  LayerKvConfig config;
  config.method = KvMethod::kOracle;
  config.budget = budget;
  config.params = DefaultMethodParams(KvMethod::kOracle);
  config.params.head_reduce = reduce;
  auto policy = CreatePolicy(config, 0, 1, 0);
  KVS_CHECK_MSG(policy.ok(), policy.status().ToString());
  return std::move(*policy);
}

TEST(OraclePolicyTest, EachKvHeadReadsItsExactTopK) {
  const int n_kv = 2, group = 3, n_q = n_kv * group, d = 8;
  std::mt19937 rng(7);
  for (const int32_t n : {5, 37, 100}) {
    for (const int32_t budget : {1, 2, 9, n - 1}) {
      if (budget >= n) continue;  // covering: the whole table (the next test)
      for (const HeadReduce reduce : {HeadReduce::kMean, HeadReduce::kMax}) {
        RaggedSpans data(n, n_kv, d, {7, 1, 16, 3}, rng);
        const std::vector<float> q = RandomNonZeroFloats(static_cast<size_t>(n_q) * d, rng, 2.f);
        auto policy = MakeOracle(KvBudget::Tokens(budget), reduce);
        policy->OnAppend(n);
        const SpanSelectionContext ctx = QueryContext(q, n_q, n_kv, d);
        std::vector<std::vector<KvSpan>> per_query(n_q);
        ASSERT_TRUE(policy->SelectQueryHeadSpans(ctx, data.spans, per_query.data())) << n << " " << budget;
        std::set<int32_t> all;
        for (int h = 0; h < n_kv; ++h) {
          const std::vector<int32_t> want = ReferenceTopK(data, q, n_q, n_kv, d, h, budget, reduce == HeadReduce::kMax);
          // One choice per KV head: the group's first list speaks for the group (SelectsPerKvHead).
          EXPECT_EQ(Positions(per_query[h * group]), want) << "n " << n << " budget " << budget << " head " << h;
          all.insert(want.begin(), want.end());
        }
        // One list for all heads: the union of the KV heads' tokens.
        std::vector<KvSpan> spans = data.spans;
        policy->SelectSpans(ctx, &spans);
        EXPECT_EQ(Positions(spans), std::vector<int32_t>(all.begin(), all.end()));
      }
    }
  }
}

TEST(OraclePolicyTest, CoveringBudgetReadsEverythingAndNothingIsEvicted) {
  std::mt19937 rng(3);
  RaggedSpans data(20, 1, 4, {6}, rng);
  const std::vector<float> q = RandomNonZeroFloats(2 * 4, rng);
  SpanSelectionContext ctx;
  ctx.q = q.data();
  ctx.n_q_heads = 2;
  ctx.n_kv_heads = 1;
  ctx.head_dim = 4;
  for (const KvBudget& budget : {KvBudget::Tokens(20), KvBudget::Tokens(64), KvBudget::Fraction(1.0)}) {
    auto policy = MakeOracle(budget);
    EXPECT_EQ(policy->name(), "oracle");
    EXPECT_TRUE(policy->SelectsSpans());
    EXPECT_TRUE(policy->SelectsPerQueryHead());
    EXPECT_TRUE(policy->SelectsPerKvHead());
    policy->OnAppend(20);
    EXPECT_EQ(policy->EvictionTarget(20, 20, EvictionPoint::kDecodeStep, 1), 20);
    std::vector<KvSpan> per_query[2];
    EXPECT_FALSE(policy->SelectQueryHeadSpans(ctx, data.spans, per_query));
    std::vector<KvSpan> spans = data.spans;
    policy->SelectSpans(ctx, &spans);
    EXPECT_EQ(spans.size(), data.spans.size());
  }
}

// "head_reduce": "none": every query head reads its own exact top-k.
TEST(OraclePolicyTest, EachQueryHeadReadsItsExactTopKWithoutAFold) {
  const int n_kv = 2, group = 3, n_q = n_kv * group, d = 8;
  std::mt19937 rng(9);
  for (const int32_t n : {37, 100}) {
    const int32_t budget = 9;
    RaggedSpans data(n, n_kv, d, {7, 1, 16, 3}, rng);
    const std::vector<float> q = RandomNonZeroFloats(static_cast<size_t>(n_q) * d, rng, 2.f);
    auto policy = MakeOracle(KvBudget::Tokens(budget), HeadReduce::kNone);
    EXPECT_FALSE(policy->SelectsPerKvHead());
    policy->OnAppend(n);
    const SpanSelectionContext ctx = QueryContext(q, n_q, n_kv, d);
    std::vector<std::vector<KvSpan>> per_query(n_q);
    ASSERT_TRUE(policy->SelectQueryHeadSpans(ctx, data.spans, per_query.data()));
    for (int i = 0; i < n_q; ++i) {
      EXPECT_EQ(Positions(per_query[i]), ReferenceTopK(data, q, n_q, n_kv, d, i / group, budget, false, i % group))
          << "n " << n << " query head " << i;
    }
  }
}

TEST(OraclePolicyTest, ConfigChecksTheHeadReduce) {
  auto config = ParseKvSparsityConfig(R"({"default": {"method": "oracle", "budget": 64, "head_reduce": "none"}})", 1);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto h2o = ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 64, "head_reduce": "none"}})", 1);
  ASSERT_FALSE(h2o.ok());
  EXPECT_NE(h2o.status().message().find("head_reduce"), std::string::npos) << h2o.status().ToString();
  auto fine = ParseKvSparsityConfig(R"({"default": {"method": "oracle", "budget": 0.1, "head_reduce": "max"}})", 1);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->layers[0].method, KvMethod::kOracle);
  EXPECT_FALSE(fine->layers[0].per_head);
}

// A sequence's reuse layers, linked: layers 0-1 dense (Full), 2 selects, then reuse up to the
// re-selection layer, which selects again for the layers after it. A selection layer reads
// everything and chooses from the attention it observes; the others read its choice.
// Per query head (the default, TidalDecode's top-k after repeat_kv) and per KV head (head_reduce mean).
class ReusePolicyTest : public ::testing::TestWithParam<HeadReduce> {};

TEST_P(ReusePolicyTest, LaterLayersReadTheSelectionLayersTokens) {
  const int n_layers = 8, n_kv = 2, group = 2, n_q = n_kv * group, d = 8;
  const int32_t budget = 9;
  LayerKvConfig config;
  config.method = KvMethod::kReuse;
  config.budget = KvBudget::Tokens(budget);
  config.params = DefaultMethodParams(KvMethod::kReuse);
  config.params.reselect_layer = 5;
  config.params.head_reduce = GetParam();
  const bool per_query_head = GetParam() == HeadReduce::kNone;
  const int choosers = per_query_head ? n_q : n_kv;  // rows of the observation, lists of the choice
  std::vector<std::unique_ptr<KvPolicy>> layers;
  std::vector<KvPolicy*> links;
  for (int l = 0; l < n_layers; ++l) {
    auto p = CreatePolicy(config, l, n_layers, 0);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    layers.push_back(std::move(*p));
    links.push_back(layers.back().get());
  }
  LinkSequencePolicies(links);
  EXPECT_EQ(layers[1]->name(), "full");
  EXPECT_EQ(layers[2]->name(), "reuse");
  std::mt19937 rng(17);
  const int32_t n = 40;
  RaggedSpans data(n, n_kv, d, {5, 16, 3}, rng);
  for (auto& p : layers) p->OnAppend(n);
  SpanSelectionContext ctx;
  ctx.n_q_heads = n_q;
  ctx.n_kv_heads = n_kv;
  ctx.head_dim = d;
  const std::vector<float> q = RandomNonZeroFloats(static_cast<size_t>(n_q) * d, rng, 2.f);
  ctx.q = q.data();
  std::vector<std::vector<int32_t>> selected(choosers);
  for (int l = 2; l < n_layers; ++l) {
    ctx.layer = l;
    const bool selects = l == 2 || l == 5;
    EXPECT_EQ(layers[l]->NeedsAttention(), selects) << "layer " << l;
    std::vector<std::vector<KvSpan>> per_query(n_q);
    const bool narrowed = layers[l]->SelectQueryHeadSpans(ctx, data.spans, per_query.data());
    EXPECT_EQ(narrowed, !selects) << "layer " << l << ": selection layers read everything";
    if (selects) {
      // The decode step's attention, per query head (or KV head): random probabilities.
      EXPECT_EQ((layers[l]->NeededObservations() & kObserveQueryHeads) != 0, per_query_head);
      std::vector<float> last = RandomNonZeroFloats(static_cast<size_t>(choosers) * n, rng, 1.f);
      for (float& x : last) x = std::abs(x);
      const int32_t query_position = 2 * n;
      AttentionObservation obs;
      obs.n_queries = 1;
      obs.n_tokens = n;
      obs.n_kv_heads = n_kv;
      obs.n_heads = choosers;
      obs.query_positions = &query_position;
      obs.last = last.data();
      obs.sum_all = last.data();
      layers[l]->Observe(obs);
      for (int h = 0; h < choosers; ++h)
        selected[h] = PlainTopK(std::vector<float>(last.begin() + h * n, last.begin() + (h + 1) * n), data, budget);
      continue;
    }
    for (int i = 0; i < n_q; ++i) {
      // Per query head each reads its own list; per KV head the group's first list speaks for it.
      if (!per_query_head && i % group != 0) continue;
      EXPECT_EQ(Positions(per_query[i]), selected[per_query_head ? i : i / group]) << "layer " << l << " head " << i;
    }
  }
  // A fork's layers (clones, linked again) share their own selection.
  std::vector<std::unique_ptr<KvPolicy>> clones;
  std::vector<KvPolicy*> clone_links;
  for (auto& p : layers) {
    clones.push_back(p->Clone());
    clone_links.push_back(clones.back().get());
  }
  LinkSequencePolicies(clone_links);
  for (auto& p : clones) p->OnAppend(1);
  std::vector<float> last = RandomNonZeroFloats(static_cast<size_t>(choosers) * (n + 1), rng, 1.f);
  for (float& x : last) x = std::abs(x);
  AttentionObservation obs;
  obs.n_queries = 1;
  obs.n_tokens = n + 1;
  obs.n_kv_heads = n_kv;
  obs.n_heads = choosers;
  obs.last = last.data();
  obs.sum_all = last.data();
  clones[2]->Observe(obs);
  RaggedSpans more(n + 1, n_kv, d, {5, 16, 3}, rng);
  std::vector<std::vector<KvSpan>> per_query(n_q);
  ASSERT_TRUE(clones[3]->SelectQueryHeadSpans(ctx, more.spans, per_query.data()));
  EXPECT_EQ(Positions(per_query[0]).size(), static_cast<size_t>(budget));
}

INSTANTIATE_TEST_SUITE_P(HeadReduce, ReusePolicyTest, ::testing::Values(HeadReduce::kNone, HeadReduce::kMean),
                         [](const auto& info) { return info.param == HeadReduce::kNone ? "per_query_head" : "per_kv_head"; });

TEST(ReuseConfigTest, ConfigDefaultsAndChecks) {
  EXPECT_EQ(DefaultMethodParams(KvMethod::kReuse).dense_layers, 2);
  EXPECT_EQ(DefaultMethodParams(KvMethod::kReuse).head_reduce, HeadReduce::kNone);
  EXPECT_FALSE(ParseKvSparsityConfig(R"({"default": {"method": "reuse", "budget": 64, "per_head": true}})", 4).ok());
  EXPECT_FALSE(ParseKvSparsityConfig(R"({"default": {"method": "reuse", "budget": 64, "reselect_layer": -2}})", 4).ok());
  auto fine = ParseKvSparsityConfig(R"({"default": {"method": "reuse", "budget": 0.1, "reselect_layer": 3}})", 4);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->layers[0].params.reselect_layer, 3);
}

}  // namespace
}  // namespace kvsparse
