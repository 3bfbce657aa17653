// Hostile GGUF inputs: every one must yield a Status (never a crash or an out-of-bounds
// read; CI also runs this under AddressSanitizer).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "model/gguf_test_util.h"

namespace kvsparse {
namespace {

// Opens `bytes` written to a temp file; returns the status (OK if it opened).
Status OpenBytes(const std::string& bytes, const std::string& name = "hostile.gguf") {
  std::string path = WriteTemp(name, bytes);
  auto f = GgufFile::Open(path);
  if (!f.ok()) return f.status();
  // Touch everything the reader exposes so ASan sees any bad pointer.
  uint64_t sum = 0;
  for (const auto& [key, v] : (*f)->metadata()) {
    for (char c : v.str) sum += static_cast<uint8_t>(c);
    for (std::string_view s : v.strings) {
      for (char c : s) sum += static_cast<uint8_t>(c);
    }
    if (v.type == GgufType::kArray && v.elem_type != GgufType::kString) {
      auto ints = (*f)->GetIntArray(key);
      if (ints.ok()) for (int64_t x : *ints) sum += static_cast<uint64_t>(x);
      auto floats = (*f)->GetF32Array(key);
      if (floats.ok()) for (float x : *floats) sum += x > 0;
    }
  }
  for (const GgufTensorInfo& t : (*f)->tensors()) {
    const uint8_t* p = static_cast<const uint8_t*>(t.data);
    if (t.nbytes > 0) sum += p[0] + p[t.nbytes - 1];
  }
  volatile uint64_t sink = sum;
  (void)sink;
  return Status::Ok();
}

void ExpectError(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos) << "missing '" << needle << "' in: " << s.message();
  EXPECT_NE(s.message().find("kvsparse_tests"), std::string::npos) << "message should name the path: "
                                                                    << s.message();
}

// Header + one f32 tensor with the given dims / type / offset and 4 KiB of data.
std::string OneTensorFile(std::vector<int64_t> ne, uint32_t type = 0, uint64_t offset = 0,
                          uint32_t n_dims_override = 0) {
  RawGguf g;
  g.Header(3, 1, 0);
  g.Str("t").Pod<uint32_t>(n_dims_override ? n_dims_override : static_cast<uint32_t>(ne.size()));
  for (int64_t d : ne) g.Pod(d);
  g.Pod(type).Pod(offset);
  g.PadTo(32).Zeros(4096);
  return g.bytes();
}

TEST(GgufHostile, SmallValidFileOpens) { EXPECT_TRUE(OpenBytes(SmallValidFile()).ok()); }

TEST(GgufHostile, MissingFile) {
  auto f = GgufFile::Open("/nonexistent/kvsparse/model.gguf");
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("/nonexistent/kvsparse/model.gguf"), std::string::npos);
}

TEST(GgufHostile, Directory) {
  auto f = GgufFile::Open(std::filesystem::temp_directory_path().string());
  EXPECT_FALSE(f.ok());
}

TEST(GgufHostile, EmptyFile) { ExpectError(OpenBytes(""), StatusCode::kDataLoss, "empty"); }

TEST(GgufHostile, WrongMagic) {
  std::string b = SmallValidFile();
  b[0] = 'X';
  ExpectError(OpenBytes(b), StatusCode::kDataLoss, "magic");
  ExpectError(OpenBytes("GG"), StatusCode::kDataLoss, "magic");
}

TEST(GgufHostile, BadVersions) {
  ExpectError(OpenBytes(RawGguf().Header(1, 0, 0).bytes()), StatusCode::kUnimplemented, "version 1");
  ExpectError(OpenBytes(RawGguf().Header(0, 0, 0).bytes()), StatusCode::kDataLoss, "found 0");
  ExpectError(OpenBytes(RawGguf().Header(4, 0, 0).bytes()), StatusCode::kDataLoss, "found 4");
  ExpectError(OpenBytes(RawGguf().Header(0x03000000, 0, 0).bytes()), StatusCode::kUnimplemented, "big-endian");
  EXPECT_TRUE(OpenBytes(RawGguf().Header(2, 0, 0).bytes()).ok());
  EXPECT_TRUE(OpenBytes(RawGguf().Header(3, 0, 0).bytes()).ok());
}

TEST(GgufHostile, TruncationAtEveryOffsetFails) {
  const std::string full = SmallValidFile();
  ASSERT_TRUE(OpenBytes(full).ok());
  for (size_t len = 0; len < full.size(); ++len) {
    Status s = OpenBytes(full.substr(0, len));
    EXPECT_FALSE(s.ok()) << "prefix of " << len << " bytes opened";
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << len << ": " << s.ToString();
  }
}

TEST(GgufHostile, ImplausibleCounts) {
  ExpectError(OpenBytes(RawGguf().Header(3, 0, 1ull << 62).Zeros(64).bytes()), StatusCode::kDataLoss,
              "metadata count");
  ExpectError(OpenBytes(RawGguf().Header(3, ~0ull, 0).Zeros(64).bytes()), StatusCode::kDataLoss, "tensor count");
}

TEST(GgufHostile, HugeStringLength) {
  RawGguf key;
  key.Header(3, 0, 1).Pod<uint64_t>(~0ull).Zeros(16);
  ExpectError(OpenBytes(key.bytes()), StatusCode::kDataLoss, "string length");
  RawGguf value;
  value.Header(3, 0, 1).Str("k").Pod<uint32_t>(8).Pod<uint64_t>(1ull << 40).Zeros(16);
  ExpectError(OpenBytes(value.bytes()), StatusCode::kDataLoss, "'k'");
  RawGguf name;
  name.Header(3, 1, 0).Pod<uint64_t>(1ull << 63).Zeros(64);
  ExpectError(OpenBytes(name.bytes()), StatusCode::kDataLoss, "tensor 0");
}

TEST(GgufHostile, HugeArrayCounts) {
  for (uint32_t elem : {0u, 4u, 8u, 10u}) {  // u8, u32, string, u64
    for (uint64_t count : {1ull << 32, 1ull << 61, ~0ull}) {
      RawGguf g;
      g.Header(3, 0, 1).Str("arr").Pod<uint32_t>(9).Pod(elem).Pod(count).Zeros(64);
      ExpectError(OpenBytes(g.bytes()), StatusCode::kDataLoss, "'arr'");
    }
  }
}

TEST(GgufHostile, BadValueTypes) {
  ExpectError(OpenBytes(RawGguf().Header(3, 0, 1).Str("k").Pod<uint32_t>(13).Zeros(8).bytes()),
              StatusCode::kDataLoss, "unknown value type 13");
  ExpectError(
      OpenBytes(RawGguf().Header(3, 0, 1).Str("k").Pod<uint32_t>(9).Pod<uint32_t>(99).Pod<uint64_t>(0).bytes()),
      StatusCode::kDataLoss, "element type 99");
  ExpectError(
      OpenBytes(RawGguf().Header(3, 0, 1).Str("k").Pod<uint32_t>(9).Pod<uint32_t>(9).Pod<uint64_t>(0).bytes()),
      StatusCode::kUnimplemented, "nested");
  ExpectError(OpenBytes(RawGguf().Header(3, 0, 1).Str("").Pod<uint32_t>(4).Pod<uint32_t>(1).bytes()),
              StatusCode::kDataLoss, "empty key");
}

TEST(GgufHostile, DuplicateKey) {
  RawGguf g;
  g.Header(3, 0, 2).KvU32("a.b", 1).KvU32("a.b", 2);
  ExpectError(OpenBytes(g.bytes()), StatusCode::kDataLoss, "duplicate metadata key 'a.b'");
}

TEST(GgufHostile, DuplicateTensor) {
  RawGguf g;
  g.Header(3, 2, 0).Tensor("w", {8}, 0, 0).Tensor("w", {8}, 0, 32).PadTo(32).Zeros(64);
  ExpectError(OpenBytes(g.bytes()), StatusCode::kDataLoss, "duplicate tensor name 'w'");
}

TEST(GgufHostile, BadDims) {
  EXPECT_TRUE(OpenBytes(OneTensorFile({4, 4})).ok());
  ExpectError(OpenBytes(OneTensorFile({1, 1, 1, 1, 1})), StatusCode::kDataLoss, "n_dims");
  ExpectError(OpenBytes(OneTensorFile({}, 0, 0, 0)), StatusCode::kDataLoss, "n_dims");
  ExpectError(OpenBytes(OneTensorFile({4, 0})), StatusCode::kDataLoss, "ne[1]");
  ExpectError(OpenBytes(OneTensorFile({-4, 2})), StatusCode::kDataLoss, "ne[0]");
  ExpectError(OpenBytes(OneTensorFile({1ll << 32, 1ll << 32})), StatusCode::kDataLoss, "overflow");
  // Element count fits int64 but the byte size does not fit the file.
  ExpectError(OpenBytes(OneTensorFile({1ll << 30, 1ll << 30})), StatusCode::kDataLoss, "past the end");
  ExpectError(OpenBytes(OneTensorFile({33, 2}, 8)), StatusCode::kDataLoss, "not a multiple of the q8_0 block");
}

TEST(GgufHostile, UnknownTensorType) {
  ExpectError(OpenBytes(OneTensorFile({32}, 4)), StatusCode::kUnimplemented, "unknown ggml type id 4");
  ExpectError(OpenBytes(OneTensorFile({32}, 1000)), StatusCode::kUnimplemented, "'t'");
}

TEST(GgufHostile, TensorOffsets) {
  ExpectError(OpenBytes(OneTensorFile({8}, 0, 4096)), StatusCode::kDataLoss, "past the end");
  ExpectError(OpenBytes(OneTensorFile({8}, 0, ~0ull & ~31ull)), StatusCode::kDataLoss, "past the end");
  ExpectError(OpenBytes(OneTensorFile({8}, 0, 4)), StatusCode::kDataLoss, "not a multiple of the alignment 32");
  EXPECT_TRUE(OpenBytes(OneTensorFile({8}, 0, 4064)).ok());  // ends exactly at the file's end
}

TEST(GgufHostile, BadAlignment) {
  // 1, 2 and 4 are powers of two, but the GGUF spec requires a multiple of 8.
  for (uint32_t a : {0u, 24u, 3u, 1u, 2u, 4u}) {
    RawGguf g;
    g.Header(3, 1, 1).KvU32("general.alignment", a).Tensor("t", {8}, 0, 0).PadTo(32).Zeros(64);
    ExpectError(OpenBytes(g.bytes()), StatusCode::kDataLoss, "general.alignment");
  }
  RawGguf wrong_type;
  wrong_type.Header(3, 0, 1).KvStr("general.alignment", "32");
  ExpectError(OpenBytes(wrong_type.bytes()), StatusCode::kDataLoss, "expected type u32");
  RawGguf ok;
  ok.Header(3, 1, 1).KvU32("general.alignment", 8).Tensor("t", {2}, 0, 8).PadTo(8).Zeros(16);
  EXPECT_TRUE(OpenBytes(ok.bytes()).ok());
}

// Random byte mutations of valid files must never crash; each either opens or fails cleanly.
void FuzzMutations(const std::string& valid, uint32_t seed, int iterations) {
  std::mt19937 rng(seed);
  int opened = 0;
  for (int it = 0; it < iterations; ++it) {
    std::string b = valid;
    int n_flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n_flips; ++k) {
      size_t pos = rng() % b.size();
      switch (rng() % 4) {
        case 0: b[pos] = static_cast<char>(rng()); break;
        case 1: b[pos] ^= static_cast<char>(1u << (rng() % 8)); break;
        case 2: b[pos] = static_cast<char>(0xFF); break;
        case 3: b.resize(pos); break;  // truncation
      }
      if (b.empty()) break;
    }
    Status s = OpenBytes(b, "fuzz.gguf");
    opened += s.ok();
  }
  // Many mutations land in tensor data and are harmless.
  EXPECT_GT(opened, 0);
}

TEST(GgufHostile, RandomMutationsOfSmallFile) { FuzzMutations(SmallValidFile(), 1, 3000); }

std::string WriterSeedFile() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetU32("general.alignment", 16);
  w.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a", "bb"});
  w.SetF32Array("tokenizer.ggml.scores", {0, 0, 0, -1, -2});
  w.SetI32Array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1});
  w.SetF32("f", 1.0f);
  w.SetBool("b", true);
  std::vector<uint8_t> data(2 * 34, 7);
  w.AddTensor("q", DType::kQ8_0, {32, 2}, data.data());
  w.AddTensor("n", DType::kF32, {4}, data.data());
  std::string path = testing::TempPath("fuzz_seed.gguf");
  KVS_CHECK(w.Write(path).ok());
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(GgufHostile, TruncationOfWriterFileFails) {
  // The seed file ends exactly at its last tensor's data (16-byte aligned, no trailing
  // padding), so every proper prefix is missing something.
  const std::string full = WriterSeedFile();
  ASSERT_TRUE(OpenBytes(full).ok());
  for (size_t len = 0; len < full.size(); ++len) {
    Status s = OpenBytes(full.substr(0, len));
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "prefix of " << len << " bytes: " << s.ToString();
  }
}

TEST(GgufHostile, RandomMutationsOfWriterFile) {
  const std::string valid = WriterSeedFile();
  ASSERT_TRUE(OpenBytes(valid).ok());
  FuzzMutations(valid, 2, 3000);
}

}  // namespace
}  // namespace kvsparse
