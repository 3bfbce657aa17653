#include "server/openai_protocol.h"

#include <charconv>
#include <cmath>
#include <exception>
#include <string>
#include <system_error>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kvsparse/sampler.h"

namespace kvsparse::server {
namespace {

using Json = nlohmann::json;
// Responses keep OpenAI's field order, which makes them easy to compare with OpenAI's by eye.
using OrderedJson = nlohmann::ordered_json;

// Deeper bodies are hostile, not clients: OpenAI requests nest at most a few levels.
constexpr int kMaxJsonDepth = 64;

// The field readers below throw this; the public parsers catch it (and everything else), so no
// exception leaves this file and each check stays one line.
struct RequestError {
  ApiError error;
};

[[noreturn]] void Fail(std::string param, std::string code, std::string message) {
  ApiError error;
  error.message = std::move(message);
  error.param = std::move(param);
  error.code = std::move(code);
  throw RequestError{std::move(error)};
}

std::string_view DescribeType(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

[[noreturn]] void FailType(const std::string& param, std::string_view expected, const Json& got) {
  Fail(param, "invalid_type",
       fmt::format("Invalid type for '{}': expected {}, but got {}.", param, expected, DescribeType(got)));
}

[[noreturn]] void FailValue(const std::string& param, std::string message) {
  Fail(param, "invalid_value", std::move(message));
}

// The field, or nullptr when it is absent or null (clients send null for "default").
const Json* Field(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<std::string> ReadString(const Json& object, const char* key, const std::string& param) {
  const Json* value = Field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) FailType(param, "a string", *value);
  return value->get<std::string>();
}

std::optional<bool> ReadBool(const Json& object, const char* key, const std::string& param) {
  const Json* value = Field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) FailType(param, "a boolean", *value);
  return value->get<bool>();
}

std::optional<double> ReadNumber(const Json& object, const char* key, const std::string& param) {
  const Json* value = Field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) FailType(param, "a number", *value);
  const double number = value->get<double>();
  if (!std::isfinite(number)) FailValue(param, fmt::format("'{}' must be a finite number.", param));
  return number;
}

// Any integer JSON value as int64; a float with an integral value (Python's 100.0) counts too.
std::optional<int64_t> AsInteger(const Json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && std::abs(d) < 9.0e15) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

std::optional<int64_t> ReadInteger(const Json& object, const char* key, const std::string& param) {
  const Json* value = Field(object, key);
  if (value == nullptr) return std::nullopt;
  std::optional<int64_t> integer = AsInteger(*value);
  if (!integer) {
    if (value->is_number()) FailValue(param, fmt::format("'{}' must be an integer.", param));
    FailType(param, "an integer", *value);
  }
  return integer;
}

// An integer that must lie in [min, max]; the message shows the bounds.
std::optional<int64_t> ReadIntegerIn(const Json& object, const char* key, int64_t min, int64_t max) {
  std::optional<int64_t> value = ReadInteger(object, key, key);
  if (value && (*value < min || *value > max)) {
    FailValue(key, fmt::format("'{}' must be between {} and {}, got {}.", key, min, max, *value));
  }
  return value;
}

Json ParseJsonBody(std::string_view body) {
  const auto limit_depth = [](int depth, Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      Fail("", "", fmt::format("The JSON body nests deeper than {} levels.", kMaxJsonDepth));
    }
    return true;
  };
  try {
    return Json::parse(body.begin(), body.end(), limit_depth);
  } catch (const Json::exception& e) {
    // A syntax error, or a number too large for a double. what() starts with
    // "[json.exception.parse_error.101] "; the rest says where and why.
    std::string_view detail = e.what();
    if (const size_t end = detail.find("] "); end != std::string_view::npos) detail.remove_prefix(end + 2);
    Fail("", "", fmt::format("We could not parse the JSON body of your request: {}", detail));
  }
}

const Json& RequireObjectBody(const Json& json) {
  if (!json.is_object()) {
    Fail("", "invalid_type", fmt::format("The request body must be a JSON object, not {}.", DescribeType(json)));
  }
  return json;
}

int32_t TokenId(const Json& value, const std::string& param) {
  std::optional<int64_t> id = AsInteger(value);
  if (!id) FailType(param, "an integer token id", value);
  if (*id < 0 || *id > std::numeric_limits<int32_t>::max()) {
    FailValue(param, fmt::format("'{}' is not a valid token id: {}.", param, *id));
  }
  return static_cast<int32_t>(*id);
}

bool IsTokenIdArray(const Json& array) {
  for (const Json& element : array) {
    if (!element.is_number()) return false;
  }
  return true;
}

std::vector<int32_t> TokenIds(const Json& array, const std::string& param) {
  std::vector<int32_t> ids;
  ids.reserve(array.size());
  for (size_t i = 0; i < array.size(); ++i) ids.push_back(TokenId(array[i], fmt::format("{}[{}]", param, i)));
  return ids;
}

void CheckPromptBytes(size_t bytes, const std::string& param, const ProtocolLimits& limits) {
  if (bytes > limits.max_prompt_bytes) {
    FailValue(param,
              fmt::format("'{}' is too long: {} bytes, at most {} allowed.", param, bytes, limits.max_prompt_bytes));
  }
}

void ParsePrompt(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  const Json* prompt = Field(body, "prompt");
  if (prompt == nullptr) Fail("prompt", "missing_required_parameter", "Missing required parameter: 'prompt'.");
  constexpr std::string_view kShapes =
      "a string, an array of strings, an array of token ids, or an array of token-id arrays";
  // OpenAI's four shapes: one prompt (a string or token ids) or a batch (an array of either).
  if (prompt->is_string()) {
    request.prompts.push_back(PromptInput{prompt->get<std::string>(), {}, false});
  } else if (!prompt->is_array()) {
    FailType("prompt", kShapes, *prompt);
  } else if (prompt->empty()) {
    FailValue("prompt", "'prompt' must not be empty.");
  } else if (IsTokenIdArray(*prompt)) {
    request.prompts.push_back(PromptInput{{}, TokenIds(*prompt, "prompt"), true});
  } else if ((*prompt)[0].is_number()) {
    request.prompts.push_back(PromptInput{{}, TokenIds(*prompt, "prompt"), true});  // names a bad entry
  } else if (!(*prompt)[0].is_string() && !(*prompt)[0].is_array()) {
    FailType("prompt", kShapes, *prompt);
  } else {
    const bool strings = (*prompt)[0].is_string();
    if (prompt->size() > static_cast<size_t>(limits.max_prompts)) {
      FailValue("prompt", fmt::format("'prompt' has {} prompts, at most {} allowed in one request.", prompt->size(),
                                      limits.max_prompts));
    }
    for (size_t i = 0; i < prompt->size(); ++i) {
      const Json& item = (*prompt)[i];
      const std::string param = fmt::format("prompt[{}]", i);
      if (strings) {
        if (!item.is_string()) FailType(param, "a string (like prompt[0])", item);
        request.prompts.push_back(PromptInput{item.get<std::string>(), {}, false});
      } else {
        if (!item.is_array() || !IsTokenIdArray(item)) FailType(param, "an array of token ids", item);
        request.prompts.push_back(PromptInput{{}, TokenIds(item, param), true});
      }
    }
  }
  size_t text_bytes = 0;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const PromptInput& p = request.prompts[i];
    const std::string param = request.prompts.size() == 1 ? "prompt" : fmt::format("prompt[{}]", i);
    if (p.is_tokens ? p.tokens.empty() : p.text.empty()) FailValue(param, fmt::format("'{}' must not be empty.", param));
    text_bytes += p.text.size();
  }
  CheckPromptBytes(text_bytes, "prompt", limits);
}

// A message's content: a string, or OpenAI's array of parts of which only text parts are taken
// (joined as they come).
std::string MessageContent(const Json& message, const std::string& param) {
  const Json* content = Field(message, "content");
  if (content == nullptr) {
    Fail(param, "missing_required_parameter", fmt::format("Missing required parameter: '{}' (a string).", param));
  }
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) FailType(param, "a string", *content);
  std::string text;
  for (size_t i = 0; i < content->size(); ++i) {
    const Json& part = (*content)[i];
    const std::string part_param = fmt::format("{}[{}]", param, i);
    if (!part.is_object()) FailType(part_param, "an object", part);
    const std::optional<std::string> type = ReadString(part, "type", part_param + ".type");
    if (type != "text") {
      FailValue(part_param + ".type",
                fmt::format("Unsupported value for '{}.type': '{}'; only 'text' parts are supported.", part_param,
                            type.value_or("")));
    }
    const std::optional<std::string> part_text = ReadString(part, "text", part_param + ".text");
    if (!part_text) {
      Fail(part_param + ".text", "missing_required_parameter", fmt::format("Missing '{}.text'.", part_param));
    }
    text += *part_text;
  }
  return text;
}

void ParseMessages(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  const Json* messages = Field(body, "messages");
  if (messages == nullptr) Fail("messages", "missing_required_parameter", "Missing required parameter: 'messages'.");
  if (!messages->is_array()) FailType("messages", "an array", *messages);
  if (messages->empty()) FailValue("messages", "'messages' must not be empty.");
  if (messages->size() > static_cast<size_t>(limits.max_messages)) {
    FailValue("messages", fmt::format("'messages' has {} messages, at most {} allowed.", messages->size(),
                                      limits.max_messages));
  }
  size_t content_bytes = 0;
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& message = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!message.is_object()) FailType(param, "an object", message);
    std::optional<std::string> role = ReadString(message, "role", param + ".role");
    if (!role) {
      Fail(param + ".role", "missing_required_parameter", fmt::format("Missing required parameter: '{}.role'.", param));
    }
    if (*role != "system" && *role != "user" && *role != "assistant") {
      FailValue(param + ".role", fmt::format("Invalid value for '{}.role': '{}'. Supported values are: 'system', "
                                             "'user' and 'assistant'.", param, *role));
    }
    std::string content = MessageContent(message, param + ".content");
    content_bytes += content.size();
    request.messages.push_back({std::move(*role), std::move(content)});
  }
  CheckPromptBytes(content_bytes, "messages", limits);
}

void ParseStop(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  const Json* stop = Field(body, "stop");
  if (stop == nullptr) return;
  if (stop->is_string()) {
    request.stop.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (size_t i = 0; i < stop->size(); ++i) {
      const Json& s = (*stop)[i];
      if (!s.is_string()) FailType(fmt::format("stop[{}]", i), "a string", s);
      request.stop.push_back(s.get<std::string>());
    }
  } else {
    FailType("stop", "a string or an array of strings", *stop);
  }
  if (request.stop.size() > static_cast<size_t>(limits.max_stop)) {
    FailValue("stop", fmt::format("'stop' has {} strings, at most {} allowed.", request.stop.size(), limits.max_stop));
  }
  for (const std::string& s : request.stop) {
    if (s.empty()) FailValue("stop", "'stop' strings must not be empty.");
    if (s.size() > static_cast<size_t>(limits.max_stop_bytes)) {
      FailValue("stop", fmt::format("a 'stop' string is {} bytes long, at most {} allowed.", s.size(),
                                    limits.max_stop_bytes));
    }
  }
}

void ParseKvOverride(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  KvOverride& kv = request.kv;
  const Json* ext = Field(body, "kvsparse");
  if (ext == nullptr) return;
  if (!ext->is_object()) FailType("kvsparse", "an object", *ext);
  // Our own extension, so a misspelt key is an error rather than silently ignored.
  for (const auto& [key, value] : ext->items()) {
    if (key != "kv_method" && key != "kv_budget" && key != "kv_type" && key != "context" && key != "context_tokens") {
      FailValue("kvsparse." + key, fmt::format("Unknown field 'kvsparse.{}' (known: kv_method, kv_budget, kv_type, "
                                               "context, context_tokens).",
                                               key));
    }
  }
  kv.method = ReadString(*ext, "kv_method", "kvsparse.kv_method");
  kv.budget = ReadNumber(*ext, "kv_budget", "kvsparse.kv_budget");
  kv.kv_type = ReadString(*ext, "kv_type", "kvsparse.kv_type");
  kv.context = ReadString(*ext, "context", "kvsparse.context");
  if (auto n = ReadInteger(*ext, "context_tokens", "kvsparse.context_tokens")) {
    if (*n < 1 || *n > std::numeric_limits<int32_t>::max()) {
      FailValue("kvsparse.context_tokens", fmt::format("'kvsparse.context_tokens' must be at least 1, got {}.", *n));
    }
    kv.context_tokens = static_cast<int32_t>(*n);
  }
  const char* context_field = kv.context ? "kvsparse.context" : "kvsparse.context_tokens";
  if ((kv.context || kv.context_tokens) && request.chat) {
    FailValue(context_field, fmt::format("'{}' applies to /v1/completions (a prompt after the context), not to chat.",
                                         context_field));
  }
  if (kv.context && kv.context_tokens) {
    FailValue("kvsparse.context_tokens", "Send 'kvsparse.context' or 'kvsparse.context_tokens', not both.");
  }
  if (kv.context) {
    if (kv.context->empty()) FailValue("kvsparse.context", "'kvsparse.context' must not be empty.");
    size_t bytes = kv.context->size();
    for (const PromptInput& p : request.prompts) bytes += p.text.size();
    CheckPromptBytes(bytes, "kvsparse.context", limits);
  }
}

// A sampling value outside the range the sampler accepts (SamplerValueRequirement, shared with
// the CLI) is refused naming the field.
void CheckSamplerValue(SamplerValue which, double value, const std::string& param) {
  if (auto requirement = SamplerValueRequirement(which, value)) {
    FailValue(param, fmt::format("'{}' {}, got {}.", param, *requirement, value));
  }
}

void ParseSampling(const Json& body, CompletionRequest& request) {
  const std::pair<SamplerValue, float*> reals[] = {{SamplerValue::kTemperature, &request.temperature},
                                                   {SamplerValue::kTopP, &request.top_p},
                                                   {SamplerValue::kRepeatPenalty, &request.repeat_penalty},
                                                   {SamplerValue::kPresencePenalty, &request.presence_penalty},
                                                   {SamplerValue::kFrequencyPenalty, &request.frequency_penalty},
                                                   {SamplerValue::kMinP, &request.min_p}};
  for (const auto& [which, field] : reals) {
    const std::string key(SamplerValueName(which));
    if (auto v = ReadNumber(body, key.c_str(), key)) {
      CheckSamplerValue(which, *v, key);
      *field = static_cast<float>(*v);
    }
  }
  if (auto k = ReadIntegerIn(body, "top_k", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())) {
    CheckSamplerValue(SamplerValue::kTopK, static_cast<double>(*k), "top_k");
    request.top_k = *k > 0 ? static_cast<int>(*k) : 0;
  }
  if (const Json* seed = Field(body, "seed")) {
    if (seed->is_number_unsigned()) {
      request.seed = seed->get<uint64_t>();
    } else if (std::optional<int64_t> s = AsInteger(*seed)) {
      if (*s >= 0) {
        request.seed = static_cast<uint64_t>(*s);
      } else if (*s != -1) {  // -1 is llama.cpp's "random seed"
        FailValue("seed", fmt::format("'seed' must be a non-negative integer (or -1 for a random seed), got {}.", *s));
      }
    } else {
      FailType("seed", "an integer", *seed);
    }
  }
}

// {"50256": -100, ...}: token ids as keys (OpenAI's shape), biases in [-100, 100].
void ParseLogitBias(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  const Json* bias = Field(body, "logit_bias");
  if (bias == nullptr) return;
  if (!bias->is_object()) FailType("logit_bias", "an object of token id -> bias", *bias);
  if (bias->size() > static_cast<size_t>(limits.max_logit_bias)) {
    FailValue("logit_bias",
              fmt::format("'logit_bias' has {} entries, at most {} allowed.", bias->size(), limits.max_logit_bias));
  }
  for (const auto& [key, value] : bias->items()) {
    const std::string param = "logit_bias." + key;
    int64_t id = -1;
    const auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (error != std::errc() || end != key.data() + key.size() || id < 0 || id > std::numeric_limits<int32_t>::max()) {
      FailValue(param, fmt::format("'{}': logit_bias keys must be token ids (non-negative integers).", param));
    }
    if (!value.is_number()) FailType(param, "a number", value);
    const double b = value.get<double>();
    CheckSamplerValue(SamplerValue::kLogitBias, b, param);
    request.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(b));
  }
}

// response_format: text is what every response is; JSON-constrained decoding is not implemented,
// so asking for it is refused rather than silently answered with free text.
void CheckResponseFormat(const Json& body) {
  const Json* format = Field(body, "response_format");
  if (format == nullptr) return;
  if (!format->is_object()) FailType("response_format", "an object", *format);
  const std::optional<std::string> type = ReadString(*format, "type", "response_format.type");
  if (!type) Fail("response_format.type", "missing_required_parameter", "Missing required parameter: 'response_format.type'.");
  if (*type != "text") {
    FailValue("response_format.type",
              fmt::format("'response_format.type' is '{}', which is not supported: this server generates free "
                          "text only (type 'text').",
                          *type));
  }
}

// Completions: `logprobs` an integer (alternatives per token) and `echo`; chat: `logprobs` a
// boolean and `top_logprobs` the alternatives. At most 20 alternatives (vLLM's default cap).
void ParseLogprobs(const Json& body, bool chat, CompletionRequest& request) {
  constexpr int kMaxTopLogprobs = 20;
  if (chat) {
    const bool wanted = ReadBool(body, "logprobs", "logprobs").value_or(false);
    const std::optional<int64_t> top = ReadIntegerIn(body, "top_logprobs", 0, kMaxTopLogprobs);
    if (top && !wanted && *top > 0) FailValue("top_logprobs", "'top_logprobs' needs 'logprobs': true.");
    if (wanted) request.logprobs = static_cast<int>(top.value_or(0));
    if (const Json* echo = Field(body, "echo"); echo != nullptr && !(echo->is_boolean() && !echo->get<bool>())) {
      FailValue("echo", "'echo' applies to /v1/completions, not to chat.");
    }
  } else {
    const Json* logprobs = Field(body, "logprobs");
    if (logprobs != nullptr && !(logprobs->is_boolean() && !logprobs->get<bool>())) {
      request.logprobs = static_cast<int>(*ReadIntegerIn(body, "logprobs", 0, kMaxTopLogprobs));
    }
    if (auto echo = ReadBool(body, "echo", "echo")) request.echo = *echo;
  }
}

void ParseStopTokenIds(const Json& body, const ProtocolLimits& limits, CompletionRequest& request) {
  const Json* ids = Field(body, "stop_token_ids");
  if (ids == nullptr) return;
  if (!ids->is_array()) FailType("stop_token_ids", "an array of token ids", *ids);
  if (ids->size() > static_cast<size_t>(limits.max_stop_token_ids)) {
    FailValue("stop_token_ids", fmt::format("'stop_token_ids' has {} ids, at most {} allowed.", ids->size(),
                                            limits.max_stop_token_ids));
  }
  request.stop_token_ids = TokenIds(*ids, "stop_token_ids");
}

void ParseCompletionFields(const Json& body, bool chat, const ProtocolLimits& limits, CompletionRequest& request) {
  request.chat = chat;
  request.max_tokens = limits.default_max_tokens;
  if (auto model = ReadString(body, "model", "model")) request.model = std::move(*model);
  if (chat) {
    ParseMessages(body, limits, request);
  } else {
    ParsePrompt(body, limits, request);
  }
  // max_completion_tokens replaces max_tokens in OpenAI's current API; it wins when both are sent.
  for (const char* key : {"max_completion_tokens", "max_tokens"}) {
    if (auto max_tokens = ReadIntegerIn(body, key, 0, limits.max_tokens_limit)) {
      request.max_tokens = static_cast<int>(*max_tokens);
      request.max_tokens_key = key;
      break;
    }
  }
  ParseSampling(body, request);
  ParseLogitBias(body, limits, request);
  ParseStop(body, limits, request);
  ParseStopTokenIds(body, limits, request);
  CheckResponseFormat(body);
  if (auto stream = ReadBool(body, "stream", "stream")) request.stream = *stream;
  if (const Json* options = Field(body, "stream_options")) {
    if (!options->is_object()) FailType("stream_options", "an object", *options);
    const std::optional<bool> include_usage = ReadBool(*options, "include_usage", "stream_options.include_usage");
    // Meaningless without streaming; tolerated rather than refused.
    request.include_usage_in_stream = request.stream && include_usage.value_or(false);
  }
  if (auto n = ReadInteger(body, "n", "n")) {
    if (*n < 1) FailValue("n", fmt::format("'n' must be at least 1, got {}.", *n));
    if (*n > limits.max_n) FailValue("n", fmt::format("'n' must be at most {}, got {}.", limits.max_n, *n));
    request.n = static_cast<int>(*n);
  }
  const size_t choices = std::max<size_t>(request.prompts.size(), 1) * static_cast<size_t>(request.n);
  if (choices > static_cast<size_t>(limits.max_choices)) {
    FailValue("n", fmt::format("{} prompts with 'n' {} make {} choices, at most {} allowed in one request.",
                               request.prompts.size(), request.n, choices, limits.max_choices));
  }
  if (auto ignore_eos = ReadBool(body, "ignore_eos", "ignore_eos")) request.ignore_eos = *ignore_eos;
  ParseLogprobs(body, chat, request);
  if (request.max_tokens == 0 && !request.echo) {
    FailValue(request.max_tokens_key, fmt::format("'{}' must be at least 1 (0 only with 'echo': score the prompt).",
                                                  request.max_tokens_key));
  }
  ParseKvOverride(body, limits, request);
  if (auto timeout = ReadNumber(body, "timeout_s", "timeout_s")) {
    if (*timeout <= 0.0) FailValue("timeout_s", fmt::format("'timeout_s' must be greater than 0, got {}.", *timeout));
    request.timeout_s = *timeout;
  }
}

ApiError InternalParseError(const std::exception& e) {
  ApiError error;
  error.message = fmt::format("Could not read the request: {}", e.what());
  return error;
}

// Runs a parser body, turning every exception into an ApiError: 400s from the checks, and a 400
// naming the problem for anything nlohmann reports beyond them.
template <typename Result, typename ParseFn>
std::variant<Result, ApiError> Guarded(ParseFn&& parse) {
  try {
    return parse();
  } catch (RequestError& e) {
    return std::move(e.error);
  } catch (const std::bad_alloc&) {
    ApiError error;
    error.http_status = 413;
    error.message = "The request is too large to process.";
    return error;
  } catch (const std::exception& e) {
    return InternalParseError(e);
  }
}

std::string Dump(const OrderedJson& json) {
  // Generated text may hold invalid UTF-8 (byte tokens that never formed a character):
  // replaced by U+FFFD rather than failing the response.
  return json.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

OrderedJson NullIfEmpty(std::string_view text) {
  return text.empty() ? OrderedJson(nullptr) : OrderedJson(std::string(text));
}

OrderedJson Usage(int prompt_tokens, int completion_tokens, size_t kv_peak_bytes) {
  OrderedJson usage = OrderedJson::object();
  usage["prompt_tokens"] = prompt_tokens;
  usage["completion_tokens"] = completion_tokens;
  usage["total_tokens"] = static_cast<int64_t>(prompt_tokens) + completion_tokens;
  usage["kv_bytes"] = static_cast<uint64_t>(kv_peak_bytes);  // extension: peak KV cache bytes held
  return usage;
}

OrderedJson Envelope(std::string_view id, std::string_view object, int64_t created, std::string_view model) {
  OrderedJson json = OrderedJson::object();
  json["id"] = std::string(id);
  json["object"] = std::string(object);
  json["created"] = created;
  json["model"] = std::string(model);
  return json;
}

}  // namespace

std::string ErrorBody(const ApiError& error) {
  OrderedJson inner = OrderedJson::object();
  inner["message"] = error.message;
  inner["type"] = error.type;
  inner["param"] = NullIfEmpty(error.param);
  inner["code"] = NullIfEmpty(error.code);
  OrderedJson body = OrderedJson::object();
  body["error"] = std::move(inner);
  return Dump(body);
}

ApiError ApiErrorFromStatus(const Status& status) {
  ApiError error;
  error.message = status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      break;  // the 400 invalid_request_error default
    case StatusCode::kNotFound:
      error.http_status = 404;
      error.type = "not_found_error";
      break;
    case StatusCode::kResourceExhausted:
      error.http_status = 503;
      error.type = "unavailable_error";
      break;
    case StatusCode::kUnimplemented:
      error.http_status = 501;
      error.type = "not_supported_error";
      break;
    default:
      error.http_status = 500;
      error.type = "server_error";
      break;
  }
  return error;
}

std::variant<CompletionRequest, ApiError> ParseCompletionRequest(std::string_view body, bool chat,
                                                                 const ProtocolLimits& limits) {
  return Guarded<CompletionRequest>([&] {
    const Json json = ParseJsonBody(body);
    CompletionRequest request;
    ParseCompletionFields(RequireObjectBody(json), chat, limits, request);
    return request;
  });
}

std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body, const ProtocolLimits& limits) {
  return Guarded<TokenizeRequest>([&] {
    const Json json = ParseJsonBody(body);
    RequireObjectBody(json);
    TokenizeRequest request;
    // llama.cpp's "content" or vLLM's "prompt" (whose add_special_tokens defaults to true).
    const char* field = Field(json, "content") == nullptr && Field(json, "prompt") != nullptr ? "prompt" : "content";
    std::optional<std::string> content = ReadString(json, field, field);
    if (!content) {
      Fail("content", "missing_required_parameter", "Missing required parameter: 'content' (or vLLM's 'prompt').");
    }
    CheckPromptBytes(content->size(), field, limits);
    request.content = std::move(*content);
    request.add_special = std::string_view(field) == "prompt";
    if (auto add_special = ReadBool(json, "add_special", "add_special")) request.add_special = *add_special;
    if (auto add = ReadBool(json, "add_special_tokens", "add_special_tokens")) request.add_special = *add;
    if (auto parse_special = ReadBool(json, "parse_special", "parse_special")) request.parse_special = *parse_special;
    return request;
  });
}

std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body) {
  return Guarded<DetokenizeRequest>([&] {
    const Json json = ParseJsonBody(body);
    RequireObjectBody(json);
    const Json* tokens = Field(json, "tokens");
    if (tokens == nullptr) Fail("tokens", "missing_required_parameter", "Missing required parameter: 'tokens'.");
    if (!tokens->is_array()) FailType("tokens", "an array of token ids", *tokens);
    return DetokenizeRequest{TokenIds(*tokens, "tokens")};
  });
}

std::string CompletionId(bool chat, uint64_t unique) {
  return fmt::format("{}-{:016x}", chat ? "chatcmpl" : "cmpl", unique);
}

namespace {

OrderedJson LogprobValue(float logprob) { return std::isnan(logprob) ? OrderedJson(nullptr) : OrderedJson(logprob); }

// OpenAI's legacy completions shape: parallel lists, top_logprobs a dict per token (null where the
// token has no log-probability).
OrderedJson LegacyLogprobs(const std::vector<LogprobEntry>& entries) {
  OrderedJson tokens = OrderedJson::array(), token_logprobs = OrderedJson::array(), top = OrderedJson::array(),
              offsets = OrderedJson::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(e.piece);
    token_logprobs.push_back(LogprobValue(e.logprob));
    if (std::isnan(e.logprob)) {
      top.push_back(nullptr);
    } else {
      OrderedJson alternatives = OrderedJson::object();
      for (const auto& [piece, logprob] : e.top) {
        if (!alternatives.contains(piece)) alternatives[piece] = logprob;  // two ids may share a text
      }
      top.push_back(std::move(alternatives));
    }
    offsets.push_back(e.text_offset);
  }
  OrderedJson json = OrderedJson::object();
  json["tokens"] = std::move(tokens);
  json["token_logprobs"] = std::move(token_logprobs);
  json["top_logprobs"] = std::move(top);
  json["text_offset"] = std::move(offsets);
  return json;
}

OrderedJson Utf8Bytes(const std::string& text) {
  OrderedJson bytes = OrderedJson::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

// The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
OrderedJson ChatLogprobs(const std::vector<LogprobEntry>& entries) {
  OrderedJson content = OrderedJson::array();
  for (const LogprobEntry& e : entries) {
    OrderedJson item = OrderedJson::object();
    item["token"] = e.piece;
    item["logprob"] = LogprobValue(e.logprob);
    item["bytes"] = Utf8Bytes(e.piece);
    OrderedJson top = OrderedJson::array();
    for (const auto& [piece, logprob] : e.top) {
      OrderedJson alternative = OrderedJson::object();
      alternative["token"] = piece;
      alternative["logprob"] = logprob;
      alternative["bytes"] = Utf8Bytes(piece);
      top.push_back(std::move(alternative));
    }
    item["top_logprobs"] = std::move(top);
    content.push_back(std::move(item));
  }
  OrderedJson json = OrderedJson::object();
  json["content"] = std::move(content);
  return json;
}

}  // namespace

std::string CompletionResponseBody(const CompletionResult& result) {
  OrderedJson json = Envelope(result.id, "text_completion", result.created, result.model);
  OrderedJson choices = OrderedJson::array();
  for (size_t i = 0; i < result.choices.size(); ++i) {
    const ChoiceResult& c = result.choices[i];
    OrderedJson choice = OrderedJson::object();
    choice["text"] = c.text;
    choice["index"] = i;
    choice["logprobs"] = c.logprobs ? LegacyLogprobs(*c.logprobs) : OrderedJson(nullptr);
    choice["finish_reason"] = NullIfEmpty(c.finish_reason);
    choices.push_back(std::move(choice));
  }
  json["choices"] = std::move(choices);
  json["usage"] = Usage(result.prompt_tokens, result.completion_tokens, result.kv_peak_bytes);
  return Dump(json);
}

std::string ChatCompletionResponseBody(const CompletionResult& result) {
  OrderedJson json = Envelope(result.id, "chat.completion", result.created, result.model);
  OrderedJson choices = OrderedJson::array();
  for (size_t i = 0; i < result.choices.size(); ++i) {
    const ChoiceResult& c = result.choices[i];
    OrderedJson message = OrderedJson::object();
    message["role"] = "assistant";
    message["content"] = c.text;
    OrderedJson choice = OrderedJson::object();
    choice["index"] = i;
    choice["message"] = std::move(message);
    choice["logprobs"] = c.logprobs ? ChatLogprobs(*c.logprobs) : OrderedJson(nullptr);
    choice["finish_reason"] = NullIfEmpty(c.finish_reason);
    choices.push_back(std::move(choice));
  }
  json["choices"] = std::move(choices);
  json["usage"] = Usage(result.prompt_tokens, result.completion_tokens, result.kv_peak_bytes);
  return Dump(json);
}

std::string CompletionChunk(const StreamMeta& meta, int index, std::string_view text, std::string_view finish_reason,
                            const std::vector<LogprobEntry>* logprobs) {
  OrderedJson json = Envelope(meta.id, "text_completion", meta.created, meta.model);
  OrderedJson choice = OrderedJson::object();
  choice["text"] = std::string(text);
  choice["index"] = index;
  choice["logprobs"] = logprobs != nullptr ? LegacyLogprobs(*logprobs) : OrderedJson(nullptr);
  choice["finish_reason"] = NullIfEmpty(finish_reason);
  json["choices"] = OrderedJson::array({std::move(choice)});
  return Dump(json);
}

std::string ChatDeltaChunk(const StreamMeta& meta, int index, std::string_view content, bool first,
                           const std::vector<LogprobEntry>* logprobs) {
  OrderedJson json = Envelope(meta.id, "chat.completion.chunk", meta.created, meta.model);
  OrderedJson delta = OrderedJson::object();
  if (first) delta["role"] = "assistant";
  delta["content"] = std::string(content);
  OrderedJson choice = OrderedJson::object();
  choice["index"] = index;
  choice["delta"] = std::move(delta);
  choice["logprobs"] = logprobs != nullptr ? ChatLogprobs(*logprobs) : OrderedJson(nullptr);
  choice["finish_reason"] = nullptr;
  json["choices"] = OrderedJson::array({std::move(choice)});
  return Dump(json);
}

std::string ChatFinishChunk(const StreamMeta& meta, int index, std::string_view finish_reason) {
  OrderedJson json = Envelope(meta.id, "chat.completion.chunk", meta.created, meta.model);
  OrderedJson choice = OrderedJson::object();
  choice["index"] = index;
  choice["delta"] = OrderedJson::object();
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = NullIfEmpty(finish_reason);
  json["choices"] = OrderedJson::array({std::move(choice)});
  return Dump(json);
}

std::string UsageChunk(const StreamMeta& meta, bool chat, int prompt_tokens, int completion_tokens,
                       size_t kv_peak_bytes) {
  OrderedJson json = Envelope(meta.id, chat ? "chat.completion.chunk" : "text_completion", meta.created, meta.model);
  json["choices"] = OrderedJson::array();
  json["usage"] = Usage(prompt_tokens, completion_tokens, kv_peak_bytes);
  return Dump(json);
}

std::string SseEvent(std::string_view json) {
  std::string event;
  event.reserve(json.size() + 8);
  event += "data: ";
  event += json;
  event += "\n\n";
  return event;
}

std::string ModelsBody(std::string_view model_id, int64_t created) {
  OrderedJson model = OrderedJson::object();
  model["id"] = std::string(model_id);
  model["object"] = "model";
  model["created"] = created;
  model["owned_by"] = "kvsparse";
  OrderedJson json = OrderedJson::object();
  json["object"] = "list";
  json["data"] = OrderedJson::array({std::move(model)});
  return Dump(json);
}

std::string TokenizeResponseBody(std::span<const int32_t> tokens, int max_model_len) {
  OrderedJson json = OrderedJson::object();
  json["tokens"] = std::vector<int32_t>(tokens.begin(), tokens.end());
  json["count"] = tokens.size();
  json["max_model_len"] = max_model_len;
  return Dump(json);
}

std::string TokenizerInfoBody(const TokenizerInfo& info) {
  auto token = [](const std::string& text, int32_t id) { return id < 0 ? OrderedJson(nullptr) : OrderedJson(text); };
  auto token_id = [](int32_t id) { return id < 0 ? OrderedJson(nullptr) : OrderedJson(id); };
  OrderedJson json = OrderedJson::object();
  json["tokenizer_class"] = info.tokenizer_class;
  json["bos_token"] = token(info.bos_token, info.bos_token_id);
  json["bos_token_id"] = token_id(info.bos_token_id);
  json["eos_token"] = token(info.eos_token, info.eos_token_id);
  json["eos_token_id"] = token_id(info.eos_token_id);
  json["add_bos_token"] = info.add_bos_token;
  json["vocab_size"] = info.vocab_size;
  json["model_max_length"] = info.model_max_length;
  json["chat_template"] = info.chat_template;
  return Dump(json);
}

std::string DetokenizeResponseBody(std::string_view content) {
  OrderedJson json = OrderedJson::object();
  json["content"] = std::string(content);
  return Dump(json);
}

}  // namespace kvsparse::server
