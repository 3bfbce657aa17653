// Synthetic models: shapes, keys, tensor names/types, vocab, determinism and weight scale.
#include "kvsparse/synth.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numbers>
#include <set>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/ops.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void ExpectTensor(const GgufFile& f, const std::string& name, std::vector<int64_t> ne, DType type) {
  const GgufTensorInfo* t = f.FindTensor(name);
  ASSERT_NE(t, nullptr) << name;
  EXPECT_EQ(t->ne, ne) << name;
  ASSERT_TRUE(t->type.has_value()) << name;
  EXPECT_EQ(*t->type, type) << name << " is " << DTypeName(*t->type);
}

// Checks metadata and every tensor of a synth model against its shape.
void CheckModel(const GgufFile& f, const SynthShape& s, DType weight_type, int n_layers) {
  const std::string a = s.arch + ".";
  EXPECT_EQ(f.GetString("general.architecture").value(), s.arch);
  EXPECT_TRUE(f.GetString("general.name").ok());
  EXPECT_TRUE(f.GetUInt("general.file_type").ok());
  EXPECT_EQ(f.GetUInt(a + "context_length").value(), static_cast<uint64_t>(s.context));
  EXPECT_EQ(f.GetUInt(a + "embedding_length").value(), static_cast<uint64_t>(s.dim));
  EXPECT_EQ(f.GetUInt(a + "block_count").value(), static_cast<uint64_t>(n_layers));
  EXPECT_EQ(f.GetUInt(a + "feed_forward_length").value(), static_cast<uint64_t>(s.hidden_dim));
  EXPECT_EQ(f.GetUInt(a + "attention.head_count").value(), static_cast<uint64_t>(s.n_heads));
  // (llama.cpp's older deepseek2 files, with the whole attn_kv_b, count one KV head per head.)
  EXPECT_EQ(f.GetUInt(a + "attention.head_count_kv").value(),
            static_cast<uint64_t>(s.mla_unsplit_kv_b ? s.n_heads : s.n_kv_heads));
  EXPECT_FLOAT_EQ(static_cast<float>(f.GetFloat(a + "attention.layer_norm_rms_epsilon").value()), s.rms_eps);
  EXPECT_FLOAT_EQ(static_cast<float>(f.GetFloat(a + "rope.freq_base").value()), s.rope_theta);
  const int64_t hd = s.head_dim > 0 ? s.head_dim : s.dim / s.n_heads;
  // MLA rotates only a tail of each head.
  const int64_t rotated = s.kv_lora_rank > 0 ? s.mla_rope_dim : hd;
  EXPECT_EQ(f.GetUInt(a + "rope.dimension_count").value(), static_cast<uint64_t>(rotated));
  EXPECT_EQ(f.GetUInt(a + "vocab_size").value(), static_cast<uint64_t>(s.n_vocab));
  EXPECT_EQ(f.GetStringArray("tokenizer.ggml.tokens").value()->size(), static_cast<size_t>(s.n_vocab));

  // The tensor list below is the llama family's; gemma2/gemma3/phi3 (post-norms, fused
  // projections, LongRoPE tables) are loaded and checked tensor by tensor in architectures_test,
  // the mixtures of experts in moe_test.
  if ((s.arch != "llama" && s.arch != "qwen2" && s.arch != "qwen3") || s.n_experts > 0) return;
  auto wt = [&](int64_t cols) {
    return cols % DTypeBlockSize(weight_type) == 0 ? weight_type : DType::kQ8_0;
  };
  ExpectTensor(f, "token_embd.weight", {s.dim, s.n_vocab}, wt(s.dim));
  ExpectTensor(f, "output_norm.weight", {s.dim}, DType::kF32);
  if (s.tied_output) {
    EXPECT_EQ(f.FindTensor("output.weight"), nullptr);
  } else {
    ExpectTensor(f, "output.weight", {s.dim, s.n_vocab}, wt(s.dim));
  }
  size_t per_layer = s.qkv_bias ? 12 : s.arch == "qwen3" ? 11 : 9;
  const bool llama3_rope = s.rope_llama3_factor > 0;
  EXPECT_EQ(f.tensors().size(), 2 + (s.tied_output ? 0 : 1) + (llama3_rope ? 1 : 0) + per_layer * n_layers);
  if (llama3_rope) {
    ExpectTensor(f, "rope_freqs.weight", {hd / 2}, DType::kF32);
    const float* factors = static_cast<const float*>(f.FindTensor("rope_freqs.weight")->data);
    EXPECT_FLOAT_EQ(factors[0], 1.0f);  // highest frequency: unscaled
    for (int64_t i = 1; i < hd / 2; ++i) EXPECT_GE(factors[i], factors[i - 1]);
  } else {
    EXPECT_EQ(f.FindTensor("rope_freqs.weight"), nullptr);
  }
  for (int l = 0; l < n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    ExpectTensor(f, b + "attn_norm.weight", {s.dim}, DType::kF32);
    ExpectTensor(f, b + "attn_q.weight", {s.dim, s.n_heads * hd}, wt(s.dim));
    ExpectTensor(f, b + "attn_k.weight", {s.dim, s.n_kv_heads * hd}, wt(s.dim));
    ExpectTensor(f, b + "attn_v.weight", {s.dim, s.n_kv_heads * hd}, wt(s.dim));
    ExpectTensor(f, b + "attn_output.weight", {s.n_heads * hd, s.dim}, wt(s.n_heads * hd));
    ExpectTensor(f, b + "ffn_norm.weight", {s.dim}, DType::kF32);
    ExpectTensor(f, b + "ffn_gate.weight", {s.dim, s.hidden_dim}, wt(s.dim));
    ExpectTensor(f, b + "ffn_up.weight", {s.dim, s.hidden_dim}, wt(s.dim));
    ExpectTensor(f, b + "ffn_down.weight", {s.hidden_dim, s.dim}, wt(s.hidden_dim));
    if (s.qkv_bias) {
      ExpectTensor(f, b + "attn_q.bias", {s.n_heads * hd}, DType::kF32);
      ExpectTensor(f, b + "attn_k.bias", {s.n_kv_heads * hd}, DType::kF32);
      ExpectTensor(f, b + "attn_v.bias", {s.n_kv_heads * hd}, DType::kF32);
    } else {
      EXPECT_EQ(f.FindTensor(b + "attn_q.bias"), nullptr);
    }
  }
}

TEST(Synth, RealShapesMatchPublishedConfigs) {
  auto tl = FindSynthShape("tinyllama-1.1b").value();
  EXPECT_EQ(tl.n_vocab, 32000);
  EXPECT_EQ(tl.dim, 2048);
  EXPECT_EQ(tl.hidden_dim, 5632);
  EXPECT_EQ(tl.n_layers, 22);
  EXPECT_EQ(tl.n_kv_heads, 4);
  EXPECT_FALSE(tl.tied_output);
  auto l32 = FindSynthShape("llama-3.2-1b").value();
  EXPECT_EQ(l32.n_vocab, 128256);
  EXPECT_EQ(l32.hidden_dim, 8192);
  EXPECT_TRUE(l32.tied_output);
  EXPECT_FLOAT_EQ(l32.rope_theta, 500000.0f);
  auto qw = FindSynthShape("qwen2.5-0.5b").value();
  EXPECT_EQ(qw.arch, "qwen2");
  EXPECT_EQ(qw.n_vocab, 151936);
  EXPECT_EQ(qw.dim, 896);
  EXPECT_EQ(qw.n_heads, 14);
  EXPECT_EQ(qw.n_kv_heads, 2);
  EXPECT_TRUE(qw.qkv_bias);
  EXPECT_TRUE(qw.tied_output);
  auto l8 = FindSynthShape("llama-3.1-8b").value();
  EXPECT_EQ(l8.dim, 4096);
  EXPECT_EQ(l8.hidden_dim, 14336);
  EXPECT_EQ(l8.n_layers, 32);
  EXPECT_FLOAT_EQ(l8.rope_llama3_factor, 8.0f);
  EXPECT_FLOAT_EQ(l32.rope_llama3_factor, 32.0f);
  EXPECT_EQ(tl.rope_llama3_factor, 0.0f);
}

TEST(Synth, Llama3RopeFactors) {
  const SynthShape s = FindSynthShape("tiny-gqa-untied").value();  // head_dim 16, theta 1e4, factor 8
  std::string path = testing::TempPath("synth_rope.gguf");
  SynthOptions o;
  o.n_layers_override = 1;
  ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  const GgufTensorInfo* t = (*f)->FindTensor("rope_freqs.weight");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->ne, (std::vector<int64_t>{8}));
  const float* x = static_cast<const float*>(t->data);
  // Wavelength 2*pi*1e4^(2i/16): i <= 5 below 2048 (unscaled), i = 7 above 8192 (factor 8),
  // i = 6 (6283) in between: smooth = (8192/6283 - 1)/3, factor 1/((1-smooth)/8 + smooth).
  for (int i = 0; i <= 5; ++i) EXPECT_FLOAT_EQ(x[i], 1.0f) << i;
  EXPECT_FLOAT_EQ(x[7], 8.0f);
  const double wavelen6 = 2 * std::numbers::pi * std::pow(1e4, 12.0 / 16.0);
  const double smooth = (8192.0 / wavelen6 - 1) / 3;
  EXPECT_NEAR(x[6], 1.0 / ((1 - smooth) / 8 + smooth), 1e-3);
}

TEST(Synth, UnknownShapeListsValidNames) {
  auto s = FindSynthShape("gpt-5");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("gpt-5"), std::string::npos);
  EXPECT_NE(s.status().message().find("tinyllama-1.1b"), std::string::npos);
  EXPECT_NE(s.status().message().find("tiny-qwen2"), std::string::npos);
}

TEST(Synth, EveryTinyShapeWritesAValidModel) {
  for (const SynthShape& s : SynthShapes()) {
    if (s.name.rfind("tiny-", 0) != 0) continue;
    SCOPED_TRACE(s.name);
    std::string path = testing::TempPath("synth_" + s.name + ".gguf");
    SynthOptions o;
    ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    CheckModel(**f, s, o.weight_type, s.n_layers);
  }
}

TEST(Synth, EveryWeightType) {
  const SynthShape s = FindSynthShape("tiny-llama-256").value();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_K}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    std::string path = testing::TempPath("synth_type.gguf");
    SynthOptions o;
    o.weight_type = t;
    o.n_layers_override = 1;
    ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    CheckModel(**f, s, t, 1);
  }
}

TEST(Synth, Q4KFallsBackToQ8_0ForShortRows) {
  const SynthShape s = FindSynthShape("tiny-qwen2").value();  // dim 64: not a multiple of 256
  std::string path = testing::TempPath("synth_q4k_fallback.gguf");
  SynthOptions o;
  o.weight_type = DType::kQ4_K;
  ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  CheckModel(**f, s, DType::kQ4_K, s.n_layers);
}

TEST(Synth, RejectsUnsupportedWeightType) {
  SynthOptions o;
  o.weight_type = DType::kQ8_K;
  Status st = WriteSynthModel(FindSynthShape("tiny-llama").value(), o, testing::TempPath("never.gguf"));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

TEST(Synth, DeterministicPerSeed) {
  const SynthShape s = FindSynthShape("tiny-gqa-untied").value();
  SynthOptions o;
  o.seed = 42;
  std::string p1 = testing::TempPath("synth_seed_a.gguf"), p2 = testing::TempPath("synth_seed_b.gguf");
  std::string p3 = testing::TempPath("synth_seed_c.gguf");
  ASSERT_TRUE(WriteSynthModel(s, o, p1).ok());
  ASSERT_TRUE(WriteSynthModel(s, o, p2).ok());
  o.seed = 43;
  ASSERT_TRUE(WriteSynthModel(s, o, p3).ok());
  std::string a = ReadAll(p1), b = ReadAll(p2), c = ReadAll(p3);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), c.size());
  EXPECT_NE(a, c);
}

TEST(Synth, WeightsAreScaledAndFinite) {
  const SynthShape s = FindSynthShape("tiny-llama-256").value();
  std::string path = testing::TempPath("synth_scale.gguf");
  SynthOptions o;
  o.weight_type = DType::kF32;
  o.n_layers_override = 1;
  ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  for (const GgufTensorInfo& t : (*f)->tensors()) {
    const float* x = static_cast<const float*>(t.data);
    const int64_t n = t.NumElements();
    double sum = 0, sum2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(x[i])) << t.name;
      sum += x[i];
      sum2 += static_cast<double>(x[i]) * x[i];
    }
    const double mean = sum / n, std = std::sqrt(sum2 / n - mean * mean);
    if (t.name.find("norm") != std::string::npos) {
      EXPECT_NEAR(mean, 1.0, 0.02) << t.name;
      EXPECT_LT(std, 0.05) << t.name;
    } else {
      const double want = 1.0 / std::sqrt(static_cast<double>(t.ne[0]));
      EXPECT_NEAR(mean, 0.0, want * 0.1) << t.name;
      EXPECT_NEAR(std, want, want * 0.05) << t.name;
    }
  }
}

TEST(Synth, GeneratedVocabIsValidSpm) {
  const SynthShape s = FindSynthShape("tiny-llama").value();
  std::string path = testing::TempPath("synth_vocab.gguf");
  ASSERT_TRUE(WriteSynthModel(s, SynthOptions{}, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok());
  const GgufFile& file = **f;
  EXPECT_EQ(file.GetString("tokenizer.ggml.model").value(), "llama");
  const auto& tokens = *file.GetStringArray("tokenizer.ggml.tokens").value();
  auto types = file.GetIntArray("tokenizer.ggml.token_type").value();
  auto scores = file.GetF32Array("tokenizer.ggml.scores").value();
  ASSERT_EQ(tokens.size(), 512u);
  ASSERT_EQ(types.size(), 512u);
  ASSERT_EQ(scores.size(), 512u);
  EXPECT_EQ(tokens[0], "<unk>");
  EXPECT_EQ(tokens[1], "<s>");
  EXPECT_EQ(tokens[2], "</s>");
  EXPECT_EQ(tokens[3], "<0x00>");
  EXPECT_EQ(tokens[3 + 255], "<0xFF>");
  for (int i = 3; i < 259; ++i) EXPECT_EQ(types[i], 6) << i;
  for (int i = 259; i < 512; ++i) EXPECT_EQ(types[i], 1) << i;
  EXPECT_EQ(tokens[259], "\xe2\x96\x81" "a");
  std::set<std::string_view> unique(tokens.begin(), tokens.end());
  EXPECT_EQ(unique.size(), tokens.size());
  EXPECT_EQ(file.GetUInt("tokenizer.ggml.bos_token_id").value(), 1u);
  EXPECT_EQ(file.GetUInt("tokenizer.ggml.eos_token_id").value(), 2u);
  EXPECT_EQ(file.GetUInt("tokenizer.ggml.unknown_token_id").value(), 0u);
}

TEST(Synth, CopiesVocabFromGguf) {
  KVS_SKIP_IF_NO_SHARED(vocab, "vocab/ggml-vocab-llama-spm.gguf");
  SynthShape s = FindSynthShape("tiny-llama").value();
  // Same vocab size as the file (32000) with a tiny body.
  s.name = "tiny-llama-32k";
  s.n_vocab = 32000;
  SynthOptions o;
  o.vocab_gguf = vocab;
  o.n_layers_override = 1;
  std::string path = testing::TempPath("synth_spm.gguf");
  ASSERT_TRUE(WriteSynthModel(s, o, path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto src = GgufFile::Open(vocab);
  ASSERT_TRUE(src.ok());
  for (const auto& [key, value] : (*src)->metadata()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    EXPECT_NE((*f)->Find(key), nullptr) << key;
  }
  EXPECT_EQ(*(*f)->GetStringArray("tokenizer.ggml.tokens").value(),
            *(*src)->GetStringArray("tokenizer.ggml.tokens").value());
  EXPECT_EQ((*f)->GetF32Array("tokenizer.ggml.scores").value(), (*src)->GetF32Array("tokenizer.ggml.scores").value());
  CheckModel(**f, s, o.weight_type, 1);
}

TEST(Synth, VocabSizeMismatchNamesBoth) {
  KVS_SKIP_IF_NO_SHARED(vocab, "vocab/ggml-vocab-llama-spm.gguf");
  SynthOptions o;
  o.vocab_gguf = vocab;
  Status st = WriteSynthModel(FindSynthShape("tiny-llama").value(), o, testing::TempPath("never.gguf"));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("32000"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("512"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("tiny-llama"), std::string::npos) << st.message();
}

TEST(Synth, BadShapesAreRejected) {
  SynthShape s = FindSynthShape("tiny-llama").value();
  s.dim = 60;  // not a multiple of the heads / blocks
  EXPECT_FALSE(WriteSynthModel(s, SynthOptions{}, testing::TempPath("never.gguf")).ok());
  s = FindSynthShape("tiny-llama").value();
  s.arch = "gpt2";
  EXPECT_FALSE(WriteSynthModel(s, SynthOptions{}, testing::TempPath("never.gguf")).ok());
  s = FindSynthShape("tiny-llama").value();
  s.n_vocab = 100;
  EXPECT_FALSE(WriteSynthModel(s, SynthOptions{}, testing::TempPath("never.gguf")).ok());
}

TEST(Synth, ShapesTheLoaderWouldRefuseAreRejected) {
  SynthShape s = FindSynthShape("tiny-llama").value();
  s.rms_eps = 0.0f;
  Status st = WriteSynthModel(s, SynthOptions{}, testing::TempPath("never.gguf"));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("epsilon"), std::string::npos) << st.message();
  s = FindSynthShape("tiny-llama").value();
  s.rope_theta = -1.0f;
  st = WriteSynthModel(s, SynthOptions{}, testing::TempPath("never.gguf"));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("theta"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("tiny-llama"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace kvsparse
