// ConvertLlama2cToGguf: weight-type validation and verbatim copying of tokenizer keys.
// (End-to-end "converted model generates like the checkpoint" lives in tests/cli_test.cc.)
#include "kvsparse/convert.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

constexpr int32_t kDim = 32, kHidden = 64, kLayers = 1, kHeads = 2, kKvHeads = 2, kVocab = 4, kSeqLen = 4;

// A tied llama2.c checkpoint of the shape above with small nonzero weights.
std::string WriteTinyCheckpoint(const std::string& name) {
  const int64_t head = kDim / kHeads, kv_dim = kKvHeads * head;
  const int64_t floats = int64_t{kVocab} * kDim + kLayers * (2 * kDim + 2 * kDim * kDim + 2 * kv_dim * kDim +
                                                              3 * int64_t{kHidden} * kDim) +
                         kDim + 2 * int64_t{kSeqLen} * (head / 2);
  const int32_t header[7] = {kDim, kHidden, kLayers, kHeads, kKvHeads, kVocab, kSeqLen};
  std::vector<float> weights(static_cast<size_t>(floats));
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
  const std::string path = testing::TempPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(weights.data()), static_cast<std::streamsize>(weights.size() * 4));
  return path;
}

TEST(Convert, RejectsWeightTypesTheEngineCannotUse) {
  const std::string in = WriteTinyCheckpoint("convert_types.bin");
  for (DType bad : {DType::kQ8_K, static_cast<DType>(99)}) {
    ConvertOptions options;
    options.weight_type = bad;
    Status s = ConvertLlama2cToGguf(in, testing::TempPath("convert_types.gguf"), options);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(in), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("q4_K"), std::string::npos) << "lists the supported types: " << s.message();
  }
}

TEST(Convert, CopiesTokenizerKeysWithTheirTypes) {
  // 64-bit values and bool / f64 arrays must survive the copy unchanged (not narrowed to 32 bits).
  GgufWriter vocab;
  vocab.SetString("tokenizer.ggml.model", "llama");
  vocab.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  vocab.SetU64("tokenizer.test.u64", uint64_t{1} << 40);
  GgufValue v;
  v.type = GgufType::kI64;
  v.i = -(int64_t{1} << 40);
  vocab.SetValue("tokenizer.test.i64", v);
  const uint8_t flags[] = {1, 0, 1};
  v = {};
  v.type = GgufType::kArray;
  v.elem_type = GgufType::kBool;
  v.count = 3;
  v.elems = flags;
  vocab.SetValue("tokenizer.test.bools", v);
  const double f64s[] = {0.1, -2.5};
  v = {};
  v.type = GgufType::kArray;
  v.elem_type = GgufType::kF64;
  v.count = 2;
  v.elems = reinterpret_cast<const uint8_t*>(f64s);
  vocab.SetValue("tokenizer.test.f64s", v);
  vocab.SetString("general.name", "not a tokenizer key");
  const std::string vocab_path = testing::TempPath("convert_vocab.gguf");
  ASSERT_TRUE(vocab.Write(vocab_path).ok());

  ConvertOptions options;
  options.vocab_gguf = vocab_path;
  const std::string out = testing::TempPath("convert_vocab_out.gguf");
  Status s = ConvertLlama2cToGguf(WriteTinyCheckpoint("convert_vocab.bin"), out, options);
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto f = GgufFile::Open(out);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& file = **f;
  EXPECT_EQ(file.Find("tokenizer.test.u64")->type, GgufType::kU64);
  EXPECT_EQ(file.GetUInt("tokenizer.test.u64").value(), uint64_t{1} << 40);
  EXPECT_EQ(file.Find("tokenizer.test.i64")->type, GgufType::kI64);
  EXPECT_EQ(file.GetInt("tokenizer.test.i64").value(), -(int64_t{1} << 40));
  const GgufValue* bools = file.Find("tokenizer.test.bools");
  ASSERT_NE(bools, nullptr);
  EXPECT_EQ(bools->elem_type, GgufType::kBool);
  ASSERT_EQ(bools->count, 3u);
  EXPECT_EQ(bools->elems[0], 1);
  EXPECT_EQ(bools->elems[1], 0);
  const GgufValue* doubles = file.Find("tokenizer.test.f64s");
  ASSERT_NE(doubles, nullptr);
  EXPECT_EQ(doubles->elem_type, GgufType::kF64);
  EXPECT_EQ(file.GetF32Array("tokenizer.test.f64s").value(), (std::vector<float>{0.1f, -2.5f}));
  EXPECT_EQ(file.GetStringArray("tokenizer.ggml.tokens").value()->size(), 4u);
  EXPECT_EQ(file.GetString("general.name").value().find("not a tokenizer key"), std::string_view::npos);
}

}  // namespace
}  // namespace kvsparse
