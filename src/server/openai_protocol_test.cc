#include "server/openai_protocol.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kvsparse::server {
namespace {

using Json = nlohmann::json;

constexpr bool kChat = true;
constexpr bool kText = false;

CompletionRequest ParseOk(std::string_view body, bool chat, const ProtocolLimits& limits = {}) {
  auto parsed = ParseCompletionRequest(body, chat, limits);
  if (const ApiError* error = std::get_if<ApiError>(&parsed)) {
    ADD_FAILURE() << "unexpected error for " << body << ": " << ErrorBody(*error);
    return {};
  }
  return std::get<CompletionRequest>(parsed);
}

// Expects a 400 invalid_request_error about `param`, whose message names the field.
ApiError ParseError(std::string_view body, bool chat, const std::string& param, const ProtocolLimits& limits = {}) {
  auto parsed = ParseCompletionRequest(body, chat, limits);
  const ApiError* error = std::get_if<ApiError>(&parsed);
  if (error == nullptr) {
    ADD_FAILURE() << "expected an error about '" << param << "' for " << body;
    return {};
  }
  EXPECT_EQ(error->http_status, 400) << body;
  EXPECT_EQ(error->type, "invalid_request_error") << body;
  EXPECT_EQ(error->param, param) << body << " → " << error->message;
  EXPECT_FALSE(error->message.empty()) << body;
  if (!param.empty()) {
    EXPECT_NE(error->message.find(param), std::string::npos) << error->message;
  }
  return *error;
}

// ---------------------------------------------------------------------------------------------
// Request parsing: accepted bodies

TEST(ParseCompletionRequest, MinimalCompletionGetsDefaults) {
  const CompletionRequest r = ParseOk(R"({"prompt": "Once upon a time"})", kText);
  EXPECT_FALSE(r.chat);
  EXPECT_EQ(r.model, "");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "Once upon a time");
  EXPECT_FALSE(r.prompts[0].is_tokens);
  EXPECT_TRUE(r.prompts[0].tokens.empty());
  EXPECT_TRUE(r.messages.empty());
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_EQ(r.temperature, 1.0f);
  EXPECT_EQ(r.top_p, 1.0f);
  EXPECT_EQ(r.top_k, 0);
  EXPECT_EQ(r.repeat_penalty, 1.0f);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage_in_stream);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_FALSE(r.kv.method || r.kv.budget || r.kv.kv_type);
  EXPECT_FALSE(r.timeout_s.has_value());
}

TEST(ParseCompletionRequest, DefaultMaxTokensComesFromLimits) {
  ProtocolLimits limits;
  limits.default_max_tokens = 17;
  EXPECT_EQ(ParseOk(R"({"prompt": "x"})", kText, limits).max_tokens, 17);
}

TEST(ParseCompletionRequest, EveryFieldOfACompletion) {
  const CompletionRequest r = ParseOk(R"({
      "model": "tinyllama", "prompt": "Q: 2+2?\nA:", "max_tokens": 32, "temperature": 0.7, "top_p": 0.9,
      "top_k": 40, "repeat_penalty": 1.1, "seed": 42, "stop": ["\n", "Q:"], "stream": true,
      "stream_options": {"include_usage": true}, "n": 1, "ignore_eos": true,
      "kvsparse": {"kv_method": "h2o", "kv_budget": 0.2, "kv_type": "int8"}, "timeout_s": 30})",
                                      kText);
  EXPECT_EQ(r.model, "tinyllama");
  EXPECT_EQ(r.prompts.at(0).text, "Q: 2+2?\nA:");
  EXPECT_EQ(r.max_tokens, 32);
  EXPECT_FLOAT_EQ(r.temperature, 0.7f);
  EXPECT_FLOAT_EQ(r.top_p, 0.9f);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_FLOAT_EQ(r.repeat_penalty, 1.1f);
  ASSERT_TRUE(r.seed.has_value());
  EXPECT_EQ(*r.seed, 42u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "Q:"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage_in_stream);
  EXPECT_EQ(r.n, 1);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.kv.method, "h2o");
  EXPECT_EQ(r.kv.budget, 0.2);
  EXPECT_EQ(r.kv.kv_type, "int8");
  EXPECT_EQ(r.timeout_s, 30.0);
}

TEST(ParseCompletionRequest, ChatMessages) {
  const CompletionRequest r = ParseOk(R"({"model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi", "name": "bob"},
      {"role": "assistant", "content": ""},
      {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "KV?"}]}]})",
                                      kChat);
  EXPECT_TRUE(r.chat);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[1].role, "user");
  EXPECT_EQ(r.messages[1].content, "Hi");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.messages[3].content, "What is KV?");  // text parts joined
  EXPECT_TRUE(r.prompts.empty());
}

TEST(ParseCompletionRequest, PromptShapes) {
  CompletionRequest one_string = ParseOk(R"({"prompt": ["hello"]})", kText);
  ASSERT_EQ(one_string.prompts.size(), 1u);
  EXPECT_EQ(one_string.prompts[0].text, "hello");
  EXPECT_FALSE(one_string.prompts[0].is_tokens);

  CompletionRequest tokens = ParseOk(R"({"prompt": [1, 15043, 0, 2147483647]})", kText);
  ASSERT_EQ(tokens.prompts.size(), 1u);
  EXPECT_TRUE(tokens.prompts[0].is_tokens);
  EXPECT_EQ(tokens.prompts[0].tokens, (std::vector<int32_t>{1, 15043, 0, 2147483647}));
  EXPECT_TRUE(tokens.prompts[0].text.empty());

  CompletionRequest nested = ParseOk(R"({"prompt": [[5, 6]]})", kText);  // OpenAI's batch of one token list
  ASSERT_EQ(nested.prompts.size(), 1u);
  EXPECT_TRUE(nested.prompts[0].is_tokens);
  EXPECT_EQ(nested.prompts[0].tokens, (std::vector<int32_t>{5, 6}));

  // Batches: each prompt its own choice (lm-eval sends lists of token lists).
  CompletionRequest strings = ParseOk(R"({"prompt": ["a", "bc", "d"]})", kText);
  ASSERT_EQ(strings.prompts.size(), 3u);
  EXPECT_EQ(strings.prompts[1].text, "bc");
  CompletionRequest lists = ParseOk(R"({"prompt": [[1, 2], [3], [4, 5, 6]], "n": 2})", kText, [] {
    ProtocolLimits limits;
    limits.max_n = 2;
    return limits;
  }());
  ASSERT_EQ(lists.prompts.size(), 3u);
  EXPECT_EQ(lists.prompts[2].tokens, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(lists.n, 2);
}

TEST(ParseCompletionRequest, BadBatchesNameTheirPrompt) {
  ParseError(R"({"prompt": ["a", 5]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [[1, 2], "b"]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [[1, 2], []]})", kText, "prompt[1]");
  ParseError(R"({"prompt": ["a", ""]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [[1, -2]]})", kText, "prompt[0][1]");
  ProtocolLimits two;
  two.max_prompts = 2;
  ParseError(R"({"prompt": ["a", "b", "c"]})", kText, "prompt", two);
  ProtocolLimits few_choices;
  few_choices.max_choices = 5;
  ParseError(R"({"prompt": ["a", "b", "c"], "n": 2})", kText, "n", few_choices);
  ProtocolLimits small;
  small.max_prompt_bytes = 4;
  ParseError(R"({"prompt": ["abc", "de"]})", kText, "prompt", small);  // the batch's bytes together
}

TEST(ParseCompletionRequest, StopAsStringOrNull) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "stop": "###"})", kText).stop, (std::vector<std::string>{"###"}));
  EXPECT_TRUE(ParseOk(R"({"prompt": "x", "stop": null})", kText).stop.empty());
  EXPECT_TRUE(ParseOk(R"({"prompt": "x", "stop": []})", kText).stop.empty());
}

TEST(ParseCompletionRequest, NullMeansDefault) {
  const CompletionRequest r = ParseOk(R"({"prompt": "x", "model": null, "max_tokens": null, "temperature": null,
      "top_p": null, "top_k": null, "seed": null, "stream": null, "stream_options": null, "n": null,
      "kvsparse": null, "timeout_s": null, "ignore_eos": null, "repeat_penalty": null})",
                                      kText);
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_EQ(r.temperature, 1.0f);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_FALSE(r.stream);
}

TEST(ParseCompletionRequest, UnknownFieldsAreIgnored) {
  const CompletionRequest r = ParseOk(R"({"messages": [{"role": "user", "content": "hi"}], "user": "u-1",
      "presence_penalty": 0.5, "frequency_penalty": 0, "logit_bias": {"50256": -100}, "tools": [],
      "response_format": {"type": "text"}, "some_future_field": {"nested": [1, {"x": null}]}})",
                                      kChat);
  ASSERT_EQ(r.messages.size(), 1u);
}

TEST(ParseCompletionRequest, MaxCompletionTokensIsAcceptedAndWins) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_completion_tokens": 12})", kText).max_tokens, 12);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_completion_tokens": 12, "max_tokens": 99})", kText).max_tokens, 12);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_tokens": 4096})", kText).max_tokens, 4096);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_tokens": 100.0})", kText).max_tokens, 100);  // Python's float
}

TEST(ParseCompletionRequest, BoundaryValuesAreAccepted) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "temperature": 0})", kText).temperature, 0.0f);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "temperature": 2})", kText).temperature, 2.0f);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "top_p": 1})", kText).top_p, 1.0f);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "max_tokens": 1})", kText).max_tokens, 1);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "top_k": -1})", kText).top_k, 0);  // vLLM's "off"
  EXPECT_FALSE(ParseOk(R"({"prompt": "x", "seed": -1})", kText).seed.has_value());  // llama.cpp's "random"
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "seed": 18446744073709551615})", kText).seed,
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "seed": 0})", kText).seed, 0u);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "stop": ["1234567890123456789012345678901234567890123456789012345678901234"]})",
                    kText).stop.size(), 1u);  // exactly 64 bytes
  ProtocolLimits four_choices;
  four_choices.max_n = 4;
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "n": 4})", kText, four_choices).n, 4);
}

TEST(ParseCompletionRequest, IncludeUsageOnlyWhenStreaming) {
  EXPECT_FALSE(ParseOk(R"({"prompt": "x", "stream_options": {"include_usage": true}})", kText).include_usage_in_stream);
  EXPECT_FALSE(ParseOk(R"({"prompt": "x", "stream": true, "stream_options": {}})", kText).include_usage_in_stream);
  EXPECT_TRUE(ParseOk(R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}})", kText)
                  .include_usage_in_stream);
}

TEST(ParseCompletionRequest, KvOverridePartial) {
  const CompletionRequest r = ParseOk(R"({"prompt": "x", "kvsparse": {"kv_budget": 1}})", kText);
  EXPECT_FALSE(r.kv.method.has_value());
  EXPECT_EQ(r.kv.budget, 1.0);
  EXPECT_FALSE(r.kv.kv_type.has_value());
}

// ---------------------------------------------------------------------------------------------
// Request parsing: rejected bodies

TEST(ParseCompletionRequest, MalformedOrNonObjectBody) {
  // The last two: invalid UTF-8 in a string, and a number past the double range.
  for (const char* body : {"", "{", R"({"prompt": "x",})", "{prompt: 1}", "nul", "{\"prompt\": \"\xC3\x28\"}",
                           R"({"prompt": "x", "temperature": 1e400})"}) {
    const ApiError e = ParseError(body, kText, "");
    EXPECT_NE(e.message.find("parse"), std::string::npos) << e.message;
  }
  for (const char* body : {"[1, 2]", "\"text\"", "null", "42", "true"}) {
    const ApiError e = ParseError(body, kChat, "");
    EXPECT_NE(e.message.find("object"), std::string::npos) << e.message;
  }
}

TEST(ParseCompletionRequest, HostileNestingIsRejectedNotFatal) {
  const std::string deep = R"({"prompt": "x", "extra": )" + std::string(100000, '[') + std::string(100000, ']') + "}";
  ParseError(deep, kText, "");
  const std::string shallow = R"({"prompt": "x", "extra": )" + std::string(20, '[') + std::string(20, ']') + "}";
  ParseOk(shallow, kText);
}

TEST(ParseCompletionRequest, PromptErrors) {
  EXPECT_EQ(ParseError(R"({"model": "m"})", kText, "prompt").code, "missing_required_parameter");
  EXPECT_EQ(ParseError(R"({"prompt": null})", kText, "prompt").code, "missing_required_parameter");
  ParseError(R"({"prompt": ""})", kText, "prompt");
  ParseError(R"({"prompt": []})", kText, "prompt");
  ParseError(R"({"prompt": [""]})", kText, "prompt");
  ParseError(R"({"prompt": [[]]})", kText, "prompt");
  EXPECT_EQ(ParseError(R"({"prompt": 5})", kText, "prompt").code, "invalid_type");
  ParseError(R"({"prompt": {"text": "x"}})", kText, "prompt");
  ParseError(R"({"prompt": [1, "a"]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [true]})", kText, "prompt");
  ParseError(R"({"prompt": [1, -2]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [1, 2.5]})", kText, "prompt[1]");
  ParseError(R"({"prompt": [2147483648]})", kText, "prompt[0]");
  ParseError(R"({"prompt": [[1, -1]]})", kText, "prompt[0][1]");
  ProtocolLimits small;
  small.max_prompt_bytes = 4;
  ParseError(R"({"prompt": "12345"})", kText, "prompt", small);
  ParseOk(R"({"prompt": "1234"})", kText, small);
}

TEST(ParseCompletionRequest, MessagesErrors) {
  EXPECT_EQ(ParseError(R"({"prompt": "x"})", kChat, "messages").code, "missing_required_parameter");
  EXPECT_EQ(ParseError(R"({"messages": {"role": "user"}})", kChat, "messages").code, "invalid_type");
  ParseError(R"({"messages": "hi"})", kChat, "messages");
  ParseError(R"({"messages": []})", kChat, "messages");
  ParseError(R"({"messages": ["hi"]})", kChat, "messages[0]");
  ParseError(R"({"messages": [{"content": "hi"}]})", kChat, "messages[0].role");
  ParseError(R"({"messages": [{"role": 1, "content": "hi"}]})", kChat, "messages[0].role");
  const ApiError bad_role =
      ParseError(R"({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})", kChat,
                 "messages[1].role");
  EXPECT_EQ(bad_role.code, "invalid_value");
  EXPECT_NE(bad_role.message.find("'tool'"), std::string::npos);
  ParseError(R"({"messages": [{"role": "user"}]})", kChat, "messages[0].content");
  ParseError(R"({"messages": [{"role": "assistant", "content": null}]})", kChat, "messages[0].content");
  ParseError(R"({"messages": [{"role": "user", "content": 5}]})", kChat, "messages[0].content");
  ParseError(R"({"messages": [{"role": "user", "content": ["hi"]}]})", kChat, "messages[0].content[0]");
  ParseError(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
      {"type": "image_url", "image_url": {"url": "http://x"}}]}]})", kChat, "messages[0].content[1].type");
  ParseError(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", kChat,
             "messages[0].content[0].text");
  ParseError(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]})", kChat,
             "messages[0].content[0].text");

  ProtocolLimits limits;
  limits.max_messages = 2;
  limits.max_prompt_bytes = 5;
  ParseError(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c"}]})", kChat, "messages", limits);
  ParseError(R"({"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "def"}]})", kChat,
             "messages", limits);  // 6 bytes in all
  ParseOk(R"({"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "def"}]})", kChat, limits);
}

TEST(ParseCompletionRequest, MaxTokensErrors) {
  ParseError(R"({"prompt": "x", "max_tokens": 0})", kText, "max_tokens");
  ParseError(R"({"prompt": "x", "max_tokens": -5})", kText, "max_tokens");
  ParseError(R"({"prompt": "x", "max_tokens": 4097})", kText, "max_tokens");
  ParseError(R"({"prompt": "x", "max_tokens": 1e30})", kText, "max_tokens");
  ParseError(R"({"prompt": "x", "max_tokens": 1.5})", kText, "max_tokens");
  EXPECT_EQ(ParseError(R"({"prompt": "x", "max_tokens": "10"})", kText, "max_tokens").code, "invalid_type");
  ParseError(R"({"prompt": "x", "max_completion_tokens": 0})", kText, "max_completion_tokens");
  ProtocolLimits limits;
  limits.max_tokens_limit = 8;
  ParseError(R"({"prompt": "x", "max_completion_tokens": 9})", kText, "max_completion_tokens", limits);
}

TEST(ParseCompletionRequest, SamplingErrors) {
  ParseError(R"({"prompt": "x", "temperature": -0.1})", kText, "temperature");
  ParseError(R"({"prompt": "x", "temperature": 2.01})", kText, "temperature");
  EXPECT_EQ(ParseError(R"({"prompt": "x", "temperature": "hot"})", kText, "temperature").code, "invalid_type");
  ParseError(R"({"prompt": "x", "top_p": 0})", kText, "top_p");
  ParseError(R"({"prompt": "x", "top_p": 1.01})", kText, "top_p");
  ParseError(R"({"prompt": "x", "top_p": -1})", kText, "top_p");
  ParseError(R"({"prompt": "x", "top_k": "40"})", kText, "top_k");
  ParseError(R"({"prompt": "x", "top_k": 2.5})", kText, "top_k");
  ParseError(R"({"prompt": "x", "top_k": 4294967296})", kText, "top_k");
  // The same ranges as `generate --top-k -3` (SamplerValueRequirement): -1 and 0 are "off".
  EXPECT_EQ(ParseError(R"({"prompt": "x", "top_k": -3})", kText, "top_k").message,
            "'top_k' must be an integer of at least -1 (-1 and 0: off), got -3.");
  ParseError(R"({"prompt": "x", "repeat_penalty": 0})", kText, "repeat_penalty");
  ParseError(R"({"prompt": "x", "repeat_penalty": -1.1})", kText, "repeat_penalty");
  ParseError(R"({"prompt": "x", "repeat_penalty": [1]})", kText, "repeat_penalty");
  ParseError(R"({"prompt": "x", "seed": -2})", kText, "seed");
  ParseError(R"({"prompt": "x", "seed": "42"})", kText, "seed");
  ParseError(R"({"prompt": "x", "seed": 4.5})", kText, "seed");
}

TEST(ParseCompletionRequest, StopErrors) {
  ParseError(R"({"prompt": "x", "stop": 5})", kText, "stop");
  ParseError(R"({"prompt": "x", "stop": {"a": 1}})", kText, "stop");
  ParseError(R"({"prompt": "x", "stop": ["a", 1]})", kText, "stop[1]");
  ParseError(R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]})",
             kText, "stop");  // 17 strings
  ParseError(R"({"prompt": "x", "stop": ""})", kText, "stop");
  ParseError(R"({"prompt": "x", "stop": ["ok", ""]})", kText, "stop");
  ParseError(R"({"prompt": "x", "stop": ["12345678901234567890123456789012345678901234567890123456789012345"]})", kText,
             "stop");  // 65 bytes
  ProtocolLimits one_stop;
  one_stop.max_stop = 1;
  ParseError(R"({"prompt": "x", "stop": ["a", "b"]})", kText, "stop", one_stop);
}

// What lm-eval and OpenAI clients send beyond the basics: 5+ stop strings with stop_token_ids,
// OpenAI's penalties, min_p, logit_bias, and response_format text (anything else is refused).
TEST(ParseCompletionRequest, SamplingExtensionsAndLimits) {
  const CompletionRequest r = ParseOk(R"({"prompt": "x", "stop": ["\n\n", "Q:", "A:", "###", "</s>", "<|im_end|>"],
      "stop_token_ids": [2, 32000], "presence_penalty": 0.5, "frequency_penalty": -1.5, "min_p": 0.05,
      "logit_bias": {"50256": -100, "13": 2.5}, "response_format": {"type": "text"}})",
                                      kText);
  EXPECT_EQ(r.stop.size(), 6u);
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{2, 32000}));
  EXPECT_FLOAT_EQ(r.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.frequency_penalty, -1.5f);
  EXPECT_FLOAT_EQ(r.min_p, 0.05f);
  std::vector<std::pair<int32_t, float>> bias = r.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int32_t, float>>{{13, 2.5f}, {50256, -100.f}}));
  const CompletionRequest defaults = ParseOk(R"({"prompt": "x"})", kText);
  EXPECT_EQ(defaults.presence_penalty, 0.f);
  EXPECT_EQ(defaults.frequency_penalty, 0.f);
  EXPECT_EQ(defaults.min_p, 0.f);
  EXPECT_TRUE(defaults.logit_bias.empty());
  EXPECT_TRUE(defaults.stop_token_ids.empty());

  ParseError(R"({"prompt": "x", "presence_penalty": 2.5})", kText, "presence_penalty");
  ParseError(R"({"prompt": "x", "frequency_penalty": -3})", kText, "frequency_penalty");
  ParseError(R"({"prompt": "x", "min_p": 1.5})", kText, "min_p");
  ParseError(R"({"prompt": "x", "logit_bias": [1, 2]})", kText, "logit_bias");
  ParseError(R"({"prompt": "x", "logit_bias": {"abc": 1}})", kText, "logit_bias.abc");
  ParseError(R"({"prompt": "x", "logit_bias": {"-1": 1}})", kText, "logit_bias.-1");
  ParseError(R"({"prompt": "x", "logit_bias": {"5": 101}})", kText, "logit_bias.5");
  ParseError(R"({"prompt": "x", "logit_bias": {"5": "1"}})", kText, "logit_bias.5");
  ParseError(R"({"prompt": "x", "stop_token_ids": 2})", kText, "stop_token_ids");
  ParseError(R"({"prompt": "x", "stop_token_ids": [-1]})", kText, "stop_token_ids[0]");
  ParseError(R"({"prompt": "x", "response_format": {"type": "json_object"}})", kText, "response_format.type");
  ParseError(R"({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}})", kText,
             "response_format.type");
  ParseError(R"({"prompt": "x", "response_format": "json"})", kText, "response_format");
  ParseError(R"({"prompt": "x", "response_format": {}})", kText, "response_format.type");
}

// lm-eval's loglikelihood request (max_tokens 0 or 1, logprobs, echo) and the chat form.
TEST(ParseCompletionRequest, LogprobsAndEcho) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x"})", kText).logprobs, -1);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "logprobs": null, "echo": false})", kText).logprobs, -1);
  const CompletionRequest loglikelihood =
      ParseOk(R"({"prompt": [1, 2, 3], "max_tokens": 0, "logprobs": 1, "echo": true, "temperature": 0})", kText);
  EXPECT_EQ(loglikelihood.logprobs, 1);
  EXPECT_TRUE(loglikelihood.echo);
  EXPECT_EQ(loglikelihood.max_tokens, 0);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "logprobs": 0})", kText).logprobs, 0);
  const CompletionRequest chat =
      ParseOk(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 2})", kChat);
  EXPECT_EQ(chat.logprobs, 2);
  EXPECT_EQ(ParseOk(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})", kChat).logprobs, 0);
  EXPECT_EQ(ParseOk(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": false})", kChat).logprobs, -1);

  ParseError(R"({"prompt": "x", "logprobs": 21})", kText, "logprobs");
  ParseError(R"({"prompt": "x", "logprobs": -1})", kText, "logprobs");
  ParseError(R"({"prompt": "x", "echo": 1})", kText, "echo");
  ParseError(R"({"prompt": "x", "max_tokens": 0, "logprobs": 1})", kText, "max_tokens");
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "logprobs": 1, "echo": true, "stream": true})", kText).logprobs, 1);
  ParseError(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", kChat, "top_logprobs");
  ParseError(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", kChat, "logprobs");
  ParseError(R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", kChat, "echo");
}

TEST(ParseCompletionRequest, FlagAndCountErrors) {
  ParseError(R"({"prompt": "x", "model": 3})", kText, "model");
  ParseError(R"({"prompt": "x", "stream": "yes"})", kText, "stream");
  ParseError(R"({"prompt": "x", "stream": 1})", kText, "stream");
  ParseError(R"({"prompt": "x", "stream": true, "stream_options": true})", kText, "stream_options");
  ParseError(R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": "y"}})", kText,
             "stream_options.include_usage");
  ParseError(R"({"prompt": "x", "n": 0})", kText, "n");
  ParseError(R"({"prompt": "x", "n": 17})", kText, "n");
  ParseError(R"({"prompt": "x", "n": "1"})", kText, "n");
  ParseError(R"({"prompt": "x", "ignore_eos": 1})", kText, "ignore_eos");
  ParseError(R"({"prompt": "x", "timeout_s": 0})", kText, "timeout_s");
  ParseError(R"({"prompt": "x", "timeout_s": -3})", kText, "timeout_s");
  ParseError(R"({"prompt": "x", "timeout_s": "10s"})", kText, "timeout_s");
}

TEST(ParseCompletionRequest, KvOverrideErrors) {
  ParseError(R"({"prompt": "x", "kvsparse": "h2o"})", kText, "kvsparse");
  ParseError(R"({"prompt": "x", "kvsparse": {"kv_method": 5}})", kText, "kvsparse.kv_method");
  ParseError(R"({"prompt": "x", "kvsparse": {"kv_budget": "0.2"}})", kText, "kvsparse.kv_budget");
  ParseError(R"({"prompt": "x", "kvsparse": {"kv_type": 8}})", kText, "kvsparse.kv_type");
  // Our own extension: a misspelt key is refused, not silently ignored.
  ParseError(R"({"prompt": "x", "kvsparse": {"budget": 0.2}})", kText, "kvsparse.budget");
}

TEST(ParseCompletionRequest, CompressedContextFields) {
  const CompletionRequest text = ParseOk(R"({"prompt": ["q1", "q2"], "kvsparse": {"context": "doc"}})", kText);
  EXPECT_EQ(text.kv.context, "doc");
  EXPECT_FALSE(text.kv.context_tokens.has_value());
  EXPECT_EQ(ParseOk(R"({"prompt": [1, 2, 3], "kvsparse": {"context_tokens": 2}})", kText).kv.context_tokens, 2);
  ParseError(R"({"prompt": "x", "kvsparse": {"context": ""}})", kText, "kvsparse.context");
  ParseError(R"({"prompt": "x", "kvsparse": {"context": 3}})", kText, "kvsparse.context");
  ParseError(R"({"prompt": "x", "kvsparse": {"context_tokens": 0}})", kText, "kvsparse.context_tokens");
  ParseError(R"({"prompt": "x", "kvsparse": {"context_tokens": 1.5}})", kText, "kvsparse.context_tokens");
  ParseError(R"({"prompt": "x", "kvsparse": {"context": "a", "context_tokens": 1}})", kText, "kvsparse.context_tokens");
  ParseError(R"({"messages": [{"role": "user", "content": "x"}], "kvsparse": {"context": "a"}})", kChat,
             "kvsparse.context");
  ProtocolLimits small;
  small.max_prompt_bytes = 6;
  ParseError(R"({"prompt": ["abc"], "kvsparse": {"context": "defg"}})", kText, "kvsparse.context", small);
}

TEST(ParseCompletionRequest, ErrorsCarryTheFirstProblem) {
  // Both fields are wrong; the error names one of them and the request is refused.
  const ApiError e = ParseError(R"({"prompt": "", "temperature": 9})", kText, "prompt");
  EXPECT_EQ(e.code, "invalid_value");
}

// ---------------------------------------------------------------------------------------------
// /tokenize and /detokenize

TEST(ParseTokenizeRequest, FieldsAndDefaults) {
  auto plain = ParseTokenizeRequest(R"({"content": "Hello world"})", {});
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(plain));
  EXPECT_EQ(std::get<TokenizeRequest>(plain).content, "Hello world");
  EXPECT_FALSE(std::get<TokenizeRequest>(plain).add_special);
  EXPECT_TRUE(std::get<TokenizeRequest>(plain).parse_special);

  auto full = ParseTokenizeRequest(R"({"content": "", "add_special": true, "parse_special": false, "x": 1})", {});
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(full));
  EXPECT_EQ(std::get<TokenizeRequest>(full).content, "");
  EXPECT_TRUE(std::get<TokenizeRequest>(full).add_special);
  EXPECT_FALSE(std::get<TokenizeRequest>(full).parse_special);
}

// vLLM's spelling (lm-eval's): "prompt", with add_special_tokens defaulting to true.
TEST(ParseTokenizeRequest, VllmFields) {
  auto vllm = ParseTokenizeRequest(R"({"model": "m", "prompt": "Hello"})", {});
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(vllm));
  EXPECT_EQ(std::get<TokenizeRequest>(vllm).content, "Hello");
  EXPECT_TRUE(std::get<TokenizeRequest>(vllm).add_special);
  auto without = ParseTokenizeRequest(R"({"prompt": "Hello", "add_special_tokens": false})", {});
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(without));
  EXPECT_FALSE(std::get<TokenizeRequest>(without).add_special);
  auto llama = ParseTokenizeRequest(R"({"content": "Hello", "add_special_tokens": true})", {});
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(llama));
  EXPECT_TRUE(std::get<TokenizeRequest>(llama).add_special);
}

TEST(ParseTokenizeRequest, Errors) {
  auto expect_error = [](std::string_view body, const std::string& param, const ProtocolLimits& limits = {}) {
    auto parsed = ParseTokenizeRequest(body, limits);
    ASSERT_TRUE(std::holds_alternative<ApiError>(parsed)) << body;
    EXPECT_EQ(std::get<ApiError>(parsed).http_status, 400);
    EXPECT_EQ(std::get<ApiError>(parsed).param, param) << body;
  };
  expect_error("{", "");
  expect_error("[]", "");
  expect_error("{}", "content");
  expect_error(R"({"content": 5})", "content");
  expect_error(R"({"content": "x", "add_special": "yes"})", "add_special");
  expect_error(R"({"content": "x", "parse_special": 0})", "parse_special");
  ProtocolLimits small;
  small.max_prompt_bytes = 2;
  expect_error(R"({"content": "abc"})", "content", small);
}

TEST(ParseDetokenizeRequest, TokensAndErrors) {
  auto ok = ParseDetokenizeRequest(R"({"tokens": [1, 2, 3]})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(ok));
  EXPECT_EQ(std::get<DetokenizeRequest>(ok).tokens, (std::vector<int32_t>{1, 2, 3}));
  auto empty = ParseDetokenizeRequest(R"({"tokens": []})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(empty));
  EXPECT_TRUE(std::get<DetokenizeRequest>(empty).tokens.empty());

  auto expect_error = [](std::string_view body, const std::string& param) {
    auto parsed = ParseDetokenizeRequest(body);
    ASSERT_TRUE(std::holds_alternative<ApiError>(parsed)) << body;
    EXPECT_EQ(std::get<ApiError>(parsed).http_status, 400);
    EXPECT_EQ(std::get<ApiError>(parsed).param, param) << body;
  };
  expect_error("not json", "");
  expect_error("{}", "tokens");
  expect_error(R"({"tokens": "1 2"})", "tokens");
  expect_error(R"({"tokens": [1, -1]})", "tokens[1]");
  expect_error(R"({"tokens": [1, "2"]})", "tokens[1]");
  expect_error(R"({"tokens": [99999999999]})", "tokens[0]");
}

// ---------------------------------------------------------------------------------------------
// Errors and responses, read back the way a client reads them

TEST(ErrorBody, OpenAiShapeWithNullsForEmptyFields) {
  ApiError bare;
  bare.message = "We could not parse the JSON body of your request.";
  const Json body = Json::parse(ErrorBody(bare));
  ASSERT_TRUE(body.is_object());
  ASSERT_EQ(body.size(), 1u);
  const Json& error = body.at("error");
  EXPECT_EQ(error.size(), 4u);
  EXPECT_EQ(error.at("message"), bare.message);
  EXPECT_EQ(error.at("type"), "invalid_request_error");
  EXPECT_TRUE(error.at("param").is_null());
  EXPECT_TRUE(error.at("code").is_null());

  ApiError full{404, "not_found_error", "no \"such\" model\n", "model", "model_not_found"};
  const Json full_body = Json::parse(ErrorBody(full));
  EXPECT_EQ(full_body["error"]["message"], "no \"such\" model\n");
  EXPECT_EQ(full_body["error"]["type"], "not_found_error");
  EXPECT_EQ(full_body["error"]["param"], "model");
  EXPECT_EQ(full_body["error"]["code"], "model_not_found");
}

TEST(ErrorBody, FromParseError) {
  auto parsed = ParseCompletionRequest(R"({"prompt": "x", "top_p": 3})", kText, {});
  const Json body = Json::parse(ErrorBody(std::get<ApiError>(parsed)));
  EXPECT_EQ(body["error"]["param"], "top_p");
  EXPECT_EQ(body["error"]["code"], "invalid_value");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
}

TEST(ApiErrorFromStatus, MapsCodesToHttpStatuses) {
  struct Case {
    Status status;
    int http_status;
    const char* type;
  };
  const Case cases[] = {
      {InvalidArgumentError("bad kv_method 'x'"), 400, "invalid_request_error"},
      {OutOfRangeError("prompt longer than context"), 400, "invalid_request_error"},
      {NotFoundError("no model"), 404, "not_found_error"},
      {ResourceExhaustedError("no free KV pages"), 503, "unavailable_error"},
      {UnimplementedError("n > 1"), 501, "not_supported_error"},
      {InternalError("oops"), 500, "server_error"},
      {DataLossError("corrupt"), 500, "server_error"},
  };
  for (const Case& c : cases) {
    const ApiError e = ApiErrorFromStatus(c.status);
    EXPECT_EQ(e.http_status, c.http_status) << c.status.ToString();
    EXPECT_EQ(e.type, c.type) << c.status.ToString();
    EXPECT_EQ(e.message, c.status.message());
  }
}

CompletionResult SampleResult() {
  CompletionResult r;
  r.id = "cmpl-00000000000000ff";
  r.created = 1700000000;
  r.model = "tinyllama-1.1b-chat";
  r.choices.push_back(ChoiceResult{"Paris, the \"city\" of light.\n", "stop", std::nullopt});
  r.prompt_tokens = 12;
  r.completion_tokens = 9;
  r.kv_peak_bytes = 3u * 1024 * 1024 * 1024;  // past 32 bits
  return r;
}

void ExpectUsage(const Json& usage, int prompt, int completion, uint64_t kv_bytes) {
  ASSERT_TRUE(usage.is_object());
  EXPECT_EQ(usage.at("prompt_tokens"), prompt);
  EXPECT_EQ(usage.at("completion_tokens"), completion);
  EXPECT_EQ(usage.at("total_tokens"), prompt + completion);
  EXPECT_TRUE(usage.at("kv_bytes").is_number_integer());
  EXPECT_EQ(usage.at("kv_bytes").get<uint64_t>(), kv_bytes);
}

TEST(CompletionResponseBody, TextCompletionShape) {
  const CompletionResult r = SampleResult();
  const std::string text = CompletionResponseBody(r);
  const Json body = Json::parse(text);
  EXPECT_EQ(body.at("id"), "cmpl-00000000000000ff");
  EXPECT_EQ(body.at("object"), "text_completion");
  EXPECT_TRUE(body.at("created").is_number_integer());
  EXPECT_EQ(body.at("created"), 1700000000);
  EXPECT_EQ(body.at("model"), "tinyllama-1.1b-chat");
  ASSERT_TRUE(body.at("choices").is_array());
  ASSERT_EQ(body["choices"].size(), 1u);
  const Json& choice = body["choices"][0];
  EXPECT_EQ(choice.at("text"), r.choices[0].text);
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_TRUE(choice.at("logprobs").is_null());
  EXPECT_EQ(choice.at("finish_reason"), "stop");
  ExpectUsage(body.at("usage"), 12, 9, 3ull * 1024 * 1024 * 1024);
  // Fields appear in OpenAI's order.
  EXPECT_EQ(text.find("{\"id\":"), 0u);
  EXPECT_LT(text.find("\"object\""), text.find("\"choices\""));
}

TEST(CompletionResponseBody, ChatCompletionShape) {
  CompletionResult r = SampleResult();
  r.id = CompletionId(true, 255);
  r.choices[0].finish_reason = "length";
  const Json body = Json::parse(ChatCompletionResponseBody(r));
  EXPECT_EQ(body.at("id"), "chatcmpl-00000000000000ff");
  EXPECT_EQ(body.at("object"), "chat.completion");
  EXPECT_EQ(body.at("created"), 1700000000);
  EXPECT_EQ(body.at("model"), r.model);
  ASSERT_EQ(body.at("choices").size(), 1u);
  const Json& choice = body["choices"][0];
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  EXPECT_EQ(choice.at("message").at("content"), r.choices[0].text);
  EXPECT_TRUE(choice.at("logprobs").is_null());
  EXPECT_EQ(choice.at("finish_reason"), "length");
  EXPECT_FALSE(choice.contains("text"));
  ExpectUsage(body.at("usage"), 12, 9, r.kv_peak_bytes);
}

TEST(CompletionResponseBody, InvalidUtf8IsReplacedNotFatal) {
  CompletionResult r = SampleResult();
  r.choices[0].text = "ok \xF0\x9F then";  // a truncated 4-byte character
  const Json body = Json::parse(CompletionResponseBody(r));
  EXPECT_EQ(body["choices"][0]["text"], "ok \xEF\xBF\xBD then");  // U+FFFD
  const Json chat = Json::parse(ChatCompletionResponseBody(r));
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "ok \xEF\xBF\xBD then");
}

TEST(CompletionId, PrefixAndHex) {
  EXPECT_EQ(CompletionId(false, 0), "cmpl-0000000000000000");
  EXPECT_EQ(CompletionId(true, 0xdeadbeefULL), "chatcmpl-00000000deadbeef");
  EXPECT_NE(CompletionId(false, 1), CompletionId(false, 2));
}

const StreamMeta kMeta{"chatcmpl-1", 1700000001, "m"};

void ExpectChunkEnvelope(const Json& chunk, std::string_view object) {
  EXPECT_EQ(chunk.at("id"), kMeta.id);
  EXPECT_EQ(chunk.at("object"), object);
  EXPECT_EQ(chunk.at("created"), kMeta.created);
  EXPECT_EQ(chunk.at("model"), kMeta.model);
  ASSERT_TRUE(chunk.at("choices").is_array());
}

TEST(StreamChunks, CompletionChunks) {
  const Json middle = Json::parse(CompletionChunk(kMeta, 0, "Hel"));
  ExpectChunkEnvelope(middle, "text_completion");
  ASSERT_EQ(middle["choices"].size(), 1u);
  EXPECT_EQ(middle["choices"][0].at("text"), "Hel");
  EXPECT_EQ(middle["choices"][0].at("index"), 0);
  EXPECT_TRUE(middle["choices"][0].at("logprobs").is_null());
  EXPECT_TRUE(middle["choices"][0].at("finish_reason").is_null());
  EXPECT_FALSE(middle.contains("usage"));

  const Json last = Json::parse(CompletionChunk(kMeta, 0, "", "length"));
  EXPECT_EQ(last["choices"][0].at("text"), "");
  EXPECT_EQ(last["choices"][0].at("finish_reason"), "length");
}

TEST(StreamChunks, ChatChunks) {
  const Json first = Json::parse(ChatDeltaChunk(kMeta, 0, "", /*first=*/true));
  ExpectChunkEnvelope(first, "chat.completion.chunk");
  ASSERT_EQ(first["choices"].size(), 1u);
  EXPECT_EQ(first["choices"][0].at("index"), 0);
  EXPECT_EQ(first["choices"][0].at("delta").at("role"), "assistant");
  EXPECT_EQ(first["choices"][0].at("delta").at("content"), "");
  EXPECT_TRUE(first["choices"][0].at("finish_reason").is_null());

  const Json next = Json::parse(ChatDeltaChunk(kMeta, 0, "Hi \xC3\xA9", /*first=*/false));
  ExpectChunkEnvelope(next, "chat.completion.chunk");
  const Json& delta = next["choices"][0].at("delta");
  EXPECT_FALSE(delta.contains("role"));
  EXPECT_EQ(delta.at("content"), "Hi \xC3\xA9");
  EXPECT_TRUE(next["choices"][0].at("finish_reason").is_null());

  const Json last = Json::parse(ChatFinishChunk(kMeta, 0, "stop"));
  ExpectChunkEnvelope(last, "chat.completion.chunk");
  EXPECT_TRUE(last["choices"][0].at("delta").is_object());
  EXPECT_TRUE(last["choices"][0].at("delta").empty());
  EXPECT_EQ(last["choices"][0].at("finish_reason"), "stop");
}

TEST(StreamChunks, UsageChunkHasNoChoices) {
  for (bool chat : {true, false}) {
    const Json usage = Json::parse(UsageChunk(kMeta, chat, 5, 7, 4096));
    ExpectChunkEnvelope(usage, chat ? "chat.completion.chunk" : "text_completion");
    EXPECT_TRUE(usage["choices"].empty());
    ExpectUsage(usage.at("usage"), 5, 7, 4096);
  }
}

TEST(Sse, EventFraming) {
  EXPECT_EQ(SseEvent(R"({"a":1})"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
  // A chunk never holds a raw newline, which would end the SSE event early.
  const std::string chunk = ChatDeltaChunk(kMeta, 0, "line 1\nline 2\r\n", false);
  EXPECT_EQ(chunk.find('\n'), std::string::npos);
  const std::string event = SseEvent(chunk);
  EXPECT_EQ(event.find("\n\n"), event.size() - 2);
}

// logprobs in OpenAI's two shapes: the completions' parallel lists (a null where a prompt's first
// token has none) and chat's content list with UTF-8 bytes.
TEST(CompletionResponseBody, LogprobShapes) {
  CompletionResult r;
  r.id = "cmpl-1";
  r.choices.push_back(ChoiceResult{"<s>Hi!", "length", std::nullopt});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  r.choices[0].logprobs = std::vector<LogprobEntry>{{"<s>", 0, nan, {}},
                                         {"Hi", 3, -0.5f, {{"Hi", -0.5f}, {"Ho", -1.5f}}},
                                         {"!", 5, -2.0f, {{".", -0.25f}, {"!", -2.0f}}}};
  const Json legacy = Json::parse(CompletionResponseBody(r))["choices"][0].at("logprobs");
  EXPECT_EQ(legacy.at("tokens"), Json::array({"<s>", "Hi", "!"}));
  EXPECT_TRUE(legacy.at("token_logprobs")[0].is_null());
  EXPECT_FLOAT_EQ(legacy["token_logprobs"][1].get<float>(), -0.5f);
  EXPECT_TRUE(legacy.at("top_logprobs")[0].is_null());
  EXPECT_FLOAT_EQ(legacy["top_logprobs"][2].at(".").get<float>(), -0.25f);
  EXPECT_EQ(legacy.at("text_offset"), Json::array({0, 3, 5}));

  r.choices[0].logprobs->erase(r.choices[0].logprobs->begin());
  const Json chat = Json::parse(ChatCompletionResponseBody(r))["choices"][0].at("logprobs");
  ASSERT_EQ(chat.at("content").size(), 2u);
  const Json& bang = chat["content"][1];
  EXPECT_EQ(bang.at("token"), "!");
  EXPECT_FLOAT_EQ(bang.at("logprob").get<float>(), -2.0f);
  EXPECT_EQ(bang.at("bytes"), Json::array({33}));
  EXPECT_EQ(bang.at("top_logprobs")[0].at("token"), ".");
  EXPECT_EQ(bang["top_logprobs"][0].at("bytes"), Json::array({46}));
  r.choices[0].logprobs.reset();
  EXPECT_TRUE(Json::parse(CompletionResponseBody(r))["choices"][0].at("logprobs").is_null());
}

// Several choices: indexed in order, each with its own text, finish_reason and logprobs; a
// stream chunk carries one choice and the log-probabilities of the tokens it brings.
TEST(CompletionResponseBody, ChoicesAndStreamedLogprobs) {
  CompletionResult r;
  r.choices.push_back(ChoiceResult{"one", "stop", std::nullopt});
  r.choices.push_back(ChoiceResult{"two", "length", std::vector<LogprobEntry>{{"two", 0, -0.75f, {}}}});
  const Json body = Json::parse(CompletionResponseBody(r));
  ASSERT_EQ(body.at("choices").size(), 2u);
  EXPECT_EQ(body["choices"][1].at("index"), 1);
  EXPECT_EQ(body["choices"][1].at("text"), "two");
  EXPECT_EQ(body["choices"][1].at("finish_reason"), "length");
  EXPECT_TRUE(body["choices"][0].at("logprobs").is_null());
  EXPECT_EQ(body["choices"][1]["logprobs"].at("tokens"), Json::array({"two"}));
  const Json chat = Json::parse(ChatCompletionResponseBody(r));
  EXPECT_EQ(chat["choices"][1].at("message").at("content"), "two");

  const std::vector<LogprobEntry> entries{{" a", 7, -1.0f, {{" a", -1.0f}}}};
  const Json chunk = Json::parse(CompletionChunk(kMeta, 3, " a", {}, &entries));
  EXPECT_EQ(chunk["choices"][0].at("index"), 3);
  EXPECT_EQ(chunk["choices"][0]["logprobs"].at("text_offset"), Json::array({7}));
  const Json delta = Json::parse(ChatDeltaChunk(kMeta, 2, " a", false, &entries));
  EXPECT_EQ(delta["choices"][0].at("index"), 2);
  EXPECT_EQ(delta["choices"][0]["logprobs"]["content"][0].at("token"), " a");
  EXPECT_EQ(Json::parse(ChatFinishChunk(kMeta, 2, "stop"))["choices"][0].at("index"), 2);
}

TEST(TokenizerInfoBody, SpecialTokensAndNulls) {
  TokenizerInfo info;
  info.tokenizer_class = "kvsparse-spm";
  info.bos_token = "<s>";
  info.bos_token_id = 1;
  info.eos_token_id = -1;
  info.vocab_size = 32000;
  info.model_max_length = 4096;
  info.add_bos_token = true;
  info.chat_template = "llama2";
  const Json body = Json::parse(TokenizerInfoBody(info));
  EXPECT_EQ(body.at("bos_token"), "<s>");
  EXPECT_EQ(body.at("bos_token_id"), 1);
  EXPECT_TRUE(body.at("eos_token").is_null());
  EXPECT_TRUE(body.at("eos_token_id").is_null());
  EXPECT_EQ(body.at("vocab_size"), 32000);
  EXPECT_EQ(body.at("model_max_length"), 4096);
  EXPECT_EQ(body.at("add_bos_token"), true);
  EXPECT_EQ(body.at("tokenizer_class"), "kvsparse-spm");
}

TEST(ModelsBody, ListShape) {
  const Json body = Json::parse(ModelsBody("tinyllama", 1700000002));
  EXPECT_EQ(body.at("object"), "list");
  ASSERT_TRUE(body.at("data").is_array());
  ASSERT_EQ(body["data"].size(), 1u);
  const Json& model = body["data"][0];
  EXPECT_EQ(model.at("id"), "tinyllama");
  EXPECT_EQ(model.at("object"), "model");
  EXPECT_EQ(model.at("created"), 1700000002);
  EXPECT_EQ(model.at("owned_by"), "kvsparse");
}

TEST(TokenizeResponses, Shapes) {
  const std::vector<int32_t> tokens = {1, 15043, 3186};
  const Json tokenized = Json::parse(TokenizeResponseBody(tokens, 4096));
  EXPECT_EQ(tokenized.at("tokens"), Json::array({1, 15043, 3186}));
  EXPECT_EQ(tokenized.at("count"), 3);
  EXPECT_EQ(tokenized.at("max_model_len"), 4096);
  EXPECT_EQ(Json::parse(TokenizeResponseBody({}, 4096)).at("tokens"), Json::array());
  EXPECT_EQ(Json::parse(DetokenizeResponseBody("Hello \xF0\x9F")).at("content"), "Hello \xEF\xBF\xBD");
}

}  // namespace
}  // namespace kvsparse::server
