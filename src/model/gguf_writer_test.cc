// GgufWriter round trip: every metadata type and tensors of every DType, read back by GgufFile.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST(GgufWriter, RoundTripMetadataAndTensors) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("u32", 4000000000u);
  w.SetI32("i32", -123456);
  w.SetU64("u64", 0x123456789abcdefull);
  w.SetF32("f32", 1.25f);
  w.SetBool("bool.t", true);
  w.SetBool("bool.f", false);
  w.SetString("empty", "");
  w.SetStringArray("strs", {"a", "", "\xe2\x96\x81hello", std::string("nul\0in", 6)});
  w.SetStringArray("strs.empty", {});
  w.SetF32Array("f32s", {1.0f, -2.5f, 3e-8f});
  w.SetI32Array("i32s", {-1, 0, 2147483647});
  // The remaining scalar / array types go through SetValue.
  GgufValue v;
  v.type = GgufType::kU8; v.u = 200; w.SetValue("u8", v);
  v = {}; v.type = GgufType::kI8; v.i = -100; w.SetValue("i8", v);
  v = {}; v.type = GgufType::kU16; v.u = 65000; w.SetValue("u16", v);
  v = {}; v.type = GgufType::kI16; v.i = -32000; w.SetValue("i16", v);
  v = {}; v.type = GgufType::kI64; v.i = -(1ll << 50); w.SetValue("i64", v);
  v = {}; v.type = GgufType::kF64; v.f = 3.141592653589793; w.SetValue("f64", v);
  std::vector<uint16_t> u16s = {1, 2, 65535};
  v = {}; v.type = GgufType::kArray; v.elem_type = GgufType::kU16; v.count = 3;
  v.elems = reinterpret_cast<const uint8_t*>(u16s.data());
  w.SetValue("u16s", v);
  w.SetU32("replaced", 1);
  w.SetU32("replaced", 2);

  struct Case {
    std::string name;
    DType type;
    std::vector<int64_t> ne;
  };
  std::vector<Case> cases = {
      {"t.f32", DType::kF32, {3, 5}},        {"t.f16", DType::kF16, {7}},
      {"t.bf16", DType::kBF16, {2, 3, 4}},   {"t.q8_0", DType::kQ8_0, {64, 3}},
      {"t.q4_0", DType::kQ4_0, {32, 2, 2}},  {"t.q4_k", DType::kQ4_K, {512, 2}},
      {"t.q8_k", DType::kQ8_K, {256, 1, 1, 2}},
  };
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < cases.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : cases[i].ne) n *= d;
    size_t nbytes = DTypeRowBytes(cases[i].type, cases[i].ne[0]) * static_cast<size_t>(n / cases[i].ne[0]);
    data.push_back(RandomBytes(nbytes, static_cast<uint32_t>(i + 1)));
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    if (i % 2 == 0) {
      w.AddTensor(cases[i].name, cases[i].type, cases[i].ne, data[i].data());
    } else {
      const std::vector<uint8_t>* src = &data[i];
      w.AddTensor(cases[i].name, cases[i].type, cases[i].ne, [src](void* dst, size_t nbytes) {
        ASSERT_EQ(nbytes, src->size());
        std::memcpy(dst, src->data(), nbytes);
      });
    }
  }
  std::string path = testing::TempPath("roundtrip.gguf");
  ASSERT_TRUE(w.Write(path).ok());

  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& file = **f;
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.metadata().size(), 20u);
  EXPECT_EQ(file.metadata()[0].first, "general.architecture");
  EXPECT_EQ(file.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(file.GetUInt("u32").value(), 4000000000u);
  EXPECT_EQ(file.GetInt("i32").value(), -123456);
  EXPECT_FALSE(file.GetUInt("i32").ok());  // negative does not fit unsigned
  EXPECT_EQ(file.GetUInt("u64").value(), 0x123456789abcdefull);
  EXPECT_DOUBLE_EQ(file.GetFloat("f32").value(), 1.25);
  EXPECT_TRUE(file.GetBool("bool.t").value());
  EXPECT_FALSE(file.GetBool("bool.f").value());
  EXPECT_EQ(file.GetString("empty").value(), "");
  const auto* strs = file.GetStringArray("strs").value();
  ASSERT_EQ(strs->size(), 4u);
  EXPECT_EQ((*strs)[2], "\xe2\x96\x81hello");
  EXPECT_EQ((*strs)[3], std::string_view("nul\0in", 6));
  EXPECT_TRUE(file.GetStringArray("strs.empty").value()->empty());
  EXPECT_EQ(file.GetF32Array("f32s").value(), (std::vector<float>{1.0f, -2.5f, 3e-8f}));
  EXPECT_EQ(file.GetIntArray("i32s").value(), (std::vector<int64_t>{-1, 0, 2147483647}));
  EXPECT_EQ(file.GetUInt("u8").value(), 200u);
  EXPECT_EQ(file.GetInt("i8").value(), -100);
  EXPECT_EQ(file.GetUInt("u16").value(), 65000u);
  EXPECT_EQ(file.GetInt("i16").value(), -32000);
  EXPECT_EQ(file.GetInt("i64").value(), -(1ll << 50));
  EXPECT_DOUBLE_EQ(file.GetFloat("f64").value(), 3.141592653589793);
  EXPECT_EQ(file.GetIntArray("u16s").value(), (std::vector<int64_t>{1, 2, 65535}));
  EXPECT_EQ(file.GetUInt("replaced").value(), 2u);

  ASSERT_EQ(file.tensors().size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const GgufTensorInfo* t = file.FindTensor(cases[i].name);
    ASSERT_NE(t, nullptr) << cases[i].name;
    EXPECT_EQ(t->ne, cases[i].ne);
    ASSERT_TRUE(t->type.has_value());
    EXPECT_EQ(*t->type, cases[i].type);
    ASSERT_EQ(t->nbytes, data[i].size());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 32, 0u) << "mmap'd data is aligned";
    EXPECT_EQ(std::memcmp(t->data, data[i].data(), t->nbytes), 0) << cases[i].name;
  }

  // Re-emitting every value through SetValue reproduces the same metadata.
  GgufWriter copy;
  for (const auto& [key, value] : file.metadata()) copy.SetValue(key, value);
  std::string path2 = testing::TempPath("roundtrip_copy.gguf");
  ASSERT_TRUE(copy.Write(path2).ok());
  auto f2 = GgufFile::Open(path2);
  ASSERT_TRUE(f2.ok()) << f2.status().ToString();
  ASSERT_EQ((*f2)->metadata().size(), file.metadata().size());
  EXPECT_EQ((*f2)->GetStringArray("strs").value()->at(3), std::string_view("nul\0in", 6));
  EXPECT_EQ((*f2)->GetIntArray("u16s").value(), (std::vector<int64_t>{1, 2, 65535}));
  EXPECT_DOUBLE_EQ((*f2)->GetFloat("f64").value(), 3.141592653589793);
}

TEST(GgufWriter, CustomAlignment) {
  GgufWriter w;
  w.SetU32("general.alignment", 64);
  std::vector<float> a(3, 1.0f), b(5, 2.0f);
  w.AddTensor("a", DType::kF32, {3}, a.data());
  w.AddTensor("b", DType::kF32, {5}, b.data());
  std::string path = testing::TempPath("align64.gguf");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->FindTensor("b")->offset, 64u);
  EXPECT_EQ(static_cast<const float*>((*f)->FindTensor("b")->data)[4], 2.0f);
}

TEST(GgufWriter, RejectsBadTensorsAndKeepsExistingFile) {
  std::string path = testing::TempPath("keep.gguf");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << "previous contents";
  }
  std::vector<uint8_t> buf(1024);
  {
    GgufWriter w;
    w.AddTensor("bad", DType::kQ8_0, {33, 2}, buf.data());
    Status s = w.Write(path);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("'bad'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("block size 32"), std::string::npos) << s.message();
  }
  {
    GgufWriter w;
    w.AddTensor("x", DType::kF32, {2}, buf.data());
    w.AddTensor("x", DType::kF32, {2}, buf.data());
    EXPECT_FALSE(w.Write(path).ok());
  }
  {
    GgufWriter w;
    w.AddTensor("zero", DType::kF32, {2, 0}, buf.data());
    EXPECT_FALSE(w.Write(path).ok());
  }
  {
    GgufWriter w;
    w.AddTensor("five", DType::kF32, {1, 1, 1, 1, 1}, buf.data());
    EXPECT_FALSE(w.Write(path).ok());
  }
  for (uint32_t alignment : {24u, 4u}) {
    GgufWriter w;
    w.SetU32("general.alignment", alignment);
    EXPECT_FALSE(w.Write(path).ok());
  }
  std::ifstream in(path, std::ios::binary);
  std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(contents, "previous contents");
  // No temporary files are left behind.
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    EXPECT_EQ(e.path().filename().string().find("keep.gguf.tmp"), std::string::npos) << e.path();
  }
}

TEST(GgufWriter, WritesAnyGgmlTypeIdByRawId) {
  // iq2_xxs (16) and i32 (26) are sized by GgmlTypeBytes although kvsparse does not compute with them.
  const std::vector<uint8_t> iq2xxs = RandomBytes(*GgmlTypeBytes(16, 256 * 3), 11);
  const std::vector<uint8_t> i32 = RandomBytes(*GgmlTypeBytes(26, 5), 12);
  GgufWriter w;
  w.AddTensor("iq2xxs", uint32_t{16}, {256, 3}, iq2xxs.data());
  w.AddTensor("i32", uint32_t{26}, {5}, [&i32](void* dst, size_t nbytes) {
    ASSERT_EQ(nbytes, i32.size());
    std::memcpy(dst, i32.data(), nbytes);
  });
  const std::string path = testing::TempPath("raw_type_ids.gguf");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufTensorInfo* t = (*f)->FindTensor("iq2xxs");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ggml_type, 16u);
  EXPECT_FALSE(t->type.has_value());
  EXPECT_EQ(t->ne, (std::vector<int64_t>{256, 3}));
  ASSERT_EQ(t->nbytes, iq2xxs.size());
  EXPECT_EQ(std::memcmp(t->data, iq2xxs.data(), t->nbytes), 0);
  t = (*f)->FindTensor("i32");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->ggml_type, 26u);
  ASSERT_EQ(t->nbytes, i32.size());
  EXPECT_EQ(std::memcmp(t->data, i32.data(), t->nbytes), 0);
}

TEST(GgufWriter, RejectsUnknownOrMisalignedRawTypeIds) {
  std::vector<uint8_t> buf(4096);
  const std::string path = testing::TempPath("raw_type_bad.gguf");
  {
    GgufWriter w;
    w.AddTensor("gone", uint32_t{4}, {32}, buf.data());  // q4_2, removed from ggml
    Status s = w.Write(path);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("'gone'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("unknown ggml type id 4"), std::string::npos) << s.message();
  }
  {
    GgufWriter w;
    w.AddTensor("short", uint32_t{13}, {128}, buf.data());
    Status s = w.Write(path);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("q5_k block size 256"), std::string::npos) << s.message();
  }
}

TEST(GgufWriter, SetValueStringArrayWritesTheStringsItHolds) {
  // A hand-built value whose count disagrees with its strings must still produce a readable file.
  GgufValue v;
  v.type = GgufType::kArray;
  v.elem_type = GgufType::kString;
  v.strings = {"a", "bc"};
  v.count = 0;
  GgufWriter w;
  w.SetValue("strs", v);
  w.SetU32("after", 7);
  const std::string path = testing::TempPath("setvalue_strings.gguf");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*(*f)->GetStringArray("strs").value(), (std::vector<std::string_view>{"a", "bc"}));
  EXPECT_EQ((*f)->GetUInt("after").value(), 7u);
}

TEST(GgufWriter, UnwritableDirectoryFails) {
  GgufWriter w;
  w.SetU32("x", 1);
  Status s = w.Write("/nonexistent-dir-kvsparse/out.gguf");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir-kvsparse/out.gguf"), std::string::npos) << s.message();
}

TEST(GgufWriter, CopiesVocabKeys) {
  KVS_SKIP_IF_NO_SHARED(vocab, "vocab/ggml-vocab-gpt-2.gguf");
  auto src = GgufFile::Open(vocab);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  GgufWriter w;
  for (const auto& [key, value] : (*src)->metadata()) w.SetValue(key, value);
  std::string path = testing::TempPath("vocab_copy.gguf");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*(*f)->GetStringArray("tokenizer.ggml.tokens").value(),
            *(*src)->GetStringArray("tokenizer.ggml.tokens").value());
  EXPECT_EQ(*(*f)->GetStringArray("tokenizer.ggml.merges").value(),
            *(*src)->GetStringArray("tokenizer.ggml.merges").value());
  EXPECT_EQ((*f)->GetIntArray("tokenizer.ggml.token_type").value(),
            (*src)->GetIntArray("tokenizer.ggml.token_type").value());
}

}  // namespace
}  // namespace kvsparse
