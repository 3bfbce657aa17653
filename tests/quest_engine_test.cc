// Quest, the oracle and reuse through the engine (SparseKvController::SelectSpans before decode
// attention):
// - a budget of the whole context reads everything: bit-identical to Full, shared and per-head
//   (both methods);
// - the oracle at a small budget reads exactly the budget per KV head and step, keeps every token,
//   and so do reuse's selection layers and the layers that reuse their choice;
// - a small budget reads at most budget + one page per decode step, keeps every token, never
//   evicts, and accounts its page metadata;
// - on the built-in retrieval model a deep needle at 1024 tokens, asked as a separate decode
//   step, is answered by Quest and the oracle at a 64-token budget and missed by StreamingLLM.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/quest_pages.h"
#include "kvsparse/retrieval_model.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/synth.h"
#include "support/retrieval_model_file.h"
#include "support/shared_data.h"
#include "support/synth_model_file.h"

namespace kvsparse {
namespace {

constexpr int kThreads = 2;

int32_t ArgMax(const std::vector<float>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

KvGeometry Geometry(const Model& m) { return KvGeometry{m.config().n_layers, m.config().n_kv_heads, m.config().head_dim}; }

KvSparsityConfig FlagsConfig(const Model& model, const std::string& method, const std::string& budget,
                             const std::string& kv_type = "f32") {
  auto config = KvSparsityConfigFromFlags(method, budget, kv_type, model.config().n_layers);
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  return config.ok() ? *config : KvSparsityConfig{};
}

// Prompt in one call, then n_decode greedy steps; the logits of every call.
std::vector<std::vector<float>> RunGreedy(const Model& model, SparseKvSetup& kv, const std::vector<int32_t>& prompt,
                                    int n_decode) {
  Engine engine(model, kv.cache.get(), kThreads, kv.controller.get());
  std::vector<float> logits(static_cast<size_t>(model.config().n_vocab));
  std::vector<std::vector<float>> out;
  Status s = engine.Forward(0, prompt.data(), static_cast<int32_t>(prompt.size()), 0, logits.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  out.push_back(logits);
  int32_t pos = static_cast<int32_t>(prompt.size());
  for (int step = 0; step < n_decode && s.ok(); ++step) {
    const int32_t token = ArgMax(logits);
    s = engine.Forward(0, &token, 1, pos++, logits.data());
    EXPECT_TRUE(s.ok()) << s.ToString();
    out.push_back(logits);
  }
  return out;
}

class QuestSynthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // 8 query heads over 2 kv heads
    model_ = testing::LoadSynthModelF32("tiny-gqa-untied", "quest_engine_tiny_gqa.gguf").release();
    ASSERT_NE(model_, nullptr);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static std::vector<int32_t> Prompt(size_t n) {
    std::vector<int32_t> prompt(n);
    for (size_t i = 0; i < n; ++i) prompt[i] = static_cast<int32_t>((i * 131 + 7) % 512);
    return prompt;
  }
  // `layer` when it is reuse's re-selection layer (13/32 of the depth), else -1.
  static int ReuseLayer(int layer) {
    const int n_layers = model_->config().n_layers;
    return layer == static_cast<int>(std::lround(n_layers * 13.0 / 32.0)) ? layer : -1;
  }
  // The re-selection layer of the model (13/32 of the depth).
  static int ReuseLayerOf(int) {
    return static_cast<int>(std::lround(model_->config().n_layers * 13.0 / 32.0));
  }
  static inline Model* model_ = nullptr;
};

TEST_F(QuestSynthTest, WholeContextBudgetIsBitIdenticalToFull) {
  const std::vector<int32_t> prompt = Prompt(70);
  const int n_decode = 40;
  const int32_t context = 70 + n_decode + 1;
  for (const std::string method : {"quest", "oracle", "reuse", "reuse-by-pages"}) {
    for (const std::string kv_type : {"f32", "int8"}) {
      for (bool per_head : {false, true}) {
        const bool reuse = method.rfind("reuse", 0) == 0;
        if (reuse && per_head) continue;  // reuse shares a selection per KV head across layers
        KvSparsityConfig full = FlagsConfig(*model_, "full", "", kv_type);
        KvSparsityConfig sparse = FlagsConfig(*model_, reuse ? "reuse" : method, std::to_string(context), kv_type);
        for (LayerKvConfig& l : full.layers) l.per_head = per_head;
        for (LayerKvConfig& l : sparse.layers) {
          l.per_head = per_head;
          l.params.dense_layers = 0;  // every layer selects (the paper's default leaves layers 0-1 dense)
          if (method == "reuse-by-pages") l.params.selection = ReuseSelectionKind::kQuest;
        }
        auto full_kv = CreateSparseKv(Geometry(*model_), full, 1, context);
        auto sparse_kv = CreateSparseKv(Geometry(*model_), sparse, 1, context);
        ASSERT_TRUE(full_kv.ok() && sparse_kv.ok());
        const auto want = RunGreedy(*model_, *full_kv, prompt, n_decode);
        const auto got = RunGreedy(*model_, *sparse_kv, prompt, n_decode);
        ASSERT_EQ(got.size(), want.size());
        for (size_t call = 0; call < want.size(); ++call) {
          ASSERT_EQ(std::memcmp(got[call].data(), want[call].data(), want[call].size() * sizeof(float)), 0)
              << method << " " << kv_type << (per_head ? " per-head" : "") << ": logits differ after call " << call;
        }
        for (const SparseKvLayerStats& s : sparse_kv->controller->layer_stats()) {
          EXPECT_EQ(s.span_selections, n_decode * (per_head ? 2 : 1));
          EXPECT_EQ(s.selected_tokens, s.selectable_tokens);
          EXPECT_EQ(s.evictions, 0);
        }
      }
    }
  }
}

// Reuse's selection layers attend densely and the layers after them read the budget.
TEST_F(QuestSynthTest, OracleAndReuseReadExactlyTheBudgetAndKeepEverything) {
  const std::vector<int32_t> prompt = Prompt(150);
  const int n_decode = 20;
  const int32_t context = 150 + n_decode + 1;
  for (const std::string method : {"oracle", "reuse"}) {
    for (const std::string kv_type : {"f16", "int8_kivi"}) {
      for (bool per_head : {false, true}) {
        if (method == "reuse" && per_head) continue;
        KvSparsityConfig config = FlagsConfig(*model_, method, "40", kv_type);
        for (LayerKvConfig& l : config.layers) {
          l.per_head = per_head;
          l.params.dense_layers = 0;
        }
        auto kv = CreateSparseKv(Geometry(*model_), config, 1, context);
        ASSERT_TRUE(kv.ok()) << kv.status().ToString();
        const auto out = RunGreedy(*model_, *kv, prompt, n_decode);
        ASSERT_EQ(out.size(), static_cast<size_t>(n_decode) + 1);
        for (int layer = 0; layer < model_->config().n_layers; ++layer) {
          const SparseKvLayerStats& s = kv->controller->layer_stats()[layer];
          const int tables = per_head ? model_->config().n_kv_heads : 1;
          EXPECT_EQ(s.span_selections, n_decode * tables);
          // Reuse's selection layers (the first and the re-selection layer) attend densely.
          const bool dense = method == "reuse" && (layer == 0 || layer == ReuseLayer(layer));
          EXPECT_EQ(s.selected_tokens, dense ? s.selectable_tokens : s.span_selections * 40)
              << method << " " << kv_type << " layer " << layer;
          EXPECT_EQ(s.evictions, 0);
          EXPECT_EQ(kv->cache->NumTokens(0, layer), 150 + n_decode);  // the oracle keeps every token
        }
      }
    }
  }
}

// Reuse choosing by Quest's page bounds: its selection layers read only the pages they choose
// (QuestPagesRead pages of each KV head, not the whole table), and the layers after them read
// exactly those tokens; nothing is evicted.
TEST_F(QuestSynthTest, ReuseByPageBoundsReadsThePagesItsSelectionLayersChoose) {
  const std::vector<int32_t> prompt = Prompt(150);
  const int n_decode = 20;
  const int32_t context = 150 + n_decode + 1;
  for (const std::string kv_type : {"f16", "int8_kivi"}) {
    KvSparsityConfig config = FlagsConfig(*model_, "reuse", "40", kv_type);
    const std::vector<std::string> params = {"selection=quest", "page_tokens=8", "dense_layers=0"};
    ASSERT_TRUE(ApplyKvParams(params, &config).ok());
    auto kv = CreateSparseKv(Geometry(*model_), config, 1, context);
    ASSERT_TRUE(kv.ok()) << kv.status().ToString();
    const auto out = RunGreedy(*model_, *kv, prompt, n_decode);
    ASSERT_EQ(out.size(), static_cast<size_t>(n_decode) + 1);
    const std::vector<SparseKvLayerStats>& stats = kv->controller->layer_stats();
    const int64_t per_step = QuestPagesRead(40, 8) * 8;  // 5 pages of 8 tokens (the last may be partial)
    for (int layer = 0; layer < model_->config().n_layers; ++layer) {
      const SparseKvLayerStats& s = stats[layer];
      EXPECT_EQ(s.span_selections, n_decode);
      EXPECT_LE(s.selected_tokens, s.span_selections * per_step) << kv_type << " layer " << layer;
      EXPECT_GT(s.selected_tokens, s.span_selections * (per_step - 8)) << kv_type << " layer " << layer;
      EXPECT_LT(s.selected_tokens, s.selectable_tokens);
      // Every layer reads what the selection layer of its stretch chose.
      const int selector = layer < ReuseLayerOf(layer) ? 0 : ReuseLayerOf(layer);
      EXPECT_EQ(s.selected_tokens, stats[selector].selected_tokens) << kv_type << " layer " << layer;
      EXPECT_EQ(s.evictions, 0);
      EXPECT_EQ(kv->cache->NumTokens(0, layer), 150 + n_decode);
    }
  }
}

TEST_F(QuestSynthTest, SmallBudgetReadsAtMostBudgetPlusOnePageAndKeepsEverything) {
  const std::vector<int32_t> prompt = Prompt(150);
  const int n_decode = 30;
  const int32_t context = 150 + n_decode + 1;
  for (bool per_head : {false, true}) {
    for (int32_t page_tokens : {0, 8}) {
      KvSparsityConfig config = FlagsConfig(*model_, "quest", "40", "f16");
      for (LayerKvConfig& l : config.layers) {
        l.per_head = per_head;
        l.params.page_tokens = page_tokens;
        l.params.dense_layers = 0;  // every layer selects
      }
      const int32_t page = page_tokens > 0 ? page_tokens : EffectivePageSize(config);
      auto kv = CreateSparseKv(Geometry(*model_), config, 1, context);
      ASSERT_TRUE(kv.ok()) << kv.status().ToString();
      SparseKvController& controller = *kv->controller;
      const auto out = RunGreedy(*model_, *kv, prompt, n_decode);
      ASSERT_EQ(out.size(), static_cast<size_t>(n_decode) + 1);
      for (int layer = 0; layer < model_->config().n_layers; ++layer) {
        const SparseKvLayerStats& s = controller.layer_stats()[layer];
        const int tables = per_head ? model_->config().n_kv_heads : 1;
        EXPECT_EQ(s.span_selections, n_decode * tables);
        EXPECT_LE(s.selected_tokens, s.span_selections * (40 + page)) << "layer " << layer;
        EXPECT_LT(s.selected_tokens, s.selectable_tokens / 3);
        EXPECT_EQ(s.evictions, 0);
        EXPECT_GT(s.metadata_bytes, 0u);
        EXPECT_EQ(kv->cache->NumTokens(0, layer), 150 + n_decode);  // Quest keeps every token
      }
      const std::string stats = controller.FormatStats();
      EXPECT_NE(stats.find("query-aware selection"), std::string::npos) << stats;
      // Restarting the sequence releases the policies' metadata.
      ASSERT_TRUE(controller.ResetSequence(0).ok());
      for (const SparseKvLayerStats& s : controller.layer_stats()) EXPECT_EQ(s.metadata_bytes, 0u);
    }
  }
}

// The built-in retrieval model (2 layers): context = filler, key, value, filler (1024 tokens
// in all), then the key is asked as its own decode step; the answer is the value.
class QuestRetrievalTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::LoadRetrievalModel(2).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  // Solved needles out of `n_tasks` deep ones (depth 40..400 of 1024).
  static int Solved(const std::string& method, const std::string& budget, const std::string& kv_type, int n_tasks) {
    const TokenVocab vocab = RetrievalModelVocab();
    std::mt19937 rng(2024);
    auto pick = [&](const std::vector<int32_t>& ids) {
      return ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
    };
    int solved = 0;
    for (int task = 0; task < n_tasks; ++task) {
      std::vector<int32_t> context(1024);
      for (int32_t& t : context) t = pick(vocab.filler);
      const int depth = std::uniform_int_distribution<int>(40, 400)(rng);
      const int32_t key = pick(vocab.keys), value = pick(vocab.values);
      context[static_cast<size_t>(depth)] = key;
      context[static_cast<size_t>(depth) + 1] = value;
      KvSparsityConfig config = FlagsConfig(*model_, method, budget, kv_type);
      auto kv = CreateSparseKv(Geometry(*model_), config, 1, 1025);
      EXPECT_TRUE(kv.ok()) << kv.status().ToString();
      if (!kv.ok()) return -1;
      Engine engine(*model_, kv->cache.get(), 1, kv->controller.get());
      std::vector<float> logits(static_cast<size_t>(model_->config().n_vocab));
      EXPECT_TRUE(engine.Forward(0, context.data(), 1024, 0, logits.data()).ok());
      EXPECT_TRUE(engine.Forward(0, &key, 1, 1024, logits.data()).ok());
      solved += ArgMax(logits) == value;
      if (method == "quest") {
        for (const SparseKvLayerStats& s : kv->controller->layer_stats()) EXPECT_LE(s.selected_tokens, 64 + 16);
      }
    }
    return solved;
  }
  static inline Model* model_ = nullptr;
};

TEST_F(QuestRetrievalTest, DeepNeedleAt1024QuestAndOracleAnswerWhereStreamingLlmFails) {
  constexpr int kTasks = 6;
  EXPECT_EQ(Solved("quest", "64", "f32", kTasks), kTasks);
  EXPECT_EQ(Solved("quest", "64", "int8", kTasks), kTasks);
  EXPECT_EQ(Solved("oracle", "64", "f32", kTasks), kTasks);
  EXPECT_EQ(Solved("streaming_llm", "64", "f32", kTasks), 0);
}

}  // namespace
}  // namespace kvsparse
