// The fidelity task's streams: sampled from the model (deterministic per seed), the user's
// token ids (parse errors that say where and what), the user's text (the model's tokenizer).
#include "kvsparse/bench_fidelity.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <set>

#include "support/retrieval_model_file.h"
#include "support/shared_data.h"
#include "support/test_model_gguf.h"
#include "support/tiny_chat_model.h"

namespace kvsparse {
namespace {

using testing::TempPath;

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::trunc) << text;
  return path;
}

// A tiny random-weight model without a tokenizer: its next-token distributions are broad, so
// sampled streams vary with the seed (the built-in retrieval model's are nearly one-hot).
std::unique_ptr<Model> LoadRandomModel() {
  const std::string path = TempPath("fidelity_random_model.gguf");
  KVS_CHECK(testing::WriteTinyModelGguf(testing::TinyModelSpec{}, path).ok());
  auto model = Model::Load(path);
  KVS_CHECK(model.ok());
  return std::move(*model);
}

void ExpectErrorMentions(const Status& st, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(st.ok());
  for (const std::string& p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << p << " in: " << st.message();
}

TEST(FidelityTokensTest, ParsesWhitespaceSeparatedIds) {
  auto ids = ParseFidelityTokens("# ids of a story\n 1 2\n3\t4#five:\r\n\n5 ", "ids.txt", 10);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_EQ(*ids, (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

TEST(FidelityTokensTest, ErrorsSayLineIndexValueAndVocabulary) {
  ExpectErrorMentions(ParseFidelityTokens("1 2\n3 x7 4", "ids.txt", 10).status(),
                      {"ids.txt:2:", "token 3", "'x7'", "[0, 10)"});
  ExpectErrorMentions(ParseFidelityTokens("1 2\n\n3 12", "ids.txt", 10).status(),
                      {"ids.txt:3:", "token 3", "is 12", "[0, 10)"});
  ExpectErrorMentions(ParseFidelityTokens("5 -1", "ids.txt", 10).status(), {"ids.txt:1:", "token 1", "is -1"});
  ExpectErrorMentions(ParseFidelityTokens("4 2.5", "ids.txt", 10).status(), {"'2.5'"});
  ExpectErrorMentions(ParseFidelityTokens(" \n ", "ids.txt", 10).status(), {"ids.txt", "no token ids"});
}

TEST(FidelityStreamTest, SampledStreamIsDeterministicPerSeed) {
  std::unique_ptr<Model> model = LoadRandomModel();
  auto bos = FidelityStartToken(*model, nullptr);
  ASSERT_TRUE(bos.ok());
  EXPECT_EQ(*bos, 1);
  FidelityStreamSource source;
  source.seed = 7;
  EXPECT_EQ(source.Label(), "sampled(seed=7)");
  auto a = MakeFidelityStreams(source, *model, nullptr, 64, 2, 1);
  auto b = MakeFidelityStreams(source, *model, nullptr, 64, 2, 2);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
  EXPECT_EQ(*a, *b);  // same seed: same streams (thread count aside)
  ASSERT_EQ(a->size(), 2u);
  for (const std::vector<int32_t>& s : *a) {
    ASSERT_EQ(s.size(), 64u);
    EXPECT_EQ(s[0], 1);
    for (int32_t t : s) EXPECT_TRUE(t >= 0 && t < model->config().n_vocab) << t;
  }
  EXPECT_NE((*a)[0], (*a)[1]);  // samples are distinct streams
  EXPECT_GT(std::set<int32_t>((*a)[0].begin(), (*a)[0].end()).size(), 8u);
  source.seed = 8;
  auto c = MakeFidelityStreams(source, *model, nullptr, 64, 2, 1);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*a, *c);
  EXPECT_NE(FidelityStreamHash(*a), FidelityStreamHash(*c));
  EXPECT_EQ(FidelityStreamHash(*a), FidelityStreamHash(*b));
}

TEST(FidelityStreamTest, Stories260kSampledStreamIsDeterministic) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  FidelityStreamSource source;
  auto a = MakeFidelityStreams(source, **model, nullptr, 128, 1, 1);
  auto b = MakeFidelityStreams(source, **model, nullptr, 128, 1, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  // The model's own text: many distinct ids, not one repeated symbol.
  EXPECT_GT(std::set<int32_t>((*a)[0].begin(), (*a)[0].end()).size(), 20u);
}

TEST(FidelityStreamTest, TokenFileErrorsNameFlagAndFile) {
  std::unique_ptr<Model> model = testing::LoadRetrievalModel();
  const int32_t n_vocab = model->config().n_vocab;
  FidelityStreamSource source;
  source.kind = FidelityStreamKind::kTokens;
  source.path = WriteFile("fidelity_bad.txt", fmt::format("1 2 3\n4 {} 5\n", n_vocab));
  ExpectErrorMentions(MakeFidelityStreams(source, *model, nullptr, 16, 1, 1).status(),
                      {"--fidelity-tokens", source.path + ":2:", "token 4", fmt::format("is {}", n_vocab),
                       fmt::format("[0, {})", n_vocab)});
  source.path = WriteFile("fidelity_short.txt", "1 2 3 4 5");
  ExpectErrorMentions(MakeFidelityStreams(source, *model, nullptr, 16, 1, 1).status(),
                      {"--fidelity-tokens", source.path, "5 tokens", "length 16"});
  source.path = TempPath("fidelity_missing.txt");
  std::remove(source.path.c_str());
  ExpectErrorMentions(MakeFidelityStreams(source, *model, nullptr, 16, 1, 1).status(),
                      {"--fidelity-tokens", "cannot read", source.path});

  std::string ids;
  for (int i = 0; i < 40; ++i) ids += std::to_string(3 + i % 5) + (i % 10 == 9 ? "\n" : " ");
  source.path = WriteFile("fidelity_ok.txt", ids);
  EXPECT_EQ(source.Label(), "tokens:" + source.path);
  auto streams = MakeFidelityStreams(source, *model, nullptr, 32, 4, 1);
  ASSERT_TRUE(streams.ok()) << streams.status().ToString();
  ASSERT_EQ(streams->size(), 1u);  // a file is one stream, its first `length` tokens
  ASSERT_EQ((*streams)[0].size(), 32u);
  EXPECT_EQ((*streams)[0][0], 3);
  EXPECT_EQ((*streams)[0][31], 3 + 31 % 5);
}

TEST(FidelityStreamTest, TextNeedsTheModelsTokenizer) {
  std::unique_ptr<Model> model = testing::LoadRetrievalModel();
  FidelityStreamSource source;
  source.kind = FidelityStreamKind::kText;
  source.path = WriteFile("fidelity_text_notok.txt", "Once upon a time");
  ExpectErrorMentions(MakeFidelityStreams(source, *model, nullptr, 16, 1, 1).status(),
                      {"--fidelity-text", source.path, "no tokenizer", "--fidelity-tokens"});
}

TEST(FidelityStreamTest, TextIsEncodedByTheModelsTokenizer) {
  std::string note;
  auto path = testing::WriteTinyChatModel("fidelity_text_model.gguf", 256, &note);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto model = Model::Load(*path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto tokenizer = Tokenizer::FromGguf(*(*model)->gguf());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  std::string text;
  for (int i = 0; i < 20; ++i) text += "Once upon a time there was a little cat who liked the sun. ";
  FidelityStreamSource source;
  source.kind = FidelityStreamKind::kText;
  source.path = WriteFile("fidelity_text.txt", text);
  EXPECT_EQ(source.Label(), "text:" + source.path);
  auto streams = MakeFidelityStreams(source, **model, tokenizer->get(), 48, 3, 1);
  ASSERT_TRUE(streams.ok()) << streams.status().ToString() << " (" << note << ")";
  ASSERT_EQ(streams->size(), 1u);
  std::vector<int32_t> expected = (*tokenizer)->Encode(text, /*add_bos=*/true);
  ASSERT_GE(expected.size(), 48u);
  expected.resize(48);
  EXPECT_EQ((*streams)[0], expected);

  source.path = WriteFile("fidelity_text_short.txt", "Once upon a time");
  ExpectErrorMentions(MakeFidelityStreams(source, **model, tokenizer->get(), 48, 1, 1).status(),
                      {"--fidelity-text", source.path, "encodes to", "length 48"});
  // A sampled stream of a model with a tokenizer starts at its BOS.
  auto bos = FidelityStartToken(**model, tokenizer->get());
  ASSERT_TRUE(bos.ok());
  EXPECT_EQ(*bos, (*tokenizer)->bos());
}

}  // namespace
}  // namespace kvsparse
