// Engine logits vs the float64 ReferenceModel on tiny random GGUF models covering each
// architecture feature and each weight type. Both sides use the same (quantized) weights,
// so the difference is activation quantization inside MatMul plus float32 rounding.
//
// Error of a row of logits a against reference row b: max_i |a_i - b_i| / max(1, max_i |b_i|)
// (quantization error scales with the whole row, not with each logit); the worst row is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/model.h"
#include "support/per_isa_test.h"
#include "support/reference_model.h"
#include "support/shared_data.h"
#include "support/test_model_gguf.h"

namespace kvsparse {
namespace {

using testing::ReferenceModel;
using testing::TinyModelSpec;

struct Variant {
  const char* name;
  TinyModelSpec spec;
};

// Shapes are multiples of 256 so every type, Q4_K included, quantizes whole blocks.
TinyModelSpec BaseSpec() {
  TinyModelSpec s;
  s.n_vocab = 128;
  s.dim = 256;
  s.hidden_dim = 512;
  s.n_layers = 2;
  s.n_heads = 8;  // head_dim 32
  s.n_kv_heads = 2;  // GQA, group of 4
  return s;
}

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  v.push_back({"LlamaGqaTied", BaseSpec()});
  {
    TinyModelSpec s = BaseSpec();
    s.tied_output = false;
    s.n_kv_heads = 8;  // plain multi-head attention
    v.push_back({"LlamaUntiedMha", s});
  }
  {
    TinyModelSpec s = BaseSpec();
    s.rope_freqs = true;
    s.rope_theta = 500000.f;
    v.push_back({"LlamaRopeFreqs", s});
  }
  {
    TinyModelSpec s = BaseSpec();
    s.rope_theta = 1000.f;
    s.rms_eps = 1e-6f;
    v.push_back({"LlamaTheta1000", s});
  }
  {
    TinyModelSpec s = BaseSpec();
    s.arch = "qwen2";
    s.qkv_bias = true;
    s.rope_theta = 1000000.f;
    s.tied_output = false;
    v.push_back({"Qwen2BiasNeox", s});
  }
  {
    // Qwen3: per-head Q/K norms, no biases, and a head size decoupled from dim (8 x 64 = 512 > 256).
    TinyModelSpec s = BaseSpec();
    s.arch = "qwen3";
    s.head_dim = 64;
    s.qk_norm = true;
    s.rope_theta = 1000000.f;
    v.push_back({"Qwen3QkNormWideHeads", s});
  }
  return v;
}

// Measured worst errors: <= 1e-6 for the float types (same weights, f32 vs f64 arithmetic) and
// 1.8e-2 .. 3.6e-2 for the quantized ones, dominated by the Q8_0 / Q8_K quantization of
// activations inside MatMul. A real bug (wrong RoPE, layout, bias) costs far more: see
// ToleranceDetectsAWrongRopeTheta.
constexpr double kQuantizedTolerance = 8e-2;
double Tolerance(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return 1e-4;
    default:
      return kQuantizedTolerance;
  }
}


// (variant, weight type, kernel family): the reference match must hold for every family.
class SyntheticModelTest : public ::testing::TestWithParam<std::tuple<int, DType, Isa>> {
 protected:
  void SetUp() override {
    const auto [variant_index, type, isa] = GetParam();
    KVS_SET_ISA_OR_SKIP(isa);
    const Variant variant = Variants()[static_cast<size_t>(variant_index)];
    spec_ = variant.spec;
    spec_.weight_type = type;
    path_ = testing::TempPath(std::string("synthetic_") + variant.name + "_" + std::string(DTypeName(type)) + ".gguf");
    ASSERT_TRUE(testing::WriteTinyModelGguf(spec_, path_).ok());
    auto model = Model::Load(path_);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value();
    auto reference = ReferenceModel::Load(path_);
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    reference_ = std::move(reference).value();
    tokens_ = {1, 17, 99, 42, 42, 5, 127, 0, 64, 3, 88, 21, 21, 21, 110, 7, 50, 33, 2, 76};
    expected_ = reference_->Forward(tokens_);
  }

  std::unique_ptr<ContiguousKvCache> NewCache(KvStorage storage = KvStorage::kF32) const {
    const ModelConfig& c = model_->config();
    return std::make_unique<ContiguousKvCache>(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, storage, 1,
                                               static_cast<int32_t>(tokens_.size()));
  }

  double WorstError(const std::vector<float>& logits) const {
    return testing::WorstRowError(logits, expected_, static_cast<size_t>(reference_->n_vocab()));
  }

  TinyModelSpec spec_;
  std::string path_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ReferenceModel> reference_;
  std::vector<int32_t> tokens_;
  std::vector<double> expected_;  // [n_tokens, n_vocab]
  testing::IsaGuard isa_guard_;
};

TEST_P(SyntheticModelTest, ConfigMatchesSpec) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(ArchName(c.arch), spec_.arch);
  EXPECT_EQ(c.rope_style, spec_.arch == "llama" ? RopeStyle::kAdjacentPairs : RopeStyle::kNeox);
  EXPECT_EQ(c.qk_norm, spec_.qk_norm);
  EXPECT_EQ(c.n_vocab, spec_.n_vocab);
  EXPECT_EQ(c.dim, spec_.dim);
  EXPECT_EQ(c.hidden_dim, spec_.hidden_dim);
  EXPECT_EQ(c.n_heads, spec_.n_heads);
  EXPECT_EQ(c.n_kv_heads, spec_.n_kv_heads);
  EXPECT_EQ(c.head_dim, spec_.head_dim > 0 ? spec_.head_dim : spec_.dim / spec_.n_heads);
  EXPECT_EQ(c.max_context, spec_.context);
  EXPECT_EQ(c.tied_output, spec_.tied_output);
  EXPECT_FLOAT_EQ(c.rope_theta, spec_.rope_theta.value_or(10000.f));
  EXPECT_FLOAT_EQ(c.rms_eps, spec_.rms_eps);
  EXPECT_EQ(model_->token_embedding.type, spec_.weight_type);
  EXPECT_EQ(model_->layers[0].bq != nullptr, spec_.qkv_bias);
  EXPECT_NE(model_->gguf(), nullptr);
  ASSERT_EQ(model_->rope_inv_freq.size(), static_cast<size_t>(c.head_dim / 2));
  const double theta = spec_.rope_theta.value_or(10000.f);
  if (!spec_.rope_freqs) {
    EXPECT_NEAR(model_->rope_inv_freq[1], std::pow(theta, -2.0 / c.head_dim), 1e-7);
  }
}

TEST_P(SyntheticModelTest, PrefillMatchesReference) {
  auto cache = NewCache();
  Engine engine(*model_, cache.get(), 2);
  const int vocab = model_->config().n_vocab;
  std::vector<float> logits(tokens_.size() * vocab);
  Status s = engine.Forward(0, tokens_.data(), static_cast<int32_t>(tokens_.size()), 0, logits.data(), true);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const double err = WorstError(logits);
  RecordProperty("max_relative_error", std::to_string(err));
  EXPECT_LT(err, Tolerance(spec_.weight_type));
}

TEST_P(SyntheticModelTest, DecodeMatchesReference) {
  auto cache = NewCache();
  Engine engine(*model_, cache.get(), 2);
  const int vocab = model_->config().n_vocab;
  std::vector<float> logits(tokens_.size() * vocab);
  for (size_t i = 0; i < tokens_.size(); ++i) {
    Status s = engine.Forward(0, &tokens_[i], 1, static_cast<int32_t>(i), &logits[i * vocab]);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_LT(WorstError(logits), Tolerance(spec_.weight_type));
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<int, DType, Isa>>& info) {
  return std::string(Variants()[static_cast<size_t>(std::get<0>(info.param))].name) + "_" +
         std::string(DTypeName(std::get<1>(info.param))) + "_" + IsaName(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AllVariantsAndTypes, SyntheticModelTest,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(Variants().size())),
                                            ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                                              DType::kQ4_0, DType::kQ4_K),
                                            ::testing::ValuesIn(CompiledIsas())),
                         ParamName);

// The other block types llama-quantize writes (its mixes and fallbacks), on the base variant: the
// kernels are checked shape by shape in matmul_test, this checks that the loader and forward pass
// take them.
INSTANTIATE_TEST_SUITE_P(MixWeightTypes, SyntheticModelTest,
                         ::testing::Combine(::testing::Values(0),
                                            ::testing::Values(DType::kQ4_1, DType::kQ5_0, DType::kQ5_1, DType::kQ2_K,
                                                              DType::kQ3_K, DType::kQ5_K, DType::kQ6_K,
                                                              DType::kIQ4_NL, DType::kIQ4_XS),
                                            ::testing::ValuesIn(CompiledIsas())),
                         ParamName);

// The quantized tolerance must still catch a real mistake: the same q4_K weights with RoPE
// theta 1000 instead of 10000 (the reference reads the other file) must fail it clearly.
TEST(SyntheticModelSanity, ToleranceDetectsAWrongRopeTheta) {
  TinyModelSpec spec = BaseSpec();
  spec.weight_type = DType::kQ4_K;
  const std::string default_theta = testing::TempPath("sanity_theta_default.gguf");
  ASSERT_TRUE(testing::WriteTinyModelGguf(spec, default_theta).ok());
  spec.rope_theta = 1000.f;
  const std::string theta_1000 = testing::TempPath("sanity_theta_1000.gguf");
  ASSERT_TRUE(testing::WriteTinyModelGguf(spec, theta_1000).ok());

  auto model = Model::Load(theta_1000);
  auto reference = ReferenceModel::Load(default_theta);
  ASSERT_TRUE(model.ok() && reference.ok());
  const ModelConfig& c = (*model)->config();
  const std::vector<int32_t> tokens = {1, 17, 99, 42, 42, 5, 127, 0, 64, 3, 88, 21};
  ContiguousKvCache cache(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, 16);
  Engine engine(**model, &cache, 2);
  std::vector<float> logits(tokens.size() * c.n_vocab);
  ASSERT_TRUE(engine.Forward(0, tokens.data(), static_cast<int32_t>(tokens.size()), 0, logits.data(), true).ok());
  const double err = testing::WorstRowError(logits, (*reference)->Forward(tokens), static_cast<size_t>(c.n_vocab));
  RecordProperty("max_relative_error", std::to_string(err));
  EXPECT_GT(err, 2 * kQuantizedTolerance);
}

}  // namespace
}  // namespace kvsparse
