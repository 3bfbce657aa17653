// AdaKV through the engine and the paged cache: per-head H2O and SnapKV layers with
// "head_budgets": "adaptive" keep H·B tokens per layer after each eviction, split unevenly over
// the heads, and every head table allocates exactly the pages its tokens fill (the pages freed
// are the tokens dropped), under AdaKV's own rule and kvpress's; a guaranteed share of 1 (alpha or
// floor) is the uniform split. On the multi-head retrieval
// instrument, where the retrieval head needs more than a uniform share, adaptive budgets answer
// every multi-query sample and the uniform split does not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "kvsparse/bench_tasks.h"
#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/model.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/retrieval_model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/synth.h"
#include "support/retrieval_model_file.h"
#include "support/shared_data.h"
#include "support/synth_model_file.h"

namespace kvsparse {
namespace {

class AdaKvEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // 8 query heads over 2 kv heads
    model_ = testing::LoadSynthModelF32("tiny-gqa-untied", "adakv_engine_tiny_gqa.gguf").release();
    ASSERT_NE(model_, nullptr);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static inline Model* model_ = nullptr;
};

TEST_F(AdaKvEngineTest, AdaptiveHeadsKeepTheLayerBudgetUnevenlyAndFreeTheirPages) {
  const int n_layers = model_->config().n_layers, n_heads = model_->config().n_kv_heads;
  const int32_t budget = 48, prompt_tokens = 200, n_decode = 40;
  for (const std::string method : {"h2o", "snapkv"}) {
    // (rule, guaranteed share): kvpress's floor or the reference's alpha; 1 is the uniform split.
    for (const auto& rule_floor : {std::pair{AdaptiveRule::kReference, 0.2}, std::pair{AdaptiveRule::kReference, 1.0},
                                   std::pair{AdaptiveRule::kKvpress, 0.5}, std::pair{AdaptiveRule::kKvpress, 1.0}}) {
      const AdaptiveRule rule = rule_floor.first;  // (not a structured binding: the lambda below captures them)
      const double floor = rule_floor.second;
      auto config = KvSparsityConfigFromFlags(method, std::to_string(budget), "f16", n_layers);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      config->evict_interval = 1;
      config->prefill_chunk = 64;
      for (LayerKvConfig& l : config->layers) {
        l.per_head = true;
        l.params.head_budgets = HeadBudgets::kAdaptive;
        l.params.adaptive_rule = rule;
        (rule == AdaptiveRule::kReference ? l.params.alpha : l.params.floor) = floor;
        l.params.decode_evict = true;  // SnapKV: evict while decoding too
      }
      auto kv = CreateSparseKv(KvGeometry{n_layers, n_heads, model_->config().head_dim}, *config, 1, 400);
      ASSERT_TRUE(kv.ok()) << kv.status().ToString();
      Engine engine(*model_, kv->cache.get(), 2, kv->controller.get());
      std::vector<int32_t> prompt(prompt_tokens);
      for (int32_t i = 0; i < prompt_tokens; ++i) prompt[i] = (i * 131 + 7) % 512;
      std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
      bool uneven = false;
      auto check = [&](const std::string& when) {
        for (int layer = 0; layer < n_layers; ++layer) {
          int32_t total = 0;
          std::vector<int32_t> per_head;
          size_t pages = 0;
          for (int h = 0; h < n_heads; ++h) {
            const int32_t n = kv->cache->NumHeadTokens(0, layer, h);
            per_head.push_back(n);
            total += n;
            pages += static_cast<size_t>((n + kv->cache->page_size() - 1) / kv->cache->page_size());
          }
          EXPECT_EQ(total, n_heads * budget) << method << " " << AdaptiveRuleName(rule) << " " << floor << " layer "
                                              << layer << " " << when;
          EXPECT_EQ(kv->cache->LayerAllocatedBytes(layer), pages * kv->cache->page_bytes(layer))
              << "pages follow each head's tokens, layer " << layer << " " << when;
          uneven = uneven || per_head.front() != per_head.back();
          if (floor == 1.0) {
            EXPECT_EQ(per_head.front(), per_head.back()) << "a guaranteed share of 1 is the uniform split";
          }
        }
      };
      ASSERT_TRUE(engine.Forward(0, prompt.data(), prompt_tokens, 0, logits.data()).ok());
      check("after the prompt");
      int32_t pos = prompt_tokens;
      for (int step = 0; step < n_decode; ++step) {
        const int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        ASSERT_TRUE(engine.Forward(0, &token, 1, pos++, logits.data()).ok());
        check("at decode step " + std::to_string(step));
      }
      kv->cache->CheckInvariants();
      if (floor < 1.0) {
        EXPECT_TRUE(uneven) << method << ": the heads' budgets never differed";
      }
    }
  }
}

TEST_F(AdaKvEngineTest, ConfigNeedsPerHeadLayers) {
  auto shared = ParseKvSparsityConfig(
      R"({"default": {"method": "snapkv", "budget": 64, "per_head": false, "head_budgets": "adaptive"}})", 2);
  ASSERT_FALSE(shared.ok());
  EXPECT_NE(shared.status().message().find("per_head"), std::string::npos) << shared.status().ToString();
  EXPECT_FALSE(ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 64, "floor": 1.5}})", 2).ok());
  EXPECT_FALSE(ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 64, "alpha": -0.1}})", 2).ok());
  EXPECT_FALSE(
      ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 64, "adaptive_rule": "kv-press"}})", 2).ok());
  auto fine = ParseKvSparsityConfig(
      R"({"default": {"method": "pyramidkv", "budget": 0.2, "head_budgets": "adaptive", "adaptive_rule": "kvpress",
                      "floor": 0.2}})",
      2);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->layers[1].params.head_budgets, HeadBudgets::kAdaptive);
  EXPECT_EQ(fine->layers[1].params.adaptive_rule, AdaptiveRule::kKvpress);
  EXPECT_TRUE(fine->layers[1].per_head);
  EXPECT_NE(KvSparsityConfigSummary(*fine).find("head_budgets=adaptive rule=kvpress floor=0.2"), std::string::npos);
  // The default rule is AdaKV's own, alpha 0.2.
  auto reference =
      ParseKvSparsityConfig(R"({"default": {"method": "snapkv", "budget": 0.2, "head_budgets": "adaptive"}})", 2);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  EXPECT_EQ(reference->layers[1].params.adaptive_rule, AdaptiveRule::kReference);
  EXPECT_NE(KvSparsityConfigSummary(*reference).find("head_budgets=adaptive alpha=0.2"), std::string::npos);
}

// niah_multiquery at 512 tokens on the 2-layer multi-head instrument: the question asks 4 needles
// of 3 value tokens, so SnapKV's window votes for 4 pooled clusters of about 7 tokens, more than a
// uniform 5% share (25 a head, half of it the window) holds. The other heads of the last layer
// (local and previous-token distractors) need only their window, which AdaKV's top-(H·B) gives
// back to the induction head.
TEST(AdaKvInstrumentTest, AdaptiveHeadsKeepEveryAskedNeedleWhereUniformCannot) {
  const std::unique_ptr<Model> model = testing::LoadRetrievalModel(2, RetrievalShape::kMultiHead);
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  const int32_t length = 512;
  constexpr int kSamples = 4;
  int solved_uniform = 0, solved_adaptive = 0;
  for (int seed = 0; seed < kSamples; ++seed) {
    BenchTaskOptions o;
    o.n_keys = 4;
    o.value_tokens = 3;
    o.depth = 0.1 + 0.15 * seed;
    auto sample = GenerateTokenSample(BenchTask::kNiahMultiQuery, RetrievalModelVocab(), length, 100 + seed, o);
    ASSERT_TRUE(sample.ok()) << sample.status().ToString();
    std::vector<int32_t> prompt = sample->context;
    prompt.insert(prompt.end(), sample->question.begin(), sample->question.end());
    for (const bool adaptive : {false, true}) {
      // 5% of the tokens seen: 25 a head, below SnapKV's 32-query window, which shrinks to half of it.
      auto config = KvSparsityConfigFromFlags("snapkv", "0.05", "f16", c.n_layers);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      config->prefill_eviction = PrefillEviction::kPromptEnd;
      config->prefill_chunk = length;
      const std::vector<std::string> params = {"head_budgets=adaptive"};
      if (adaptive) {
        ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
      }
      const auto n_prompt = static_cast<int32_t>(prompt.size());
      auto runtime = CreateRuntime(*model, &*config, KvStorage::kF16, 1, n_prompt + 4, 2);
      ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
      std::vector<float> logits(static_cast<size_t>(c.n_vocab));
      ASSERT_TRUE((*runtime)->engine->Forward(0, prompt.data(), n_prompt, 0, logits.data()).ok());
      // The first value token comes from the prompt's pass; the others from the compressed cache.
      std::vector<int32_t> generated;
      for (int32_t pos = n_prompt; generated.size() < sample->answers[0].size(); ++pos) {
        generated.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
        ASSERT_TRUE((*runtime)->engine->Forward(0, &generated.back(), 1, pos, logits.data()).ok());
      }
      (adaptive ? solved_adaptive : solved_uniform) += generated == sample->answers[0];
      (*runtime)->paged_cache()->CheckInvariants();
    }
  }
  EXPECT_EQ(solved_adaptive, kSamples);
  EXPECT_LT(solved_uniform, kSamples);
  std::printf("multi-query at 5%% of 512 tokens: uniform SnapKV %d/%d, adaptive %d/%d\n", solved_uniform, kSamples,
              solved_adaptive, kSamples);
}

}  // namespace
}  // namespace kvsparse
