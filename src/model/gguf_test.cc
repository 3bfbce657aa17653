// GgufFile reader tests: real vocab files from ../shared and small hand-built files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "model/gguf_test_util.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

TEST(GgufReader, OpensSmallValidFile) {
  std::string path = WriteTemp("small_valid.gguf", SmallValidFile());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& file = **f;
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  ASSERT_EQ(file.metadata().size(), 3u);
  EXPECT_EQ(file.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(file.GetUInt("llama.block_count").value(), 2u);
  EXPECT_EQ(file.GetInt("llama.block_count").value(), 2);
  EXPECT_DOUBLE_EQ(file.GetFloat("llama.block_count").value(), 2.0);
  auto toks = file.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(toks.ok());
  ASSERT_EQ((*toks)->size(), 2u);
  EXPECT_EQ((**toks)[1], "bc");
  ASSERT_EQ(file.tensors().size(), 2u);
  const GgufTensorInfo* w = file.FindTensor("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(w->NumElements(), 8);
  EXPECT_EQ(w->nbytes, 32u);
  ASSERT_TRUE(w->type.has_value());
  EXPECT_EQ(*w->type, DType::kF32);
  EXPECT_FLOAT_EQ(static_cast<const float*>(w->data)[3], 3.5f);
  const GgufTensorInfo* b = file.FindTensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_FLOAT_EQ(static_cast<const float*>(b->data)[7], -7.0f);
  EXPECT_EQ(file.FindTensor("nope"), nullptr);
}

TEST(GgufReader, TypedGetterErrors) {
  std::string path = WriteTemp("getters.gguf", SmallValidFile());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& file = **f;
  auto missing = file.GetUInt("no.such.key");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no.such.key"), std::string::npos);
  auto wrong = file.GetUInt("general.architecture");
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("general.architecture"), std::string::npos);
  EXPECT_NE(wrong.status().message().find("string"), std::string::npos);
  EXPECT_FALSE(file.GetString("llama.block_count").ok());
  EXPECT_FALSE(file.GetF32Array("tokenizer.ggml.tokens").ok());
  EXPECT_FALSE(file.GetBool("llama.block_count").ok());
  EXPECT_EQ(file.GetUIntOr("absent", 7).value(), 7u);
  EXPECT_FALSE(file.GetUIntOr("general.architecture", 7).ok());
  EXPECT_DOUBLE_EQ(file.GetFloatOr("absent", 1.5).value(), 1.5);
}

TEST(GgufReader, TypeSizes) {
  EXPECT_EQ(GgmlTypeBytes(0, 10).value(), 40u);
  EXPECT_EQ(GgmlTypeBytes(8, 64).value(), 68u);
  EXPECT_EQ(GgmlTypeBytes(12, 512).value(), 288u);
  EXPECT_EQ(GgmlTypeBytes(14, 256).value(), 210u);
  EXPECT_EQ(GgmlTypeBytes(34, 256).value(), 54u);
  EXPECT_FALSE(GgmlTypeBytes(8, 33).has_value());
  EXPECT_FALSE(GgmlTypeBytes(4, 32).has_value());
  EXPECT_FALSE(GgmlTypeBytes(0, -1).has_value());
  EXPECT_EQ(GgmlTypeName(13), "q5_k");
  EXPECT_EQ(GgmlTypeName(5), "unknown");
}

TEST(GgufReader, OpensAllSharedVocabFiles) {
  KVS_SKIP_IF_NO_SHARED(dir, "vocab");
  int opened = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".gguf") continue;
    std::string path = entry.path().string();
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const GgufFile& file = **f;
    EXPECT_TRUE(file.tensors().empty()) << path;
    auto model = file.GetString("tokenizer.ggml.model");
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    EXPECT_TRUE(*model == "llama" || *model == "gpt2") << path << ": " << *model;
    auto tokens = file.GetStringArray("tokenizer.ggml.tokens");
    ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
    EXPECT_GT((*tokens)->size(), 1000u) << path;
    if (*model == "gpt2") {
      auto merges = file.GetStringArray("tokenizer.ggml.merges");
      ASSERT_TRUE(merges.ok()) << merges.status().ToString();
      EXPECT_GT((*merges)->size(), 1000u) << path;
    }
    if (auto types = file.GetIntArray("tokenizer.ggml.token_type"); types.ok()) {
      EXPECT_EQ(types->size(), (*tokens)->size()) << path;
    }
    ++opened;
  }
  EXPECT_EQ(opened, 10);
}

TEST(GgufReader, LlamaSpmVocabContents) {
  KVS_SKIP_IF_NO_SHARED(path, "vocab/ggml-vocab-llama-spm.gguf");
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->GetString("tokenizer.ggml.model").value(), "llama");
  auto tokens = (*f)->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ((*tokens)->size(), 32000u);
  EXPECT_EQ((**tokens)[1], "<s>");
  EXPECT_EQ((**tokens)[3], "<0x00>");
  auto scores = (*f)->GetF32Array("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.ok());
  EXPECT_EQ(scores->size(), 32000u);
  EXPECT_EQ((*f)->GetUInt("tokenizer.ggml.bos_token_id").value(), 1u);
}

}  // namespace
}  // namespace kvsparse
