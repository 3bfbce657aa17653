#include "kvsparse/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "kvsparse/gguf.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

constexpr const char* kSpmSpace = "\xE2\x96\x81";  // "▁"

std::string Sp(const std::string& s) {  // "_" → "▁" for readable SPM vocab literals
  std::string out;
  for (char c : s) {
    if (c == '_') {
      out += kSpmSpace;
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// A small SPM vocab: <unk>, <s>, </s>, 256 byte tokens, then scored pieces.
TokenizerSpec SmallSpmSpec() {
  TokenizerSpec spec;
  spec.model = "llama";
  spec.tokens = {"<unk>", "<s>", "</s>"};
  spec.token_types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    spec.tokens.push_back(name);
    spec.token_types.push_back(6);
  }
  spec.scores.assign(spec.tokens.size(), 0.0f);
  const std::vector<std::pair<std::string, float>> pieces = {
      {Sp("_"), -1}, {"h", -2}, {"e", -2}, {"l", -2}, {"o", -2}, {"w", -2}, {"r", -2}, {"d", -2},
      {Sp("_h"), -3}, {"ll", -4}, {Sp("_he"), -6}, {"lo", -1.5f},
      {Sp("_w"), -3}, {"or", -3}, {Sp("_wor"), -4}, {"ld", -5}, {"<|user|>", 0},
  };
  for (const auto& [text, score] : pieces) {
    spec.tokens.push_back(text);
    spec.scores.push_back(score);
    spec.token_types.push_back(text == "<|user|>" ? 4 : 1);
  }
  spec.bos = 1;
  spec.eos = 2;
  spec.unk = 0;
  return spec;
}

int32_t IdOf(const Tokenizer& tok, std::string_view text) {
  for (int32_t id = 0; id < tok.n_vocab(); ++id) {
    if (tok.TokenText(id) == text) return id;
  }
  return -1;
}

TEST(SpmTokenizer, MergesHighestScoringPairFirstAndFallsBackToBytes) {
  auto tok_or = Tokenizer::FromSpec(SmallSpmSpec());
  ASSERT_TRUE(tok_or.ok()) << tok_or.status().ToString();
  const Tokenizer& tok = **tok_or;
  EXPECT_EQ(tok.model_name(), "llama");
  EXPECT_EQ(tok.pre_name(), "default");
  // "▁hello": "lo" (-1.5) merges before "ll" (-4) can, then ▁h (-3), then ▁he (-6).
  const std::vector<int32_t> ids = tok.Encode("hello", /*add_bos=*/false);
  const std::vector<int32_t> expected = {IdOf(tok, Sp("_he")), IdOf(tok, "l"), IdOf(tok, "lo")};
  EXPECT_EQ(ids, expected);
  // "é" has no piece: spelled as its two UTF-8 bytes.
  const std::vector<int32_t> bytes = tok.Encode("\xC3\xA9", false);
  const std::vector<int32_t> expected_bytes = {IdOf(tok, Sp("_")), 3 + 0xC3, 3 + 0xA9};
  EXPECT_EQ(bytes, expected_bytes);
  EXPECT_EQ(tok.Decode(bytes), "\xC3\xA9");
  EXPECT_EQ(tok.Decode(tok.Encode("hello world", false)), "hello world");
  EXPECT_EQ(tok.Encode("", false), std::vector<int32_t>{});
}

TEST(SpmTokenizer, BosAndSpecialTokens) {
  auto tok = Tokenizer::FromSpec(SmallSpmSpec());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ(tok.value()->bos(), 1);
  EXPECT_EQ(tok.value()->eos(), 2);
  const std::vector<int32_t> with_bos = tok.value()->Encode("hello", true);
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos[0], 1);
  EXPECT_EQ(tok.value()->Encode("", true), std::vector<int32_t>{1});
  // Control tokens only with parse_special.
  const std::vector<int32_t> plain = tok.value()->Encode("</s>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  const std::vector<int32_t> parsed = tok.value()->Encode("hello</s>", false, /*parse_special=*/true);
  ASSERT_FALSE(parsed.empty());
  EXPECT_EQ(parsed.back(), 2);
  // User-defined tokens are always matched.
  const int32_t user = IdOf(**tok, "<|user|>");
  const std::vector<int32_t> with_user = tok.value()->Encode("<|user|>hello", false);
  ASSERT_FALSE(with_user.empty());
  EXPECT_EQ(with_user[0], user);
  EXPECT_TRUE(tok.value()->IsEndOfGeneration(2));
  EXPECT_FALSE(tok.value()->IsEndOfGeneration(1));
  // Decode drops control tokens and the SPM space prefix.
  EXPECT_EQ(tok.value()->Decode(with_bos), "hello");
  EXPECT_EQ(tok.value()->TokenToPiece(IdOf(**tok, Sp("_he"))), " he");
  EXPECT_EQ(tok.value()->TokenToPiece(3 + 'A'), "A");
  EXPECT_EQ(tok.value()->TokenToPiece(-5), "");
  EXPECT_EQ(tok.value()->TokenToPiece(1 << 30), "");
}

TEST(SpmTokenizer, SpacePrefixCanBeDisabled) {
  TokenizerSpec spec = SmallSpmSpec();
  spec.add_space_prefix = false;
  auto tok = Tokenizer::FromSpec(spec);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const std::vector<int32_t> ids = tok.value()->Encode("he", false);
  const std::vector<int32_t> expected = {IdOf(**tok, "h"), IdOf(**tok, "e")};
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tok.value()->Decode(ids), "he");
}

// A byte-level BPE vocab: the 256 byte characters plus a few merges.
TokenizerSpec SmallBpeSpec() {
  TokenizerSpec spec;
  spec.model = "gpt2";
  spec.pre = "gpt-2";
  // Printable ASCII maps to itself in the byte-level alphabet; ' ' is "Ġ", '\n' is "Ċ".
  // Other bytes have no token here.
  static const char* kExtra[] = {"Ġ", "Ċ"};
  for (int c = 0x21; c <= 0x7E; ++c) spec.tokens.push_back(std::string(1, static_cast<char>(c)));
  for (const char* e : kExtra) spec.tokens.push_back(e);
  // "Ġ l" never applies to "Ġlow": "l o" (rank 0) claims the 'l' first.
  spec.merges = {"l o", "lo w", "Ġ low", "e r", "Ġ l", "Ġ n", "Ġn e"};
  spec.tokens.insert(spec.tokens.end(), {"lo", "low", "Ġlow", "er", "Ġl", "Ġn", "Ġne", "<|endoftext|>"});
  spec.token_types.assign(spec.tokens.size(), 1);
  spec.token_types.back() = 3;
  spec.eos = static_cast<int32_t>(spec.tokens.size()) - 1;
  spec.bos = spec.eos;
  return spec;
}

TEST(BpeTokenizer, MergesByRankWithinWords) {
  auto tok_or = Tokenizer::FromSpec(SmallBpeSpec());
  ASSERT_TRUE(tok_or.ok()) << tok_or.status().ToString();
  const Tokenizer& tok = **tok_or;
  EXPECT_EQ(tok.model_name(), "gpt2");
  // "lower low": words "lower", " low" → [low, er], [Ġlow]
  const std::vector<int32_t> ids = tok.Encode("lower low", false);
  const std::vector<int32_t> expected = {IdOf(tok, "low"), IdOf(tok, "er"), IdOf(tok, "Ġlow")};
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tok.Decode(ids), "lower low");
  EXPECT_EQ(tok.TokenToPiece(IdOf(tok, "Ġlow")), " low");
  // BPE add_bos defaults to false.
  EXPECT_EQ(tok.Encode("low", true), std::vector<int32_t>{IdOf(tok, "low")});
  const std::vector<int32_t> special = tok.Encode("low<|endoftext|>", false, true);
  ASSERT_EQ(special.size(), 2u);
  EXPECT_EQ(special[1], tok.eos());
  EXPECT_TRUE(tok.IsEndOfGeneration(tok.eos()));
}

TEST(BpeTokenizer, LlamaStyleAddBosDefault) {
  TokenizerSpec spec = SmallBpeSpec();
  spec.pre = "llama-bpe";
  auto tok = Tokenizer::FromSpec(spec);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const std::vector<int32_t> ids = tok.value()->Encode("low", true);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0], spec.bos);
}

// Every status names the GGUF key at fault; nothing crashes.
void ExpectError(const TokenizerSpec& spec, const std::string& needle) {
  auto tok = Tokenizer::FromSpec(spec);
  ASSERT_FALSE(tok.ok()) << "expected an error mentioning " << needle;
  EXPECT_NE(tok.status().message().find(needle), std::string::npos) << tok.status().ToString();
}

TEST(TokenizerSpecValidation, RejectsMismatchedOrBrokenArrays) {
  TokenizerSpec spm = SmallSpmSpec();
  spm.scores.pop_back();
  ExpectError(spm, "tokenizer.ggml.scores");

  spm = SmallSpmSpec();
  spm.token_types.push_back(1);
  ExpectError(spm, "tokenizer.ggml.token_type");

  spm = SmallSpmSpec();
  spm.token_types[5] = 42;
  ExpectError(spm, "tokenizer.ggml.token_type[5]");

  spm = SmallSpmSpec();
  spm.bos = 100000;
  ExpectError(spm, "tokenizer.ggml.bos_token_id");

  spm = SmallSpmSpec();
  spm.eos = -7;
  ExpectError(spm, "tokenizer.ggml.eos_token_id");

  spm = SmallSpmSpec();
  spm.tokens.clear();
  spm.scores.clear();
  spm.token_types.clear();
  ExpectError(spm, "tokenizer.ggml.tokens");

  spm = SmallSpmSpec();
  spm.scores[10] = std::nanf("");
  ExpectError(spm, "tokenizer.ggml.scores[10]");

  spm = SmallSpmSpec();
  spm.model = "bert";
  ExpectError(spm, "tokenizer.ggml.model");

  TokenizerSpec bpe = SmallBpeSpec();
  bpe.merges.push_back("zz q");
  ExpectError(bpe, "tokenizer.ggml.merges[7]");

  bpe = SmallBpeSpec();
  bpe.merges.push_back("noseparator");
  ExpectError(bpe, "tokenizer.ggml.merges[7]");

  bpe = SmallBpeSpec();
  bpe.merges.push_back("a b");  // both known, "ab" is not a token
  ExpectError(bpe, "'ab'");

  bpe = SmallBpeSpec();
  bpe.pre = "no-such-pre";
  auto tok = Tokenizer::FromSpec(bpe);
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("no-such-pre"), std::string::npos);
  EXPECT_NE(tok.status().message().find("deepseek-coder"), std::string::npos) << "lists supported names";

  bpe = SmallBpeSpec();
  bpe.bos = -1;
  bpe.add_bos = true;
  ExpectError(bpe, "tokenizer.ggml.add_bos_token");
}

TEST(BpeTokenizer, BytesWithoutTokensAreSkipped) {
  auto tok = Tokenizer::FromSpec(SmallBpeSpec());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  // Invalid UTF-8 whose byte-level characters SmallBpeSpec lacks: dropped, no crash.
  const std::vector<int32_t> ids = tok.value()->Encode("low\xFF\xC3", false);
  EXPECT_EQ(ids, std::vector<int32_t>{IdOf(**tok, "low")});
}

TEST(TokenizerSpecValidation, OddButValidVocabsDoNotCrash) {
  // Empty and duplicate token texts, control tokens with empty text.
  TokenizerSpec spm = SmallSpmSpec();
  spm.tokens.push_back("");
  spm.tokens.push_back(Sp("_he"));
  spm.scores.insert(spm.scores.end(), {0.0f, 5.0f});
  spm.token_types.insert(spm.token_types.end(), {3, 1});
  auto spm_tok = Tokenizer::FromSpec(spm);
  ASSERT_TRUE(spm_tok.ok()) << spm_tok.status().ToString();
  TokenizerSpec bpe = SmallBpeSpec();
  bpe.tokens.push_back("");
  bpe.token_types.push_back(4);
  auto bpe_tok = Tokenizer::FromSpec(bpe);
  ASSERT_TRUE(bpe_tok.ok()) << bpe_tok.status().ToString();
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text;
    for (int i = 0; i < 64; ++i) text.push_back(static_cast<char>(rng() % 256));
    for (bool parse_special : {false, true}) {
      for (const auto* tok : {spm_tok.value().get(), bpe_tok.value().get()}) {
        const std::vector<int32_t> ids = tok->Encode(text, true, parse_special);
        for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok->n_vocab());
        (void)tok->Decode(ids);
      }
    }
  }
}

TEST(SupportedPreTokenizers, IncludesRequiredNames) {
  const std::vector<std::string_view> names = SupportedBpePreTokenizers();
  for (std::string_view want : {"gpt-2", "gpt-neox", "falcon", "starcoder", "refact", "mpt", "deepseek-llm",
                                "deepseek-coder", "llama3", "llama-bpe", "qwen2"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  }
}

// ---- FromGguf on written files ----

// Writes `spec` as a vocab-only GGUF; `mutate` may break it first.
std::string WriteVocab(const std::string& name, const TokenizerSpec& spec,
                       const std::function<void(GgufWriter&)>& mutate = nullptr) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("tokenizer.ggml.model", spec.model);
  if (!spec.pre.empty()) w.SetString("tokenizer.ggml.pre", spec.pre);
  w.SetStringArray("tokenizer.ggml.tokens", spec.tokens);
  if (!spec.scores.empty()) w.SetF32Array("tokenizer.ggml.scores", spec.scores);
  w.SetI32Array("tokenizer.ggml.token_type", spec.token_types);
  if (!spec.merges.empty()) w.SetStringArray("tokenizer.ggml.merges", spec.merges);
  if (spec.bos >= 0) w.SetU32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(spec.bos));
  if (spec.eos >= 0) w.SetU32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(spec.eos));
  if (spec.unk >= 0) w.SetU32("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(spec.unk));
  if (mutate) mutate(w);
  const std::string path = testing::TempPath("tokenizer_" + name + ".gguf");
  const Status st = w.Write(path);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return path;
}

Status LoadStatus(const std::string& path) {
  auto file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  auto tok = Tokenizer::FromGguf(**file);
  return tok.ok() ? Status::Ok() : tok.status();
}

TEST(TokenizerFromGguf, LoadsWrittenVocabs) {
  for (const TokenizerSpec& spec : {SmallSpmSpec(), SmallBpeSpec()}) {
    const std::string path = WriteVocab("ok_" + spec.model, spec);
    auto file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto from_file = Tokenizer::FromGguf(**file);
    ASSERT_TRUE(from_file.ok()) << from_file.status().ToString();
    auto from_spec = Tokenizer::FromSpec(spec);
    ASSERT_TRUE(from_spec.ok());
    EXPECT_EQ(from_file.value()->n_vocab(), from_spec.value()->n_vocab());
    EXPECT_EQ(from_file.value()->bos(), from_spec.value()->bos());
    for (const char* text : {"hello world", "lower low", "<|user|>he"}) {
      EXPECT_EQ(from_file.value()->Encode(text, true), from_spec.value()->Encode(text, true)) << text;
    }
  }
}

TEST(TokenizerFromGguf, BrokenVocabsNameTheKey) {
  struct Case {
    const char* name;
    TokenizerSpec spec;
    std::function<void(GgufWriter&)> mutate;
    const char* needle;
  };
  TokenizerSpec short_scores = SmallSpmSpec();
  short_scores.scores.resize(10);
  TokenizerSpec bad_merge = SmallBpeSpec();
  bad_merge.merges.push_back("zz q");
  TokenizerSpec bad_pre = SmallBpeSpec();
  bad_pre.pre = "klingon";
  TokenizerSpec no_merges = SmallBpeSpec();
  no_merges.merges.clear();
  TokenizerSpec big_bos = SmallSpmSpec();
  big_bos.bos = 1 << 20;
  const std::vector<Case> cases = {
      {"short_scores", short_scores, nullptr, "tokenizer.ggml.scores"},
      {"bad_merge", bad_merge, nullptr, "tokenizer.ggml.merges"},
      {"bad_pre", bad_pre, nullptr, "klingon"},
      {"no_merges", no_merges, nullptr, "tokenizer.ggml.merges"},
      {"big_bos", big_bos, nullptr, "tokenizer.ggml.bos_token_id"},
      {"types_as_strings", SmallSpmSpec(),
       [](GgufWriter& w) { w.SetStringArray("tokenizer.ggml.token_type", {"1", "2"}); }, "tokenizer.ggml.token_type"},
      {"tokens_as_floats", SmallSpmSpec(),
       [](GgufWriter& w) { w.SetF32Array("tokenizer.ggml.tokens", {1.0f}); }, "tokenizer.ggml.tokens"},
      {"model_as_int", SmallSpmSpec(), [](GgufWriter& w) { w.SetU32("tokenizer.ggml.model", 3); },
       "tokenizer.ggml.model"},
      {"unknown_model", SmallSpmSpec(), [](GgufWriter& w) { w.SetString("tokenizer.ggml.model", "t5"); }, "'t5'"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteVocab(c.name, c.spec, c.mutate);
    const Status st = LoadStatus(path);
    ASSERT_FALSE(st.ok()) << c.name;
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << c.name << ": " << st.ToString();
  }
}

// ---- llama.cpp tokenizer vectors from ../shared/vocab ----

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Inputs are separated by "\n__ggml_vocab_test__\n"; the file ends with a separator.
std::vector<std::string> ParseInputs(const std::string& content) {
  const std::string separator = "\n__ggml_vocab_test__\n";
  std::vector<std::string> inputs;
  size_t start = 0;
  for (size_t hit; (hit = content.find(separator, start)) != std::string::npos;) {
    inputs.push_back(content.substr(start, hit - start));
    start = hit + separator.size();
  }
  EXPECT_EQ(start, content.size()) << "text after the last separator";
  return inputs;
}

std::vector<std::vector<int32_t>> ParseOutputs(const std::string& content) {
  std::vector<std::vector<int32_t>> outputs;
  std::istringstream lines(content);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::vector<int32_t> ids;
    for (int32_t id; fields >> id;) ids.push_back(id);
    outputs.push_back(std::move(ids));
  }
  return outputs;
}

std::string Show(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s += ' ';
    s += std::to_string(ids[i]);
  }
  return s + "]";
}

std::string Escape(const std::string& text) {
  std::string s;
  for (char c : text) {
    if (c == '\n') s += "\\n";
    else if (c == '\t') s += "\\t";
    else if (c == '\r') s += "\\r";
    else s.push_back(c);
  }
  return "\"" + s + "\"";
}

std::unique_ptr<Tokenizer> LoadVocab(const std::string& path) {
  auto file = GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (!file.ok()) return nullptr;
  auto tok = Tokenizer::FromGguf(**file);
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  if (!tok.ok()) return nullptr;
  return std::move(tok).value();
}

class VocabVectors : public ::testing::TestWithParam<const char*> {};

TEST_P(VocabVectors, MatchesLlamaCppExactly) {
  const std::string name = GetParam();
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-" + name + ".gguf");
  const std::vector<std::string> inputs = ParseInputs(ReadFile(gguf + ".inp"));
  const std::vector<std::vector<int32_t>> outputs = ParseOutputs(ReadFile(gguf + ".out"));
  ASSERT_EQ(inputs.size(), outputs.size()) << "input and expected-output counts differ";
  ASSERT_GT(inputs.size(), 0u);
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);

  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<int32_t> actual = tok->Encode(inputs[i], /*add_bos=*/false);
    ASSERT_EQ(actual, outputs[i]) << name << ": first mismatch at input #" << i << " " << Escape(inputs[i])
                                  << "\n  expected " << Show(outputs[i]) << "\n  actual   " << Show(actual);
  }
}

TEST_P(VocabVectors, DecodeInvertsEncode) {
  const std::string name = GetParam();
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-" + name + ".gguf");
  const std::vector<std::string> inputs = ParseInputs(ReadFile(gguf + ".inp"));
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(tok->Decode(tok->Encode(inputs[i], false)), inputs[i]) << name << " input #" << i;
    // With BOS (where the vocab adds one) the text is unchanged too.
    EXPECT_EQ(tok->Decode(tok->Encode(inputs[i], true)), inputs[i]) << name << " input #" << i << " with BOS";
  }
}

TEST_P(VocabVectors, LongInputFinishes) {
  const std::string name = GetParam();
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-" + name + ".gguf");
  const std::string corpus = ReadFile(gguf + ".inp");
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  std::string text;
  while (text.size() < 100 * 1024) text += corpus;
  const std::vector<int32_t> ids = tok->Encode(text, false);
  EXPECT_GT(ids.size(), text.size() / 16);
  EXPECT_EQ(tok->Decode(ids), text);
  // Degenerate inputs: long runs that become one huge word, or that tempt regexes
  // into rescanning a run from every start position.
  const std::string run(100 * 1024, ' ');
  for (const std::string& text : {std::string(100 * 1024, 'a'), std::string(100 * 1024, '7'), run, run + "5",
                                  std::string(100 * 1024, '\n') + "x", std::string(100 * 1024, '\t') + "x"}) {
    EXPECT_EQ(tok->Decode(tok->Encode(text, false)), text) << "run of '" << Escape(text.substr(0, 1)) << "'";
  }
}

// Arbitrary bytes (invalid UTF-8 included) come back unchanged: byte-level BPE spells
// every byte, SPM falls back to <0xNN> tokens.
TEST_P(VocabVectors, ArbitraryBytesRoundTrip) {
  const std::string name = GetParam();
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-" + name + ".gguf");
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  // Byte-level vocabs trained on UTF-8 text may lack a few bytes (e.g. 0xF5..0xFF):
  // draw only from bytes the vocab can spell on their own.
  std::vector<char> spellable;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    if (tok->Decode(tok->Encode(one, false)) == one) spellable.push_back(static_cast<char>(b));
  }
  if (name == "gpt-2" || name == "llama-spm") {
    EXPECT_EQ(spellable.size(), 256u);
  }
  std::vector<char> continuation;
  for (char c : spellable) {
    if ((static_cast<uint8_t>(c) & 0xC0) == 0x80) continuation.push_back(c);
  }
  ASSERT_FALSE(continuation.empty());
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 20; ++trial) {
    std::string text;
    const int length = 1 + static_cast<int>(rng() % 300);
    for (int i = 0; i < length; ++i) {
      switch (rng() % 4) {
        case 0: text.push_back(spellable[rng() % spellable.size()]); break;        // any byte
        case 1: text.push_back(continuation[rng() % continuation.size()]); break;  // stray continuation
        case 2: text += " \n\t"[rng() % 3]; break;
        default: text.push_back(static_cast<char>('a' + rng() % 26)); break;
      }
    }
    EXPECT_EQ(tok->Decode(tok->Encode(text, false)), text) << name << " trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(Shared, VocabVectors,
                         ::testing::Values("llama-spm", "phi-3", "gpt-2", "falcon", "starcoder", "deepseek-llm",
                                           "deepseek-coder", "mpt", "refact"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (c == '-') c = '_';
                           }
                           return s;
                         });

TEST(VocabFiles, GptNeoxLoads) {
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-gpt-neox.gguf");
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->model_name(), "gpt2");
  EXPECT_EQ(tok->pre_name(), "default");
  EXPECT_EQ(tok->n_vocab(), 50432);
  const std::string text = "Hello world, it's 2024!";
  EXPECT_EQ(tok->Decode(tok->Encode(text, false)), text);
}

TEST(VocabFiles, LlamaSpmSpecialTokens) {
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-llama-spm.gguf");
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos(), 1);
  EXPECT_EQ(tok->eos(), 2);
  EXPECT_EQ(tok->n_vocab(), 32000);
  const std::vector<int32_t> ids = tok->Encode("Hello world", true);
  const std::vector<int32_t> expected = {1, 15043, 3186};
  EXPECT_EQ(ids, expected);
  // "<s>" in text stays text unless parse_special.
  EXPECT_NE(tok->Encode("<s>", false), std::vector<int32_t>{1});
  const std::vector<int32_t> parsed = tok->Encode("<s>Hello", false, true);
  ASSERT_FALSE(parsed.empty());
  EXPECT_EQ(parsed[0], 1);
  EXPECT_TRUE(tok->IsEndOfGeneration(2));
  EXPECT_EQ(tok->TokenToPiece(15043), " Hello");
}

TEST(VocabFiles, Phi3EndOfTurn) {
  KVS_SKIP_IF_NO_SHARED(gguf, "vocab/ggml-vocab-phi-3.gguf");
  std::unique_ptr<Tokenizer> tok = LoadVocab(gguf);
  ASSERT_NE(tok, nullptr);
  const int32_t end = IdOf(*tok, "<|end|>");
  ASSERT_GE(end, 0);
  EXPECT_TRUE(tok->IsEndOfGeneration(end));
  EXPECT_TRUE(tok->IsEndOfGeneration(tok->eos()));
  const std::vector<int32_t> ids = tok->Encode("<|user|>\nHi<|end|>", false, true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), IdOf(*tok, "<|user|>"));
  EXPECT_EQ(ids.back(), end);
}

}  // namespace
}  // namespace kvsparse
