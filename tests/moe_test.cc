// Mixtures of experts (qwen3moe, qwen2moe, olmoe, Mixtral as llama with experts): what the loader
// reads, the router's choice against llama.cpp's rule, what a decode step reads, prompt and decode
// paths against each other across batch shapes, and hostile expert metadata. The logits against
// the float64 reference are in architectures_test.cc; llama.cpp's greedy ids in
// llamacpp_greedy_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/synth.h"
#include "runtime/engine_internal.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

std::string WriteShape(const std::string& shape, DType type = DType::kF32, const std::string& suffix = "") {
  SynthOptions options;
  options.weight_type = type;
  const std::string path = testing::TempPath("moe_" + shape + suffix + ".gguf");
  const Status written = WriteSynthModel(FindSynthShape(shape).value(), options, path);
  EXPECT_TRUE(written.ok()) << written.ToString();
  return path;
}

TEST(Moe, LoadsExpertsByName) {
  struct Case {
    const char* shape;
    Arch arch;
    bool norm, shared, full_width_norm;
  };
  for (const Case& k : {Case{"tiny-qwen3moe", Arch::kQwen3Moe, true, false, false},
                        Case{"tiny-qwen2moe", Arch::kQwen2Moe, false, true, false},
                        Case{"tiny-olmoe", Arch::kOlmoe, false, false, true},
                        Case{"tiny-mixtral", Arch::kLlama, true, false, false}}) {
    SCOPED_TRACE(k.shape);
    auto model = Model::Load(WriteShape(k.shape));
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const ModelConfig& c = (*model)->config();
    EXPECT_EQ(c.arch, k.arch);
    EXPECT_EQ(c.n_experts, 8);
    EXPECT_EQ(c.n_experts_used, 2);
    EXPECT_EQ(c.expert_hidden_dim, 128);
    EXPECT_EQ(c.expert_weights_norm, k.norm);
    EXPECT_EQ(c.qk_norm_full_width, k.full_width_norm);
    EXPECT_EQ(c.shared_expert_hidden_dim, k.shared ? 256 : 0);
    const LayerWeights& l = (*model)->layers[1];
    EXPECT_EQ(l.w_gate.data, nullptr);  // no dense FFN
    ASSERT_EQ(l.expert_gate.size(), 8u);
    EXPECT_EQ(l.router.type, DType::kF32);
    EXPECT_EQ(l.router.rows, 8);
    // Each expert is a row range of the one 3-D tensor: nothing copied.
    const size_t expert_bytes = 128 * DTypeRowBytes(l.expert_gate[0].type, 256);
    EXPECT_EQ(static_cast<const uint8_t*>(l.expert_gate[3].data),
              static_cast<const uint8_t*>(l.expert_gate[0].data) + 3 * expert_bytes);
    EXPECT_EQ(l.expert_down[5].rows, 256);
    EXPECT_EQ(l.expert_down[5].cols, 128);
    EXPECT_EQ(l.shared_expert_gate != nullptr, k.shared);
  }
}

// A decode step reads the router, the shared expert and 2 of the 8 experts of each layer.
TEST(Moe, ActiveBytesCountTheChosenExperts) {
  auto model = Model::Load(WriteShape("tiny-qwen3moe", DType::kQ8_0, "_q8"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const Model& m = **model;
  size_t experts = 0;
  for (const LayerWeights& l : m.layers) {
    for (const auto* list : {&l.expert_gate, &l.expert_up, &l.expert_down}) {
      for (const WeightView& w : *list) experts += static_cast<size_t>(w.rows) * DTypeRowBytes(w.type, w.cols);
    }
  }
  const size_t embedding = static_cast<size_t>(m.token_embedding.rows) *
                           DTypeRowBytes(m.token_embedding.type, m.token_embedding.cols);
  const size_t embedding_row = DTypeRowBytes(m.token_embedding.type, m.token_embedding.cols);
  EXPECT_EQ(m.ActiveWeightBytesPerToken(), m.WeightBytes() - embedding + embedding_row - experts + experts / 4);
  EXPECT_NE(m.Summary().find("2 of 8 experts"), std::string::npos) << m.Summary();
}

TEST(Moe, RouteToExpertsFollowsLlamaCpp) {
  using engine_detail::RouterRule;
  const float logits[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.5f, -3.0f};
  double total = 0;
  for (float l : logits) total += std::exp(static_cast<double>(l));
  int32_t experts[3];
  float weights[3];
  float probs[6];
  engine_detail::RouteToExperts(logits, RouterRule{6, 3}, probs, experts, weights);
  EXPECT_EQ(experts[0], 1);  // the lower id first among equals
  EXPECT_EQ(experts[1], 3);
  EXPECT_EQ(experts[2], 4);
  EXPECT_NEAR(weights[0], std::exp(2.0) / total, 1e-6);
  EXPECT_NEAR(weights[2], std::exp(1.5) / total, 1e-6);
  engine_detail::RouteToExperts(logits, RouterRule{6, 3, ExpertGating::kSoftmax, nullptr, true, 2.5f}, probs, experts,
                                weights);
  const double chosen = 2 * std::exp(2.0) + std::exp(1.5);
  EXPECT_NEAR(weights[0], 2.5 * std::exp(2.0) / chosen, 1e-6);
  EXPECT_NEAR(weights[0] + weights[1] + weights[2], 2.5, 1e-5);
  // gpt-oss: the same choice, weighted by the softmax of the chosen logits only.
  engine_detail::RouteToExperts(logits, RouterRule{6, 3, ExpertGating::kSoftmaxChosen}, probs, experts, weights);
  EXPECT_EQ(experts[0], 1);
  EXPECT_EQ(experts[2], 4);
  EXPECT_NEAR(weights[0], std::exp(2.0) / chosen, 1e-6);
  EXPECT_NEAR(weights[2], std::exp(1.5) / chosen, 1e-6);
  // NaN logits never crash the choice: distinct, valid experts.
  const float nan_logits[4] = {NAN, 1.0f, NAN, 0.0f};
  engine_detail::RouteToExperts(nan_logits, RouterRule{4, 3, ExpertGating::kSoftmax, nullptr, true, 1.0f}, probs,
                                experts, weights);
  EXPECT_EQ(experts[0], 1);
  EXPECT_EQ(experts[1], 3);
  EXPECT_TRUE(experts[2] == 0 || experts[2] == 2);
}

// DeepSeek-V3's rule: sigmoid weights, chosen by weight plus a selection bias that does not enter
// the weights.
TEST(Moe, SigmoidGatingWithSelectionBias) {
  using engine_detail::RouterRule;
  const float logits[4] = {1.0f, 0.0f, 2.0f, -1.0f};
  const float bias[4] = {0.0f, 0.9f, 0.0f, 0.0f};
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  int32_t experts[2];
  float weights[2];
  float probs[4];
  engine_detail::RouteToExperts(logits, RouterRule{4, 2, ExpertGating::kSigmoid, bias, false, 1.0f}, probs, experts,
                                weights);
  EXPECT_EQ(experts[0], 1);  // sigmoid(0) + 0.9 = 1.4 beats sigmoid(2) = 0.88
  EXPECT_EQ(experts[1], 2);
  EXPECT_NEAR(weights[0], sigmoid(0.0), 1e-6);
  EXPECT_NEAR(weights[1], sigmoid(2.0), 1e-6);
  engine_detail::RouteToExperts(logits, RouterRule{4, 2, ExpertGating::kSigmoid, nullptr, true, 2.0f}, probs, experts,
                                weights);
  EXPECT_EQ(experts[0], 2);
  EXPECT_EQ(experts[1], 0);
  EXPECT_NEAR(weights[0], 2.0 * sigmoid(2.0) / (sigmoid(2.0) + sigmoid(1.0)), 1e-6);
}

// Rows grouped by expert give each row what it gets alone: the whole prompt at once, token by
// token, and two sequences batched in one step, with quantized weights (deepseek2: the latent
// cache and the absorbed projections over batched rows too).
class MoeGroupedTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeGroupedTest, GroupedPromptEqualsDecode) {
  auto model = Model::Load(WriteShape(GetParam(), DType::kQ8_0, "_q8"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const Model& m = **model;
  const int n = 24, vocab = m.config().n_vocab;
  std::vector<int32_t> tokens;
  for (int i = 0; i < n; ++i) tokens.push_back((i * 53 + 7) % 1000);
  std::vector<float> prompt(static_cast<size_t>(n) * vocab), decode(prompt.size());
  {
    ContiguousKvCache cache(ModelKvGeometry(m), KvStorage::kF32, 1, n);
    Engine engine(m, &cache, 2);
    ASSERT_TRUE(engine.Forward(0, tokens.data(), n, 0, prompt.data(), /*all_logits=*/true).ok());
  }
  {
    ContiguousKvCache cache(ModelKvGeometry(m), KvStorage::kF32, 2, n);
    Engine engine(m, &cache, 2);
    for (int i = 0; i < n; ++i) {
      // Sequence 1 runs the same tokens beside it in the same steps.
      std::vector<float> other(static_cast<size_t>(vocab));
      BatchSequence batch[2];
      batch[0] = BatchSequence{0, &tokens[i], 1, i};
      batch[0].logits = &decode[static_cast<size_t>(i) * vocab];
      batch[1] = BatchSequence{1, &tokens[i], 1, i};
      batch[1].logits = other.data();
      ASSERT_TRUE(engine.ForwardBatch(batch).ok());
      for (int j = 0; j < vocab; ++j) ASSERT_NEAR(other[j], decode[static_cast<size_t>(i) * vocab + j], 1e-5);
    }
  }
  double worst = 0;
  for (size_t i = 0; i < prompt.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(prompt[i] - decode[i])));
  // Q8_0 activations quantized per row: the paths differ in the last bits only.
  EXPECT_LT(worst, 0.05);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeGroupedTest, ::testing::Values("tiny-qwen2moe", "tiny-deepseek2", "tiny-deepseek3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& ch : name) ch = ch == '-' ? '_' : ch;
                           return name;
                         });

// Rewrites the u32 value of metadata `key` in a GGUF file's bytes.
void PatchU32(const std::string& path, const std::string& key, uint32_t value) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const uint64_t length = key.size();
  const std::string needle = std::string(reinterpret_cast<const char*>(&length), sizeof(length)) + key;
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos) << key;
  const size_t value_at = at + needle.size() + sizeof(uint32_t);  // past the type tag
  uint32_t type;
  std::memcpy(&type, &bytes[at + needle.size()], sizeof(type));
  ASSERT_EQ(type, 4u) << key << " is not a u32";
  std::memcpy(&bytes[value_at], &value, sizeof(value));
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(Moe, BadExpertMetadataIsAnError) {
  struct Case {
    const char* key;
    uint32_t value;
    const char* message;
  };
  for (const Case& k : {Case{"qwen3moe.expert_count", 0, "'qwen3moe.expert_count' = 0 is out of range"},
                        Case{"qwen3moe.expert_used_count", 9, "'qwen3moe.expert_used_count' = 9 exceeds"},
                        Case{"qwen3moe.expert_used_count", 0, "'qwen3moe.expert_used_count' = 0 is out of range"},
                        Case{"qwen3moe.expert_count", 7, "'blk.0.ffn_gate_inp.weight' has shape [256, 8], expected "
                                                         "[256, 7]"},
                        Case{"qwen3moe.expert_count", 100000, "out of range [1, 4096]"},
                        Case{"qwen3moe.expert_feed_forward_length", 96,
                             "'blk.0.ffn_gate_exps.weight' has shape [256, 128, 8], expected [256, 96, 8]"}}) {
    SCOPED_TRACE(k.key);
    const std::string path = WriteShape("tiny-qwen3moe", DType::kF32, "_bad");
    PatchU32(path, k.key, k.value);
    auto model = Model::Load(path);
    ASSERT_FALSE(model.ok());
    EXPECT_NE(model.status().message().find(k.message), std::string::npos) << model.status().ToString();
  }
}

// gpt-oss's sinks reach every attention path: each method (shared tables, per-head tables with
// Quest's per-query-head jobs, razor's compensation merge, the decode batch) runs a prompt chunk
// and decode steps on tiny-gpt-oss to finite logits, at f16 and int8 pages; a path that dropped a
// job's sinks would abort in AttentionBatch. The full cache equals the contiguous one's logits.
TEST(Moe, EveryMethodRunsWithSinks) {
  auto model = Model::Load(WriteShape("tiny-gpt-oss"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 11) % 1000);
  const int n = static_cast<int>(tokens.size());
  const size_t vocab = static_cast<size_t>(c.n_vocab);
  std::vector<float> reference(static_cast<size_t>(n) * vocab), logits;
  {
    ContiguousKvCache cache(ModelKvGeometry(**model), KvStorage::kF32, 1, n);
    Engine engine(**model, &cache, 2);
    ASSERT_TRUE(engine.Forward(0, tokens.data(), n, 0, reference.data(), /*all_logits=*/true).ok());
  }
  auto run = [&](const std::string& method, const std::string& type) -> Status {
    auto flags = KvSparsityConfigFromFlags(method, method == "full" ? "" : "0.5", type, c.n_layers);
    KVS_RETURN_IF_ERROR(flags.status());
    auto runtime = CreateRuntime(**model, &*flags, KvStorage::kF32, 1, n, 2);
    KVS_RETURN_IF_ERROR(runtime.status());
    logits.assign(static_cast<size_t>(n) * vocab, 0.0f);
    KVS_RETURN_IF_ERROR((*runtime)->engine->Forward(0, tokens.data(), 24, 0, logits.data(), true));
    for (int i = 24; i < n; ++i) {
      KVS_RETURN_IF_ERROR((*runtime)->engine->Forward(0, &tokens[i], 1, i, &logits[static_cast<size_t>(i) * vocab]));
    }
    return Status::Ok();
  };
  ASSERT_TRUE(run("full", "f32").ok());
  double worst = 0;
  for (size_t i = 0; i < logits.size(); ++i) worst = std::max(worst, std::abs(double{logits[i]} - reference[i]));
  EXPECT_LT(worst, 1e-3) << "paged full cache against the contiguous one";
  const std::string names = ValidKvMethodNames();  // "full, streaming_llm, ..."
  for (size_t start = 0; start < names.size();) {
    const size_t end = std::min(names.find(", ", start), names.size());
    const std::string method = names.substr(start, end - start);
    start = end + 2;
    for (const char* type : {"f16", "int8"}) {
      const Status status = run(method, type);
      ASSERT_TRUE(status.ok()) << method << " " << type << ": " << status.ToString();
      for (float v : logits) ASSERT_TRUE(std::isfinite(v)) << method << " " << type;
    }
  }
}

// gpt-oss: the expert width against the experts' tensors and their bias tables; an MXFP4 tensor
// whose blocks are read as another type's (17-byte blocks where 18 are expected) is refused.
TEST(Moe, BadGptOssInputIsAnError) {
  {
    const std::string path = WriteShape("tiny-gpt-oss", DType::kF32, "_bad");
    PatchU32(path, "gpt-oss.expert_feed_forward_length", 96);
    auto model = Model::Load(path);
    ASSERT_FALSE(model.ok());
    EXPECT_NE(model.status().message().find("expected [256, 96, 8]"), std::string::npos) << model.status().ToString();
  }
  const std::string path = WriteShape("tiny-gpt-oss", DType::kMXFP4, "_bad_mxfp4");
  ASSERT_TRUE(Model::Load(path).ok());
  // The tensor info: name, n_dims (u32), n_dims x i64 dims, then the ggml type (u32).
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string name = "blk.0.ffn_up_exps.weight";
  const size_t at = bytes.find(name);
  ASSERT_NE(at, std::string::npos);
  const size_t type_at = at + name.size() + sizeof(uint32_t) + 3 * sizeof(int64_t);
  uint32_t type;
  std::memcpy(&type, &bytes[type_at], sizeof(type));
  ASSERT_EQ(type, 39u);  // MXFP4
  const uint32_t iq4_nl = 20;
  std::memcpy(&bytes[type_at], &iq4_nl, sizeof(iq4_nl));
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto model = Model::Load(path);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find(name), std::string::npos) << model.status().ToString();
}

// deepseek2's latent attention: each rank and length is checked against the tensors.
TEST(Moe, BadLatentMetadataIsAnError) {
  struct Case {
    const char* shape;
    const char* key;
    uint32_t value;
    const char* message;
  };
  for (const Case& k : {
           Case{"tiny-deepseek3", "deepseek2.attention.kv_lora_rank", 0, "'deepseek2.attention.kv_lora_rank' = 0 is out of range"},
           Case{"tiny-deepseek3", "deepseek2.attention.kv_lora_rank", 48, "MLA cache row is kv_lora_rank + rope dims = 48 + 16"},
           Case{"tiny-deepseek3", "deepseek2.attention.q_lora_rank", 64, "'blk.0.attn_q_a.weight' has shape [256, 96], expected [256, 64]"},
           Case{"tiny-deepseek3", "deepseek2.rope.dimension_count", 8, "kv_lora_rank + rope dims = 64 + 8"},
           Case{"tiny-deepseek3", "deepseek2.attention.key_length_mla", 40, "'blk.0.attn_q_b.weight' has shape [96, 192], expected [96, 160]"},
           Case{"tiny-deepseek3", "deepseek2.attention.value_length_mla", 16, "'blk.0.attn_v_b.weight' has shape [64, 32, 4], expected [64, 16, 4]"},
           Case{"tiny-deepseek3", "deepseek2.expert_gating_func", 3, "'deepseek2.expert_gating_func' = 3 is not supported"},
           Case{"tiny-deepseek3", "deepseek2.leading_dense_block_count", 9, "'deepseek2.leading_dense_block_count' = 9 is out of range [0, 2]"},
           Case{"tiny-deepseek2-kvb", "deepseek2.attention.kv_lora_rank", 32, "'blk.0.attn_kv_a_mqa.weight' has shape [256, 80], expected [256, 48]"},
       }) {
    SCOPED_TRACE(std::string(k.shape) + " " + k.key);
    const std::string path = WriteShape(k.shape, DType::kF32, "_bad");
    PatchU32(path, k.key, k.value);
    auto model = Model::Load(path);
    ASSERT_FALSE(model.ok());
    EXPECT_NE(model.status().message().find(k.message), std::string::npos) << model.status().ToString();
  }
}

}  // namespace
}  // namespace kvsparse
