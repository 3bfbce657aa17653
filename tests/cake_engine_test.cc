// CAKE through the engine and the paged cache: after a prompt the layers hold budgets that
// differ and sum to the layers' total (the cascade trims earlier layers as later ones are
// measured, so no call ends above it), every head of a layer keeps the same count, pages follow
// the tokens, decode steps evict back to the budgets, a covering budget evicts nothing, and forks
// continue like the original.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/sparse_kv_controller.h"
#include "support/synth_model_file.h"

namespace kvsparse {
namespace {

class CakeEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::LoadSynthModelF32("tiny-gqa-untied", "cake_engine_tiny_gqa.gguf").release();
    ASSERT_NE(model_, nullptr);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static KvGeometry Geometry() {
    const ModelConfig& c = model_->config();
    return KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim};
  }
  static std::vector<int32_t> Prompt(int32_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) p[i] = (i * 131 + 7) % model_->config().n_vocab;
    return p;
  }
  static inline Model* model_ = nullptr;
};

// Live tokens of each layer (every head of a layer must agree); with one sequence in the cache,
// its pages must follow them.
std::vector<int32_t> LayerTokens(const PagedKvCache& cache, int seq, int n_layers, int n_heads, bool pages_follow = true) {
  std::vector<int32_t> out;
  for (int l = 0; l < n_layers; ++l) {
    const int32_t n = cache.NumHeadTokens(seq, l, 0);
    const int tables = cache.per_head(l) ? n_heads : 1;
    size_t pages = 0;
    for (int h = 0; h < n_heads; ++h) EXPECT_EQ(cache.NumHeadTokens(seq, l, h), n) << "layer " << l << " head " << h;
    for (int h = 0; h < tables; ++h) {
      pages += static_cast<size_t>((cache.NumHeadTokens(seq, l, h) + cache.page_size() - 1) / cache.page_size());
    }
    if (pages_follow) {
      EXPECT_EQ(cache.LayerAllocatedBytes(l), pages * cache.page_bytes(l)) << "layer " << l;
    }
    out.push_back(n);
  }
  return out;
}

// The `cake` method, and other methods under CAKE's allocation ("layer_budgets": "cake"): H2O
// (per KV head, evicting while decoding) and Random (one table per layer, no attention of its own).
TEST_F(CakeEngineTest, LayerBudgetsDifferAndSumToTheTotal) {
  const int n_layers = model_->config().n_layers, n_heads = model_->config().n_kv_heads;
  const int32_t budget = 48, prompt_tokens = 300;
  const std::vector<std::pair<std::string, std::vector<std::string>>> methods = {
      {"cake", {"window=8"}}, {"h2o", {"layer_budgets=cake"}}, {"random", {"layer_budgets=cake", "tau2=2"}}};
  for (const auto& [method, params] : methods) {
    for (const std::string eviction : {"prompt_end", "chunk"}) {
      SCOPED_TRACE(method + " " + eviction);
      auto config = KvSparsityConfigFromFlags(method, std::to_string(budget), "f16", n_layers);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
      config->prefill_chunk = 64;
      config->prefill_eviction = eviction == "chunk" ? PrefillEviction::kEveryChunk : PrefillEviction::kPromptEnd;
      auto kv = CreateSparseKv(Geometry(), *config, 2, 400);
      ASSERT_TRUE(kv.ok()) << kv.status().ToString();
      Engine engine(*model_, kv->cache.get(), 2, kv->controller.get());
      std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
      const std::vector<int32_t> prompt = Prompt(prompt_tokens);
      if (eviction == "chunk") {
        // Chunk by chunk: no call may end with more than the total cached.
        for (int32_t at = 0; at < prompt_tokens; at += 64) {
          const int32_t n = std::min(64, prompt_tokens - at);
          ASSERT_TRUE(engine.Forward(0, prompt.data() + at, n, at, logits.data()).ok());
          const auto live = LayerTokens(*kv->cache, 0, n_layers, n_heads);
          int64_t sum = 0;
          for (int32_t x : live) sum += x;
          EXPECT_LE(sum, static_cast<int64_t>(n_layers) * budget + (at == 0 ? n_layers * 64 : 0)) << "after " << at + n;
        }
      } else {
        ASSERT_TRUE(engine.Forward(0, prompt.data(), prompt_tokens, 0, logits.data()).ok());
      }
      const auto live = LayerTokens(*kv->cache, 0, n_layers, n_heads);
      int64_t sum = 0;
      for (int32_t x : live) sum += x;
      EXPECT_EQ(sum, static_cast<int64_t>(n_layers) * budget);
      EXPECT_GT(std::set<int32_t>(live.begin(), live.end()).size(), 1u) << "every layer got the same budget";
      for (int32_t x : live) EXPECT_LE(x, prompt_tokens);
      // Five decode steps stay within the evict_interval (16): every layer grows by 5.
      int32_t pos = prompt_tokens;
      for (int step = 0; step < 5; ++step) {
        const int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        ASSERT_TRUE(engine.Forward(0, &token, 1, pos++, logits.data()).ok());
      }
      const auto after = LayerTokens(*kv->cache, 0, n_layers, n_heads);
      for (int l = 0; l < n_layers; ++l) EXPECT_EQ(after[l], live[l] + 5) << "layer " << l;
      // A fork continues exactly like the original.
      ASSERT_TRUE(kv->controller->Fork(0, 1).ok());
      std::vector<float> a(logits.size()), b(logits.size());
      const int32_t next = 3;
      ASSERT_TRUE(engine.Forward(0, &next, 1, pos, a.data()).ok());
      ASSERT_TRUE(engine.Forward(1, &next, 1, pos, b.data()).ok());
      EXPECT_EQ(a, b);
      EXPECT_EQ(LayerTokens(*kv->cache, 0, n_layers, n_heads, false),
                LayerTokens(*kv->cache, 1, n_layers, n_heads, false));
      kv->cache->CheckInvariants();
    }
  }
}

// The reference evicts at every decode step back to the layer's budget (its share plus the
// window): with evict_interval 1 every layer holds exactly its post-prompt count through 512
// generated tokens; "decode_evict": false keeps every generated token instead.
TEST_F(CakeEngineTest, DecodeStaysAtTheLayerBudgets) {
  const int n_layers = model_->config().n_layers, n_heads = model_->config().n_kv_heads;
  const int32_t budget = 48, prompt_tokens = 300, steps = 512;
  for (const bool decode_evict : {true, false}) {
    SCOPED_TRACE(decode_evict ? "decode_evict" : "prompt only");
    auto config = KvSparsityConfigFromFlags("cake", std::to_string(budget), "f16", n_layers);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    const std::vector<std::string> params = {"window=8", decode_evict ? "decode_evict=true" : "decode_evict=false"};
    ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
    config->evict_interval = 1;
    auto kv = CreateSparseKv(Geometry(), *config, 1, prompt_tokens + steps + 16);
    ASSERT_TRUE(kv.ok()) << kv.status().ToString();
    Engine engine(*model_, kv->cache.get(), 2, kv->controller.get());
    std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
    const std::vector<int32_t> prompt = Prompt(prompt_tokens);
    ASSERT_TRUE(engine.Forward(0, prompt.data(), prompt_tokens, 0, logits.data()).ok());
    const auto live = LayerTokens(*kv->cache, 0, n_layers, n_heads);
    int64_t sum = 0;
    for (int32_t x : live) sum += x;
    ASSERT_EQ(sum, static_cast<int64_t>(n_layers) * budget);
    for (int32_t step = 1; step <= steps; ++step) {
      const int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ASSERT_TRUE(engine.Forward(0, &token, 1, prompt_tokens + step - 1, logits.data()).ok());
      if (decode_evict || step == steps) {
        const auto now = LayerTokens(*kv->cache, 0, n_layers, n_heads);
        for (int l = 0; l < n_layers; ++l) {
          ASSERT_EQ(now[l], live[l] + (decode_evict ? 0 : step)) << "layer " << l << " after step " << step;
        }
      }
    }
    kv->cache->CheckInvariants();
  }
}

// Observations per query head (kObserveQueryHeads: CAKE's own, and a tap's on request) are the
// unfolded rows: over prompt chunks (a gathering pass per head index of the groups) and decode
// steps (the raw scores), each KV head's group mean of them is the folded observation the policy
// sees, on shared and per-head layers.
TEST_F(CakeEngineTest, PerQueryHeadObservationsFoldToTheKvHeads) {
  const int n_layers = model_->config().n_layers;
  const int group = model_->config().n_heads / model_->config().n_kv_heads;
  ASSERT_GT(group, 1);
  for (const bool per_head : {false, true}) {
    std::vector<std::vector<float>> folded, unfolded;  // sum_all of each observation, in call order
    for (const bool query_heads : {false, true}) {
      auto config = KvSparsityConfigFromFlags("h2o", "1.0", "f32", n_layers);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      for (LayerKvConfig& layer : config->layers) layer.per_head = per_head;
      config->prefill_chunk = 48;
      auto kv = CreateSparseKv(Geometry(), *config, 1, 200);
      ASSERT_TRUE(kv.ok()) << kv.status().ToString();
      std::vector<std::vector<float>>& seen = query_heads ? unfolded : folded;
      std::mutex mutex;  // per-head layers' heads may call the tap concurrently
      kv->controller->SetObservationTap(
          [&](int, int layer, int kv_head, const AttentionObservation& obs) {
            ASSERT_EQ(obs.heads(), query_heads ? obs.n_kv_heads * group : obs.n_kv_heads);
            std::lock_guard<std::mutex> lock(mutex);
            std::vector<float> row = {static_cast<float>(layer), static_cast<float>(kv_head)};
            row.insert(row.end(), obs.sum_all, obs.sum_all + static_cast<size_t>(obs.heads()) * obs.n_tokens);
            seen.push_back(std::move(row));
          },
          query_heads);
      Engine engine(*model_, kv->cache.get(), 2, kv->controller.get());
      std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
      const std::vector<int32_t> prompt = Prompt(100);
      ASSERT_TRUE(engine.Forward(0, prompt.data(), 100, 0, logits.data()).ok());
      for (int32_t step = 0; step < 4; ++step) {
        const int32_t token = 5 + step;
        ASSERT_TRUE(engine.Forward(0, &token, 1, 100 + step, logits.data()).ok());
      }
    }
    auto order = [](std::vector<std::vector<float>>* v) {  // heads of a layer may arrive in any order
      std::stable_sort(v->begin(), v->end(), [](const auto& a, const auto& b) {
        return std::pair(a[0], a[1]) < std::pair(b[0], b[1]);
      });
    };
    order(&folded);
    order(&unfolded);
    ASSERT_EQ(folded.size(), unfolded.size());
    ASSERT_FALSE(folded.empty());
    for (size_t c = 0; c < folded.size(); ++c) {
      const std::vector<float>& f = folded[c];
      const std::vector<float>& u = unfolded[c];
      ASSERT_EQ((u.size() - 2), (f.size() - 2) * group) << "observation " << c;
      const size_t n_tokens_heads = f.size() - 2;  // [kv heads, n_tokens]
      for (size_t k = 0; k < n_tokens_heads; ++k) {
        // Row h of the fold, token t: the mean of query heads h·group .. of the unfolded rows.
        const size_t n_tokens = n_tokens_heads / (per_head ? 1 : model_->config().n_kv_heads);
        const size_t h = k / n_tokens, t = k % n_tokens;
        double mean = 0;
        for (int g = 0; g < group; ++g) mean += u[2 + (h * group + g) * n_tokens + t];
        mean /= group;
        ASSERT_NEAR(f[2 + k], mean, 1e-5 * (1 + std::fabs(mean))) << "observation " << c << " head " << h << " token " << t;
      }
    }
  }
}

TEST_F(CakeEngineTest, CoveringBudgetEvictsNothing) {
  const int n_layers = model_->config().n_layers, n_heads = model_->config().n_kv_heads;
  auto config = KvSparsityConfigFromFlags("cake", "1.0", "f16", n_layers);
  ASSERT_TRUE(config.ok());
  auto kv = CreateSparseKv(Geometry(), *config, 1, 300);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  Engine engine(*model_, kv->cache.get(), 2, kv->controller.get());
  std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
  const std::vector<int32_t> prompt = Prompt(200);
  ASSERT_TRUE(engine.Forward(0, prompt.data(), 200, 0, logits.data()).ok());
  for (int32_t n : LayerTokens(*kv->cache, 0, n_layers, n_heads)) EXPECT_EQ(n, 200);
}

TEST_F(CakeEngineTest, ConfigKeysAreChecked) {
  auto fine = ParseKvSparsityConfig(R"({"default": {"method": "cake", "budget": 0.2, "gamma": 0, "tau1": 1.6, "tau2": 0.4}})", 2);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->layers[0].params.kernel, 5);
  EXPECT_EQ(fine->layers[0].params.pooling, VotePooling::kAvg);
  EXPECT_TRUE(fine->layers[0].per_head);
  EXPECT_TRUE(fine->layers[0].params.decode_evict);
  EXPECT_EQ(fine->layers[0].params.excess, CakeExcess::kEqual);
  EXPECT_NE(KvSparsityConfigSummary(*fine).find("tau1=1.6"), std::string::npos) << KvSparsityConfigSummary(*fine);
  EXPECT_NE(KvSparsityConfigSummary(*fine).find("excess=equal"), std::string::npos) << KvSparsityConfigSummary(*fine);
  for (const auto& [bad, field] : std::vector<std::pair<const char*, const char*>>{
           {R"({"default": {"method": "cake", "budget": 0.2, "tau1": 0}})", "tau1"},
           {R"({"default": {"method": "cake", "budget": 0.2, "gamma": -1}})", "gamma"},
           {R"({"default": {"method": "cake", "budget": 0.2, "tau2": "x"}})", "tau2"},
           {R"({"default": {"method": "cake", "budget": 0.2, "excess": "most"}})", "excess"}}) {
    auto r = ParseKvSparsityConfig(bad, 2);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().ToString();
  }
}

}  // namespace
}  // namespace kvsparse
