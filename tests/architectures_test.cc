// The architectures beyond llama/qwen (gemma2, gemma3, phi3, the mixtures of experts) and YaRN, on their tiny synth shapes
// with f32 weights: the loader's config (sliding pattern, softcaps, scales, RoPE tables), and the
// Engine's logits against the float64 reference model (tests/support/reference_model.cc, written
// from the formulas), on the prompt path and the decode path, past the 16-token windows, for
// every kernel family. The greedy ids against llama.cpp are in llamacpp_greedy_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/gguf.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/synth.h"
#include "support/per_isa_test.h"
#include "support/reference_model.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

std::unique_ptr<Model> LoadShape(const std::string& shape) {
  SynthOptions options;
  options.weight_type = DType::kF32;
  const std::string path = testing::TempPath("arch_" + shape + ".gguf");
  EXPECT_TRUE(WriteSynthModel(FindSynthShape(shape).value(), options, path).ok());
  auto model = Model::Load(path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? std::move(model).value() : nullptr;
}

TEST(Architectures, Gemma2Config) {
  const auto model = LoadShape("tiny-gemma2");
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  EXPECT_EQ(c.arch, Arch::kGemma2);
  EXPECT_EQ(c.ffn_activation, FfnActivation::kGeluTanh);
  EXPECT_TRUE(c.post_norms);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FLOAT_EQ(c.embedding_scale, 16.0f);  // sqrt(256)
  EXPECT_FLOAT_EQ(c.attn_softcap, 5.0f);
  EXPECT_FLOAT_EQ(c.final_softcap, 10.0f);
  EXPECT_FLOAT_EQ(c.AttentionLogitScale(0), 0.125f);  // 1/sqrt(head_dim 64)
  EXPECT_EQ(c.sliding_window, 16);
  EXPECT_EQ(c.sliding_layers, (std::vector<uint8_t>{1, 0, 1, 0}));  // every other layer, global last
  EXPECT_TRUE(model->rope_inv_freq_sliding.empty());                // the sliding layers share the global RoPE
  EXPECT_NE(model->layers[0].post_attn_norm, nullptr);
  EXPECT_NE(model->layers[0].post_ffn_norm, nullptr);
}

TEST(Architectures, Gemma3Config) {
  const auto model = LoadShape("tiny-gemma3");
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  EXPECT_EQ(c.arch, Arch::kGemma3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FLOAT_EQ(c.attn_softcap, 0.0f);
  EXPECT_FLOAT_EQ(c.final_softcap, 0.0f);
  EXPECT_EQ(c.head_dim, 128);  // 4 heads of 128 over a 256-wide residual
  EXPECT_EQ(c.sliding_layers, (std::vector<uint8_t>{1, 1, 1, 1, 1, 0, 1}));
  // Sliding layers turn at base 10000, the global ones at the file's 1e6.
  ASSERT_EQ(model->rope_inv_freq_sliding.size(), 64u);
  EXPECT_NEAR(model->rope_inv_freq_sliding[1], std::pow(10000.0, -2.0 / 128), 1e-7);
  EXPECT_NEAR(model->rope_inv_freq[1], std::pow(1e6, -2.0 / 128), 1e-7);
  EXPECT_EQ(model->RopeInvFreq(0), model->rope_inv_freq_sliding.data());
  EXPECT_EQ(model->RopeInvFreq(5), model->rope_inv_freq.data());
  EXPECT_EQ(ModelKvGeometry(*model).layer_window, (std::vector<int32_t>{16, 16, 16, 16, 16, 0, 16}));
}

TEST(Architectures, Phi3FusedProjectionsAndLongRope) {
  const auto model = LoadShape("tiny-phi3");
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  EXPECT_EQ(c.arch, Arch::kPhi3);
  const LayerWeights& l = model->layers[0];
  // Q, K, V and gate, up are row ranges of the fused tensors.
  const size_t row_bytes = DTypeRowBytes(l.wq.type, c.dim);
  EXPECT_EQ(static_cast<const uint8_t*>(l.wk.data), static_cast<const uint8_t*>(l.wq.data) + 256 * row_bytes);
  EXPECT_EQ(static_cast<const uint8_t*>(l.wv.data), static_cast<const uint8_t*>(l.wk.data) + 256 * row_bytes);
  EXPECT_EQ(static_cast<const uint8_t*>(l.w_up.data), static_cast<const uint8_t*>(l.w_gate.data) + 512 * row_bytes);
  // LongRoPE: the training context (4096) is past the original (1024): long factors by default.
  EXPECT_EQ(model->long_rope_original_context, 1024);
  EXPECT_EQ(model->rope_inv_freq, model->rope_inv_freq_long);
  model->SetContextLength(1024);
  EXPECT_EQ(model->rope_inv_freq, model->rope_inv_freq_short);
  model->SetContextLength(1025);
  EXPECT_EQ(model->rope_inv_freq, model->rope_inv_freq_long);
  // attn_factor sqrt(1 + ln 4 / ln 1024) on q and k: scores times its square.
  const double factor2 = 1.0 + std::log(4.0) / std::log(1024.0);
  EXPECT_NEAR(c.AttentionLogitScale(0), factor2 / std::sqrt(32.0), 1e-6);
}

TEST(Architectures, YarnTable) {
  const auto model = LoadShape("tiny-qwen2-yarn");
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  // The fastest pair turns many times over the original context: kept; the slowest: divided by 4.
  EXPECT_NEAR(model->rope_inv_freq[0], 1.0, 1e-7);
  const size_t last = model->rope_inv_freq.size() - 1;
  EXPECT_NEAR(model->rope_inv_freq[last], std::pow(1e6, -2.0 * static_cast<double>(last) / c.head_dim) / 4, 1e-9);
  EXPECT_NEAR(c.rope_mscale, 1.0 + 0.1 * std::log(4.0), 1e-6);
  EXPECT_NEAR(c.AttentionLogitScale(0), std::pow(1.0 + 0.1 * std::log(4.0), 2) / 4.0, 1e-6);  // head_dim 16
}

// Hostile metadata gets an error naming the key.
TEST(Architectures, BadGemmaMetadataIsAnError) {
  SynthOptions options;
  options.weight_type = DType::kF32;
  SynthShape shape = FindSynthShape("tiny-gemma2").value();
  shape.attn_softcap = -1.0f;
  const std::string path = testing::TempPath("arch_bad_gemma2.gguf");
  ASSERT_TRUE(WriteSynthModel(shape, options, path).ok());
  auto model = Model::Load(path);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("attn_logit_softcapping"), std::string::npos) << model.status().ToString();
}

// (shape, kernel family): logits against the float64 reference over 40 tokens.
class ArchitectureReferenceTest : public ::testing::TestWithParam<std::tuple<std::string, Isa>> {
 protected:
  testing::IsaGuard isa_guard_;
};


TEST_P(ArchitectureReferenceTest, MatchesFloat64Reference) {
  const auto& [shape, isa] = GetParam();
  KVS_SET_ISA_OR_SKIP(isa);
  const auto model = LoadShape(shape);
  ASSERT_NE(model, nullptr);
  auto reference = testing::ReferenceModel::Load(model->path());
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 11) % 500);
  const std::vector<double> want = (*reference)->Forward(tokens);
  const ModelConfig& c = model->config();
  const int n = static_cast<int>(tokens.size());
  const size_t vocab = static_cast<size_t>(c.n_vocab);
  std::vector<float> logits(static_cast<size_t>(n) * vocab);
  // f32 weights: only f32-vs-f64 arithmetic differs (measured <= 2e-6).
  constexpr double kTolerance = 1e-4;
  {
    ContiguousKvCache cache(ModelKvGeometry(*model), KvStorage::kF32, 1, n);
    Engine engine(*model, &cache, 2);
    ASSERT_TRUE(engine.Forward(0, tokens.data(), n, 0, logits.data(), /*all_logits=*/true).ok());
    EXPECT_LT(testing::WorstRowError(logits, want, vocab), kTolerance) << "prompt path";
  }
  {
    // The default runtime: paged with window trimming where the model has sliding layers.
    auto runtime = CreateRuntime(*model, nullptr, KvStorage::kF32, 1, n, 2);
    ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE((*runtime)->engine->Forward(0, &tokens[i], 1, i, &logits[static_cast<size_t>(i) * vocab]).ok());
    }
    EXPECT_LT(testing::WorstRowError(logits, want, vocab), kTolerance) << "decode path";
  }
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<std::string, Isa>>& info) {
  std::string name = std::get<0>(info.param) + "_" + std::string(IsaName(std::get<1>(info.param)));
  for (char& ch : name) ch = ch == '-' ? '_' : ch;
  return name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ArchitectureReferenceTest,
                         ::testing::Combine(::testing::Values("tiny-gemma2", "tiny-gemma3", "tiny-phi3",
                                                              "tiny-qwen2-yarn", "tiny-qwen3moe", "tiny-qwen2moe",
                                                              "tiny-olmoe", "tiny-mixtral", "tiny-deepseek2",
                                                              "tiny-deepseek3", "tiny-deepseek2-kvb", "tiny-gpt-oss"),
                                            ::testing::ValuesIn(testing::EndToEndFamilies())),
                         ParamName);

}  // namespace
}  // namespace kvsparse
