#include "kvsparse/attention_scores.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvsparse/attention.h"
#include "ops/attention_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::LastPosition;
using testing::MakeSpans;
using testing::RandomQueries;
using testing::SpanSet;

struct ScoreCase {
  int n_q;
  int head_dim;
  int group;
  KvStorage storage;
  GqaAggregation aggregation;
  int n_threads;
};

std::string ScoreCaseName(const ScoreCase& c) {
  std::ostringstream name;
  name << "q" << c.n_q << "_d" << c.head_dim << "_g" << c.group << "_" << KvStorageName(c.storage)
       << (c.aggregation == GqaAggregation::kMax ? "_max" : "_mean") << "_t" << c.n_threads;
  return name.str();
}

struct Gathered {
  std::vector<float> sum_all, sum_window, last;  // each [n_kv_heads, n_tokens]
  explicit Gathered(size_t n) : sum_all(n, -5.f), sum_window(n, -5.f), last(n, -5.f) {}
  ScoreOutputs Outputs() { return {sum_all.data(), sum_window.data(), last.data()}; }
};

void ExpectScoresClose(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6f + 2e-5f * std::fabs(want[i])) << what << " element " << i;
  }
}

// Runs ops::Attention for the statistics, then ops::AttentionScores, and compares with the reference.
void CheckAgainstReference(const AttentionShape& shape, const SpanSet& set, const std::vector<float>& q,
                           const std::vector<int32_t>& q_pos, const ScoreGathering& gathering, int n_threads,
                           const std::string& what) {
  const int32_t n_q = static_cast<int32_t>(q_pos.size());
  const int32_t n_spans = static_cast<int32_t>(set.spans.size());
  int64_t n_tokens = 0;
  for (const KvSpan& s : set.spans) n_tokens += s.n;
  const size_t n_out = static_cast<size_t>(shape.n_kv_heads) * n_tokens;
  std::vector<float> out(q.size()), stats(static_cast<size_t>(n_q) * shape.n_heads * 2);
  ops::Attention(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, out.data(), n_threads,
                 stats.data());
  Gathered want(n_out), got(n_out);
  ref::AttentionScores(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, gathering,
                       want.Outputs());
  ops::AttentionScores(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, stats.data(),
                       gathering, got.Outputs(), n_threads);
  ExpectScoresClose(got.sum_all, want.sum_all, what + " sum_all");
  ExpectScoresClose(got.sum_window, want.sum_window, what + " sum_window");
  ExpectScoresClose(got.last, want.last, what + " last");

  // The window's per-query rows ([n_window, n_kv_heads, n_tokens], every element written),
  // fast vs reference, and their sum is sum_window.
  int32_t n_window = 0;
  for (int32_t p : q_pos) n_window += p >= gathering.window_start;
  if (n_window > 0) {
    std::vector<float> want_rows(n_window * n_out, -7.f), got_rows(n_window * n_out, -7.f);
    ScoreOutputs want_out{}, got_out{};
    want_out.window_rows = want_rows.data();
    got_out.window_rows = got_rows.data();
    ref::AttentionScores(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, gathering,
                         want_out);
    ops::AttentionScores(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, stats.data(),
                         gathering, got_out, n_threads);
    ExpectScoresClose(got_rows, want_rows, what + " window_rows");
    std::vector<float> summed(n_out, 0.f);
    for (int32_t w = 0; w < n_window; ++w) {
      for (size_t e = 0; e < n_out; ++e) summed[e] += got_rows[w * n_out + e];
    }
    for (size_t e = 0; e < n_out; ++e) ASSERT_NEAR(summed[e], want.sum_window[e], 1e-5f) << what << " rows sum " << e;
  }

  // The decode path: the same outputs from the raw scores ops::Attention keeps (every element
  // of the raw array is written: it starts as garbage), fast and reference gathering.
  std::vector<float> raw(static_cast<size_t>(n_q) * shape.n_heads * n_tokens, 123.f);
  std::vector<float> raw_out(q.size()), raw_stats(stats.size());
  ops::Attention(shape, set.storage, q.data(), q_pos.data(), n_q, set.spans.data(), n_spans, raw_out.data(), n_threads,
                 raw_stats.data(), raw.data());
  Gathered from_raw(n_out), from_raw_ref(n_out);
  ops::GatherScoresFromRaw(shape, q_pos.data(), n_q, n_tokens, raw.data(), raw_stats.data(), gathering,
                           from_raw.Outputs(), n_threads);
  ref::GatherScoresFromRaw(shape, q_pos.data(), n_q, n_tokens, raw.data(), raw_stats.data(), gathering,
                           from_raw_ref.Outputs());
  for (const auto& [gathered, name] : {std::pair{&from_raw, " raw"}, std::pair{&from_raw_ref, " raw ref"}}) {
    ExpectScoresClose(gathered->sum_all, want.sum_all, what + name + " sum_all vs ref");
    ExpectScoresClose(gathered->sum_window, want.sum_window, what + name + " sum_window vs ref");
    ExpectScoresClose(gathered->last, want.last, what + name + " last vs ref");
    ExpectScoresClose(gathered->sum_all, got.sum_all, what + name + " sum_all vs ops");
    ExpectScoresClose(gathered->sum_window, got.sum_window, what + name + " sum_window vs ops");
    ExpectScoresClose(gathered->last, got.last, what + name + " last vs ops");
  }
}

// Every test runs once per kernel family (scalar, avx2, avx512) the CPU can run.
class AttentionScoresTest : public testing::PerIsaTest {};
KVS_INSTANTIATE_PER_ISA(AttentionScoresTest);

// Ragged spans with gaps; queries before, inside and after the cached positions; a window
// covering some of the queries.
void CheckRaggedCase(const ScoreCase& c) {
  std::mt19937 rng(2000 + c.n_q * 131 + c.head_dim * 7 + c.group * 3 + c.n_threads);
  const int n_kv_heads = c.group == 8 ? 1 : 3;
  AttentionShape shape{n_kv_heads * c.group, n_kv_heads, c.head_dim, 1.f / std::sqrt(static_cast<float>(c.head_dim))};
  SpanSet set = MakeSpans(c.storage, {1, 5, 16, 31, 2, 17, 1, 40, 0, 90}, n_kv_heads, c.head_dim, rng, 3);
  const int32_t last = LastPosition(set);
  std::vector<int32_t> q_pos(c.n_q);
  for (int i = 0; i < c.n_q; ++i) q_pos[i] = last - (c.n_q - 1 - i) * 13;  // ascending, like a prefill chunk
  if (c.n_q > 2) q_pos[0] = 1;  // sees nothing
  ScoreGathering gathering;
  gathering.aggregation = c.aggregation;
  gathering.window_start = q_pos[c.n_q / 2];
  for (float amplitude : {0.5f, 4.f}) {
    std::vector<float> q = RandomQueries(static_cast<size_t>(c.n_q) * shape.n_heads * c.head_dim, rng, amplitude);
    CheckAgainstReference(shape, set, q, q_pos, gathering, c.n_threads, "amplitude " + std::to_string(amplitude));
  }
}

// Every storage type meets every query count and group; head dim, aggregation and thread count
// rotate through those cases, so each type still sees each of them (see AllCases in attention_test.cc).
std::vector<ScoreCase> AllScoreCases() {
  std::vector<ScoreCase> cases;
  int rotation = 0;
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    for (int n_q : {1, 4, 19}) {
      for (int group : {1, 2, 8}) {
        const GqaAggregation aggregation = (rotation / 2) % 2 == 0 ? GqaAggregation::kMean : GqaAggregation::kMax;
        cases.push_back({n_q, rotation % 2 == 0 ? 64 : 20, group, storage, aggregation, rotation % 3 == 0 ? 3 : 1});
        ++rotation;
      }
    }
  }
  return cases;
}

TEST_P(AttentionScoresTest, RaggedCasesMatchReference) {
  for (const ScoreCase& c : AllScoreCases()) {
    SCOPED_TRACE(ScoreCaseName(c));
    CheckRaggedCase(c);
    if (HasFatalFailure()) return;
  }
}

// Long context split over many chunks, decode and a prefill chunk.
TEST_P(AttentionScoresTest, LongContextMatchesReference) {
  std::mt19937 rng(8);
  AttentionShape shape{8, 2, 64, 0.125f};
  SpanSet set = MakeSpans(KvStorage::kF16, {600, 3, 900}, 2, 64, rng);
  const int32_t last = LastPosition(set);
  for (int n_q : {1, 24}) {
    std::vector<int32_t> q_pos(n_q);
    for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 41;
    std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 64, rng, 3.f);
    ScoreGathering gathering{GqaAggregation::kMean, q_pos[n_q - 1] - 100};
    for (int n_threads : {1, 2, 4}) {
      CheckAgainstReference(shape, set, q, q_pos, gathering, n_threads,
                            "n_q " + std::to_string(n_q) + " threads " + std::to_string(n_threads));
    }
  }
}

// int8_kivi: quantized pages and full-precision spans interleaved (segments), empty spans at
// their edges, long enough to split each segment over several chunks.
TEST_P(AttentionScoresTest, Int8KiviMixedSegmentsMatchReference) {
  std::mt19937 rng(15);
  AttentionShape shape{8, 2, 64, 0.125f};
  SpanSet set = MakeSpans(KvStorage::kInt8Kivi, {16, 0, 16, 16, 300, 0, 9, 400, 11}, 2, 64, rng);
  set.MakeResidual(4);
  set.MakeResidual(6);
  const int32_t last = LastPosition(set);
  for (int n_q : {1, 24}) {
    std::vector<int32_t> q_pos(n_q);
    for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 29;
    std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 64, rng, 3.f);
    ScoreGathering gathering{GqaAggregation::kMax, q_pos[n_q - 1] - 90};
    for (int n_threads : {1, 3}) {
      CheckAgainstReference(shape, set, q, q_pos, gathering, n_threads,
                            "n_q " + std::to_string(n_q) + " threads " + std::to_string(n_threads));
    }
  }
}

// Probabilities of each query head sum to 1 over the tokens it sees, so with mean folding
// sum_all sums to the number of queries that see anything, and `last` to 1 per kv head.
TEST_P(AttentionScoresTest, ProbabilitiesSumToOne) {
  std::mt19937 rng(12);
  AttentionShape shape{6, 2, 32, 0.3f};
  SpanSet set = MakeSpans(KvStorage::kF32, {50, 30}, 2, 32, rng);
  const int32_t last = LastPosition(set);
  std::vector<int32_t> q_pos = {-1, 10, 40, last};
  std::vector<float> q = RandomQueries(4 * 6 * 32, rng, 2.f);
  std::vector<float> out(q.size()), stats(4 * 6 * 2);
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 4, set.spans.data(), 2, out.data(), 2, stats.data());
  Gathered got(2 * 80);
  ops::AttentionScores(shape, KvStorage::kF32, q.data(), q_pos.data(), 4, set.spans.data(), 2, stats.data(),
                       ScoreGathering{GqaAggregation::kMean, 40}, got.Outputs(), 2);
  for (int h = 0; h < 2; ++h) {
    double all = 0, window = 0, final_query = 0;
    for (int t = 0; t < 80; ++t) {
      all += got.sum_all[h * 80 + t];
      window += got.sum_window[h * 80 + t];
      final_query += got.last[h * 80 + t];
    }
    EXPECT_NEAR(all, 3.0, 1e-5);     // the query at -1 sees nothing
    EXPECT_NEAR(window, 2.0, 1e-5);  // queries at 40 and last
    EXPECT_NEAR(final_query, 1.0, 1e-5);
  }
  // Tokens after position 40 are seen only by the last query: their sum_all equals last.
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 80; ++t) {
      if (set.F32Spans()[t < 50 ? 0 : 1].positions[t < 50 ? t : t - 50] > 40) {
        EXPECT_FLOAT_EQ(got.sum_all[h * 80 + t], got.last[h * 80 + t]);
      }
    }
  }
}

// Max folding keeps the largest head's probability: with one dominant head per token it
// differs from mean folding by the group factor at most.
TEST_P(AttentionScoresTest, MaxFoldBoundsMeanFold) {
  std::mt19937 rng(13);
  AttentionShape shape{8, 2, 16, 0.5f};
  SpanSet set = MakeSpans(KvStorage::kF16, {37}, 2, 16, rng);
  const int32_t last = LastPosition(set);
  std::vector<int32_t> q_pos = {last};
  std::vector<float> q = RandomQueries(8 * 16, rng, 2.f);
  std::vector<float> out(q.size()), stats(8 * 2);
  ops::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), 1, set.spans.data(), 1, out.data(), 1, stats.data());
  Gathered mean(2 * 37), max(2 * 37);
  ops::AttentionScores(shape, KvStorage::kF16, q.data(), q_pos.data(), 1, set.spans.data(), 1, stats.data(),
                       ScoreGathering{GqaAggregation::kMean}, mean.Outputs(), 1);
  ops::AttentionScores(shape, KvStorage::kF16, q.data(), q_pos.data(), 1, set.spans.data(), 1, stats.data(),
                       ScoreGathering{GqaAggregation::kMax}, max.Outputs(), 1);
  for (size_t e = 0; e < mean.last.size(); ++e) {
    EXPECT_GE(max.last[e], mean.last[e] * (1 - 1e-6f));
    EXPECT_LE(max.last[e], 4 * mean.last[e] * (1 + 1e-6f));  // group of 4
    EXPECT_EQ(max.sum_window[e], 0.f);                         // default window: none
  }
}

// No queries, no tokens, null outputs.
TEST_P(AttentionScoresTest, EmptyInputs) {
  std::mt19937 rng(14);
  AttentionShape shape{2, 1, 16, 0.25f};
  SpanSet set = MakeSpans(KvStorage::kF32, {5}, 1, 16, rng);
  Gathered got(5);
  ops::AttentionScores(shape, KvStorage::kF32, nullptr, nullptr, 0, set.spans.data(), 1, nullptr, ScoreGathering{},
                       got.Outputs(), 2);
  for (float x : got.sum_all) EXPECT_EQ(x, 0.f);
  std::vector<float> q = RandomQueries(2 * 16, rng, 1.f);
  std::vector<int32_t> q_pos = {100};
  std::vector<float> stats = {-INFINITY, 0.f, -INFINITY, 0.f};
  ops::AttentionScores(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, nullptr, 0, stats.data(), ScoreGathering{},
                       ScoreOutputs{}, 2);
  // Only sum_all requested.
  std::vector<float> out(q.size());
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, set.spans.data(), 1, out.data(), 1, stats.data());
  std::vector<float> sum_all(5, -1.f);
  ops::AttentionScores(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, set.spans.data(), 1, stats.data(),
                       ScoreGathering{}, ScoreOutputs{sum_all.data(), nullptr, nullptr}, 2);
  double total = 0;
  for (float x : sum_all) total += x;
  EXPECT_NEAR(total, 1.0, 1e-5);

  // Gathering from raw scores: no queries zeroes the outputs; no tokens or null outputs are fine.
  std::vector<float> raw(2 * 5);
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, set.spans.data(), 1, out.data(), 1, stats.data(),
                 raw.data());
  Gathered none(5);
  ops::GatherScoresFromRaw(shape, nullptr, 0, 5, nullptr, nullptr, ScoreGathering{}, none.Outputs(), 2);
  for (float x : none.sum_all) EXPECT_EQ(x, 0.f);
  for (float x : none.last) EXPECT_EQ(x, 0.f);
  ops::GatherScoresFromRaw(shape, q_pos.data(), 1, 0, nullptr, stats.data(), ScoreGathering{}, ScoreOutputs{}, 2);
  std::fill(sum_all.begin(), sum_all.end(), -1.f);
  ops::GatherScoresFromRaw(shape, q_pos.data(), 1, 5, raw.data(), stats.data(), ScoreGathering{},
                           ScoreOutputs{sum_all.data(), nullptr, nullptr}, 2);
  total = 0;
  for (float x : sum_all) total += x;
  EXPECT_NEAR(total, 1.0, 1e-5);
}

// A decode step over a long ragged context, split over threads: raw-score gathering equals
// the second pass for every storage type, both folds and a window covering the query.
TEST_P(AttentionScoresTest, RawGatheringMatchesSecondPassOnLongDecode) {
  std::mt19937 rng(16);
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    AttentionShape shape{32, 4, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {16, 16, 5, 16, 700, 16, 3, 333, 9}, 4, 64, rng);
    if (IsKiviStorage(storage)) set.MakeResidual(4);
    const int32_t last = LastPosition(set);
    std::vector<int32_t> q_pos = {last};
    std::vector<float> q = RandomQueries(32 * 64, rng, 3.f);
    for (GqaAggregation aggregation : {GqaAggregation::kMean, GqaAggregation::kMax}) {
      for (int n_threads : {1, 2, 5}) {
        CheckAgainstReference(shape, set, q, q_pos, ScoreGathering{aggregation, last}, n_threads,
                              std::string(KvStorageName(storage)) + " threads " + std::to_string(n_threads));
      }
    }
  }
}

// Within a family the attention kernel and the second pass share their block primitives, so
// the raw scores ops::Attention keeps and the ones ops::AttentionScores recomputes are the same
// bits, and gathering from either gives identical outputs (one query tile in the second pass,
// so both sum the queries in the same order). The attention kernel's query tiles (8 queries at
// group 4) end blocks early where the second pass has whole ones, and the threads split the
// tokens differently: a token's packed K must not depend on the block it falls in.
TEST_P(AttentionScoresTest, RawGatheringEqualsSecondPassExactly) {
  std::mt19937 rng(17);
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    for (int head_dim : {64, 20, 37}) {
      if (!KvStorageFits(storage, head_dim)) continue;
      AttentionShape shape{8, 2, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
      SpanSet set = MakeSpans(storage, {16, 5, 40, 16, 300, 7, 16, 200, 9}, 2, head_dim, rng);
      if (IsKiviStorage(storage)) set.MakeResidual(4);
      const int32_t last = LastPosition(set);
      int64_t n_tokens = 0;
      for (const KvSpan& s : set.spans) n_tokens += s.n;
      const size_t n_out = static_cast<size_t>(shape.n_kv_heads) * n_tokens;
      for (int n_q : {1, 16}) {
        std::vector<int32_t> q_pos(n_q);
        for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 23;
        std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * head_dim, rng, 3.f);
        std::vector<float> out(q.size()), stats(static_cast<size_t>(n_q) * shape.n_heads * 2);
        std::vector<float> raw(static_cast<size_t>(n_q) * shape.n_heads * n_tokens);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, out.data(), 2, stats.data(),
                       raw.data());
        for (GqaAggregation aggregation : {GqaAggregation::kMean, GqaAggregation::kMax}) {
          const ScoreGathering gathering{aggregation, q_pos[n_q / 2]};
          Gathered second(n_out), from_raw(n_out);
          ops::AttentionScores(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, stats.data(),
                               gathering, second.Outputs(), 3);
          ops::GatherScoresFromRaw(shape, q_pos.data(), n_q, n_tokens, raw.data(), stats.data(), gathering,
                                   from_raw.Outputs(), 2);
          const std::string what = std::string(KvStorageName(storage)) + " head_dim " + std::to_string(head_dim) +
                                   " n_q " + std::to_string(n_q);
          EXPECT_EQ(from_raw.sum_all, second.sum_all) << what;
          EXPECT_EQ(from_raw.sum_window, second.sum_window) << what;
          EXPECT_EQ(from_raw.last, second.last) << what;
        }
      }
    }
  }
}

// ---- sliding windows and softcapping (AttentionShape::window, ::softcap) ----

// Every storage type meets every window and softcap, over ragged spans with gaps in the
// positions; query counts, head dims, groups, folds and thread counts rotate. The second pass,
// its per-query window rows, and gathering from raw scores (fast and reference) all against
// ref::AttentionScores. Scores are large (scale 0.3, queries up to 3) so a softcap of 5 bites.
TEST_P(AttentionScoresTest, WindowAndSoftcapMatchReference) {
  int rotation = 0;
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    for (int32_t window : {1, 3, 17, 40, 1 << 30}) {
      for (float softcap : {0.f, 5.f, 50.f}) {
        constexpr int kQueries[] = {1, 4, 19};
        constexpr int kGroups[] = {1, 2, 8};
        const int n_q = kQueries[rotation % 3], group = kGroups[(rotation / 3) % 3];
        const int head_dim = rotation % 2 == 0 ? 64 : 20;
        const int n_threads = rotation % 3 == 0 ? 3 : 1;
        const GqaAggregation aggregation = (rotation / 2) % 2 == 0 ? GqaAggregation::kMean : GqaAggregation::kMax;
        ++rotation;
        std::mt19937 rng(4000 + rotation);
        const int n_kv_heads = group == 8 ? 1 : 3;
        AttentionShape shape{n_kv_heads * group, n_kv_heads, head_dim, 0.3f};
        shape.window = window;
        shape.softcap = softcap;
        SpanSet set = MakeSpans(storage, {1, 5, 16, 31, 2, 17, 1, 40, 0, 90}, n_kv_heads, head_dim, rng, 3);
        const int32_t last = LastPosition(set);
        std::vector<int32_t> q_pos(n_q);
        for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 13;  // ascending, like a prefill chunk
        if (n_q > 2) q_pos[0] = 1;  // sees nothing
        ScoreGathering gathering;
        gathering.aggregation = aggregation;
        gathering.window_start = q_pos[n_q / 2];
        const std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * head_dim, rng, 3.f);
        std::ostringstream what;
        what << KvStorageName(storage) << " window " << window << " softcap " << softcap << " n_q " << n_q
             << " group " << group << " d" << head_dim;
        CheckAgainstReference(shape, set, q, q_pos, gathering, n_threads, what.str());
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A decode step and a prefill chunk over a long context split into many chunks, windows
// narrower than a chunk (the chunks then cover only the window), with and without softcap.
TEST_P(AttentionScoresTest, WindowLongContextMatchesReference) {
  std::mt19937 rng(18);
  AttentionShape shape{8, 2, 64, 0.125f};
  SpanSet set = MakeSpans(KvStorage::kF16, {600, 3, 900}, 2, 64, rng);
  const int32_t last = LastPosition(set);
  for (int n_q : {1, 24}) {
    for (int32_t window : {60, 700}) {
      shape.window = window;
      shape.softcap = window == 60 ? 0.f : 5.f;
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 41;
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 64, rng, 3.f);
      ScoreGathering gathering{GqaAggregation::kMean, q_pos[n_q - 1] - 100};
      for (int n_threads : {1, 4}) {
        CheckAgainstReference(shape, set, q, q_pos, gathering, n_threads,
                              "n_q " + std::to_string(n_q) + " window " + std::to_string(window) + " threads " +
                                  std::to_string(n_threads));
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Within a family the raw scores ops::Attention keeps and the second pass's scores are the
// same bits with windows and softcaps too (the same cap, the same masks).
TEST_P(AttentionScoresTest, RawGatheringEqualsSecondPassExactlyWithWindowAndSoftcap) {
  std::mt19937 rng(19);
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi,
                            KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16, KvStorage::kInt4Kivi,
                            KvStorage::kInt2Kivi}) {
    for (int32_t window : {3, 40, 250}) {
      AttentionShape shape{8, 2, 37, 0.3f};
      if (!KvStorageFits(storage, shape.head_dim)) shape.head_dim = 64;
      shape.window = window;
      shape.softcap = window == 40 ? 0.f : 5.f;
      SpanSet set = MakeSpans(storage, {16, 5, 40, 16, 300, 7, 16, 200, 9}, 2, shape.head_dim, rng);
      if (IsKiviStorage(storage)) set.MakeResidual(4);
      const int32_t last = LastPosition(set);
      int64_t n_tokens = 0;
      for (const KvSpan& s : set.spans) n_tokens += s.n;
      const size_t n_out = static_cast<size_t>(shape.n_kv_heads) * n_tokens;
      for (int n_q : {1, 16}) {
        std::vector<int32_t> q_pos(n_q);
        for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 23;
        std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * shape.head_dim, rng, 3.f);
        std::vector<float> out(q.size()), stats(static_cast<size_t>(n_q) * shape.n_heads * 2);
        std::vector<float> raw(static_cast<size_t>(n_q) * shape.n_heads * n_tokens);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, out.data(), 2, stats.data(),
                       raw.data());
        const ScoreGathering gathering{GqaAggregation::kMean, q_pos[n_q / 2]};
        Gathered second(n_out), from_raw(n_out);
        ops::AttentionScores(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, stats.data(), gathering,
                             second.Outputs(), 3);
        ops::GatherScoresFromRaw(shape, q_pos.data(), n_q, n_tokens, raw.data(), stats.data(), gathering,
                                 from_raw.Outputs(), 2);
        const std::string what = std::string(KvStorageName(storage)) + " window " + std::to_string(window) +
                                 " n_q " + std::to_string(n_q);
        EXPECT_EQ(from_raw.sum_all, second.sum_all) << what;
        EXPECT_EQ(from_raw.sum_window, second.sum_window) << what;
        EXPECT_EQ(from_raw.last, second.last) << what;
      }
    }
  }
}

// Out-of-window tokens get probability exactly 0, and each query head's probabilities still
// sum to 1 over the tokens its window holds.
TEST_P(AttentionScoresTest, WindowProbabilitiesAreZeroOutsideAndSumToOne) {
  std::mt19937 rng(20);
  AttentionShape shape{6, 2, 32, 0.3f};
  shape.window = 25;
  shape.softcap = 5.f;
  SpanSet set = MakeSpans(KvStorage::kF32, {50, 30}, 2, 32, rng);
  const int32_t last = LastPosition(set);
  std::vector<int32_t> q_pos = {last};
  std::vector<float> q = RandomQueries(6 * 32, rng, 3.f);
  std::vector<float> out(q.size()), stats(6 * 2);
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, set.spans.data(), 2, out.data(), 2, stats.data());
  Gathered got(2 * 80);
  ops::AttentionScores(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, set.spans.data(), 2, stats.data(),
                       ScoreGathering{GqaAggregation::kMean, last}, got.Outputs(), 2);
  const std::vector<KvSpan> spans = set.F32Spans();
  for (int h = 0; h < 2; ++h) {
    double total = 0;
    for (int t = 0; t < 80; ++t) {
      const int32_t pos = spans[t < 50 ? 0 : 1].positions[t < 50 ? t : t - 50];
      const float p = got.last[h * 80 + t];
      if (last - pos >= shape.window) {
        EXPECT_EQ(p, 0.f) << "token " << t << " at " << pos;
      } else {
        EXPECT_GT(p, 0.f) << "token " << t << " at " << pos;
      }
      total += p;
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
  }
}

}  // namespace
}  // namespace kvsparse
