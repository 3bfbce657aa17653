// When prompts are compressed (KvSparsityConfig::prefill_eviction):
// - every chunk (default): a layer never holds more than budget + chunk during the prompt;
// - prompt end: the whole prompt stays until its last chunk was attended, then one trim; so a
//   question at the end of the prompt steers SnapKV to the needle (the retrieval model finds
//   a needle of the first chunk), which chunk-wise eviction cannot do.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/retrieval_model.h"
#include "kvsparse/sparse_kv_controller.h"
#include "support/retrieval_model_file.h"

namespace kvsparse {
namespace {

constexpr int32_t kLength = 1024;

using testing::LoadRetrievalModel;

// filler..., key, value (at `depth`), filler..., key: the answer is `value`.
std::vector<int32_t> NeedlePrompt(double depth, int32_t key, int32_t value) {
  const TokenVocab vocab = RetrievalModelVocab();
  std::vector<int32_t> prompt(kLength);
  for (int32_t i = 0; i < kLength; ++i) prompt[i] = vocab.filler[(i * 7 + i / 5) % vocab.filler.size()];
  const int32_t at = static_cast<int32_t>(depth * (kLength - 3));
  prompt[at] = key;
  prompt[at + 1] = value;
  prompt.push_back(key);
  return prompt;
}

struct Outcome {
  int32_t answer = -1;
  int32_t peak_live = 0;  // most tokens any layer held
};

Outcome RunPrompt(const Model& model, PrefillEviction when, const std::vector<int32_t>& prompt) {
  const ModelConfig& c = model.config();
  auto config = KvSparsityConfigFromFlags("snapkv", "96", "f32", c.n_layers);
  KVS_CHECK(config.ok());
  config->prefill_chunk = 256;
  config->prefill_eviction = when;
  auto kv = CreateSparseKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, *config, 1, kLength + 8);
  KVS_CHECK(kv.ok());
  Engine engine(model, kv->cache.get(), /*n_threads=*/1, kv->controller.get());
  std::vector<float> logits(c.n_vocab);
  KVS_CHECK(engine.Forward(0, prompt.data(), static_cast<int32_t>(prompt.size()), 0, logits.data()).ok());
  Outcome out;
  out.answer = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  for (const SparseKvLayerStats& s : kv->controller->layer_stats()) out.peak_live = std::max(out.peak_live, s.peak_live_tokens);
  for (int layer = 0; layer < c.n_layers; ++layer) EXPECT_LE(kv->cache->NumTokens(0, layer), 96);
  return out;
}

TEST(PrefillEviction, PromptEndLetsTheQuestionSteerSelection) {
  auto model = LoadRetrievalModel(RetrievalModelOptions{}.n_layers);
  const TokenVocab vocab = RetrievalModelVocab();
  int prompt_end_hits = 0, chunk_hits = 0;
  for (int i = 0; i < 4; ++i) {
    const int32_t key = vocab.keys[i], value = vocab.values[i];
    const std::vector<int32_t> prompt = NeedlePrompt(0.1 + 0.05 * i, key, value);  // inside the first chunk
    const Outcome end = RunPrompt(*model, PrefillEviction::kPromptEnd, prompt);
    const Outcome chunk = RunPrompt(*model, PrefillEviction::kEveryChunk, prompt);
    prompt_end_hits += end.answer == value;
    chunk_hits += chunk.answer == value;
    // Prompt end holds the whole prompt before its single trim; chunks stay within budget + chunk.
    EXPECT_EQ(end.peak_live, kLength + 1);
    EXPECT_LE(chunk.peak_live, 96 + 256);
  }
  EXPECT_EQ(prompt_end_hits, 4);
  EXPECT_EQ(chunk_hits, 0);
}

TEST(PrefillEviction, ParsedFromJsonAndRejectedWhenMisspelt) {
  auto ok = ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 0.2}, "prefill_eviction": "prompt_end"})", 2);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->prefill_eviction, PrefillEviction::kPromptEnd);
  EXPECT_NE(KvSparsityConfigSummary(*ok).find("prefill_eviction=prompt_end"), std::string::npos);
  auto bad = ParseKvSparsityConfig(R"({"prefill_eviction": "end"})", 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("prefill_eviction"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace kvsparse
