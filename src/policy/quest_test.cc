// Quest (quest_pages.h, quest.cc): the bound and its scalar twin, page choice on hand-made
// pages, the span filter at page sizes other than the cache's, the incremental index against
// a fresh one on every storage type, the policy's interface, and its configuration.
#include "kvsparse/quest_pages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/paged_kv_cache.h"
#include "ops/attention_ref_util.h"
#include "support/random_data.h"

namespace kvsparse {
namespace {

using testing::RandomNonZeroFloats;

// Hand-made f32 pages: keys [n_tokens, heads, d] cut into spans of `span_tokens`.
struct HandPages {
  int heads, d;
  std::vector<float> keys;        // [n_tokens, heads, d]
  std::vector<float> values;      // [n_tokens, heads, d]
  std::vector<int32_t> positions;  // [n_tokens]
  std::vector<KvSpan> spans;

  HandPages(int32_t n_tokens, int heads_, int d_, int32_t span_tokens, std::mt19937& rng, float amplitude = 1.f)
      : heads(heads_), d(d_) {
    keys = RandomNonZeroFloats(static_cast<size_t>(n_tokens) * heads * d, rng, amplitude);
    values = RandomNonZeroFloats(keys.size(), rng);
    for (int32_t t = 0; t < n_tokens; ++t) positions.push_back(3 * t + 1);
    for (int32_t t = 0; t < n_tokens; t += span_tokens) {
      KvSpan s;
      s.k = keys.data() + static_cast<size_t>(t) * heads * d;
      s.v = values.data() + static_cast<size_t>(t) * heads * d;
      s.positions = positions.data() + t;
      s.n = std::min(span_tokens, n_tokens - t);
      spans.push_back(s);
    }
  }
  const float* key(int32_t t, int h) const { return keys.data() + (static_cast<size_t>(t) * heads + h) * d; }
};

double Dot(const float* a, const float* b, int d) {
  double s = 0;
  for (int c = 0; c < d; ++c) s += static_cast<double>(a[c]) * b[c];
  return s;
}

int32_t Tokens(const std::vector<KvSpan>& spans) {
  int32_t n = 0;
  for (const KvSpan& s : spans) n += s.n;
  return n;
}

TEST(QuestBoundTest, MatchesScalarTwinAndBoundsEveryKey) {
  std::mt19937 rng(11);
  for (int d : {1, 3, 7, 8, 9, 16, 31, 64, 70, 128}) {
    for (int trial = 0; trial < 20; ++trial) {
      HandPages page(16, 1, d, 16, rng);
      QuestPageIndex index(16, 1, d);
      index.Update(KvStorage::kF32, page.spans.data(), static_cast<int32_t>(page.spans.size()));
      const std::vector<float> q = RandomNonZeroFloats(d, rng);
      const float fast = QuestBound(q.data(), index.page_min(0), index.page_max(0), d);
      const double slow = ref::QuestBound(q.data(), index.page_min(0), index.page_max(0), d);
      ASSERT_NEAR(fast, slow, 1e-4 * (1 + std::fabs(slow))) << "head_dim " << d;
      for (int32_t t = 0; t < 16; ++t) {
        ASSERT_GE(slow, Dot(q.data(), page.key(t, 0), d) - 1e-9) << "token " << t << " head_dim " << d;
      }
    }
  }
}

// One planted key that scores far above everything else: its page is chosen at every budget,
// wherever it sits, for every head layout and reduction.
TEST(QuestSelectTest, PageOfTheMaxScoringKeyIsAlwaysSelected) {
  std::mt19937 rng(5);
  const int d = 16;
  for (int heads : {1, 2}) {
    for (int group : {1, 4}) {
      for (HeadReduce reduce : {HeadReduce::kMax, HeadReduce::kMean}) {
        for (int trial = 0; trial < 40; ++trial) {
          const int32_t n = 16 * 9 + 7;  // 10 pages, the last partly filled
          HandPages pages(n, heads, d, 16, rng, 0.1f);
          const std::vector<float> q = RandomNonZeroFloats(static_cast<size_t>(heads) * group * d, rng);
          // Plant key = 3 * q of one query head at a random token outside the last page.
          const int32_t planted = std::uniform_int_distribution<int32_t>(0, 16 * 9 - 1)(rng);
          const int head = std::uniform_int_distribution<int>(0, heads - 1)(rng);
          const int qh = head * group + std::uniform_int_distribution<int>(0, group - 1)(rng);
          float* k = pages.keys.data() + (static_cast<size_t>(planted) * heads + head) * d;
          for (int c = 0; c < d; ++c) k[c] = 3.f * q[static_cast<size_t>(qh) * d + c];
          QuestPageIndex index(16, heads, d);
          index.Update(KvStorage::kF32, pages.spans.data(), static_cast<int32_t>(pages.spans.size()));
          ASSERT_EQ(index.n_pages(), 10);
          std::vector<float> scores(10);
          QuestPageScores(index, q.data(), heads * group, reduce, scores.data());
          std::vector<int32_t> order, chosen;
          for (int32_t budget : {23, 40, 100}) {  // room for the last page (7 tokens) and at least one more
            QuestSelectPages(scores.data(), 10, 16, n, budget, &order, &chosen);
            EXPECT_TRUE(std::binary_search(chosen.begin(), chosen.end(), planted / 16))
                << "budget " << budget << " planted at " << planted;
            EXPECT_EQ(chosen.back(), 9) << "the most recent page is always read";
          }
        }
      }
    }
  }
}

TEST(QuestSelectTest, TokensFitTheBudgetPlusOnePageAndTiesPickEarlierPages) {
  std::vector<int32_t> order, pages;
  const std::vector<float> flat(10, 1.f);
  for (int32_t n_tokens : {16 * 9 + 1, 16 * 9 + 7, 16 * 10}) {
    for (int32_t budget = 1; budget <= 200; ++budget) {
      QuestSelectPages(flat.data(), 10, 16, n_tokens, budget, &order, &pages);
      int32_t tokens = 0;
      for (int32_t p : pages) tokens += p == 9 ? n_tokens - 9 * 16 : 16;
      EXPECT_LE(tokens, budget + 16);
      EXPECT_LE(tokens, std::max(budget, n_tokens - 9 * 16));
      if (budget >= n_tokens) {
        EXPECT_EQ(pages.size(), 10u);
      }
      ASSERT_TRUE(std::is_sorted(pages.begin(), pages.end()));
      EXPECT_EQ(pages.back(), 9);
      for (size_t i = 0; i + 1 < pages.size(); ++i) EXPECT_EQ(pages[i], static_cast<int32_t>(i));  // ties: earliest
    }
  }
  // Scores decide: the two best of the older pages, whatever their order.
  const std::vector<float> scores = {0.f, 5.f, -1.f, 7.f, 2.f, NAN};
  QuestSelectPages(scores.data(), 6, 4, 22, 2 + 2 * 4, &order, &pages);
  EXPECT_EQ(pages, (std::vector<int32_t>{1, 3, 5}));
}

// The filtered spans hold exactly the selected pages' tokens, in order, pointing into the
// cache's own storage, for Quest pages smaller than, equal to and larger than the cache's.
TEST(QuestFilterTest, SpansCoverExactlyTheSelectedPagesOnEveryStorage) {
  std::mt19937 rng(7);
  const KvGeometry g{1, 2, 8};
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi}) {
    PagedKvCacheOptions options;
    options.page_size = 16;
    options.layer_storage = {storage};
    options.budget_bytes = 1 << 20;
    auto cache = PagedKvCache::Create(g, options);
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    const int32_t n = 16 * 6 + 5;
    const std::vector<float> k = RandomNonZeroFloats(static_cast<size_t>(n) * 2 * 8, rng);
    const std::vector<float> v = RandomNonZeroFloats(k.size(), rng);
    std::vector<int32_t> pos(n);
    for (int32_t t = 0; t < n; ++t) pos[t] = 2 * t;
    ASSERT_TRUE((*cache)->Append(0, 0, n, k.data(), v.data(), pos.data()).ok());
    std::vector<KvSpan> all;
    (*cache)->Spans(0, 0, &all);
    const ref::KvElementReader reader{storage, 2, 8};
    // Every live token's K and V as the cache stores them, by live index.
    std::vector<double> want_k, want_v;
    for (const KvSpan& s : all) {
      for (int32_t i = 0; i < s.n; ++i)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 8; ++c) want_k.push_back(reader.K(s, i, h, c)), want_v.push_back(reader.V(s, i, h, c));
    }
    for (int32_t page_tokens : {5, 8, 16, 40}) {
      const int32_t n_pages = (n + page_tokens - 1) / page_tokens;
      std::vector<int32_t> pages;
      for (int32_t p = 0; p < n_pages; ++p)
        if (p % 3 != 1 || p + 1 == n_pages) pages.push_back(p);
      std::vector<KvSpan> spans = all, scratch;
      QuestFilterSpans(storage, 2, 8, pages, page_tokens, &spans, &scratch);
      std::vector<int32_t> expected;  // live indices of the selected tokens
      for (int32_t p : pages)
        for (int32_t t = p * page_tokens; t < std::min(n, (p + 1) * page_tokens); ++t) expected.push_back(t);
      ASSERT_EQ(Tokens(spans), static_cast<int32_t>(expected.size())) << KvStorageName(storage) << " " << page_tokens;
      size_t at = 0;
      for (const KvSpan& s : spans) {
        for (int32_t i = 0; i < s.n; ++i, ++at) {
          const int32_t t = expected[at];
          ASSERT_EQ(s.positions[i], pos[t]);
          for (int h = 0; h < 2; ++h) {
            for (int c = 0; c < 8; ++c) {
              const size_t e = (static_cast<size_t>(t) * 2 + h) * 8 + c;
              ASSERT_EQ(reader.K(s, i, h, c), want_k[e]) << KvStorageName(storage) << " token " << t;
              ASSERT_EQ(reader.V(s, i, h, c), want_v[e]) << KvStorageName(storage) << " token " << t;
            }
          }
        }
      }
      if (page_tokens == 16) {
        EXPECT_EQ(spans.size(), pages.size());  // whole cache pages, untouched
      }
    }
  }
}

// Bounds kept up to date token by token (and chunk by chunk) equal bounds built at once, on
// every storage type (int8_kivi re-folds its residual page once quantized) and at Quest page
// sizes other than the cache's; removing tokens already folded rebuilds.
TEST(QuestIndexTest, IncrementalEqualsFreshOnEveryStorage) {
  std::mt19937 rng(3);
  const KvGeometry g{1, 2, 8};
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi}) {
    for (int32_t page_tokens : {16, 6, 32}) {
      PagedKvCacheOptions options;
      options.page_size = 16;
      options.layer_storage = {storage};
      options.budget_bytes = 1 << 20;
      auto cache = PagedKvCache::Create(g, options);
      ASSERT_TRUE(cache.ok());
      QuestPageIndex incremental(page_tokens, 2, 8);
      std::vector<KvSpan> spans;
      auto expect_fresh = [&](const char* when) {
        (*cache)->Spans(0, 0, &spans);
        incremental.Update(storage, spans.data(), static_cast<int32_t>(spans.size()));
        QuestPageIndex fresh(page_tokens, 2, 8);
        fresh.Update(storage, spans.data(), static_cast<int32_t>(spans.size()));
        ASSERT_EQ(incremental.n_tokens(), fresh.n_tokens()) << when;
        ASSERT_EQ(incremental.n_pages(), fresh.n_pages());
        for (int32_t p = 0; p < fresh.n_pages(); ++p) {
          for (int e = 0; e < 16; ++e) {
            ASSERT_EQ(incremental.page_min(p)[e], fresh.page_min(p)[e])
                << KvStorageName(storage) << " page_tokens " << page_tokens << " page " << p << " " << when;
            ASSERT_EQ(incremental.page_max(p)[e], fresh.page_max(p)[e]);
          }
        }
      };
      int32_t next = 0;
      for (int32_t chunk : {1, 1, 3, 20, 1, 1, 1, 9, 16, 1, 2, 33, 1, 1, 1, 1}) {
        const std::vector<float> k = RandomNonZeroFloats(static_cast<size_t>(chunk) * 16, rng);
        std::vector<int32_t> pos(chunk);
        for (int32_t i = 0; i < chunk; ++i) pos[i] = next++;
        ASSERT_TRUE((*cache)->Append(0, 0, chunk, k.data(), k.data(), pos.data()).ok());
        expect_fresh("after append");
      }
      ASSERT_TRUE((*cache)->RemoveRange(0, 10, 14).ok());
      expect_fresh("after RemoveRange");
      (*cache)->Clear(0);
      expect_fresh("after Clear");
      EXPECT_EQ(incremental.n_pages(), 0);
    }
  }
}

TEST(QuestPolicyTest, NeverEvictsAndSelectsSpans) {
  LayerKvConfig config;
  config.method = KvMethod::kQuest;
  config.budget = KvBudget::Tokens(32);
  config.params = DefaultMethodParams(KvMethod::kQuest);
  EXPECT_EQ(config.params.head_reduce, HeadReduce::kMax);
  EXPECT_EQ(config.params.page_tokens, 0);
  auto policy = CreatePolicy(config, 0, 1, 0);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  KvPolicy& p = **policy;
  EXPECT_EQ(p.name(), "quest");
  EXPECT_EQ(p.NeededObservations(), 0u);
  EXPECT_TRUE(p.SelectsSpans());
  p.OnAppend(100);
  EXPECT_EQ(p.EvictionTarget(100, 100, EvictionPoint::kPrefillChunk, 1), 100);
  EXPECT_EQ(p.EvictionTarget(100, 100, EvictionPoint::kDecodeStep, 1), 100);

  // 100 tokens of 2 kv heads, 4 query heads: 32 tokens budget -> the last page (4 tokens) and one more.
  std::mt19937 rng(1);
  HandPages pages(100, 2, 8, 16, rng);
  const std::vector<float> q = RandomNonZeroFloats(4 * 8, rng);
  SpanSelectionContext ctx;
  ctx.q = q.data();
  ctx.n_q_heads = 4;
  ctx.n_kv_heads = 2;
  ctx.head_dim = 8;
  ctx.cache_page_size = 16;
  std::vector<KvSpan> spans = pages.spans;
  p.SelectSpans(ctx, &spans);
  EXPECT_EQ(Tokens(spans), 16 + 4);
  EXPECT_EQ(spans.back().positions[spans.back().n - 1], pages.positions.back());
  EXPECT_GT(p.MetadataBytes(), 2u * 7 * 2 * 8 * sizeof(float));  // 7 pages of min and max

  // A budget of the whole context leaves the spans untouched (nothing to narrow).
  config.budget = KvBudget::Fraction(1.0);
  auto whole = CreatePolicy(config, 0, 1, 0);
  (*whole)->OnAppend(100);
  spans = pages.spans;
  (*whole)->SelectSpans(ctx, &spans);
  ASSERT_EQ(spans.size(), pages.spans.size());
  for (size_t i = 0; i < spans.size(); ++i) EXPECT_EQ(spans[i].k, pages.spans[i].k);
  EXPECT_EQ((*whole)->MetadataBytes(), 0u);
}

TEST(QuestConfigTest, ParsesParamsAndRejectsBadOnes) {
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "quest", "budget": 0.25},
          "layers": [{"layers": "0-1", "method": "full"},
                     {"layers": 3, "page_tokens": 32, "head_reduce": "mean", "budget": 512}]})",
      4);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layers[2].method, KvMethod::kQuest);
  EXPECT_EQ(config->layers[2].params.head_reduce, HeadReduce::kMax);
  EXPECT_EQ(config->layers[2].params.page_tokens, 0);
  EXPECT_EQ(config->layers[3].params.page_tokens, 32);
  EXPECT_EQ(config->layers[3].params.head_reduce, HeadReduce::kMean);
  EXPECT_EQ(config->layers[3].budget.tokens, 512);
  const std::string summary = KvSparsityConfigSummary(*config);
  EXPECT_NE(summary.find("quest"), std::string::npos) << summary;
  EXPECT_NE(summary.find("page_tokens=32"), std::string::npos) << summary;

  auto flags = KvSparsityConfigFromFlags("quest", "64", "int8", 2);
  ASSERT_TRUE(flags.ok()) << flags.status().ToString();
  EXPECT_EQ(flags->layers[1].method, KvMethod::kQuest);

  auto expect_error = [](const std::string& json, const std::vector<std::string>& parts) {
    auto bad = ParseKvSparsityConfig(json, 4);
    ASSERT_FALSE(bad.ok()) << json;
    for (const std::string& part : parts)
      EXPECT_NE(bad.status().message().find(part), std::string::npos) << bad.status().message();
  };
  expect_error(R"({"layers": [{"layers": 2, "method": "quest", "budget": 64, "page_tokens": -1}]})",
               {"layer 2", "page_tokens", ">= 1"});
  expect_error(R"({"layers": [{"layers": 1, "method": "quest", "budget": 64, "page_tokens": "16"}]})",
               {"layers[0]", "page_tokens", "integer"});
  expect_error(R"({"layers": [{"layers": 1, "method": "quest", "budget": 64, "head_reduce": "min"}]})",
               {"layers[0]", "head_reduce", "mean, max"});
  expect_error(R"({"layers": [{"layers": 1, "method": "quest", "budget": 64, "n_sink": 4}]})",
               {"layers[0]", "n_sink", "page_tokens"});
  expect_error(R"({"layers": [{"layers": 1, "method": "h2o", "budget": 64, "page_tokens": 16}]})",
               {"page_tokens", "quest"});
  expect_error(R"({"layers": [{"layers": 3, "method": "quest"}]})", {"layer 3", "budget"});
}

}  // namespace
}  // namespace kvsparse
