#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "kvsparse/bench_tasks.h"
#include "kvsparse/gguf.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

StatusOr<std::vector<UserTaskRecord>> Parse(std::string_view text) { return ParseUserTasks(text, "data.jsonl", "data"); }

TEST(UserTasks, ParsesGoodLines) {
  const std::string text =
      "{\"context\": \"Ann wrote the book.\", \"question\": \"\\nQ: Who wrote it?\\nA:\", \"answers\": [\"Ann\", "
      "\"Ann Lee\"], \"metric\": \"f1\", \"task\": \"qa\", \"subtask\": \"short\", \"id\": 7, \"max_new_tokens\": 12, "
      "\"meta\": {\"length\": 4}}\n"
      "\n"
      "   \r\n"
      "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"metric\": \"exact\", \"id\": \"s-2\"}\r\n"
      "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"metric\": \"exact\", \"first_line_only\": false}";
  auto r = Parse(text);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 3u);
  const UserTaskRecord& a = (*r)[0];
  EXPECT_EQ(a.context, "Ann wrote the book.");
  EXPECT_EQ(a.question, "\nQ: Who wrote it?\nA:");
  EXPECT_EQ(a.answers, (std::vector<std::string>{"Ann", "Ann Lee"}));
  EXPECT_EQ(a.metric, AnswerMetric::kF1);
  EXPECT_EQ(a.task, "qa");
  EXPECT_EQ(a.subtask, "short");
  EXPECT_EQ(a.id, "7");
  EXPECT_EQ(a.max_new_tokens, 12);
  EXPECT_FALSE(a.first_line_only);
  EXPECT_EQ(a.line, 1);
  const UserTaskRecord& b = (*r)[1];
  EXPECT_EQ(b.line, 4);
  EXPECT_EQ(b.task, "data");  // default: the file's stem
  EXPECT_EQ(b.id, "s-2");
  EXPECT_EQ(b.answers, std::vector<std::string>{"x"});
  EXPECT_EQ(b.metric, AnswerMetric::kExact);
  EXPECT_TRUE(b.first_line_only);  // default for exact
  EXPECT_EQ(b.max_new_tokens, 64);
  EXPECT_FALSE((*r)[2].first_line_only);
  auto defaults = Parse("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\"}");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ((*defaults)[0].metric, AnswerMetric::kContains);
}

struct BadLine {
  const char* json;
  const char* expect;  // substring of the error after "data.jsonl:2: "
};

TEST(UserTasks, RejectsEachKindOfBadLine) {
  const std::string good = "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\"}\n";
  const BadLine cases[] = {
      {"{\"context\": \"c\", \"question\": ", "malformed JSON"},
      {"[1, 2]", "expected a JSON object, found an array"},
      {"{\"question\": \"q\", \"answer\": \"x\"}", "field 'context': missing"},
      {"{\"context\": 5, \"question\": \"q\", \"answer\": \"x\"}", "field 'context': expected a string, found the integer 5"},
      {"{\"context\": \"c\", \"answer\": \"x\"}", "field 'question': missing"},
      {"{\"context\": \"c\", \"question\": \"q\"}", "field 'answers': missing"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"answers\": [\"y\"]}", "field 'answer': give either"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answers\": []}", "field 'answers': expected a non-empty array of strings, found an empty array"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answers\": \"x\"}", "field 'answers': expected a non-empty array of strings, found a string"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answers\": [\"x\", 3]}", "field 'answers': element 1 is the integer 3"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": null}", "field 'answer': expected a string, found null"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"metric\": \"rouge\"}", "field 'metric': unknown metric 'rouge'"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"anwser\": \"y\"}", "field 'anwser': unknown field"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"max_new_tokens\": 0}", "field 'max_new_tokens': expected an integer in [1, 4096], found the integer 0"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"max_new_tokens\": 2.5}", "field 'max_new_tokens'"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"id\": [1]}", "field 'id': expected a string or an integer"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"first_line_only\": 1}", "field 'first_line_only': expected true or false"},
      {"{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\", \"task\": \"\"}", "field 'task': must not be empty"},
  };
  for (const BadLine& c : cases) {
    auto r = Parse(good + c.json + "\n" + good);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    const std::string& msg = r.status().message();
    EXPECT_EQ(msg.rfind("data.jsonl:2: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << msg;
  }
  auto empty = Parse("\n  \n");
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("no samples"), std::string::npos);
}

TEST(UserTasks, LoadsFileWithStemAsTask) {
  const std::string path = testing::TempPath("longbench_qa.jsonl");
  {
    std::ofstream out(path);
    out << "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"x\"}\n";
  }
  auto r = LoadUserTasks(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)[0].task, "longbench_qa");
  auto missing = LoadUserTasks(path + ".absent");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  std::remove(path.c_str());
}

TEST(UserTasks, BuildsAndScoresWithARealTokenizer) {
  KVS_SKIP_IF_NO_SHARED(vocab, "vocab/ggml-vocab-llama-spm.gguf");
  auto file = GgufFile::Open(vocab);
  ASSERT_TRUE(file.ok());
  auto tok_or = Tokenizer::FromGguf(**file);
  ASSERT_TRUE(tok_or.ok());
  const Tokenizer& tok = **tok_or;
  auto records = Parse(
      "{\"context\": \"The capital of France is Paris. It lies on the Seine.\", \"question\": \"\\nQuestion: What is "
      "the capital of France?\\nAnswer:\", \"answers\": [\"Paris\"], \"metric\": \"exact\", \"id\": \"fr\"}");
  ASSERT_TRUE(records.ok());
  const BenchSample s = BuildUserSample((*records)[0], tok);
  EXPECT_EQ(s.task, "data");
  EXPECT_EQ(s.id, "fr");
  EXPECT_EQ(s.context, tok.Encode(s.context_text, true));
  EXPECT_EQ(s.target_length, static_cast<int32_t>(s.context.size()));
  EXPECT_EQ(tok.Decode(PromptTokens(s, BenchProtocol::kQuestionLast)), s.context_text + s.question_text);
  ASSERT_EQ(s.answers.size(), 1u);
  EXPECT_EQ(tok.Decode(s.answers[0]), "Paris");
  // exact + first line only: the model may keep talking on the next line.
  std::vector<int32_t> gen = s.answers[0];
  const std::vector<int32_t> more = tok.Encode(".\nQuestion: and Spain?", false);
  gen.insert(gen.end(), more.begin(), more.end());
  EXPECT_EQ(ScoreGeneration(s, gen, &tok), 1.0);
  EXPECT_EQ(ScoreGeneration(s, tok.Encode("Lyon", false), &tok), 0.0);

  UserSampleOptions trunc;
  trunc.max_context_tokens = 8;
  const BenchSample t = BuildUserSample((*records)[0], tok, trunc);
  ASSERT_EQ(t.context.size(), 8u);
  EXPECT_EQ(std::vector<int32_t>(t.context.begin(), t.context.begin() + 4),
            std::vector<int32_t>(s.context.begin(), s.context.begin() + 4));
  EXPECT_EQ(std::vector<int32_t>(t.context.end() - 4, t.context.end()),
            std::vector<int32_t>(s.context.end() - 4, s.context.end()));
}

}  // namespace
}  // namespace kvsparse
