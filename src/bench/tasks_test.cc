#include "kvsparse/bench_tasks.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "kvsparse/bench_metrics.h"
#include "kvsparse/gguf.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

// ---------------------------------------------------------------------------------------
// Token-level tasks.

TokenVocab SmallVocab() {
  TokenVocab v;
  for (int i = 0; i < 8; ++i) v.filler.push_back(i);
  for (int i = 0; i < 12; ++i) v.keys.push_back(8 + i);
  for (int i = 0; i < 12; ++i) v.values.push_back(20 + i);
  return v;
}

int64_t Count(const std::vector<int32_t>& v, int32_t x) { return std::count(v.begin(), v.end(), x); }

// What the built-in retrieval model computes: an induction head predicts the token that
// followed the previous occurrence of the current token. Greedy, n steps.
std::vector<int32_t> InductionGenerate(std::vector<int32_t> seq, int n) {
  std::vector<int32_t> out;
  for (int step = 0; step < n; ++step) {
    const int32_t cur = seq.back();
    int32_t next = -1;
    for (size_t i = seq.size() - 1; i-- > 0;) {
      if (seq[i] == cur) {
        next = seq[i + 1];
        break;
      }
    }
    if (next < 0) break;
    out.push_back(next);
    seq.push_back(next);
  }
  return out;
}

TEST(TokenTasks, DeterministicPerSeed) {
  const TokenVocab vocab = SmallVocab();
  for (BenchTask task : AllBenchTasks()) {
    if (!HasTokenLevelForm(task)) continue;
    auto a = GenerateTokenSample(task, vocab, 300, 7);
    auto b = GenerateTokenSample(task, vocab, 300, 7);
    auto c = GenerateTokenSample(task, vocab, 300, 8);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << BenchTaskName(task);
    EXPECT_EQ(a->context, b->context) << BenchTaskName(task);
    EXPECT_EQ(a->question, b->question);
    EXPECT_EQ(a->answers, b->answers);
    EXPECT_NE(a->context, c->context) << BenchTaskName(task);
  }
}

TEST(TokenTasks, NeedleFollowsKeyOnceAtDepth) {
  const TokenVocab vocab = SmallVocab();
  const std::set<int32_t> filler(vocab.filler.begin(), vocab.filler.end());
  for (int32_t len : {2, 3, 64, 257, 1000}) {
    for (double depth : {0.0, 0.25, 0.5, 1.0}) {
      BenchTaskOptions o;
      o.depth = depth;
      auto s = GenerateTokenSample(BenchTask::kNiahSingle, vocab, len, 11 + len, o);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      ASSERT_EQ(static_cast<int32_t>(s->context.size()), len);
      ASSERT_EQ(s->question.size(), 1u);
      const int32_t key = s->question[0];
      ASSERT_EQ(s->answers.size(), 1u);
      const int32_t value = s->answers[0][0];
      EXPECT_EQ(Count(s->context, key), 1);
      EXPECT_EQ(Count(s->context, value), 1);
      const auto at = std::find(s->context.begin(), s->context.end(), key) - s->context.begin();
      ASSERT_LT(at + 1, len);
      EXPECT_EQ(s->context[at + 1], value);
      ASSERT_EQ(s->evidence.size(), 1u);
      EXPECT_EQ(s->evidence[0].begin, at);
      EXPECT_EQ(s->evidence[0].end, at + 2);
      if (len >= 64) {
        EXPECT_NEAR(static_cast<double>(at) / (len - 2), depth, 0.01);
      }
      for (int32_t i = 0; i < len; ++i) {
        if (i != at && i != at + 1) {
          EXPECT_TRUE(filler.count(s->context[i]));
        }
      }
      EXPECT_EQ(s->metric, AnswerMetric::kExact);
      EXPECT_EQ(s->max_new_tokens, 1);
      EXPECT_EQ(s->subtask, fmt::format("depth={:g}", depth));
      // The induction model answers it under question_last.
      EXPECT_EQ(InductionGenerate(PromptTokens(*s, BenchProtocol::kQuestionLast), 1), s->answers[0]);
      EXPECT_EQ(PromptTokens(*s, BenchProtocol::kQuestionAfter), s->context);
    }
  }
}

TEST(TokenTasks, MultiKeyAndKvRetrieval) {
  const TokenVocab vocab = SmallVocab();
  for (BenchTask task : {BenchTask::kNiahMultiKey, BenchTask::kKvRetrieval}) {
    for (uint64_t seed = 0; seed < 20; ++seed) {
      BenchTaskOptions o;
      o.depth = static_cast<double>(seed % 5) / 4.0;
      o.n_keys = 2 + static_cast<int32_t>(seed % 6);
      o.bos_token = seed % 2 ? 99 : -1;
      auto s = GenerateTokenSample(task, vocab, 500, seed, o);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      ASSERT_EQ(s->context.size(), 500u);
      if (o.bos_token >= 0) {
        EXPECT_EQ(s->context[0], 99);
      }
      // Every key occurs at most once and is followed by a value.
      int32_t n_keys = 0;
      for (int32_t k : vocab.keys) {
        const int64_t c = Count(s->context, k);
        ASSERT_LE(c, 1);
        if (c == 1) {
          ++n_keys;
          const auto at = std::find(s->context.begin(), s->context.end(), k) - s->context.begin();
          EXPECT_GE(s->context[at + 1], 20);
        }
      }
      if (task == BenchTask::kNiahMultiKey) {
        EXPECT_EQ(n_keys, o.n_keys);
      } else {
        EXPECT_EQ(n_keys, 12);  // every key, in one block
      }
      const int32_t key = s->question.at(0);
      const auto at = std::find(s->context.begin(), s->context.end(), key) - s->context.begin();
      ASSERT_LT(at, 500);
      EXPECT_EQ(s->context[at + 1], s->answers.at(0).at(0));
      ASSERT_EQ(s->evidence.size(), 1u);
      EXPECT_EQ(s->evidence[0].begin, at);
      EXPECT_NEAR(static_cast<double>(at) / 500.0, o.depth, 0.06);
      EXPECT_EQ(InductionGenerate(PromptTokens(*s, BenchProtocol::kQuestionLast), 1), s->answers[0]);
    }
  }
}

TEST(TokenTasks, CopySpan) {
  const TokenVocab vocab = SmallVocab();
  for (int32_t prompt : {1, 3}) {
    BenchTaskOptions o;
    o.depth = 0.3;
    o.span_length = 8;
    o.copy_prompt = prompt;
    auto s = GenerateTokenSample(BenchTask::kCopy, vocab, 400, 5, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_EQ(s->context.size(), 400u);
    ASSERT_EQ(s->evidence.size(), 1u);
    const TokenRange span = s->evidence[0];
    ASSERT_EQ(span.end - span.begin, 8);
    const std::vector<int32_t> tokens(s->context.begin() + span.begin, s->context.begin() + span.end);
    for (int32_t t : tokens) EXPECT_EQ(Count(s->context, t), 1);  // distinct, and only there
    EXPECT_EQ(s->question, std::vector<int32_t>(tokens.begin(), tokens.begin() + prompt));
    EXPECT_EQ(s->answers[0], std::vector<int32_t>(tokens.begin() + prompt, tokens.end()));
    EXPECT_EQ(s->max_new_tokens, 8 - prompt);
    EXPECT_EQ(InductionGenerate(PromptTokens(*s, BenchProtocol::kQuestionLast), 8 - prompt), s->answers[0]);
  }
  // The span is clamped to the distinct values the vocab has.
  BenchTaskOptions big;
  big.span_length = 16;
  auto s = GenerateTokenSample(BenchTask::kCopy, vocab, 100, 1, big);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->answers[0].size(), 11u);
  EXPECT_EQ(s->subtask, "span=12,depth=0.5");
}

TEST(TokenTasks, Errors) {
  const TokenVocab vocab = SmallVocab();
  auto vt = GenerateTokenSample(BenchTask::kVariableTracking, vocab, 100, 1);
  EXPECT_EQ(vt.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(vt.status().message().find("token-level"), std::string::npos);

  BenchTaskOptions deep;
  deep.depth = 1.5;
  auto d = GenerateTokenSample(BenchTask::kNiahSingle, vocab, 100, 1, deep);
  EXPECT_NE(d.status().message().find("depth 1.5"), std::string::npos);

  auto small = GenerateTokenSample(BenchTask::kNiahMultiKey, vocab, 5, 1);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("minimum 8"), std::string::npos) << small.status().message();

  BenchTaskOptions many;
  many.n_keys = 13;
  EXPECT_FALSE(GenerateTokenSample(BenchTask::kNiahMultiKey, vocab, 500, 1, many).ok());

  TokenVocab overlap = vocab;
  overlap.values.push_back(3);  // a filler id
  Status st = ValidateTokenVocab(overlap);
  EXPECT_NE(st.message().find("id 3"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("values"), std::string::npos);
  TokenVocab empty = vocab;
  empty.keys.clear();
  EXPECT_NE(ValidateTokenVocab(empty).message().find("'keys' is empty"), std::string::npos);
  EXPECT_NE(ValidateTokenVocab(vocab, 30).message().find("outside [0, 30)"), std::string::npos);
  EXPECT_TRUE(ValidateTokenVocab(vocab, 32).ok());
}

TEST(TaskNames, RoundTrip) {
  for (BenchTask t : AllBenchTasks()) EXPECT_EQ(*ParseBenchTask(BenchTaskName(t)), t);
  EXPECT_NE(ParseBenchTask("niah").status().message().find("niah_single"), std::string::npos);
  EXPECT_EQ(*ParseBenchProtocol("question_after"), BenchProtocol::kQuestionAfter);
  EXPECT_FALSE(ParseBenchProtocol("after").ok());
  EXPECT_EQ(*ParseAnswerMetric("contains_all"), AnswerMetric::kContainsAll);
  EXPECT_FALSE(ParseAnswerMetric("rouge").ok());
}

// ---------------------------------------------------------------------------------------
// Text tasks.

// SPM vocab of "▁" and the 256 byte tokens: one token per character, always available.
std::unique_ptr<Tokenizer> ByteTokenizer() {
  TokenizerSpec spec;
  spec.model = "llama";
  spec.tokens = {"<unk>", "<s>", "</s>", "\xE2\x96\x81"};
  spec.token_types = {2, 3, 3, 1};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    spec.tokens.push_back(name);
    spec.token_types.push_back(6);
  }
  spec.bos = 1;
  spec.eos = 2;
  spec.unk = 0;
  auto tok = Tokenizer::FromSpec(std::move(spec));
  KVS_CHECK(tok.ok());
  return std::move(tok).value();
}

std::unique_ptr<Tokenizer> SharedTokenizer(const std::string& path) {
  auto file = GgufFile::Open(path);
  if (!file.ok()) return nullptr;
  auto tok = Tokenizer::FromGguf(**file);
  if (!tok.ok()) return nullptr;
  return std::move(tok).value();
}

size_t CountOf(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

std::string Decoded(const Tokenizer& tok, const BenchSample& s, TokenRange r) {
  return tok.Decode(std::vector<int32_t>(s.context.begin() + r.begin, s.context.begin() + r.end));
}

TEST(TokenTasks, MultiQueryAsksEveryKeyAndScoresTheLast) {
  const TokenVocab vocab = SmallVocab();
  for (uint64_t seed = 0; seed < 20; ++seed) {
    BenchTaskOptions o;
    o.depth = static_cast<double>(seed % 5) / 4.0;
    o.n_keys = 2 + static_cast<int32_t>(seed % 5);
    o.value_tokens = 1 + static_cast<int32_t>(seed % 2);
    auto s = GenerateTokenSample(BenchTask::kNiahMultiQuery, vocab, 400, seed, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_EQ(s->context.size(), 400u);
    EXPECT_EQ(s->subtask, fmt::format("keys={},depth={:g}", o.n_keys, o.depth));
    // The question is every needle's key, each once; the last one is the scored needle's.
    ASSERT_EQ(s->question.size(), static_cast<size_t>(o.n_keys));
    const std::set<int32_t> asked(s->question.begin(), s->question.end());
    EXPECT_EQ(asked.size(), s->question.size());
    for (int32_t k : s->question) {
      EXPECT_EQ(Count(s->context, k), 1) << "key " << k;
    }
    const int32_t scored = s->question.back();
    const auto at = std::find(s->context.begin(), s->context.end(), scored) - s->context.begin();
    ASSERT_EQ(s->evidence.size(), 1u);
    EXPECT_EQ(s->evidence[0].begin, at);
    EXPECT_NEAR(static_cast<double>(at) / 400.0, o.depth, 0.06);
    ASSERT_EQ(s->answers.size(), 1u);
    EXPECT_EQ(s->answers[0].size(), static_cast<size_t>(o.value_tokens));
    EXPECT_EQ(s->metric, AnswerMetric::kExact);
    // The induction model answers the last key (the earlier ones are followed only by other keys).
    EXPECT_EQ(InductionGenerate(PromptTokens(*s, BenchProtocol::kQuestionLast), o.value_tokens), s->answers[0]);
  }
}

// Checks every task's answer by re-deriving it from the context text alone.
void CheckTextSample(const Tokenizer& tok, BenchTask task, const BenchSample& s, const BenchTaskOptions& o) {
  SCOPED_TRACE(fmt::format("task {} target {} seed {}", BenchTaskName(task), s.target_length, s.seed));
  const auto len = static_cast<int32_t>(s.context.size());
  EXPECT_LE(len, s.target_length);
  EXPECT_GE(len, s.target_length - TextLengthTolerance(s.target_length));
  EXPECT_EQ(s.context, tok.Encode(s.context_text, true));
  ASSERT_FALSE(s.answer_texts.empty());
  ASSERT_EQ(s.answers.size(), s.answer_texts.size());
  // Prompt ids spell prompt text; answer ids spell the answers.
  EXPECT_EQ(tok.Decode(PromptTokens(s, BenchProtocol::kQuestionLast)), s.context_text + s.question_text);
  for (size_t i = 0; i < s.answers.size(); ++i) {
    EXPECT_EQ(NormalizeAnswer(tok.Decode(s.answers[i])), NormalizeAnswer(s.answer_texts[i]));
    EXPECT_EQ(ScoreGeneration(s, s.answers[i], &tok) * static_cast<double>(s.answers.size() > 1 ? s.answers.size() : 1),
              1.0);
  }
  EXPECT_GE(s.max_new_tokens, static_cast<int32_t>(s.answers[0].size()));
  EXPECT_EQ(ScoreGenerationText(s, "I do not know."), 0.0);
  const std::string& text = s.context_text;
  const std::string& q = s.question_text;
  std::smatch m;
  switch (task) {
    case BenchTask::kNiahSingle:
    case BenchTask::kNiahMultiKey: {
      ASSERT_TRUE(std::regex_search(q, m, std::regex("magic number for ([a-z]+-[a-z]+) mentioned")));
      const std::string key = m[1];
      const std::string needle = "for " + key + " is: " + s.answer_texts[0] + ".";
      EXPECT_EQ(CountOf(text, key), 1u);
      EXPECT_EQ(CountOf(text, s.answer_texts[0]), 1u);
      EXPECT_EQ(CountOf(text, needle), 1u);
      const size_t n_needles = CountOf(text, "One of the special magic numbers for ");
      EXPECT_EQ(n_needles, task == BenchTask::kNiahSingle ? 1u : static_cast<size_t>(o.n_keys));
      ASSERT_EQ(s.evidence.size(), 1u);
      EXPECT_NE(Decoded(tok, s, s.evidence[0]).find(needle), std::string::npos);
      // Depth is a fraction of the haystack: the prose after the instruction line, needles removed.
      std::string hay = text.substr(text.find('\n') + 1);
      const size_t needle_at = hay.find("One of the special magic numbers " + needle);
      std::string before = hay.substr(0, needle_at), after = hay.substr(needle_at);
      const std::regex any_needle("One of the special magic numbers for [a-z]+-[a-z]+ is: [0-9]+\\. ?");
      before = std::regex_replace(before, any_needle, "");
      after = std::regex_replace(after, any_needle, "");
      // Needles sit at the sentence boundary nearest their depth (sentences are < 80 characters).
      const double hay_chars = static_cast<double>(before.size() + after.size());
      EXPECT_NEAR(static_cast<double>(before.size()) / hay_chars, o.depth, 0.01 + 40.0 / hay_chars);
      break;
    }
    case BenchTask::kNiahMultiQuery: {
      // Every needle's key is listed; every value is an answer, all required.
      EXPECT_EQ(s.metric, AnswerMetric::kContainsAll);
      ASSERT_EQ(s.answer_texts.size(), static_cast<size_t>(o.n_keys));
      EXPECT_EQ(s.evidence.size(), static_cast<size_t>(o.n_keys));
      EXPECT_EQ(CountOf(text, "One of the special magic numbers for "), static_cast<size_t>(o.n_keys));
      const std::regex needle("One of the special magic numbers for ([a-z]+-[a-z]+) is: ([0-9]+)\\.");
      std::set<std::string> values;
      for (auto it = std::sregex_iterator(text.begin(), text.end(), needle); it != std::sregex_iterator(); ++it) {
        EXPECT_NE(q.find((*it)[1].str()), std::string::npos) << "key not asked: " << (*it)[1];
        values.insert((*it)[2]);
      }
      EXPECT_EQ(values, std::set<std::string>(s.answer_texts.begin(), s.answer_texts.end()));
      EXPECT_NE(q.find("What are all the special magic numbers for "), std::string::npos);
      break;
    }
    case BenchTask::kKvRetrieval: {
      ASSERT_TRUE(std::regex_search(q, m, std::regex("Key: \"([0-9a-f-]+)\"")));
      const size_t at = text.find("JSON data:\n");
      ASSERT_NE(at, std::string::npos);
      const auto obj = nlohmann::json::parse(text.substr(at + 11));  // throws (fails) if not JSON
      std::set<std::string> keys;
      size_t pairs = 0;
      for (const auto& [k, v] : obj.items()) keys.insert(k), ++pairs;
      EXPECT_EQ(keys.size(), pairs);
      EXPECT_EQ(CountOf(text, m[1]), 1u);
      EXPECT_EQ(obj.at(std::string(m[1])).get<std::string>(), s.answer_texts[0]);
      ASSERT_EQ(s.evidence.size(), 1u);
      EXPECT_NE(Decoded(tok, s, s.evidence[0]).find(s.answer_texts[0]), std::string::npos);
      break;
    }
    case BenchTask::kVariableTracking: {
      ASSERT_TRUE(std::regex_search(q, m, std::regex("does VAR ([A-Z]{5}) hold")));
      const std::string asked = m[1];
      std::map<std::string, std::string> assign;  // var -> number or var
      const std::regex stmt("VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|([0-9]+))\\.");
      size_t n = 0;
      for (auto it = std::sregex_iterator(text.begin(), text.end(), stmt); it != std::sregex_iterator(); ++it, ++n) {
        EXPECT_TRUE(assign.emplace((*it)[1], (*it)[3].matched ? (*it)[3].str() : "#" + (*it)[4].str()).second);
      }
      EXPECT_EQ(n, static_cast<size_t>(o.n_chains * (o.n_hops + 1)));
      std::string cur = asked;
      int hops = 0;
      while (assign.count(cur) && assign[cur][0] != '#') cur = assign[cur], ++hops;
      ASSERT_TRUE(assign.count(cur));
      EXPECT_EQ(hops, o.n_hops);
      EXPECT_EQ(assign[cur].substr(1), s.answer_texts[0]);
      EXPECT_EQ(s.evidence.size(), static_cast<size_t>(o.n_hops + 1));
      break;
    }
    case BenchTask::kFreqWords: {
      const std::string coded = text.substr(text.find('\n') + 1);
      std::map<std::string, int> counts;
      std::istringstream in(coded);
      for (std::string w; in >> w;) ++counts[w];
      std::vector<std::pair<int, std::string>> by_count;
      for (const auto& [w, c] : counts) by_count.push_back({c, w});
      std::sort(by_count.rbegin(), by_count.rend());
      ASSERT_GT(by_count.size(), static_cast<size_t>(o.top_k));
      EXPECT_GT(by_count[o.top_k - 1].first, by_count[o.top_k].first);
      std::set<std::string> top, answers(s.answer_texts.begin(), s.answer_texts.end());
      for (int i = 0; i < o.top_k; ++i) top.insert(by_count[i].second);
      EXPECT_EQ(top, answers);
      EXPECT_EQ(s.metric, AnswerMetric::kContainsAll);
      std::string all;
      for (const std::string& a : s.answer_texts) all += a + ", ";
      EXPECT_EQ(ScoreGenerationText(s, all), 1.0);
      EXPECT_NEAR(ScoreGenerationText(s, s.answer_texts[0]), 1.0 / o.top_k, 1e-12);
      break;
    }
    case BenchTask::kCopy: {
      const std::string intro = "The sequence to remember is: ";
      ASSERT_EQ(CountOf(text, intro), 1u);
      const size_t at = text.find(intro) + intro.size();
      const std::string span = text.substr(at, text.find('.', at) - at);
      std::vector<std::string> words;
      std::istringstream in(span);
      for (std::string w; in >> w;) words.push_back(w);
      ASSERT_EQ(words.size(), static_cast<size_t>(o.span_length));
      for (const std::string& w : words) EXPECT_EQ(CountOf(text, " " + w + " ") + CountOf(text, " " + w + "."), 1u);
      std::string prompt = intro + words[0], rest;
      for (int i = 1; i < o.copy_prompt; ++i) prompt += " " + words[i];
      for (int i = o.copy_prompt; i < o.span_length; ++i) rest += (rest.empty() ? "" : " ") + words[i];
      EXPECT_TRUE(q.ends_with(prompt)) << q;
      EXPECT_EQ(s.answer_texts[0], rest);
      ASSERT_EQ(s.evidence.size(), 1u);
      EXPECT_NE(Decoded(tok, s, s.evidence[0]).find(span), std::string::npos);
      break;
    }
  }
}

void CheckAllTasks(const Tokenizer& tok, const std::vector<int32_t>& lengths) {
  for (BenchTask task : AllBenchTasks()) {
    for (int32_t len : lengths) {
      for (uint64_t seed : {1u, 2u}) {
        BenchTaskOptions o;
        o.depth = seed == 1 ? 0.2 : 0.9;
        o.n_keys = 3;
        o.n_hops = 3;
        o.top_k = seed == 1 ? 3 : 5;
        o.span_length = 10;
        o.copy_prompt = seed == 1 ? 1 : 2;
        auto s = GenerateTextSample(task, tok, len, seed, o);
        ASSERT_TRUE(s.ok()) << BenchTaskName(task) << " " << len << ": " << s.status().ToString();
        EXPECT_EQ(s->subtask, BenchSubtask(task, o));
        CheckTextSample(tok, task, *s, o);
      }
    }
  }
}

TEST(TextTasks, ByteTokenizerAllTasks) {
  auto tok = ByteTokenizer();
  CheckAllTasks(*tok, {700, 2500});
}

TEST(TextTasks, LlamaSpmAllTasks) {
  KVS_SKIP_IF_NO_SHARED(path, "vocab/ggml-vocab-llama-spm.gguf");
  auto tok = SharedTokenizer(path);
  ASSERT_NE(tok, nullptr);
  CheckAllTasks(*tok, {600, 4000});
}

TEST(TextTasks, Gpt2BpeAllTasks) {
  KVS_SKIP_IF_NO_SHARED(path, "vocab/ggml-vocab-gpt-2.gguf");
  auto tok = SharedTokenizer(path);
  ASSERT_NE(tok, nullptr);
  CheckAllTasks(*tok, {600, 4000});
}

TEST(TextTasks, DeterministicPerSeed) {
  auto tok = ByteTokenizer();
  for (BenchTask task : AllBenchTasks()) {
    auto a = GenerateTextSample(task, *tok, 800, 3);
    auto b = GenerateTextSample(task, *tok, 800, 3);
    auto c = GenerateTextSample(task, *tok, 800, 4);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << BenchTaskName(task);
    EXPECT_EQ(a->context_text, b->context_text);
    EXPECT_EQ(a->context, b->context);
    EXPECT_EQ(a->question, b->question);
    EXPECT_EQ(a->answers, b->answers);
    EXPECT_EQ(a->answer_texts, b->answer_texts);
    EXPECT_NE(a->context_text, c->context_text) << BenchTaskName(task);
    EXPECT_NE(a->answer_texts, c->answer_texts) << BenchTaskName(task);
  }
}

TEST(TextTasks, DepthMovesTheNeedle) {
  auto tok = ByteTokenizer();
  int32_t last = -1;
  for (double depth : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    BenchTaskOptions o;
    o.depth = depth;
    auto s = GenerateTextSample(BenchTask::kNiahSingle, *tok, 2000, 9, o);
    ASSERT_TRUE(s.ok());
    ASSERT_EQ(s->evidence.size(), 1u);
    const TokenRange r = s->evidence[0];
    EXPECT_GT(r.begin, last);
    last = r.begin;
    const auto head = static_cast<int32_t>(tok->Encode(s->context_text.substr(0, s->context_text.find('\n') + 1), true).size());
    const auto len = static_cast<int32_t>(s->context.size());
    // The needle starts at head + depth · (haystack tokens), to within a sentence.
    const double want = head + depth * static_cast<double>(len - head - (r.end - r.begin));
    EXPECT_NEAR(r.begin, want, 60) << depth;
  }
}

TEST(TextTasks, Errors) {
  auto tok = ByteTokenizer();
  auto small = GenerateTextSample(BenchTask::kNiahSingle, *tok, 50, 1);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("below the minimum"), std::string::npos) << small.status().message();
  BenchTaskOptions bad;
  bad.top_k = 0;
  EXPECT_NE(GenerateTextSample(BenchTask::kFreqWords, *tok, 1000, 1, bad).status().message().find("top_k 0"),
            std::string::npos);
  bad = {};
  bad.copy_prompt = 16;
  EXPECT_FALSE(GenerateTextSample(BenchTask::kCopy, *tok, 1000, 1, bad).ok());
}

TEST(Scoring, FirstLineAndMetrics) {
  BenchSample s;
  s.answer_texts = {"Paris", "City of Light"};
  s.answers = {{5}, {6, 7}};
  s.metric = AnswerMetric::kExact;
  s.first_line_only = true;
  EXPECT_EQ(ScoreGenerationText(s, "\n  paris.\nQuestion: next"), 1.0);
  s.first_line_only = false;
  EXPECT_EQ(ScoreGenerationText(s, "\n  paris.\nQuestion: next"), 0.0);
  s.metric = AnswerMetric::kContains;
  EXPECT_EQ(ScoreGenerationText(s, "It is the city of light."), 1.0);
  s.metric = AnswerMetric::kF1;
  EXPECT_NEAR(ScoreGenerationText(s, "light city"), 0.8, 1e-12);  // vs "city of light": P 1, R 2/3
  s.metric = AnswerMetric::kContainsAll;
  EXPECT_EQ(ScoreGenerationText(s, "Paris"), 0.5);
  EXPECT_EQ(ScoreGenerationIds(s, std::vector<int32_t>{6, 7, 5}), 1.0);
  s.metric = AnswerMetric::kExact;
  EXPECT_EQ(ScoreGenerationIds(s, std::vector<int32_t>{6, 7}), 1.0);
  EXPECT_EQ(ScoreGeneration(s, std::vector<int32_t>{6}, nullptr), 0.0);
}

}  // namespace
}  // namespace kvsparse
