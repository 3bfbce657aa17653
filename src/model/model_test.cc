// Model loading (GGUF and llama2.c): configs, size accounting, and every loader error
// naming what is wrong. Forward-pass accuracy lives in tests/synthetic_model_test.cc and
// tests/stories260k_test.cc.
#include "kvsparse/engine.h"
#include "kvsparse/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/gguf.h"
#include "support/reference_model.h"
#include "support/shared_data.h"
#include "support/test_model_gguf.h"

namespace kvsparse {
namespace {

using testing::TempPath;
using testing::TinyModelSpec;
using testing::WriteTinyModelGguf;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Writes `spec` to a temp file and returns Model::Load's result.
StatusOr<std::unique_ptr<Model>> LoadSpec(const TinyModelSpec& spec, const std::string& name,
                                          const ModelLoadOptions& options = {}) {
  const std::string path = TempPath(name);
  Status written = WriteTinyModelGguf(spec, path);
  if (!written.ok()) return written;
  return Model::Load(path, options);
}

void WriteBytes(const std::string& path, const void* data, size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

// Logits [tokens.size(), n_vocab] from a fresh f32 cache.
std::vector<float> RunAll(const Model& model, const std::vector<int32_t>& tokens) {
  const ModelConfig& c = model.config();
  ContiguousKvCache cache(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1,
                          static_cast<int32_t>(tokens.size()));
  Engine engine(model, &cache, 1);
  std::vector<float> logits(tokens.size() * c.n_vocab);
  Status s = engine.Forward(0, tokens.data(), static_cast<int32_t>(tokens.size()), 0, logits.data(), true);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return logits;
}

// Re-packs an f32 llama GGUF as a llama2.c checkpoint holding the same weights.
void GgufToLlama2c(const std::string& gguf_path, const std::string& out_path) {
  auto file = GgufFile::Open(gguf_path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const GgufFile& f = **file;
  const int32_t dim = static_cast<int32_t>(*f.GetUInt("llama.embedding_length"));
  const int32_t n_layers = static_cast<int32_t>(*f.GetUInt("llama.block_count"));
  const int32_t n_heads = static_cast<int32_t>(*f.GetUInt("llama.attention.head_count"));
  const int32_t seq_len = static_cast<int32_t>(*f.GetUInt("llama.context_length"));
  const bool tied = f.FindTensor("output.weight") == nullptr;
  const int32_t vocab = static_cast<int32_t>(f.FindTensor("token_embd.weight")->ne[1]);
  const int32_t header[7] = {dim,
                             static_cast<int32_t>(*f.GetUInt("llama.feed_forward_length")),
                             n_layers,
                             n_heads,
                             static_cast<int32_t>(*f.GetUInt("llama.attention.head_count_kv")),
                             tied ? vocab : -vocab,
                             seq_len};
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  auto append = [&](const std::string& name) {
    const GgufTensorInfo* t = f.FindTensor(name);
    ASSERT_NE(t, nullptr) << name;
    ASSERT_EQ(t->ggml_type, 0u) << name << " must be f32";
    bytes.append(static_cast<const char*>(t->data), t->nbytes);
  };
  append("token_embd.weight");
  for (const char* per_layer : {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_down.weight",
                                "ffn_up.weight"}) {
    for (int l = 0; l < n_layers; ++l) append("blk." + std::to_string(l) + "." + per_layer);
  }
  append("output_norm.weight");
  // freq_cis_real / freq_cis_imag: ignored by loaders, so any values do.
  bytes.append(2 * static_cast<size_t>(seq_len) * (dim / n_heads / 2) * sizeof(float), '\0');
  if (!tied) append("output.weight");
  WriteBytes(out_path, bytes.data(), bytes.size());
}

// ---------------------------------------------------------------- GGUF loading

TEST(GgufModelLoader, ReadsConfigAndCountsParameters) {
  TinyModelSpec spec;  // dim 64, hidden 128, 2 layers, 4 heads, 2 kv heads, vocab 96, tied
  spec.tied_output = false;
  spec.weight_type = DType::kQ8_0;
  auto model = LoadSpec(spec, "loader_config.gguf");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.n_vocab, 96);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.max_context, 256);
  EXPECT_FALSE(c.tied_output);
  EXPECT_EQ((*model)->output.type, DType::kQ8_0);
  EXPECT_EQ((*model)->output.rows, 96);
  EXPECT_EQ((*model)->layers[1].wk.rows, 32);
  EXPECT_EQ((*model)->layers[1].wk.cols, 64);
  EXPECT_EQ((*model)->layers[1].w_down.rows, 64);
  EXPECT_EQ((*model)->layers[1].w_down.cols, 128);
  const int64_t per_layer = 2 * 64 + 64 * 64 * 2 + 2 * 32 * 64 + 3 * 128 * 64;
  EXPECT_EQ((*model)->ParameterCount(), 2 * 96 * 64 + 64 + 2 * per_layer);
  const size_t q8_bytes = 34;  // per 32 weights
  const size_t matrix_bytes = (2 * 96 * 64 + 2 * (64 * 64 * 2 + 2 * 32 * 64 + 3 * 128 * 64)) / 32 * q8_bytes;
  EXPECT_EQ((*model)->WeightBytes(), matrix_bytes + sizeof(float) * (64 + 2 * 2 * 64));
}

TEST(GgufModelLoader, ConvertsF16NormsToF32) {
  TinyModelSpec spec;
  spec.norm_type = DType::kF16;
  const std::string path = TempPath("loader_f16_norms.gguf");
  ASSERT_TRUE(WriteTinyModelGguf(spec, path).ok());
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto reference = testing::ReferenceModel::Load(path);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  const std::vector<int32_t> tokens = {1, 5, 9, 77, 3};
  const std::vector<float> got = RunAll(**model, tokens);
  const std::vector<double> want = (*reference)->Forward(tokens);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 * std::max(1.0, std::fabs(want[i])));
}

TEST(GgufModelLoader, LinearRopeScalingDividesFrequencies) {
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) {
    w.SetString("llama.rope.scaling.type", "linear");
    w.SetF32("llama.rope.scaling.factor", 4.0f);
  };
  auto model = LoadSpec(spec, "loader_linear_rope.gguf");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_FLOAT_EQ((*model)->rope_inv_freq[0], 0.25f);
  EXPECT_NEAR((*model)->rope_inv_freq[1], std::pow(10000.0, -2.0 / 16) / 4, 1e-7);
}

TEST(GgufModelLoader, MinimallyAlignedTensorDataComputesLikeDefault) {
  // general.alignment = 8 (the GGUF minimum) leaves tensors 8- but not 32-byte aligned,
  // so every kernel must read weights without assuming more (checked under UBSan in CI).
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0}) {
    TinyModelSpec spec;
    spec.weight_type = type;
    spec.tied_output = false;
    auto aligned = LoadSpec(spec, "loader_aligned.gguf");
    ASSERT_TRUE(aligned.ok()) << aligned.status().ToString();
    spec.extra_metadata = [](GgufWriter& w) { w.SetU32("general.alignment", 8); };
    auto packed = LoadSpec(spec, "loader_align8.gguf");
    ASSERT_TRUE(packed.ok()) << DTypeName(type) << ": " << packed.status().ToString();
    size_t off_32 = 0;
    for (const LayerWeights& l : (*packed)->layers) {
      for (const WeightView* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
        off_32 += reinterpret_cast<uintptr_t>(w->data) % 32 != 0;
      }
    }
    if (type == DType::kQ8_0 || type == DType::kQ4_0) {
      EXPECT_GT(off_32, 0u) << DTypeName(type);
    }
    const std::vector<int32_t> tokens = {1, 5, 9, 77, 3};
    EXPECT_EQ(RunAll(**packed, tokens), RunAll(**aligned, tokens)) << DTypeName(type);
  }
}

// Kept panels (Model::KeptPanelBytes: Q8_0 matrices packed at load on avx512, their file pages
// released) compute what the rows do: bit for bit with 5+ tokens (the same panels, packed per
// call without them), within f32 rounding in decode (panels instead of row strips). A tied output
// keeps panels while the embedding lookups fault its rows back in.
TEST(GgufModelLoader, KeptPanelsComputeLikeTheRows) {
  for (bool tied : {false, true}) {
    TinyModelSpec spec;
    spec.weight_type = DType::kQ8_0;
    spec.tied_output = tied;
    auto kept = LoadSpec(spec, "loader_kept.gguf");
    ASSERT_TRUE(kept.ok()) << kept.status().ToString();
    ::setenv("KVSPARSE_REPACK", "0", 1);
    auto rows = LoadSpec(spec, "loader_rows.gguf");
    ::unsetenv("KVSPARSE_REPACK");
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    EXPECT_EQ((*rows)->KeptPanelBytes(), 0u);
    // A metadata-only load (kvsparse inspect) packs nothing either.
    auto metadata_only = LoadSpec(spec, "loader_metadata.gguf", ModelLoadOptions{.keep_panels = false});
    ASSERT_TRUE(metadata_only.ok()) << metadata_only.status().ToString();
    EXPECT_EQ((*metadata_only)->KeptPanelBytes(), 0u);
    EXPECT_EQ((*metadata_only)->layers[0].wq.panels, nullptr);
    if ((*kept)->KeptPanelBytes() == 0) GTEST_SKIP() << "the active kernel family keeps no panels";
    EXPECT_NE((*kept)->layers[0].wq.panels, nullptr);
    EXPECT_NE((*kept)->output.panels, nullptr);
    EXPECT_EQ((*kept)->token_embedding.panels, nullptr);

    const std::vector<int32_t> tokens = {1, 5, 9, 77, 3, 12};
    EXPECT_EQ(RunAll(**kept, tokens), RunAll(**rows, tokens)) << "tied " << tied;
    // Decode: one token per step.
    const ModelConfig& c = (*kept)->config();
    std::vector<float> got(c.n_vocab), want(c.n_vocab);
    ContiguousKvCache cache_kept(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, 16);
    ContiguousKvCache cache_rows(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, 16);
    Engine engine_kept(**kept, &cache_kept, 2), engine_rows(**rows, &cache_rows, 2);
    for (int32_t pos = 0; pos < static_cast<int32_t>(tokens.size()); ++pos) {
      ASSERT_TRUE(engine_kept.Forward(0, &tokens[pos], 1, pos, got.data(), false).ok());
      ASSERT_TRUE(engine_rows.Forward(0, &tokens[pos], 1, pos, want.data(), false).ok());
      for (int32_t v = 0; v < c.n_vocab; ++v) {
        ASSERT_NEAR(got[v], want[v], 1e-4f * (1.f + std::fabs(want[v]))) << "tied " << tied << " pos " << pos;
      }
    }
  }
}

// ---------------------------------------------------------------- GGUF errors

TEST(ModelLoaderError, MissingTensorIsNamed) {
  TinyModelSpec spec;
  spec.omit_tensor = "blk.1.ffn_up.weight";
  auto model = LoadSpec(spec, "err_missing_tensor.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(model.status().message(), "'blk.1.ffn_up.weight'")) << model.status().message();
  EXPECT_TRUE(Contains(model.status().message(), "missing")) << model.status().message();
}

TEST(ModelLoaderError, WrongShapeNamesExpectedAndFound) {
  TinyModelSpec spec;
  spec.reshape_tensor = "blk.0.attn_k.weight";
  spec.reshape_ne = {64, 40};
  auto model = LoadSpec(spec, "err_shape.gguf");
  ASSERT_FALSE(model.ok());
  const std::string& m = model.status().message();
  EXPECT_EQ(model.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(m, "'blk.0.attn_k.weight'")) << m;
  EXPECT_TRUE(Contains(m, "[64, 40]")) << m;
  EXPECT_TRUE(Contains(m, "expected [64, 32]")) << m;
}

TEST(ModelLoaderError, UnsupportedTensorTypeIsNamed) {
  TinyModelSpec spec;
  spec.dim = 256;  // IQ2_XXS rows are 256-element blocks
  spec.hidden_dim = 256;
  spec.retype_tensor = "blk.0.ffn_down.weight";
  spec.retype_id = 16;  // iq2_xxs: a real ggml type kvsparse does not compute with
  auto model = LoadSpec(spec, "err_iq2xxs.gguf");
  ASSERT_FALSE(model.ok());
  const std::string& m = model.status().message();
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(m, "'blk.0.ffn_down.weight'")) << m;
  EXPECT_TRUE(Contains(m, "iq2_xxs")) << m;
  EXPECT_TRUE(Contains(m, "q6_K")) << m;  // lists the supported types
}

TEST(ModelLoaderError, HeadSizesAreCheckedAgainstTheFile) {
  {  // A hostile key_length is refused before anything is sized by it.
    TinyModelSpec spec;
    spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.attention.key_length", 1u << 30); };
    auto model = LoadSpec(spec, "err_key_length.gguf");
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE(Contains(model.status().message(), "head_dim must be in")) << model.status().message();
  }
  {  // A key_length the tensors do not have: the Q projection's shape is named.
    TinyModelSpec spec;
    spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.attention.key_length", 32); };
    auto model = LoadSpec(spec, "err_key_length_shape.gguf");
    ASSERT_FALSE(model.ok());
    EXPECT_TRUE(Contains(model.status().message(), "attn_q.weight")) << model.status().message();
  }
  {  // K and V head sizes must agree.
    TinyModelSpec spec;
    spec.head_dim = 16;
    spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.attention.value_length", 32); };
    auto model = LoadSpec(spec, "err_value_length.gguf");
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
    EXPECT_TRUE(Contains(model.status().message(), "value_length")) << model.status().message();
  }
}

TEST(ModelLoaderError, UnknownArchitectureListsSupportedOnes) {
  TinyModelSpec spec;
  spec.arch = "gpt-j";
  auto model = LoadSpec(spec, "err_arch.gguf");
  ASSERT_FALSE(model.ok());
  const std::string& m = model.status().message();
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(m, "'gpt-j'")) << m;
  EXPECT_TRUE(Contains(m, "llama")) << m;
  EXPECT_TRUE(Contains(m, "qwen2")) << m;
}

TEST(ModelLoaderError, Qwen2WithoutBiasesNamesTheBias) {
  TinyModelSpec spec;
  spec.arch = "qwen2";
  spec.qkv_bias = false;
  auto model = LoadSpec(spec, "err_qwen_bias.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), "'blk.0.attn_q.bias'")) << model.status().message();
}

TEST(ModelLoaderError, PartialRopeIsUnimplemented) {
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.rope.dimension_count", 8); };
  auto model = LoadSpec(spec, "err_partial_rope.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(model.status().message(), "partial RoPE")) << model.status().message();
}

TEST(ModelLoaderError, UnknownRopeScalingIsUnimplemented) {
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) { w.SetString("llama.rope.scaling.type", "longrope-v9"); };
  auto model = LoadSpec(spec, "err_rope_scaling.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(model.status().message(), "'longrope-v9'")) << model.status().message();
  EXPECT_TRUE(Contains(model.status().message(), "yarn")) << model.status().message();  // lists what is supported
}

TEST(ModelLoaderError, UnknownArchitectureListsTheSupportedOnes) {
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) { w.SetString("general.architecture", "mamba"); };
  auto model = LoadSpec(spec, "err_arch.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kUnimplemented);
  for (const char* name : {"'mamba'", "gemma2", "gemma3", "phi3", "qwen3"}) {
    EXPECT_TRUE(Contains(model.status().message(), name)) << model.status().message();
  }
}

TEST(ModelLoaderError, HugeBlockCountFailsBeforeAnythingIsSized) {
  // A hostile block_count must not size anything (layers, the sliding-layer pattern): more layers
  // than the file has tensors is refused at once; a count within them fails at the first missing layer.
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.block_count", INT32_MAX); };
  auto model = LoadSpec(spec, "err_huge_block_count.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(model.status().message(), "block_count")) << model.status().message();
  spec.extra_metadata = [](GgufWriter& w) { w.SetU32("llama.block_count", 3); };
  model = LoadSpec(spec, "err_block_count_3.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(model.status().message(), "'blk.2.attn_norm.weight'")) << model.status().message();
}

TEST(ModelLoaderError, EmbeddingLengthMustMatchTokenEmbedding) {
  // Checked before anything is sized by dim (1 << 30 would otherwise build a 2^28-entry RoPE table).
  for (uint32_t embedding_length : {128u, 1u << 30}) {
    TinyModelSpec spec;
    spec.extra_metadata = [=](GgufWriter& w) { w.SetU32("llama.embedding_length", embedding_length); };
    auto model = LoadSpec(spec, "err_embedding_length.gguf");
    ASSERT_FALSE(model.ok());
    const std::string& m = model.status().message();
    EXPECT_EQ(model.status().code(), StatusCode::kDataLoss);
    EXPECT_TRUE(Contains(m, "'token_embd.weight' has shape [64, 96]")) << m;
    EXPECT_TRUE(Contains(m, "expected [" + std::to_string(embedding_length) + " (llama.embedding_length)")) << m;
  }
}

TEST(ModelLoaderError, KvHeadsMustDivideHeads) {
  TinyModelSpec spec;
  spec.n_kv_heads = 3;
  auto model = LoadSpec(spec, "err_kv_heads.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), "n_kv_heads (3)")) << model.status().message();
}

TEST(ModelLoaderError, TokenizerSizeMustMatchEmbedding) {
  TinyModelSpec spec;
  spec.extra_metadata = [](GgufWriter& w) {
    w.SetStringArray("tokenizer.ggml.tokens", std::vector<std::string>(10, "x"));
  };
  auto model = LoadSpec(spec, "err_tokenizer_size.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), "10 tokens")) << model.status().message();
  EXPECT_TRUE(Contains(model.status().message(), "96 rows")) << model.status().message();
}

TEST(ModelLoaderError, VocabOnlyGgufIsNotAModel) {
  KVS_SKIP_IF_NO_SHARED(path, "vocab/ggml-vocab-llama-spm.gguf");
  auto model = Model::Load(path);
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), "token_embd.weight")) << model.status().message();
}

TEST(ModelLoaderError, MissingFileIsNotFound) {
  auto model = Model::Load("/nonexistent/kvsparse/model.gguf");
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(model.status().message(), "/nonexistent/kvsparse/model.gguf")) << model.status().message();
}

// ---------------------------------------------------------------- llama2.c

class Llama2cLoader : public ::testing::TestWithParam<bool> {};

TEST_P(Llama2cLoader, MatchesGgufOfTheSameWeights) {
  const bool tied = GetParam();
  TinyModelSpec spec;
  spec.tied_output = tied;
  const std::string gguf_path = TempPath(tied ? "l2c_tied.gguf" : "l2c_untied.gguf");
  const std::string l2c_path = TempPath(tied ? "l2c_tied.bin" : "l2c_untied.bin");
  ASSERT_TRUE(WriteTinyModelGguf(spec, gguf_path).ok());
  GgufToLlama2c(gguf_path, l2c_path);

  auto from_gguf = Model::Load(gguf_path);
  auto from_l2c = Model::Load(l2c_path);
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status().ToString();
  ASSERT_TRUE(from_l2c.ok()) << from_l2c.status().ToString();
  const ModelConfig& c = (*from_l2c)->config();
  EXPECT_EQ(c.tied_output, tied);
  EXPECT_EQ(c.n_vocab, 96);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ((*from_l2c)->gguf(), nullptr);
  EXPECT_EQ((*from_l2c)->ParameterCount(), (*from_gguf)->ParameterCount());

  const std::vector<int32_t> tokens = {1, 50, 95, 0, 7, 7, 33};
  const std::vector<float> a = RunAll(**from_gguf, tokens);
  const std::vector<float> b = RunAll(**from_l2c, tokens);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i;
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, Llama2cLoader, ::testing::Bool());

// A well-formed header for a small llama2.c model and its exact file size.
struct L2cHeader {
  int32_t v[7] = {64, 128, 2, 4, 2, 96, 32};  // dim hidden layers heads kv_heads vocab seq_len
  size_t Floats() const {
    const size_t d = v[0], h = v[1], L = v[2], kv = static_cast<size_t>(v[4]) * (v[0] / v[3]);
    const size_t V = static_cast<size_t>(std::abs(v[5])), S = v[6], hs = v[0] / v[3];
    return V * d + 2 * L * d + 2 * L * d * d + 2 * L * kv * d + 3 * L * h * d + d + S * hs + (v[5] < 0 ? V * d : 0);
  }
};

Status LoadL2c(const L2cHeader& h, size_t n_floats, const std::string& name) {
  std::vector<uint8_t> bytes(sizeof(h.v) + n_floats * sizeof(float));
  std::memcpy(bytes.data(), h.v, sizeof(h.v));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  for (size_t i = 0; i < n_floats; ++i) {
    const float x = dist(rng);
    std::memcpy(&bytes[sizeof(h.v) + i * sizeof(float)], &x, sizeof(x));
  }
  const std::string path = TempPath(name);
  WriteBytes(path, bytes.data(), bytes.size());
  auto model = Model::Load(path);
  return model.ok() ? Status::Ok() : model.status();
}

TEST(ModelLoaderError, Llama2cExactSizeLoads) {
  L2cHeader h;
  EXPECT_TRUE(LoadL2c(h, h.Floats(), "l2c_ok.bin").ok());
  h.v[5] = -96;  // untied classifier
  EXPECT_TRUE(LoadL2c(h, h.Floats(), "l2c_ok_untied.bin").ok());
}

TEST(ModelLoaderError, Llama2cTruncatedNamesBothSizes) {
  L2cHeader h;
  Status s = LoadL2c(h, h.Floats() - 1, "l2c_truncated.bin");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  const size_t expected = 28 + 4 * h.Floats();
  EXPECT_TRUE(Contains(s.message(), "implies " + std::to_string(expected) + " bytes")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "file has " + std::to_string(expected - 4) + " bytes")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "truncated")) << s.message();
  // An untied header over a tied-size file is also a mismatch.
  h.v[5] = -96;
  EXPECT_EQ(LoadL2c(h, h.Floats() - 96 * 64, "l2c_untied_short.bin").code(), StatusCode::kDataLoss);
}

TEST(ModelLoaderError, Llama2cTrailingBytesRejected) {
  L2cHeader h;
  Status s = LoadL2c(h, h.Floats() + 3, "l2c_trailing.bin");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(s.message(), "trailing")) << s.message();
}

TEST(ModelLoaderError, Llama2cBadHeadersNameTheField) {
  struct Case {
    int index;
    int32_t value;
    const char* expect;
  };
  for (const Case& c : {Case{0, 62, "multiple of n_heads"}, Case{4, 3, "multiple of n_kv_heads"},
                        Case{2, 0, "n_layers must be positive"}, Case{1, -5, "hidden_dim must be positive"},
                        Case{5, 0, "n_vocab must be positive"}, Case{5, INT32_MIN, "n_vocab must be positive"},
                        Case{3, 64, "even"}, Case{6, -1, "context_length must be positive"},
                        Case{0, INT32_MAX, "multiple of n_heads"}}) {
    L2cHeader h;
    h.v[c.index] = c.value;
    Status s = LoadL2c(h, 1000, "l2c_bad_header.bin");
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << c.expect;
    EXPECT_TRUE(Contains(s.message(), c.expect)) << s.message();
  }
}

TEST(ModelLoaderError, Llama2cHugeHeaderDoesNotOverflow) {
  L2cHeader h;
  h.v[0] = 1 << 30;
  h.v[1] = INT32_MAX;
  h.v[2] = INT32_MAX;
  h.v[3] = 1 << 29;
  h.v[4] = 1 << 29;
  h.v[5] = -INT32_MAX;
  h.v[6] = INT32_MAX;
  Status s = LoadL2c(h, 16, "l2c_huge.bin");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(s.message(), "truncated")) << s.message();
}

TEST(ModelLoaderError, TinyOrEmptyFileIsNeitherFormat) {
  const std::string path = TempPath("l2c_tiny.bin");
  WriteBytes(path, "GGU", 3);
  auto model = Model::Load(path);
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(Contains(model.status().message(), "too small")) << model.status().message();
  WriteBytes(path, "", 0);
  EXPECT_FALSE(Model::Load(path).ok());
}

TEST(ModelLoaderError, DirectoryIsNotAModelFile) {
  const std::string dir = std::filesystem::path(TempPath("x")).parent_path().string();
  using Loader = std::function<StatusOr<std::unique_ptr<Model>>(const std::string&)>;
  const Loader loaders[] = {[](const std::string& p) { return Model::Load(p); }, &Model::LoadLlama2c,
                            [](const std::string& p) { return Model::LoadGguf(p); }};
  for (const Loader& load : loaders) {
    auto model = load(dir);
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.status().code(), StatusCode::kInvalidArgument) << model.status().ToString();
    EXPECT_TRUE(Contains(model.status().message(), dir)) << model.status().message();
    EXPECT_TRUE(Contains(model.status().message(), "not a regular file")) << model.status().message();
  }
}

TEST(ModelLoaderError, RandomHeaderMutationsLoadOrFailCleanly) {
  // Mutations of metadata and tensor infos (not weights): each file either fails with a
  // Status or loads into a model whose forward pass runs (under ASan in CI).
  TinyModelSpec spec;
  spec.tied_output = false;
  spec.rope_freqs = true;
  spec.qkv_bias = true;
  spec.weight_type = DType::kQ8_0;
  const std::string seed_path = TempPath("fuzz_model_seed.gguf");
  ASSERT_TRUE(WriteTinyModelGguf(spec, seed_path).ok());
  std::string valid;
  {
    std::ifstream in(seed_path, std::ios::binary);
    valid.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto seed_file = GgufFile::Open(seed_path);
  ASSERT_TRUE(seed_file.ok()) << seed_file.status().ToString();
  // End of the last tensor info (name, n_dims, ne[], type, offset): everything before the data.
  const GgufTensorInfo& last = (*seed_file)->tensors().back();
  const size_t data_start = valid.rfind(last.name) + last.name.size() + 4 + 8 * last.ne.size() + 4 + 8;
  ASSERT_LT(data_start, valid.size());
  std::mt19937 rng(3);
  int loaded = 0;
  const std::string path = TempPath("fuzz_model.gguf");
  for (int it = 0; it < 400; ++it) {
    std::string b = valid;
    const int n_flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n_flips; ++k) {
      const size_t pos = 24 + rng() % (data_start - 24);  // after the header counts
      switch (rng() % 3) {
        case 0: b[pos] = static_cast<char>(rng()); break;
        case 1: b[pos] ^= static_cast<char>(1u << (rng() % 8)); break;
        case 2: b[pos] = static_cast<char>(0xFF); break;
      }
    }
    std::remove(path.c_str());
    WriteBytes(path, b.data(), b.size());
    auto model = Model::Load(path);
    if (!model.ok()) {
      EXPECT_FALSE(model.status().message().empty());
      continue;
    }
    ++loaded;
    const ModelConfig& c = (*model)->config();
    ContiguousKvCache cache(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, 4);
    Engine engine(**model, &cache, 1);
    std::vector<float> logits(c.n_vocab);
    const int32_t tokens[] = {0, c.n_vocab - 1};
    EXPECT_TRUE(engine.Forward(0, tokens, 2, 0, logits.data()).ok());
  }
  EXPECT_GT(loaded, 0);  // e.g. flips inside general.name
}

// ---------------------------------------------------------------- engine input errors

TEST(EngineBadInput, TokenIdsOutOfRangeAreRejected) {
  auto model = LoadSpec(TinyModelSpec{}, "engine_bad_input.gguf");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  ContiguousKvCache cache(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, 8);
  Engine engine(**model, &cache, 1);
  std::vector<float> logits(c.n_vocab);
  const int32_t tokens[] = {3, 96};
  Status s = engine.Forward(0, tokens, 2, 0, logits.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(Contains(s.message(), "token id 96 at index 1 is out of range [0, 96)")) << s.message();
  EXPECT_EQ(cache.NumTokens(0, 0), 0);
  EXPECT_EQ(engine.Forward(0, nullptr, 1, 0, logits.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.Forward(0, tokens, 1, 0, nullptr).code(), StatusCode::kInvalidArgument);
  const int32_t valid[] = {3, 4};
  EXPECT_EQ(engine.Forward(0, valid, 2, INT32_MAX, logits.data()).code(), StatusCode::kOutOfRange);
  // Positions must increase: replaying position 0 after it is stored is refused by the cache.
  ASSERT_TRUE(engine.Forward(0, tokens, 1, 0, logits.data()).ok());
  EXPECT_FALSE(engine.Forward(0, tokens, 1, 0, logits.data()).ok());
  // An unknown sequence id is an error, not a crash.
  EXPECT_FALSE(engine.Forward(5, tokens, 1, 0, logits.data()).ok());
}

}  // namespace
}  // namespace kvsparse
