// The sparse prefill estimators (sparse_prefill.h): what each must keep, what it may drop, and
// the selections' shape; the kernel that reads them is tested in ops/attention_test.cc.
#include "kvsparse/sparse_prefill.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvsparse/attention.h"

namespace kvsparse {
namespace {

constexpr int kHeadDim = 16;
constexpr int kGroup = 2;

// A prompt chunk: n_q queries of `group` heads, the newest n_q of n_tokens keys their own (no eviction).
struct Chunk {
  int32_t n_q;
  int64_t n_tokens;
  int group;
  std::vector<float> q;     // [n_q, group, head_dim]
  std::vector<float> keys;  // [n_tokens rounded up to 8, head_dim]
  std::vector<int64_t> visible;
  Chunk(int32_t queries, int64_t tokens, std::mt19937& rng, int heads = kGroup)
      : n_q(queries), n_tokens(tokens), group(heads) {
    std::normal_distribution<float> noise(0.f, 0.3f);
    q.resize(static_cast<size_t>(n_q) * group * kHeadDim);
    keys.assign(static_cast<size_t>((n_tokens + 7) / 8 * 8) * kHeadDim, 0.f);
    for (float& x : q) x = noise(rng);
    for (int64_t t = 0; t < n_tokens * kHeadDim; ++t) keys[t] = noise(rng);
    for (int32_t i = 0; i < n_q; ++i) visible.push_back(n_tokens - n_q + i + 1);
  }
  // Key t answers every query strongly (a "vertical" token: a needle or a sink).
  void Plant(int64_t t) {
    for (int c = 0; c < kHeadDim; ++c) keys[t * kHeadDim + c] = 0.f;
    keys[t * kHeadDim] = 8.f;
    for (size_t r = 0; r < q.size() / kHeadDim; ++r) q[r * kHeadDim] = 3.f;
  }
  // Every query head's selection (config.group_shared 0), or the group's one.
  std::vector<PrefillSelection> SelectAll(const PrefillSparsity& config) const {
    std::vector<PrefillSelection> out(static_cast<size_t>(PrefillSelectionsPerKvHead(config, group)));
    PrefillSelector selector;
    const AttentionShape shape{group, 1, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
    selector.Select(config, shape, q.data(), visible.data(), n_q, keys.data(), n_tokens, 2, out.data());
    return out;
  }
  // The group's one selection (group_shared).
  PrefillSelection Select(PrefillSparsity config) const {
    config.group_shared = 1;
    return SelectAll(config)[0];
  }
  // Query head g alone, as a one-head group.
  Chunk Head(int g) const {
    Chunk one = *this;
    one.group = 1;
    one.q.resize(static_cast<size_t>(n_q) * kHeadDim);
    for (int32_t i = 0; i < n_q; ++i) {
      std::copy_n(q.data() + (static_cast<size_t>(i) * group + g) * kHeadDim, kHeadDim,
                  one.q.data() + static_cast<size_t>(i) * kHeadDim);
    }
    return one;
  }
};

bool SameSelection(const PrefillSelection& a, const PrefillSelection& b) {
  return a.query_block == b.query_block && a.range_offsets == b.range_offsets && a.ranges == b.ranges;
}

// Whether query block b's ranges hold token t.
bool Holds(const PrefillSelection& s, int block, int64_t t) {
  for (int64_t r = s.range_offsets[block]; r < s.range_offsets[block + 1]; ++r) {
    if (s.ranges[2 * r] <= t && t < s.ranges[2 * r + 1]) return true;
  }
  return false;
}

// Ascending, disjoint, non-empty ranges inside what the block's last query sees, and every
// query's own token kept.
void ExpectWellFormed(const PrefillSelection& s, const Chunk& chunk) {
  const int n_blocks = (chunk.n_q + s.query_block - 1) / s.query_block;
  ASSERT_EQ(static_cast<int>(s.range_offsets.size()), n_blocks + 1);
  for (int b = 0; b < n_blocks; ++b) {
    const int32_t last = std::min(chunk.n_q, (b + 1) * s.query_block) - 1;
    int64_t previous_end = -1;
    for (int64_t r = s.range_offsets[b]; r < s.range_offsets[b + 1]; ++r) {
      EXPECT_LT(s.ranges[2 * r], s.ranges[2 * r + 1]) << "block " << b;
      EXPECT_GT(s.ranges[2 * r], previous_end) << "block " << b << ": ranges ascend, disjoint and merged";
      EXPECT_LE(s.ranges[2 * r + 1], chunk.visible[last]) << "block " << b;
      previous_end = s.ranges[2 * r + 1];
    }
    for (int32_t i = b * s.query_block; i <= last; ++i) {
      EXPECT_TRUE(Holds(s, b, chunk.visible[i] - 1)) << "query " << i << " keeps its own token";
    }
  }
}

// A method's defaults with small budgets: `vertical` columns and `slash` diagonals
// (vertical_slash), `top_blocks` key blocks (block_sparse), `threshold` (xattention).
PrefillSparsity SmallBudgets(PrefillMethod method, int vertical, int slash, int top_blocks, double threshold) {
  PrefillSparsity config = DefaultPrefillSparsity(method);
  config.vertical = vertical;
  config.slash = slash;
  config.top_blocks = top_blocks;
  config.threshold = threshold;
  return config;
}

double ComputedShare(const PrefillSelection& s, const Chunk& chunk) {
  const PrefillWork work = CountPrefillWork(s, chunk.visible.data(), chunk.n_q);
  return static_cast<double>(work.selected_pairs) / work.causal_pairs;
}

TEST(SparsePrefill, DenseSelectsEveryCausalPair) {
  std::mt19937 rng(1);
  Chunk chunk(150, 1000, rng);
  const PrefillSelection s = chunk.Select(DefaultPrefillSparsity(PrefillMethod::kDense));
  ExpectWellFormed(s, chunk);
  EXPECT_EQ(ComputedShare(s, chunk), 1.0);
}

TEST(SparsePrefill, GenerousBudgetsSelectEverything) {
  std::mt19937 rng(2);
  Chunk chunk(130, 700, rng);
  for (PrefillMethod method :
       {PrefillMethod::kVerticalSlash, PrefillMethod::kBlockSparse, PrefillMethod::kXAttention}) {
    PrefillSparsity config = DefaultPrefillSparsity(method);
    config.threshold = 1.0;  // (defaults for the others already cover 700 tokens)
    const PrefillSelection s = chunk.Select(config);
    ExpectWellFormed(s, chunk);
    EXPECT_EQ(ComputedShare(s, chunk), 1.0) << PrefillMethodName(method);
  }
}

TEST(SparsePrefill, VerticalSlashKeepsSinksLocalBandAndAPlantedColumn) {
  std::mt19937 rng(3);
  Chunk chunk(128, 4000, rng);
  chunk.Plant(1777);
  PrefillSparsity config = DefaultPrefillSparsity(PrefillMethod::kVerticalSlash);
  config.vertical = 40;
  config.slash = 4;
  config.sink_columns = 4;
  config.local_diagonals = 16;
  const PrefillSelection s = chunk.Select(config);
  ExpectWellFormed(s, chunk);
  for (int b = 0; b < 2; ++b) {
    EXPECT_TRUE(Holds(s, b, 1777)) << "the column every query attends to";
    for (int64_t t = 0; t < 4; ++t) EXPECT_TRUE(Holds(s, b, t)) << "sink " << t;
    const int32_t first = b * 64;
    for (int64_t o = 0; o < 16; ++o) EXPECT_TRUE(Holds(s, b, chunk.visible[first] - 1 - o)) << "diagonal " << o;
  }
  const double share = ComputedShare(s, chunk);
  EXPECT_LT(share, 0.15) << "40 columns and 50 diagonals (the least MInference keeps) of ~4000 keys";
}

// MInference's forced columns and diagonals lie inside its counts, which are at least 30 and 50:
// slash=32 with 100 forced diagonals keeps the 50 nearest (not 132), and vertical=30 with 30
// forced columns keeps those alone.
TEST(SparsePrefill, VerticalSlashForcedOnesCountWithinTheCounts) {
  std::mt19937 rng(13);
  Chunk chunk(64, 4000, rng);  // one query block
  PrefillSparsity config = DefaultPrefillSparsity(PrefillMethod::kVerticalSlash);
  config.vertical = 30;
  config.slash = 32;
  ASSERT_EQ(config.sink_columns, 30);
  ASSERT_EQ(config.local_diagonals, 100);
  const PrefillSelection s = chunk.Select(config);
  ExpectWellFormed(s, chunk);
  const int64_t newest = chunk.visible[0] - 1;  // the block's first query's own token
  for (int64_t o = 0; o < 50; ++o) EXPECT_TRUE(Holds(s, 0, newest - o)) << "diagonal " << o;
  for (int64_t o = 50; o < 100; ++o) EXPECT_FALSE(Holds(s, 0, newest - o)) << "diagonal " << o << " is past the 50";
  int64_t kept = 0;
  for (int64_t r = s.range_offsets[0]; r < s.range_offsets[1]; ++r) kept += s.ranges[2 * r + 1] - s.ranges[2 * r];
  EXPECT_EQ(kept, 30 + 49 + 64) << "30 sink columns, and 50 diagonals' bands over 64 queries";
}

TEST(SparsePrefill, BlockSparseKeepsTopBlocksAndOwnBlocks) {
  std::mt19937 rng(4);
  Chunk chunk(128, 4096, rng);
  for (int64_t t = 640; t < 704; ++t) chunk.Plant(t);  // key block 10 matches every query
  PrefillSparsity config = DefaultPrefillSparsity(PrefillMethod::kBlockSparse);
  config.top_blocks = 2;
  const PrefillSelection s = chunk.Select(config);
  ExpectWellFormed(s, chunk);
  for (int b = 0; b < 2; ++b) {
    EXPECT_TRUE(Holds(s, b, 640) && Holds(s, b, 703)) << "block " << b << " keeps the planted key block";
    int64_t kept = 0;
    for (int64_t r = s.range_offsets[b]; r < s.range_offsets[b + 1]; ++r) kept += s.ranges[2 * r + 1] - s.ranges[2 * r];
    EXPECT_LE(kept, 3 * 64) << "two top blocks and its own";
  }
}

TEST(SparsePrefill, XAttentionThresholdBoundsTheKeptBlocks) {
  std::mt19937 rng(5);
  Chunk chunk(256, 4096, rng);
  for (int64_t t = 1280; t < 1408; ++t) chunk.Plant(t);  // key block 10 (of 128) matches every query
  PrefillSparsity config = DefaultPrefillSparsity(PrefillMethod::kXAttention);
  config.threshold = 0.3;
  const PrefillSelection low = chunk.Select(config);
  ExpectWellFormed(low, chunk);
  for (int b = 0; b < 2; ++b) {
    EXPECT_TRUE(Holds(low, b, 0)) << "sink block";
    EXPECT_TRUE(Holds(low, b, 1300)) << "the block holding most of the attention";
  }
  EXPECT_LT(ComputedShare(low, chunk), 0.2);
  config.threshold = 1.0;
  const PrefillSelection all = chunk.Select(config);
  ExpectWellFormed(all, chunk);
  EXPECT_EQ(ComputedShare(all, chunk), 1.0) << "a threshold of 1 keeps every block";
}

// The attention mass (softmax over every visible key, mean over queries and group heads) that a
// selection keeps.
double KeptMass(const PrefillSelection& s, const Chunk& chunk) {
  const float scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
  double kept = 0;
  std::vector<double> p;
  for (int32_t i = 0; i < chunk.n_q; ++i) {
    const int block = i / s.query_block;
    for (int g = 0; g < kGroup; ++g) {
      const float* q = chunk.q.data() + (static_cast<size_t>(i) * kGroup + g) * kHeadDim;
      p.assign(static_cast<size_t>(chunk.visible[i]), 0.0);
      double max = -1e30, sum = 0;
      for (int64_t t = 0; t < chunk.visible[i]; ++t) {
        double dot = 0;
        for (int c = 0; c < kHeadDim; ++c) dot += q[c] * chunk.keys[t * kHeadDim + c];
        p[t] = dot * scale;
        max = std::max(max, p[t]);
      }
      for (double& x : p) sum += (x = std::exp(x - max));
      for (int64_t r = s.range_offsets[block]; r < s.range_offsets[block + 1]; ++r) {
        for (int64_t t = s.ranges[2 * r]; t < std::min(s.ranges[2 * r + 1], chunk.visible[i]); ++t) kept += p[t] / sum;
      }
    }
  }
  return kept / (chunk.n_q * kGroup);
}

// estimate_bits 8 (int8 products, where the family has integer dots) selects within a stated
// tolerance of the f32 estimate: it keeps at least the attention mass the f32 selection keeps,
// less 0.01, and about as many pairs. Peaked attention (planted columns, a local band) as
// models have it, plus noise.
TEST(SparsePrefill, Int8EstimatesKeepTheMassOfF32Estimates) {
  std::mt19937 rng(31);
  Chunk chunk(256, 3000, rng);
  for (int64_t t : {5, 700, 1900}) {
    for (int c = 1; c < kHeadDim; ++c) chunk.keys[t * kHeadDim + c] = 0.f;
    chunk.keys[t * kHeadDim] = 4.f;
  }
  for (size_t r = 0; r < chunk.q.size() / kHeadDim; ++r) chunk.q[r * kHeadDim] += 1.f;
  for (PrefillMethod method :
       {PrefillMethod::kVerticalSlash, PrefillMethod::kXAttention, PrefillMethod::kBlockSparse}) {
    PrefillSparsity config = SmallBudgets(method, 100, 200, 8, 0.5);
    config.estimate_bits = 32;
    const PrefillSelection f32 = chunk.Select(config);
    config.estimate_bits = 8;
    const PrefillSelection int8 = chunk.Select(config);
    ExpectWellFormed(int8, chunk);
    const double f32_mass = KeptMass(f32, chunk), int8_mass = KeptMass(int8, chunk);
    EXPECT_GE(int8_mass, f32_mass - 0.01) << PrefillMethodName(method);
    EXPECT_NEAR(ComputedShare(int8, chunk), ComputedShare(f32, chunk), 0.02) << PrefillMethodName(method);
  }
}

// The references select per query head (after repeat_kv): a group of 4 query heads each of which
// attends to its own token keeps all four, each head reading its own; the group-shared form (one
// selection from the heads' mean) can lose them to tokens the whole group attends to moderately.
TEST(SparsePrefill, PerQueryHeadSelectionKeepsEachHeadsToken) {
  constexpr int kHeads = 4;
  std::mt19937 rng(17);
  Chunk chunk(64, 4000, rng, kHeads);
  // Queries: dim 0 = 2 for every head (the common tokens), dim 1 + g = 2 for head g (its own token).
  for (int32_t i = 0; i < chunk.n_q; ++i) {
    for (int g = 0; g < kHeads; ++g) {
      float* q = chunk.q.data() + (static_cast<size_t>(i) * kHeads + g) * kHeadDim;
      std::fill(q, q + kHeadDim, 0.f);
      q[0] = 2.f;
      q[1 + g] = 2.f;
    }
  }
  // 30 common tokens score 5 for every head (after the 1/4 scale); head g's own token scores 6
  // for head g and 0 for the others: its mean over the group (e^6 / 4) falls below a common one's
  // (e^5), its own head's above.
  std::vector<int64_t> own = {1500, 2200, 2900, 3500};  // beyond the common tokens' diagonal bands
  for (int j = 0; j < 30; ++j) {
    float* k = chunk.keys.data() + static_cast<size_t>(100 + 37 * j) * kHeadDim;
    std::fill(k, k + kHeadDim, 0.f);
    k[0] = 10.f;
  }
  for (int g = 0; g < kHeads; ++g) {
    float* k = chunk.keys.data() + static_cast<size_t>(own[g]) * kHeadDim;
    std::fill(k, k + kHeadDim, 0.f);
    k[1 + g] = 12.f;
  }
  PrefillSparsity config = DefaultPrefillSparsity(PrefillMethod::kVerticalSlash);
  config.vertical = 30;
  config.slash = 50;
  config.sink_columns = 0;
  config.local_diagonals = 0;
  const std::vector<PrefillSelection> per_head = chunk.SelectAll(config);
  ASSERT_EQ(per_head.size(), 4u);
  for (int g = 0; g < kHeads; ++g) {
    ExpectWellFormed(per_head[g], chunk);
    EXPECT_TRUE(Holds(per_head[g], 0, own[g])) << "query head " << g << " keeps its own token";
    EXPECT_LT(ComputedShare(per_head[g], chunk), 0.1) << "30 columns and 50 diagonals of 4000 keys";
  }
  const PrefillSelection shared = chunk.Select(config);
  int shared_kept = 0;
  for (int g = 0; g < kHeads; ++g) shared_kept += Holds(shared, 0, own[g]);
  EXPECT_EQ(shared_kept, 0) << "the group's mean ranks the 30 common tokens first";
}

// Each query head's selection is the one its rows alone would get (a one-head group), for every
// method; and with one head per group both forms agree.
TEST(SparsePrefill, PerQueryHeadSelectionIsEachHeadsOwnEstimate) {
  std::mt19937 rng(23);
  Chunk chunk(200, 3000, rng, 4);
  for (int64_t t : {9, 800, 2100}) {
    for (int c = 0; c < kHeadDim; ++c) chunk.keys[t * kHeadDim + c] = 0.f;
    chunk.keys[t * kHeadDim + (t % 4)] = 6.f;  // each planted token matches one head's dimension
  }
  for (int32_t i = 0; i < chunk.n_q; ++i)
    for (int g = 0; g < 4; ++g) chunk.q[(static_cast<size_t>(i) * 4 + g) * kHeadDim + g] += 2.f;
  for (PrefillMethod method :
       {PrefillMethod::kVerticalSlash, PrefillMethod::kBlockSparse, PrefillMethod::kXAttention}) {
    const PrefillSparsity config = SmallBudgets(method, 60, 60, 6, 0.6);
    const std::vector<PrefillSelection> per_head = chunk.SelectAll(config);
    for (int g = 0; g < 4; ++g) {
      const Chunk alone = chunk.Head(g);
      const std::vector<PrefillSelection> own = alone.SelectAll(config);
      ASSERT_EQ(own.size(), 1u);
      EXPECT_TRUE(SameSelection(per_head[g], own[0])) << PrefillMethodName(method) << " head " << g;
      EXPECT_TRUE(SameSelection(alone.Select(config), own[0])) << PrefillMethodName(method) << " head " << g;
    }
  }
}

TEST(SparsePrefill, ParsesAndValidatesSpecs) {
  StatusOr<PrefillSparsity> p = ParsePrefillSparsity("xattention:threshold=0.8:stride=16", "--sparse-prefill");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->method, PrefillMethod::kXAttention);
  EXPECT_EQ(p->block, 128);
  EXPECT_EQ(p->stride, 16);
  EXPECT_DOUBLE_EQ(p->threshold, 0.8);
  EXPECT_EQ(p->estimate_bits, 8);
  EXPECT_EQ(ParsePrefillSparsity("block_sparse", "--sparse-prefill")->estimate_bits, 32);
  EXPECT_EQ(ParsePrefillSparsity("vertical_slash:estimate_bits=32", "--sparse-prefill")->estimate_bits, 32);
  EXPECT_EQ(p->group_shared, 0);
  EXPECT_EQ(ParsePrefillSparsity("block_sparse:group_shared=1", "--sparse-prefill")->group_shared, 1);
  EXPECT_EQ(PrefillSparsitySummary(*ParsePrefillSparsity("block_sparse:group_shared=1", "--sparse-prefill")),
            "block_sparse block=64 top_blocks=100 estimate_bits=32 group_shared");
  EXPECT_EQ(ParsePrefillSparsity("vertical_slash", "--sparse-prefill")->two_pass, 0);
  EXPECT_EQ(PrefillSparsitySummary(*ParsePrefillSparsity("vertical_slash:two_pass=1", "--sparse-prefill")),
            "vertical_slash block=64 last_q=64 vertical=1000 slash=6096 two_pass estimate_bits=8");
  for (const char* bad :
       {"xattn", "vertical_slash:two_pass=2", "block_sparse:two_pass=1", "xattention:threshold=2", "xattention:stride=7", "block_sparse:vertical=3", "vertical_slash:slash=-1",
        "vertical_slash:estimate_bits=16", "xattention:group_shared=2",
        "vertical_slash:slash", "block_sparse:top_blocks=1.5", "block_sparse:block=0", "vertical_slash:last_q=x"}) {
    StatusOr<PrefillSparsity> parsed = ParsePrefillSparsity(bad, "--sparse-prefill");
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find("--sparse-prefill"), std::string::npos) << bad;
    }
  }
}

}  // namespace
}  // namespace kvsparse
