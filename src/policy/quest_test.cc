// Quest (quest_pages.h, quest.cc): the bound and its scalar twin, the page count rule and page
// choice on hand-made pages, the span filter at page sizes other than the cache's, the
// incremental index against a fresh one on every storage type, per-query-head selection against
// a plainly written reference (bounds from the keys, top pages, attention over exactly their
// tokens), the policy's interface, and its configuration.
#include "kvsparse/quest_pages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvsparse/attention.h"
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
// wherever it sits, for every head layout and reduction (per query head: by the planted head).
TEST(QuestSelectTest, PageOfTheMaxScoringKeyIsAlwaysSelected) {
  std::mt19937 rng(5);
  const int d = 16;
  for (int heads : {1, 2}) {
    for (int group : {1, 4}) {
      for (HeadReduce reduce : {HeadReduce::kMax, HeadReduce::kMean, HeadReduce::kNone}) {
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
          std::vector<float> scores;
          const float* row = nullptr;  // the planted query head's scores (folded: the table's)
          if (reduce == HeadReduce::kNone) {
            scores.resize(static_cast<size_t>(heads) * group * 10);
            QuestQueryHeadScores(index, q.data(), heads * group, scores.data());
            row = scores.data() + static_cast<size_t>(qh) * 10;
          } else {
            scores.resize(10);
            QuestPageScores(index, q.data(), heads * group, reduce, scores.data());
            row = scores.data();
          }
          std::vector<int32_t> order, chosen;
          for (int32_t budget : {23, 40, 100}) {  // 3, 3 and 6 pages
            QuestSelectPages(row, 10, QuestPagesRead(budget, 16), &order, &chosen);
            EXPECT_TRUE(std::binary_search(chosen.begin(), chosen.end(), planted / 16))
                << "budget " << budget << " planted at " << planted;
            EXPECT_EQ(chosen.back(), 9) << "the most recent page is always read";
          }
        }
      }
    }
  }
}

// The reference's count: max(3, budget / page) pages, rounded down, the last page among them.
TEST(QuestSelectTest, ReadsMaxOfThreeAndBudgetPagesWithTheLastAndTiesPickEarlierPages) {
  EXPECT_EQ(QuestPagesRead(0, 16), 3);
  EXPECT_EQ(QuestPagesRead(47, 16), 3);
  EXPECT_EQ(QuestPagesRead(63, 16), 3);
  EXPECT_EQ(QuestPagesRead(64, 16), 4);
  EXPECT_EQ(QuestPagesRead(100, 16), 6);
  EXPECT_EQ(QuestPagesRead(1000, 8), 125);
  std::vector<int32_t> order, pages;
  const std::vector<float> flat(10, 1.f);
  for (int32_t n_read = 1; n_read <= 12; ++n_read) {
    QuestSelectPages(flat.data(), 10, n_read, &order, &pages);
    ASSERT_EQ(pages.size(), static_cast<size_t>(std::min(n_read, 10)));
    EXPECT_EQ(pages.back(), 9);
    for (size_t i = 0; i + 1 < pages.size(); ++i) EXPECT_EQ(pages[i], static_cast<int32_t>(i));  // ties: earliest
  }
  // Scores decide: the two best of the older pages, whatever their order; NaN counts as nothing.
  const std::vector<float> scores = {0.f, 5.f, -1.f, 7.f, 2.f, NAN};
  QuestSelectPages(scores.data(), 6, 3, &order, &pages);
  EXPECT_EQ(pages, (std::vector<int32_t>{1, 3, 5}));
  QuestSelectPages(scores.data(), 1, 3, &order, &pages);
  EXPECT_EQ(pages, (std::vector<int32_t>{0}));
}

// The filtered spans hold exactly the selected pages' tokens, in order, pointing into the
// cache's own storage, for Quest pages smaller than, equal to and larger than the cache's.
TEST(QuestFilterTest, SpansCoverExactlyTheSelectedPagesOnEveryStorage) {
  std::mt19937 rng(7);
  const KvGeometry g{1, 2, 8};
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi, KvStorage::kFp8E4M3,
                           KvStorage::kFp8E5M2, KvStorage::kBf16}) {
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
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi, KvStorage::kFp8E4M3,
                           KvStorage::kFp8E5M2, KvStorage::kBf16}) {
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
  EXPECT_EQ(config.params.head_reduce, HeadReduce::kNone);  // the reference selects per query head
  EXPECT_EQ(config.params.page_tokens, 0);
  config.params.dense_layers = 0;  // layer 0 would be dense by default
  auto policy = CreatePolicy(config, 0, 1, 0);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  KvPolicy& p = **policy;
  EXPECT_EQ(p.name(), "quest");
  EXPECT_EQ(p.NeededObservations(), 0u);
  EXPECT_TRUE(p.SelectsSpans());
  KvPolicy* by_query = &p;
  EXPECT_TRUE(by_query->SelectsPerQueryHead());
  p.OnAppend(100);
  EXPECT_EQ(p.EvictionTarget(100, 100, EvictionPoint::kPrefillChunk, 1), 100);
  EXPECT_EQ(p.EvictionTarget(100, 100, EvictionPoint::kDecodeStep, 1), 100);

  // 100 tokens of 2 kv heads, 4 query heads: a 32-token budget reads max(3, 2) = 3 pages, the
  // last (4 tokens) among them.
  std::mt19937 rng(1);
  HandPages pages(100, 2, 8, 16, rng);
  const std::vector<float> q = RandomNonZeroFloats(4 * 8, rng);
  SpanSelectionContext ctx;
  ctx.q = q.data();
  ctx.n_q_heads = 4;
  ctx.n_kv_heads = 2;
  ctx.head_dim = 8;
  ctx.cache_page_size = 16;
  std::vector<KvSpan> per_query[4];
  ASSERT_TRUE(by_query->SelectQueryHeadSpans(ctx, pages.spans, per_query));
  for (const std::vector<KvSpan>& runs : per_query) {
    EXPECT_EQ(Tokens(runs), 16 + 16 + 4);
    EXPECT_EQ(runs.back().positions[runs.back().n - 1], pages.positions.back());
  }
  EXPECT_GT(p.MetadataBytes(), 2u * 7 * 2 * 8 * sizeof(float));  // 7 pages of min and max
  // One list for all heads (a caller that cannot attend per query head): the union of theirs.
  std::vector<KvSpan> spans = pages.spans;
  p.SelectSpans(ctx, &spans);
  EXPECT_GE(Tokens(spans), 36);
  for (const std::vector<KvSpan>& runs : per_query) {
    for (const KvSpan& run : runs) {
      for (int32_t i = 0; i < run.n; ++i) {
        bool found = false;
        for (const KvSpan& s : spans) found = found || std::binary_search(s.positions, s.positions + s.n, run.positions[i]);
        EXPECT_TRUE(found) << "position " << run.positions[i];
      }
    }
  }

  // Folded over heads ("max"): one choice of 3 pages for the table.
  config.params.head_reduce = HeadReduce::kMax;
  auto folded = CreatePolicy(config, 0, 1, 0);
  (*folded)->OnAppend(100);
  EXPECT_FALSE((*folded)->SelectsPerQueryHead());
  spans = pages.spans;
  (*folded)->SelectSpans(ctx, &spans);
  EXPECT_EQ(Tokens(spans), 16 + 16 + 4);

  // A budget of the whole context, or one whose page count covers the table, leaves the spans
  // untouched (nothing to narrow, no index).
  config.params.head_reduce = HeadReduce::kNone;
  for (KvBudget budget : {KvBudget::Fraction(1.0), KvBudget::Tokens(100), KvBudget::Tokens(112)}) {
    config.budget = budget;
    auto whole = CreatePolicy(config, 0, 1, 0);
    (*whole)->OnAppend(100);
    spans = pages.spans;
    (*whole)->SelectSpans(ctx, &spans);
    ASSERT_EQ(spans.size(), pages.spans.size());
    for (size_t i = 0; i < spans.size(); ++i) EXPECT_EQ(spans[i].k, pages.spans[i].k);
    EXPECT_FALSE((*whole)->SelectQueryHeadSpans(ctx, pages.spans, per_query));
    EXPECT_EQ((*whole)->MetadataBytes(), 0u);
  }
  // 3 pages of 40 tokens: the minimum of 3 pages is the whole table.
  config.budget = KvBudget::Tokens(8);
  auto small = CreatePolicy(config, 0, 1, 0);
  (*small)->OnAppend(40);
  std::vector<KvSpan> three(pages.spans.begin(), pages.spans.begin() + 3);
  three.back().n = 8;
  EXPECT_FALSE((*small)->SelectQueryHeadSpans(ctx, three, per_query));
}

// Per-query-head selection through the paged cache (shared rows, and a per-head layer's head
// tables) equals a plainly written reference: each query head's page bounds computed straight
// from the stored keys, the last page plus the best max(3, budget / page) - 1 others, and
// attention over exactly those tokens.
TEST(QuestQueryHeadTest, SelectionAndAttentionEqualPlainReference) {
  std::mt19937 rng(99);
  const int n_kv = 2, group = 3, d = 16;
  const int n_heads = n_kv * group;
  const int32_t n = 16 * 19 + 5;  // 20 cache pages, the last partly filled
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi, KvStorage::kFp8E4M3,
                           KvStorage::kFp8E5M2, KvStorage::kBf16}) {
    for (bool per_head : {false, true}) {
      for (int32_t page_tokens : {16, 8, 32}) {
        for (int32_t budget : {40, 100}) {
          PagedKvCacheOptions options;
          options.page_size = 16;
          options.layer_storage = {storage};
          options.layer_per_head = {static_cast<uint8_t>(per_head)};
          options.budget_bytes = 1 << 22;
          auto cache = PagedKvCache::Create(KvGeometry{1, n_kv, d}, options);
          ASSERT_TRUE(cache.ok()) << cache.status().ToString();
          const std::vector<float> k = RandomNonZeroFloats(static_cast<size_t>(n) * n_kv * d, rng);
          const std::vector<float> v = RandomNonZeroFloats(k.size(), rng);
          std::vector<int32_t> pos(n);
          for (int32_t t = 0; t < n; ++t) pos[t] = 2 * t + 1;
          ASSERT_TRUE((*cache)->Append(0, 0, n, k.data(), v.data(), pos.data()).ok());
          const std::vector<float> q = RandomNonZeroFloats(static_cast<size_t>(n_heads) * d, rng);  // [heads, d]
          const int32_t q_pos = pos.back();

          LayerKvConfig config;
          config.method = KvMethod::kQuest;
          config.budget = KvBudget::Tokens(budget);
          config.params = DefaultMethodParams(KvMethod::kQuest);
          config.params.page_tokens = page_tokens;
          config.params.dense_layers = 0;
          // Per-head layers: one policy per kv head, each over its own head table.
          const int tables = per_head ? n_kv : 1;
          const int row_heads = per_head ? 1 : n_kv;
          std::vector<std::vector<KvSpan>> table_spans(tables), runs(n_heads);
          for (int t = 0; t < tables; ++t) {
            auto policy = CreatePolicy(config, 0, 1, 0);
            ASSERT_TRUE(policy.ok());
            (*policy)->OnAppend(n);
            if (per_head) {
              (*cache)->HeadSpans(0, 0, t, &table_spans[t]);
            } else {
              (*cache)->Spans(0, 0, &table_spans[t]);
            }
            SpanSelectionContext ctx;
            ctx.q = q.data() + static_cast<size_t>(t) * (per_head ? group : 0) * d;
            ctx.n_q_heads = per_head ? group : n_heads;
            ctx.n_kv_heads = row_heads;
            ctx.head_dim = d;
            ctx.storage = storage;
            ctx.cache_page_size = 16;
            KvPolicy* by_query = policy->get();
            ASSERT_TRUE(by_query->SelectQueryHeadSpans(ctx, table_spans[t], &runs[static_cast<size_t>(t) * (per_head ? group : 0)]));
          }
          std::vector<AttentionJob> jobs(n_heads);
          std::vector<float> got(static_cast<size_t>(n_heads) * d);
          for (int h = 0; h < n_heads; ++h) {
            jobs[h].spans = runs[h].data();
            jobs[h].n_spans = static_cast<int32_t>(runs[h].size());
            jobs[h].first_kv_head = per_head ? 0 : h / group;
            jobs[h].q = q.data() + static_cast<size_t>(h) * d;
            jobs[h].out = got.data() + static_cast<size_t>(h) * d;
          }
          ops::AttentionBatch(AttentionShape{1, 1, d, 0.25f}, row_heads, storage, &q_pos, 1, jobs.data(), n_heads, 2);

          // The plain reference, from every live token's stored K / V (live index = token t).
          std::vector<double> key(static_cast<size_t>(n) * n_kv * d), value(key.size());
          {
            std::vector<KvSpan> all;
            for (int hd = 0; hd < n_kv; ++hd) {
              const int table_head = per_head ? 0 : hd;
              if (per_head) {
                (*cache)->HeadSpans(0, 0, hd, &all);
              } else {
                (*cache)->Spans(0, 0, &all);
              }
              const ref::KvElementReader reader{storage, row_heads, d};
              int32_t t = 0;
              for (const KvSpan& s : all) {
                for (int32_t i = 0; i < s.n; ++i, ++t) {
                  for (int c = 0; c < d; ++c) {
                    key[(static_cast<size_t>(t) * n_kv + hd) * d + c] = reader.K(s, i, table_head, c);
                    value[(static_cast<size_t>(t) * n_kv + hd) * d + c] = reader.V(s, i, table_head, c);
                  }
                }
              }
            }
          }
          const int32_t n_pages = (n + page_tokens - 1) / page_tokens;
          const int32_t n_read = std::max(3, budget / page_tokens);
          for (int h = 0; h < n_heads; ++h) {
            const int hd = h / group;
            const float* qh = q.data() + static_cast<size_t>(h) * d;
            std::vector<std::pair<double, int32_t>> bound;  // (bound, page) of the pages before the last
            for (int32_t page = 0; page + 1 < n_pages; ++page) {
              double b = 0;
              for (int c = 0; c < d; ++c) {
                double lo = INFINITY, hi = -INFINITY;
                for (int32_t t = page * page_tokens; t < std::min(n, (page + 1) * page_tokens); ++t) {
                  lo = std::min(lo, key[(static_cast<size_t>(t) * n_kv + hd) * d + c]);
                  hi = std::max(hi, key[(static_cast<size_t>(t) * n_kv + hd) * d + c]);
                }
                b += std::max(qh[c] * lo, qh[c] * hi);
              }
              bound.emplace_back(-b, page);  // ascending sort: best first, ties to the earlier page
            }
            std::sort(bound.begin(), bound.end());
            std::vector<int32_t> tokens;
            std::vector<uint8_t> read(n_pages, 0);
            read[n_pages - 1] = 1;
            for (int32_t i = 0; i < n_read - 1; ++i) read[bound[i].second] = 1;
            for (int32_t t = 0; t < n; ++t)
              if (read[t / page_tokens]) tokens.push_back(t);
            ASSERT_EQ(Tokens(runs[h]), static_cast<int32_t>(tokens.size()))
                << KvStorageName(storage) << (per_head ? " per-head" : "") << " page " << page_tokens << " head " << h;
            // softmax(0.25 q.k) v over exactly those tokens.
            std::vector<double> score;
            double top = -INFINITY;
            for (int32_t t : tokens) {
              double dot = 0;
              for (int c = 0; c < d; ++c) dot += qh[c] * key[(static_cast<size_t>(t) * n_kv + hd) * d + c];
              score.push_back(0.25 * dot);
              top = std::max(top, score.back());
            }
            double sum = 0;
            for (double& x : score) sum += x = std::exp(x - top);
            for (int c = 0; c < d; ++c) {
              double want = 0;
              for (size_t i = 0; i < tokens.size(); ++i)
                want += score[i] / sum * value[(static_cast<size_t>(tokens[i]) * n_kv + hd) * d + c];
              ASSERT_NEAR(got[static_cast<size_t>(h) * d + c], want, 2e-5 + 2e-4 * std::fabs(want))
                  << KvStorageName(storage) << (per_head ? " per-head" : "") << " page " << page_tokens << " budget "
                  << budget << " head " << h;
            }
          }
        }
      }
    }
  }
}

TEST(QuestConfigTest, ParsesParamsAndRejectsBadOnes) {
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "quest", "budget": 0.25},
          "layers": [{"layers": "0-1", "method": "full"},
                     {"layers": 3, "page_tokens": 32, "head_reduce": "mean", "budget": 512}]})",
      4);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layers[2].method, KvMethod::kQuest);
  EXPECT_EQ(config->layers[2].params.head_reduce, HeadReduce::kNone);
  EXPECT_EQ(config->layers[2].params.page_tokens, 0);
  EXPECT_EQ(config->layers[3].params.page_tokens, 32);
  EXPECT_EQ(config->layers[3].params.head_reduce, HeadReduce::kMean);
  EXPECT_EQ(config->layers[3].budget.tokens, 512);
  const std::string summary = KvSparsityConfigSummary(*config);
  EXPECT_NE(summary.find("quest"), std::string::npos) << summary;
  EXPECT_NE(summary.find("page_tokens=32"), std::string::npos) << summary;

  auto none = ParseKvSparsityConfig(R"({"default": {"method": "quest", "budget": 64, "head_reduce": "none"}})", 2);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->layers[1].params.head_reduce, HeadReduce::kNone);
  EXPECT_NE(KvSparsityConfigSummary(*none).find("head_reduce=none"), std::string::npos)
      << KvSparsityConfigSummary(*none);

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
  expect_error(R"({"layers": [{"layers": 1, "method": "h2o", "budget": 64, "head_reduce": "none"}]})",
               {"head_reduce", "none", "mean or max"});
  expect_error(R"({"layers": [{"layers": 1, "method": "quest", "budget": 64, "n_sink": 4}]})",
               {"layers[0]", "n_sink", "page_tokens"});
  expect_error(R"({"layers": [{"layers": 1, "method": "h2o", "budget": 64, "page_tokens": 16}]})",
               {"page_tokens", "quest"});
  expect_error(R"({"layers": [{"layers": 3, "method": "quest"}]})", {"layer 3", "budget"});
}

}  // namespace
}  // namespace kvsparse
