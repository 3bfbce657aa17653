// The retrieval-head probe and razor (RazorAttention) on the multi-head retrieval instrument:
// the probe finds the planted induction head; heads files round-trip and bad ones are refused;
// ResolveRetrievalHeads marks the best heads of the whole model; a razor cache keeps every token
// in the retrieval heads only (pages follow), folds what the other heads drop into their
// compensation tokens, and answers a deep needle that StreamingLLM at the same window loses.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/head_probe.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/retrieval_model.h"
#include "kvsparse/runtime.h"
#include "support/retrieval_model_file.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

constexpr int kLayers = 4;

class RazorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = testing::LoadRetrievalModel(kLayers, RetrievalShape::kMultiHead).release(); }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static const Model& model() { return *model_; }
  static inline Model* model_ = nullptr;
};

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
}

TEST_F(RazorTest, ProbeFindsThePlantedInductionHead) {
  auto heads = ProbeRetrievalHeads(model(), HeadProbeOptions{});
  ASSERT_TRUE(heads.ok()) << heads.status().ToString();
  ASSERT_EQ(heads->size(), static_cast<size_t>(kLayers * model().config().n_kv_heads));
  const RetrievalHead induction = RetrievalCircuitHeads(RetrievalShape::kMultiHead, kLayers).back();
  EXPECT_EQ((*heads)[0].layer, induction.layer);
  EXPECT_EQ((*heads)[0].kv_head, induction.kv_head);
  EXPECT_GT((*heads)[0].induction, 0.9);
  // Local, previous-token and uniform heads (the circuit's previous-token head among them).
  for (size_t i = 1; i < heads->size(); ++i) EXPECT_LT((*heads)[i].score(), 0.1) << "rank " << i;
  for (size_t i = 1; i < heads->size(); ++i) EXPECT_LE((*heads)[i].score(), (*heads)[i - 1].score());

  // The one-head instrument: its last layer is the induction head.
  auto one_head = testing::LoadRetrievalModel(3);
  auto ranked = ProbeRetrievalHeads(*one_head, HeadProbeOptions{});
  ASSERT_TRUE(ranked.ok()) << ranked.status().ToString();
  EXPECT_EQ((*ranked)[0].layer, 2);
  EXPECT_GT((*ranked)[0].score(), 0.9);
}

// The reference ranks a KV head by the max of its group's query heads (_max_every_group): an
// induction head whose group's other query head attends uniformly keeps its full score (a group
// mean would halve it). Every copy after the first is read, so the score sums the attention on
// each earlier occurrence's successor.
TEST_F(RazorTest, ProbeTakesTheGroupsMaxOverQueryHeads) {
  RetrievalModelOptions options;
  options.shape = RetrievalShape::kMultiHead;
  options.n_layers = kLayers;
  options.lone_induction_query_head = true;
  const std::string path = testing::TempPath("razor_lone_induction.gguf");
  ASSERT_TRUE(WriteRetrievalModel(options, path).ok());
  auto lone = Model::Load(path);
  ASSERT_TRUE(lone.ok()) << lone.status().ToString();
  ASSERT_EQ((*lone)->config().n_heads, 2 * (*lone)->config().n_kv_heads);
  auto heads = ProbeRetrievalHeads(**lone, HeadProbeOptions{});
  ASSERT_TRUE(heads.ok()) << heads.status().ToString();
  const RetrievalHead induction = RetrievalCircuitHeads(RetrievalShape::kMultiHead, kLayers).back();
  EXPECT_EQ((*heads)[0].layer, induction.layer);
  EXPECT_EQ((*heads)[0].kv_head, induction.kv_head);
  EXPECT_GT((*heads)[0].induction, 0.9) << "the group's max, not its mean (about 0.5)";
}

// The reference's lists: the best echo_heads (1%) by echo and the best induction_heads (14%) by
// induction, each ranked on its own score; retrieval_heads set ranks by their sum instead.
TEST_F(RazorTest, ResolveTakesTheEchoAndInductionListsApart) {
  const std::string path = testing::TempPath("razor_two_lists.json");
  // 16 heads: 14% -> round(2.24) = 2 induction heads; echo 1% -> round(0.16) = 0, 7% -> round(1.12) = 1.
  WriteFile(path, HeadScoresToJson({{3, 2, 0.9, 0}, {1, 3, 0.5, 0}, {1, 0, 0.0, 0.45}, {0, 0, 0.1, 0.0}}, kLayers, 4));
  for (const bool two_lists : {true, false}) {
    auto config = KvSparsityConfigFromFlags("razor", "64", "f16", kLayers);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    std::vector<std::string> params = {"heads=" + path, "echo_heads=0.07"};
    if (!two_lists) params.push_back("retrieval_heads=2");
    ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
    ASSERT_TRUE(ResolveRetrievalHeads(model(), 1, &*config).ok());
    // Two lists: induction (3, 2), (1, 3) and echo (1, 0); one list of 2: (3, 2), (1, 3).
    const std::vector<uint64_t> masks =
        two_lists ? std::vector<uint64_t>{0, (1u << 3) | 1u, 0, 1u << 2} : std::vector<uint64_t>{0, 1u << 3, 0, 1u << 2};
    for (int l = 0; l < kLayers; ++l) EXPECT_EQ(config->layers[l].params.full_heads, masks[l]) << "layer " << l;
  }
  // The reference's 1% of 16 heads rounds to no echo head.
  auto config = KvSparsityConfigFromFlags("razor", "64", "f16", kLayers);
  ASSERT_TRUE(config.ok());
  const std::vector<std::string> params = {"heads=" + path};
  ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
  ASSERT_TRUE(ResolveRetrievalHeads(model(), 1, &*config).ok());
  EXPECT_EQ(config->layers[1].params.full_heads, 1u << 3) << "induction (1, 3) only";
  auto summary = ParseKvSparsityConfig(R"({"default": {"method": "razor", "budget": 64}})", kLayers);
  ASSERT_TRUE(summary.ok());
  EXPECT_NE(KvSparsityConfigSummary(*summary).find("echo_heads=0.01 induction_heads=0.14"), std::string::npos)
      << KvSparsityConfigSummary(*summary);
}

TEST_F(RazorTest, HeadsFileRoundTripsAndBadFilesAreRefused) {
  const std::vector<HeadScore> heads = {{3, 2, 0.75, 0.25}, {0, 1, 0.01, 0.0}, {1, 0, 0.0, 0.0}};
  const std::string path = testing::TempPath("razor_heads.json");
  WriteFile(path, HeadScoresToJson(heads, kLayers, 4));
  auto loaded = LoadHeadScores(path, kLayers, 4);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), heads.size());
  for (size_t i = 0; i < heads.size(); ++i) {
    EXPECT_EQ((*loaded)[i].layer, heads[i].layer);
    EXPECT_EQ((*loaded)[i].kv_head, heads[i].kv_head);
    EXPECT_DOUBLE_EQ((*loaded)[i].induction, heads[i].induction);
    EXPECT_DOUBLE_EQ((*loaded)[i].echo, heads[i].echo);
  }
  struct Bad {
    std::string text, expect;
  };
  const std::vector<Bad> bad = {
      {"[1, 2]", "not a JSON object"},
      {"{\"n_kv_heads\": 8, \"heads\": []}", "'n_kv_heads' is 8 but the model has 4"},
      {"{\"heads\": [{\"layer\": 0, \"kv_head\": 4, \"score\": 1}]}", "heads[0]: 'kv_head'"},
      {"{\"heads\": [{\"layer\": 9, \"kv_head\": 0, \"score\": 1}]}", "heads[0]: 'layer'"},
      {"{\"heads\": [{\"layer\": 0, \"kv_head\": 0}]}", "'score'"},
      {"{\"heads\": [{\"layer\": 0, \"kv_head\": 0, \"score\": 1}, {\"layer\": 0, \"kv_head\": 0, \"score\": 2}]}",
       "listed twice"},
      {"{\"heads\": 3}", "'heads' array"},
      {"{not json", "not a JSON object"},
  };
  for (const Bad& b : bad) {
    WriteFile(path, b.text);
    auto r = LoadHeadScores(path, kLayers, 4);
    ASSERT_FALSE(r.ok()) << b.text;
    EXPECT_NE(r.status().message().find(b.expect), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << "the message names the file";
  }
  EXPECT_EQ(LoadHeadScores(testing::TempPath("no_such_heads.json"), kLayers, 4).status().code(),
            StatusCode::kNotFound);
}

TEST_F(RazorTest, ResolveMarksTheBestHeadsOfTheWholeModel) {
  const std::string path = testing::TempPath("razor_resolve_heads.json");
  WriteFile(path, HeadScoresToJson({{3, 2, 0.9, 0}, {1, 3, 0.5, 0}, {1, 0, 0.4, 0}, {0, 0, 0.1, 0}}, kLayers, 4));
  for (const auto& [count, masks] : std::vector<std::pair<std::string, std::vector<uint64_t>>>{
           {"1", {0, 0, 0, 1u << 2}},
           {"3", {0, (1u << 3) | 1u, 0, 1u << 2}},
           {"0.15", {0, 1u << 3, 0, 1u << 2}},  // 0.15 x 16 heads = 2.4 -> 2
           {"0", {0, 0, 0, 0}}}) {
    auto config = KvSparsityConfigFromFlags("razor", "64", "f16", kLayers);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    const std::vector<std::string> params = {"heads=" + path, "retrieval_heads=" + count};
    ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
    ASSERT_TRUE(ResolveRetrievalHeads(model(), 1, &*config).ok());
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_TRUE(config->layers[l].params.full_heads_resolved);
      EXPECT_EQ(config->layers[l].params.full_heads, masks[l]) << "retrieval_heads " << count << " layer " << l;
    }
  }
}

TEST_F(RazorTest, ConfigErrorsNameTheField) {
  // Shared-heads layers cannot keep some heads whole.
  auto shared = ParseKvSparsityConfig(R"({"default": {"method": "razor", "budget": 64, "per_head": false}})", kLayers);
  ASSERT_FALSE(shared.ok());
  EXPECT_NE(shared.status().message().find("per_head"), std::string::npos) << shared.status().ToString();
  auto share = ParseKvSparsityConfig(R"({"default": {"method": "razor", "budget": 64, "retrieval_heads": 1.5}})", kLayers);
  ASSERT_FALSE(share.ok());
  EXPECT_NE(share.status().message().find("retrieval_heads"), std::string::npos) << share.status().ToString();
  auto heads = ParseKvSparsityConfig(R"({"default": {"method": "razor", "budget": 64, "heads": 3}})", kLayers);
  ASSERT_FALSE(heads.ok());
  EXPECT_NE(heads.status().message().find("heads"), std::string::npos) << heads.status().ToString();
  // Without the runtime (which resolves the heads), a razor cache refuses to start.
  auto config = KvSparsityConfigFromFlags("razor", "64", "f16", kLayers);
  ASSERT_TRUE(config.ok());
  const ModelConfig& c = model().config();
  auto kv = CreateSparseKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, *config, 1, 256);
  ASSERT_FALSE(kv.ok());
  EXPECT_NE(kv.status().message().find("not resolved"), std::string::npos) << kv.status().ToString();
  // A heads file for a model with more heads is refused by name.
  const std::string path = testing::TempPath("razor_wrong_model.json");
  WriteFile(path, HeadScoresToJson({{0, 0, 1, 0}}, kLayers, 8));
  std::vector<std::string> params = {"heads=" + path};
  ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
  auto runtime = CreateRuntime(model(), &*config, KvStorage::kF16, 1, 256, 1);
  ASSERT_FALSE(runtime.ok());
  EXPECT_NE(runtime.status().message().find(path), std::string::npos) << runtime.status().ToString();
}

// A server's request may change a razor config's budget, but not switch another method to razor:
// its retrieval heads are chosen when the runtime starts.
TEST_F(RazorTest, RequestsCannotSwitchToRazor) {
  auto h2o = KvSparsityConfigFromFlags("h2o", "64", "f16", kLayers);
  ASSERT_TRUE(h2o.ok());
  auto to_razor = KvLayersWithOverride(*h2o, "razor", "0.2");
  ASSERT_FALSE(to_razor.ok());
  EXPECT_NE(to_razor.status().message().find("kv_method: razor"), std::string::npos) << to_razor.status().ToString();
  auto razor = KvSparsityConfigFromFlags("razor", "64", "f16", kLayers);
  ASSERT_TRUE(razor.ok());
  const std::vector<std::string> params = {"retrieval_heads=1"};
  ASSERT_TRUE(ApplyKvParams(params, &*razor).ok());
  ASSERT_TRUE(ResolveRetrievalHeads(model(), 1, &*razor).ok());
  auto rebudget = KvLayersWithOverride(*razor, "razor", "0.2");
  ASSERT_TRUE(rebudget.ok()) << rebudget.status().ToString();
  EXPECT_TRUE((*rebudget)[kLayers - 1].params.full_heads_resolved);
  EXPECT_EQ((*rebudget)[kLayers - 1].params.full_heads, razor->layers[kLayers - 1].params.full_heads);
}

// A needle in the first of two prompt chunks, the question after it: the window of StreamingLLM
// (and of razor's other heads) has long passed the needle, razor's retrieval head still holds it.
TEST_F(RazorTest, RetrievalHeadKeepsEveryTokenAndAnswersADeepNeedle) {
  const ModelConfig& c = model().config();
  const TokenVocab vocab = RetrievalModelVocab();
  const int32_t length = 600, budget = 48;
  std::mt19937 rng(7);
  int razor_solved = 0, streaming_solved = 0;
  constexpr int kTasks = 2;
  for (int task = 0; task < kTasks; ++task) {
    std::vector<int32_t> prompt(static_cast<size_t>(length));
    for (int32_t& t : prompt) t = vocab.filler[std::uniform_int_distribution<size_t>(0, vocab.filler.size() - 1)(rng)];
    const int depth = std::uniform_int_distribution<int>(16, 200)(rng);
    const int32_t key = vocab.keys[static_cast<size_t>(task)], value = vocab.values[static_cast<size_t>(task)];
    prompt[static_cast<size_t>(depth)] = key;
    prompt[static_cast<size_t>(depth) + 1] = value;
    prompt.back() = key;
    for (const std::string method : {"razor", "streaming_llm"}) {
      auto config = KvSparsityConfigFromFlags(method, std::to_string(budget), "f16", c.n_layers);
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      config->prefill_chunk = 256;
      if (method == "razor") {
        const std::vector<std::string> params = {"retrieval_heads=1"};  // probed at start-up
        ASSERT_TRUE(ApplyKvParams(params, &*config).ok());
      }
      auto runtime = CreateRuntime(model(), &*config, KvStorage::kF16, 1, length + 4, 1);
      ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
      std::vector<float> logits(static_cast<size_t>(c.n_vocab));
      ASSERT_TRUE((*runtime)->engine->Forward(0, prompt.data(), length, 0, logits.data()).ok());
      const bool solved = std::max_element(logits.begin(), logits.end()) - logits.begin() == value;
      (method == "razor" ? razor_solved : streaming_solved) += solved;
      if (method != "razor") continue;
      PagedKvCache& cache = *(*runtime)->paged_cache();
      const RetrievalHead induction = RetrievalCircuitHeads(RetrievalShape::kMultiHead, c.n_layers).back();
      size_t pages = 0;
      for (int l = 0; l < c.n_layers; ++l) {
        size_t layer_pages = 0;
        for (int h = 0; h < c.n_kv_heads; ++h) {
          const int32_t n = cache.NumHeadTokens(0, l, h);
          const bool full = l == induction.layer && h == induction.kv_head;
          EXPECT_EQ(n, full ? length : budget) << "layer " << l << " head " << h;
          // A local head's compensation token stands for every token it dropped.
          EXPECT_EQ((*runtime)->controller()->Compensation(0, l, h).count, full ? 0 : length - budget);
          layer_pages += static_cast<size_t>((n + cache.page_size() - 1) / cache.page_size());
        }
        EXPECT_EQ(cache.LayerAllocatedBytes(l), layer_pages * cache.page_bytes(l)) << "pages follow, layer " << l;
        pages += layer_pages;
      }
      EXPECT_LT(pages, static_cast<size_t>(c.n_layers * c.n_kv_heads) * (length / cache.page_size()) / 4);
      cache.CheckInvariants();
    }
  }
  EXPECT_EQ(razor_solved, kTasks);
  EXPECT_EQ(streaming_solved, 0);
}

}  // namespace
}  // namespace kvsparse
