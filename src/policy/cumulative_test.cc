// cumulative: the shared ranking against a brute-force recomputation, nesting of the layers'
// sets, the retention schedule, and the linked per-layer policies driven like the engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "policy/cumulative_ranking.h"
#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

using policy::CumulativeRanking;

std::vector<CumulativeRanking::Layer> Layers(const std::vector<double>& shares, const std::vector<float>& weights) {
  std::vector<CumulativeRanking::Layer> layers;
  for (size_t c = 0; c < shares.size(); ++c) layers.push_back({weights[c], KvBudget::Fraction(shares[c])});
  return layers;
}

// Plain recomputation of the importance: S <- decay^n S at each append, += w_l a_l per observation.
struct BruteForce {
  std::vector<double> score;
  void Append(int32_t n, double decay) {
    for (double& s : score) s *= std::pow(decay, n);
    score.resize(score.size() + static_cast<size_t>(n), 0.0);
  }
};

// Tokens layer c holds, by id.
std::vector<int32_t> HeldIds(const CumulativeRanking& r, int c) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < r.n_ids(); ++id)
    if (r.Held(c, id)) ids.push_back(id);
  return ids;
}

void ExpectNested(const CumulativeRanking& r) {
  for (int c = 1; c < r.n_layers(); ++c) {
    for (int32_t id = 0; id < r.n_ids(); ++id) {
      if (r.Held(c, id)) {
        ASSERT_TRUE(r.Held(c - 1, id)) << "token " << id << " held by layer " << c << " not " << c - 1;
      }
    }
  }
}

// Drives a ranking like the engine: per step append, each layer observes what it holds (mask
// mode: what it reads) and trims to its share. Checks scores after every step and, in mask mode,
// the held sets right after every re-rank against the brute-force top-k.
void RunRanking(CumulativeMode mode, int32_t rerank_period, double decay, uint32_t seed) {
  const std::vector<double> shares = {0.75, 0.5, 0.25};
  const std::vector<float> weights = {1.f, 1.5f, 2.f};
  CumulativeRanking r(Layers(shares, weights), decay, rerank_period, mode);
  BruteForce brute;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> att(0.01f, 1.f);
  int32_t since_rerank = 0;
  for (int step = 0; step < 120; ++step) {
    const int32_t n_new = step == 0 ? 40 : (step % 17 == 0 ? 5 : 1);  // a prompt, then decode with a few chunks
    const bool rerank = since_rerank >= rerank_period;  // due: Append re-ranks before the new tokens enter
    const int32_t n_before = r.n_ids();
    r.Append(n_new);
    if (rerank) since_rerank = 0;
    since_rerank += n_new;
    if (rerank && mode == CumulativeMode::kMask) {
      // Nested prefixes of one order: layer k holds exactly the best-scored tokens (the newest
      // always), and the new ones.
      std::vector<int32_t> order(static_cast<size_t>(n_before));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return brute.score[a] != brute.score[b] ? brute.score[a] > brute.score[b] : a > b;
      });
      int32_t keep = n_before;
      for (int k = 0; k < r.n_layers(); ++k) {
        keep = std::min(keep, ResolveBudget(KvBudget::Fraction(shares[k]), n_before));
        std::set<int32_t> expected(order.begin(), order.begin() + keep);
        expected.insert(n_before - 1);
        for (int32_t id = n_before; id < r.n_ids(); ++id) expected.insert(id);
        const std::vector<int32_t> held = HeldIds(r, k);
        EXPECT_EQ(std::set<int32_t>(held.begin(), held.end()), expected) << "step " << step << " layer " << k;
      }
    }
    brute.Append(n_new, decay);
    for (int c = 0; c < r.n_layers(); ++c) {
      const std::vector<int32_t> ids = HeldIds(r, c);
      std::vector<float> mass(ids.size());
      for (float& m : mass) m = att(rng);
      r.AddAttention(c, ids.data(), mass.data(), static_cast<int32_t>(ids.size()));
      for (size_t i = 0; i < ids.size(); ++i) brute.score[static_cast<size_t>(ids[i])] += weights[c] * mass[i];
      const int32_t own = ResolveBudget(KvBudget::Fraction(shares[c]), r.n_present());
      const int32_t before = r.HeldBy(c);
      r.Trim(c, own);
      EXPECT_EQ(r.HeldBy(c), std::min(own, before)) << "step " << step << " layer " << c;
      ASSERT_NO_FATAL_FAILURE(ExpectNested(r));
      ASSERT_TRUE(r.Held(c, r.n_ids() - 1)) << "the newest token is always kept";
    }
    for (int32_t id = 0; id < r.n_ids(); ++id)
      ASSERT_NEAR(r.Score(id), brute.score[static_cast<size_t>(id)], 1e-4 * (1.0 + brute.score[static_cast<size_t>(id)]))
          << "step " << step << " token " << id;
  }
}

TEST(CumulativeRankingTest, EvictModeMatchesBruteForce) {
  for (int32_t period : {1, 4, 16}) RunRanking(CumulativeMode::kEvict, period, 0.99, 7u + period);
}

TEST(CumulativeRankingTest, MaskModeMatchesBruteForce) {
  for (int32_t period : {1, 4, 16}) RunRanking(CumulativeMode::kMask, period, 0.95, 11u + period);
}

TEST(CumulativeRankingTest, LongDecayRescalesWithoutLosingOrder) {
  // 1/g passes the rescale threshold (0.9^400 ~ 5e-19): scores stay equal to the plain sums.
  RunRanking(CumulativeMode::kEvict, 8, 0.9, 3u);
}

TEST(CumulativeRankingTest, DropsTheLowestRankedWithinAPeriod) {
  // One layer: with scores 0..8 (token i gets i), trimming to 6 drops tokens 0-3; the newest
  // token (9) is kept however low its score.
  CumulativeRanking r(Layers({1.0}, {1.f}), 1.0, 10, CumulativeMode::kEvict);
  r.Append(10);
  std::vector<int32_t> ids(10);
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<float> mass = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  mass[9] = 0;
  r.AddAttention(0, ids.data(), mass.data(), 10);
  EXPECT_EQ(r.Trim(0, 6), 4);
  EXPECT_EQ(HeldIds(r, 0), (std::vector<int32_t>{4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(r.TakeRerankWork().first, 0);
  r.Append(1);  // 11 tokens appended since the start >= the period of 10: a re-rank first
  const auto [reranks, seconds] = r.TakeRerankWork();
  EXPECT_EQ(reranks, 1);
  EXPECT_GE(seconds, 0.0);
  EXPECT_EQ(r.TakeRerankWork().first, 0);
}

TEST(CumulativeScheduleTest, SharesAverageToTheBudgetAndDecreaseWithDepth) {
  for (RetentionSchedule schedule : {RetentionSchedule::kLinear, RetentionSchedule::kCosine}) {
    KvMethodParams p = DefaultMethodParams(KvMethod::kCumulative);
    p.schedule = schedule;
    const int n_layers = 22;
    double sum = 0, previous = 2;
    for (int l = 0; l < n_layers; ++l) {
      const KvBudget b = CumulativeLayerBudget(KvBudget::Fraction(0.25), p, l, n_layers);
      ASSERT_TRUE(b.is_fraction());
      EXPECT_LE(b.fraction, previous);
      previous = b.fraction;
      sum += b.fraction;
    }
    EXPECT_NEAR(sum / n_layers, 0.25, 1e-9);
    EXPECT_NEAR(CumulativeLayerBudget(KvBudget::Fraction(0.25), p, 0, n_layers).fraction, 0.375, 1e-9);
    EXPECT_NEAR(CumulativeLayerBudget(KvBudget::Fraction(0.25), p, n_layers - 1, n_layers).fraction, 0.125, 1e-9);
  }
  KvMethodParams none = DefaultMethodParams(KvMethod::kCumulative);
  none.schedule = RetentionSchedule::kNone;
  EXPECT_EQ(CumulativeLayerBudget(KvBudget::Tokens(100), none, 3, 8).tokens, 100);
  KvMethodParams linear = DefaultMethodParams(KvMethod::kCumulative);
  EXPECT_EQ(CumulativeLayerBudget(KvBudget::Tokens(100), linear, 0, 3).tokens, 150);
  // A mean of 0.8 at spread 3 would give the first layer 1.2: the spread drops to 1 / (2 0.8 - 1)
  // = 5/3, the first layer keeps everything and the layers still average 0.8.
  EXPECT_NEAR(CumulativeSpread(KvBudget::Fraction(0.8), linear), 5.0 / 3.0, 1e-12);
  EXPECT_EQ(CumulativeSpread(KvBudget::Fraction(0.6), linear), 3.0);
  EXPECT_EQ(CumulativeSpread(KvBudget::Tokens(100), linear), 3.0);
  for (double mean : {0.7, 0.8, 0.95, 1.0}) {
    const int n_layers = 22;
    double sum = 0;
    for (int l = 0; l < n_layers; ++l) {
      const double share = CumulativeLayerBudget(KvBudget::Fraction(mean), linear, l, n_layers).fraction;
      EXPECT_LE(share, 1.0 + 1e-12);
      sum += share;
    }
    EXPECT_NEAR(sum / n_layers, mean, 1e-9) << mean;
    EXPECT_NEAR(CumulativeLayerBudget(KvBudget::Fraction(mean), linear, 0, n_layers).fraction, 1.0, 1e-9);
  }
}

// The layers' policies of one sequence, linked, each over a stand-in cache of live ids.
class LinkedLayers {
 public:
  LinkedLayers(const LayerKvConfig& config, int n_layers) {
    for (int l = 0; l < n_layers; ++l) layers_.push_back(std::make_unique<Harness>(config, l, n_layers));
    Link();
  }
  void Link() {
    std::vector<KvPolicy*> policies;
    for (auto& h : layers_) policies.push_back(&h->policy());
    LinkSequencePolicies(policies);
  }
  Harness& layer(int l) { return *layers_[static_cast<size_t>(l)]; }
  int n_layers() const { return static_cast<int>(layers_.size()); }

  // One forward call: append, observe random attention over each layer's live tokens, evict
  // where the target says so (evict_interval 1 on decode steps).
  void Step(int32_t n_new, int32_t n_seen, std::mt19937* rng) {
    std::uniform_real_distribution<float> att(0.01f, 1.f);
    for (int l = 0; l < n_layers(); ++l) {
      Harness& h = layer(l);
      h.Append(n_new);
      std::vector<float> scores(static_cast<size_t>(h.n_live()));
      for (float& s : scores) s = att(*rng);
      h.Observe(SameForAllHeads(scores, 2, n_new));
      const int32_t target = h.policy().EvictionTarget(
          h.n_live(), n_seen, n_new > 1 ? EvictionPoint::kPromptEnd : EvictionPoint::kDecodeStep, 1);
      if (target < h.n_live()) h.Evict(target);
    }
  }

 private:
  std::vector<std::unique_ptr<Harness>> layers_;
};

LayerKvConfig CumulativeLayer(double mean_share) {
  return Layer(KvMethod::kCumulative, KvBudget::Fraction(mean_share));
}

TEST(CumulativePolicyTest, LinkedLayersKeepNestedSharesOfOneRanking) {
  LinkedLayers seq(CumulativeLayer(0.25), 4);
  std::mt19937 rng(5);
  int32_t n_seen = 0;
  for (int step = 0; step < 300; ++step) {
    const int32_t n_new = step == 0 ? 64 : 1;
    n_seen += n_new;
    seq.Step(n_new, n_seen, &rng);
    for (int l = 0; l < seq.n_layers(); ++l) {
      const KvBudget share = CumulativeLayerBudget(KvBudget::Fraction(0.25), DefaultMethodParams(KvMethod::kCumulative),
                                                   l, seq.n_layers());
      // Each layer holds at most its share after its eviction, and the newest token.
      EXPECT_LE(seq.layer(l).n_live(), ResolveBudget(share, n_seen)) << "step " << step << " layer " << l;
      EXPECT_EQ(seq.layer(l).live().back(), n_seen - 1);
      if (l == 0) continue;
      const std::vector<int32_t>& deep = seq.layer(l).live();
      const std::vector<int32_t>& shallow = seq.layer(l - 1).live();
      ASSERT_TRUE(std::includes(shallow.begin(), shallow.end(), deep.begin(), deep.end()))
          << "step " << step << ": layer " << l << " keeps a token layer " << l - 1 << " dropped";
    }
  }
  // Shares 0.375 .. 0.125: the layers hold about 3:1.
  EXPECT_GT(seq.layer(0).n_live(), 2 * seq.layer(3).n_live());
}

TEST(CumulativePolicyTest, CloneThenLinkContinuesLikeTheOriginal) {
  LinkedLayers a(CumulativeLayer(0.3), 3);
  std::mt19937 rng(9);
  int32_t n_seen = 0;
  for (int step = 0; step < 40; ++step) a.Step(step == 0 ? 32 : 1, n_seen += step == 0 ? 32 : 1, &rng);
  // A fork: every layer cloned, then linked again; both continue with the same inputs.
  std::vector<std::unique_ptr<KvPolicy>> clones;
  std::vector<KvPolicy*> clone_ptrs;
  for (int l = 0; l < a.n_layers(); ++l) {
    clones.push_back(a.layer(l).policy().Clone());
    clone_ptrs.push_back(clones.back().get());
  }
  LinkSequencePolicies(clone_ptrs);
  // Drive the clones by hand against copies of the live lists, step for step with the original.
  std::vector<std::vector<int32_t>> live(a.n_layers());
  for (int l = 0; l < a.n_layers(); ++l) live[l] = a.layer(l).live();
  for (int step = 0; step < 60; ++step) {
    ++n_seen;
    std::mt19937 rng_copy = rng;
    a.Step(1, n_seen, &rng);
    std::uniform_real_distribution<float> att(0.01f, 1.f);
    for (int l = 0; l < a.n_layers(); ++l) {
      KvPolicy& p = *clones[l];
      live[l].push_back(n_seen - 1);
      p.OnAppend(1);
      std::vector<float> scores(live[l].size());
      for (float& s : scores) s = att(rng_copy);
      p.Observe(SameForAllHeads(scores, 2, 1).view());
      const int32_t n_live = static_cast<int32_t>(live[l].size());
      const int32_t target = p.EvictionTarget(n_live, n_seen, EvictionPoint::kDecodeStep, 1);
      if (target < n_live) {
        SelectionContext ctx;
        ctx.layer = l;
        ctx.n_live = n_live;
        ctx.target = target;
        ctx.positions = live[l].data();
        std::vector<uint8_t> keep;
        p.SelectKeep(ctx, &keep);
        std::vector<int32_t> kept;
        for (size_t i = 0; i < keep.size(); ++i)
          if (keep[i]) kept.push_back(live[l][i]);
        live[l] = kept;
        p.OnEvict(keep);
      }
      ASSERT_EQ(live[l], a.layer(l).live()) << "step " << step << " layer " << l;
    }
  }
}

TEST(CumulativePolicyTest, RemovedTokensLeaveEveryLayer) {
  LayerKvConfig whole = CumulativeLayer(1.0);
  whole.params.schedule = RetentionSchedule::kNone;  // every layer keeps everything
  LinkedLayers seq(whole, 2);
  std::mt19937 rng(2);
  seq.Step(20, 20, &rng);
  // RemoveRange: every layer drops live indices 5..9 with one mask each.
  for (int l = 0; l < 2; ++l) {
    std::vector<uint8_t> keep(20, 1);
    for (int i = 5; i < 10; ++i) keep[i] = 0;
    seq.layer(l).policy().OnEvict(keep);
  }
  // The layers keep working on the 15 tokens left (a budget of all of them evicts nothing).
  for (int l = 0; l < 2; ++l) {
    Harness& h = seq.layer(l);
    std::vector<float> scores(15, 0.5f);
    h.policy().OnAppend(1);
    scores.push_back(0.5f);
    h.policy().Observe(SameForAllHeads(scores).view());
    EXPECT_EQ(h.policy().EvictionTarget(16, 16, EvictionPoint::kDecodeStep, 1), 16);
  }
}

TEST(CumulativeConfigTest, ParsesItsKeysAndRejectsMismatchedLayers) {
  const char* good = R"({"default": {"method": "cumulative", "budget": 0.25, "decay": 0.9, "rerank_period": 8,
                                     "mode": "mask", "schedule": "cosine", "spread": 2, "layer_weight": 1.5}})";
  auto config = ParseKvSparsityConfig(good, 4);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const KvMethodParams& p = config->layers[2].params;
  EXPECT_EQ(p.decay, 0.9);
  EXPECT_EQ(p.rerank_period, 8);
  EXPECT_EQ(p.mode, CumulativeMode::kMask);
  EXPECT_EQ(p.schedule, RetentionSchedule::kCosine);
  EXPECT_EQ(p.spread, 2.0);
  EXPECT_EQ(p.layer_weight, 1.5);

  auto mismatch = ParseKvSparsityConfig(
      R"({"default": {"method": "cumulative", "budget": 0.25}, "layers": [{"layers": "2-3", "rerank_period": 4}]})", 4);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("rerank_period"), std::string::npos) << mismatch.status().ToString();
  EXPECT_NE(mismatch.status().message().find("layer 2"), std::string::npos) << mismatch.status().ToString();

  for (const char* bad : {R"({"default": {"method": "cumulative", "budget": 0.2, "decay": 0}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "rerank_period": 0}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "spread": 0.5}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "mode": "drop"}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "per_head": true, "mode": "mask"}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "head_budgets": "adaptive"}})",
                          R"({"default": {"method": "cumulative", "budget": 0.2, "per_head": true, "floor": 2}})"}) {
    EXPECT_FALSE(ParseKvSparsityConfig(bad, 4).ok()) << bad;
  }
  // Per-head rankings, with AdaKV's split of each layer's budget over its heads.
  auto adaptive = ParseKvSparsityConfig(
      R"({"default": {"method": "cumulative", "budget": 0.2, "per_head": true, "head_budgets": "adaptive", "floor": 0.3}})",
      4);
  ASSERT_TRUE(adaptive.ok()) << adaptive.status().ToString();
  EXPECT_TRUE(adaptive->layers[3].per_head);
  EXPECT_EQ(adaptive->layers[3].params.head_budgets, HeadBudgets::kAdaptive);
  EXPECT_EQ(adaptive->layers[3].params.floor, 0.3);
}

}  // namespace
}  // namespace kvsparse::policy_test
