// cumulative through the engine and the paged cache:
// - a retention of 100% (schedule "none") is bit-identical to Full, in evict and mask mode;
// - evict mode: after every call the layers' cached positions are nested (a token a deep layer
//   caches is cached by every shallower one), each layer holds at most its share, its pages
//   shrink with it, and the re-ranks are counted apart;
// - mask mode keeps every token, reads about the layer's share per decode step, never evicts;
// - per_head: each KV head nests across layers on its own ranking; uniform heads hold at most the
//   layer's share each, adaptive heads (AdaKV's split) at most H shares together, unevenly, and a
//   floor of 1 is the uniform split exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/model.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/synth.h"
#include "support/shared_data.h"
#include "support/synth_model_file.h"

namespace kvsparse {
namespace {

constexpr int kThreads = 2;

KvGeometry Geometry(const Model& m) { return KvGeometry{m.config().n_layers, m.config().n_kv_heads, m.config().head_dim}; }

class CumulativeEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // 8 query heads over 2 kv heads
    model_ = testing::LoadSynthModelF32("tiny-gqa-untied", "cumulative_engine_tiny_gqa.gguf").release();
    ASSERT_NE(model_, nullptr);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static KvSparsityConfig Config(const std::string& method, const std::string& budget, const std::string& kv_type,
                                 CumulativeMode mode = CumulativeMode::kEvict,
                                 RetentionSchedule schedule = RetentionSchedule::kLinear) {
    auto config = KvSparsityConfigFromFlags(method, budget, kv_type, model_->config().n_layers);
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    config->prefill_chunk = 32;
    for (LayerKvConfig& l : config->layers) {
      l.params.mode = mode;
      l.params.schedule = schedule;
    }
    return *config;
  }
  // The prompt (in chunks of the config's prefill_chunk), then n_decode greedy steps; the logits
  // of every call. `check(n_seen)` runs after every call.
  template <typename Check>
  static std::vector<std::vector<float>> Run(SparseKvSetup& kv, int32_t prompt_tokens, int n_decode, Check check) {
    Engine engine(*model_, kv.cache.get(), kThreads, kv.controller.get());
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
    for (int32_t i = 0; i < prompt_tokens; ++i) prompt[i] = (i * 131 + 7) % 512;
    std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
    std::vector<std::vector<float>> out;
    Status s = engine.Forward(0, prompt.data(), prompt_tokens, 0, logits.data());
    EXPECT_TRUE(s.ok()) << s.ToString();
    check(prompt_tokens);
    out.push_back(logits);
    int32_t pos = prompt_tokens;
    for (int step = 0; step < n_decode; ++step) {
      const int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      Status s = engine.Forward(0, &token, 1, pos++, logits.data());
      EXPECT_TRUE(s.ok()) << s.ToString();
      if (!s.ok()) break;
      check(pos);
      out.push_back(logits);
    }
    return out;
  }
  // The cached positions of sequence 0's layer (kv_head >= 0: that head's table of a per-head layer).
  static std::vector<int32_t> Positions(const PagedKvCache& cache, int layer, int kv_head = -1) {
    std::vector<KvSpan> spans;
    if (kv_head >= 0) {
      cache.HeadSpans(0, layer, kv_head, &spans);
    } else {
      cache.Spans(0, layer, &spans);
    }
    std::vector<int32_t> positions;
    for (const KvSpan& s : spans) positions.insert(positions.end(), s.positions, s.positions + s.n);
    return positions;
  }
  static inline Model* model_ = nullptr;
};

TEST_F(CumulativeEngineTest, WholeRetentionIsBitIdenticalToFull) {
  const int32_t prompt = 70;
  const int n_decode = 40;
  for (CumulativeMode mode : {CumulativeMode::kEvict, CumulativeMode::kMask}) {
    for (const std::string kv_type : {"f32", "int8"}) {
      auto full = CreateSparseKv(Geometry(*model_), Config("full", "", kv_type), 1, prompt + n_decode + 1);
      auto whole = CreateSparseKv(Geometry(*model_),
                                  Config("cumulative", "1.0", kv_type, mode, RetentionSchedule::kNone), 1,
                                  prompt + n_decode + 1);
      ASSERT_TRUE(full.ok() && whole.ok());
      const auto want = Run(*full, prompt, n_decode, [](int32_t) {});
      const auto got = Run(*whole, prompt, n_decode, [](int32_t) {});
      ASSERT_EQ(got.size(), want.size());
      for (size_t call = 0; call < want.size(); ++call)
        ASSERT_EQ(std::memcmp(got[call].data(), want[call].data(), want[call].size() * sizeof(float)), 0)
            << CumulativeModeName(mode) << " " << kv_type << ": logits differ after call " << call;
      for (const SparseKvLayerStats& s : whole->controller->layer_stats()) {
        EXPECT_EQ(s.evicted_tokens, 0);
        EXPECT_EQ(s.selected_tokens, s.selectable_tokens);
      }
    }
  }
}

TEST_F(CumulativeEngineTest, EvictModeKeepsNestedSharesAndFreesPages) {
  const int n_layers = model_->config().n_layers;
  for (const std::string kv_type : {"f16", "int8_kivi"}) {
    KvSparsityConfig config = Config("cumulative", "0.25", kv_type);
    auto kv = CreateSparseKv(Geometry(*model_), config, 1, 400);
    ASSERT_TRUE(kv.ok()) << kv.status().ToString();
    auto check = [&](int32_t n_seen) {
      for (int layer = 0; layer < n_layers; ++layer) {
        const std::vector<int32_t> here = Positions(*kv->cache, layer);
        const int32_t share =
            ResolveBudget(CumulativeLayerBudget(config.layers[layer].budget, config.layers[layer].params, layer,
                                                n_layers),
                          n_seen);
        // Decode steps let a layer grow to its share + evict_interval - 1 before it evicts.
        const int32_t slack = n_seen > 256 ? config.evict_interval - 1 : 0;
        EXPECT_LE(static_cast<int32_t>(here.size()), share + slack) << kv_type << " layer " << layer << " at " << n_seen;
        EXPECT_EQ(here.back(), n_seen - 1) << "the newest token is kept";
        if (layer == 0) continue;
        const std::vector<int32_t> above = Positions(*kv->cache, layer - 1);
        EXPECT_TRUE(std::includes(above.begin(), above.end(), here.begin(), here.end()))
            << kv_type << ": layer " << layer << " caches a token layer " << layer - 1 << " freed, at " << n_seen;
      }
    };
    Run(*kv, 256, 64, check);
    kv->cache->CheckInvariants();
    // Pages follow the tokens: the last layer (share 1/8) allocates well under the first (3/8);
    // whole pages and the decode slack of evict_interval keep it above a third.
    const size_t first = kv->cache->LayerAllocatedBytes(0), last = kv->cache->LayerAllocatedBytes(n_layers - 1);
    EXPECT_LT(last * 3, first * 2) << kv_type << ": first layer " << first << " B, last " << last << " B";
    int64_t reranks = 0;
    for (const SparseKvLayerStats& s : kv->controller->layer_stats()) reranks += s.reranks;
    // A re-rank runs at the first append after 16 tokens were appended since the last: before
    // prompt chunks 2-8 of 32 tokens (7), the first decode step (1), then every 16 steps (3).
    EXPECT_EQ(reranks, 7 + 1 + 3) << kv_type;
    EXPECT_NE(kv->controller->FormatStats().find("global re-ranks"), std::string::npos);
  }
}

TEST_F(CumulativeEngineTest, PerHeadRankingsNestAndAdaptiveHeadsSplitTheLayerBudget) {
  const int n_layers = model_->config().n_layers, n_heads = model_->config().n_kv_heads;
  std::vector<std::vector<float>> uniform_logits;
  for (const double floor : {-1.0, 0.5, 1.0}) {  // -1: uniform head budgets
    const bool adaptive = floor >= 0;
    KvSparsityConfig config = Config("cumulative", "0.25", "f16");
    config.evict_interval = 1;
    for (LayerKvConfig& l : config.layers) {
      l.per_head = true;
      if (adaptive) l.params.head_budgets = HeadBudgets::kAdaptive, l.params.floor = floor;
    }
    ASSERT_TRUE(ValidateKvSparsityConfig(config).ok());
    auto kv = CreateSparseKv(Geometry(*model_), config, 1, 400);
    ASSERT_TRUE(kv.ok()) << kv.status().ToString();
    bool uneven = false;
    auto check = [&](int32_t n_seen) {
      for (int layer = 0; layer < n_layers; ++layer) {
        const int32_t share = ResolveBudget(
            CumulativeLayerBudget(config.layers[layer].budget, config.layers[layer].params, layer, n_layers), n_seen);
        int32_t total = 0;
        size_t pages = 0;
        for (int h = 0; h < n_heads; ++h) {
          const std::vector<int32_t> here = Positions(*kv->cache, layer, h);
          const auto n = static_cast<int32_t>(here.size());
          total += n;
          pages += static_cast<size_t>((n + kv->cache->page_size() - 1) / kv->cache->page_size());
          if (!adaptive || floor == 1.0) {
            EXPECT_LE(n, share) << "floor " << floor << " layer " << layer << " head " << h << " at " << n_seen;
          }
          uneven = uneven || n != kv->cache->NumHeadTokens(0, layer, 0);
          EXPECT_EQ(here.back(), n_seen - 1) << "the newest token is kept";
          if (layer == 0) continue;
          const std::vector<int32_t> above = Positions(*kv->cache, layer - 1, h);
          EXPECT_TRUE(std::includes(above.begin(), above.end(), here.begin(), here.end()))
              << "floor " << floor << ": layer " << layer << " head " << h << " caches a token its head in layer "
              << layer - 1 << " freed, at " << n_seen;
        }
        // Decode steps: the layer waits until it is evict_interval tokens a head over (as AdaKV's).
        const int32_t slack = adaptive && n_seen > 256 ? n_heads * config.evict_interval - 1 : 0;
        EXPECT_LE(total, share * n_heads + slack) << "floor " << floor << " layer " << layer << " at " << n_seen;
        EXPECT_EQ(kv->cache->LayerAllocatedBytes(layer), pages * kv->cache->page_bytes(layer)) << "pages follow";
      }
    };
    const auto logits = Run(*kv, 256, 48, check);
    kv->cache->CheckInvariants();
    if (floor == 0.5) {
      EXPECT_TRUE(uneven) << "adaptive heads never held different counts";
    }
    if (!adaptive) uniform_logits = logits;
    if (floor == 1.0) {
      ASSERT_EQ(logits.size(), uniform_logits.size());
      for (size_t call = 0; call < logits.size(); ++call)
        ASSERT_EQ(std::memcmp(logits[call].data(), uniform_logits[call].data(), logits[call].size() * sizeof(float)),
                  0)
            << "a floor of 1 is the uniform split; logits differ after call " << call;
    }
  }
  // The cumulative layers share their ranking's layout: per_head must agree.
  KvSparsityConfig mixed = Config("cumulative", "0.25", "f16");
  mixed.layers[1].per_head = true;
  const Status status = ValidateKvSparsityConfig(mixed);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("per_head"), std::string::npos) << status.ToString();
}

TEST_F(CumulativeEngineTest, MaskModeReadsItsShareAndKeepsEveryToken) {
  const int n_layers = model_->config().n_layers;
  KvSparsityConfig config = Config("cumulative", "0.25", "f16", CumulativeMode::kMask);
  auto kv = CreateSparseKv(Geometry(*model_), config, 1, 400);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  Run(*kv, 256, 64, [&](int32_t n_seen) {
    for (int layer = 0; layer < n_layers; ++layer)
      EXPECT_EQ(static_cast<int32_t>(Positions(*kv->cache, layer).size()), n_seen) << "mask mode keeps every token";
  });
  for (int layer = 0; layer < n_layers; ++layer) {
    const SparseKvLayerStats& s = kv->controller->layer_stats()[layer];
    EXPECT_EQ(s.evictions, 0);
    EXPECT_EQ(s.span_selections, 64);
    const double share = CumulativeLayerBudget(config.layers[layer].budget, config.layers[layer].params, layer,
                                               n_layers)
                             .fraction;
    const double read = static_cast<double>(s.selected_tokens) / static_cast<double>(s.selectable_tokens);
    EXPECT_NEAR(read, share, 0.02) << "layer " << layer;
  }
}

}  // namespace
}  // namespace kvsparse
