// The OpenAI-compatible wire protocol, without HTTP: request bodies of /v1/completions,
// /v1/chat/completions, /tokenize and /detokenize parsed into checked structs (or an OpenAI-style
// error naming the offending field), and the JSON of responses, stream chunks and /v1/models.
// Unknown request fields are ignored, since OpenAI clients send many; fields of our own
// "kvsparse" extension object are checked strictly. JSON null counts as "not given".
// Nothing here throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvsparse/status.h"
#include "server/chat_template.h"

namespace kvsparse::server {

struct ApiError {
  int http_status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // the offending field ("temperature", "messages[1].content"); empty: none
  std::string code;   // "invalid_type", "invalid_value", "missing_required_parameter"; empty: none
};

// {"error":{"message":..,"type":..,"param":..,"code":..}}; param and code are null when empty.
std::string ErrorBody(const ApiError& error);

// An engine Status as an API error: InvalidArgument/OutOfRange → 400 invalid_request_error,
// NotFound → 404 not_found_error, ResourceExhausted → 503 unavailable_error (out of KV memory:
// retry later), Unimplemented → 501 not_supported_error, anything else → 500 server_error.
ApiError ApiErrorFromStatus(const Status& status);

struct ProtocolLimits {
  int max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  int default_max_tokens = 256;  // when the request gives none
  int max_n = 16;                // 'n': choices per prompt
  int max_prompts = 64;          // prompts of one batched /v1/completions request
  int max_choices = 64;          // prompts x n: each is its own sequence
  int max_stop = 16;             // stop strings per request
  int max_stop_token_ids = 64;   // stop_token_ids per request
  int max_logit_bias = 1024;     // logit_bias entries per request
  int max_stop_bytes = 64;       // bytes per stop string
  size_t max_prompt_bytes = 1 << 20;  // prompt text, or all message contents together
  int max_messages = 256;
};

// The "kvsparse" extension object: {"kv_method": "h2o", "kv_budget": 0.2, "kv_type": "int8"}.
// Only parsed and type-checked here; the server validates the values against the KV config.
// Completions may also name a context to compress once and keep (the scheduler's
// GenerationRequest::context_tokens): {"context": "<text>"} goes before every prompt (tokenized
// with BOS, each prompt then without), or {"context_tokens": N} marks every prompt's first N
// tokens as the context.
struct KvOverride {
  std::optional<std::string> method;
  std::optional<double> budget;
  std::optional<std::string> kv_type;
  std::optional<std::string> context;
  std::optional<int32_t> context_tokens;  // >= 1
};

// One prompt of /v1/completions: text, or token ids (sent as they are, no BOS added).
struct PromptInput {
  std::string text;
  std::vector<int32_t> tokens;
  bool is_tokens = false;
};

struct CompletionRequest {
  bool chat = false;  // /v1/chat/completions (messages) or /v1/completions (prompt)
  std::string model;  // as sent; empty when absent
  // Completions: one prompt, or a batch (OpenAI's list of strings or of token-id lists); the
  // response's choices run prompt by prompt, n for each (index = prompt * n + copy).
  std::vector<PromptInput> prompts;
  std::vector<ChatMessage> messages;  // chat; roles are system, user or assistant
  int max_tokens = 0;  // the request's max_completion_tokens / max_tokens, else default_max_tokens
  const char* max_tokens_key = "max_tokens";  // which of the two set it (error messages)
  float temperature = 1.0f;   // [0, 2]; 0 is greedy
  float top_p = 1.0f;         // (0, 1]
  int top_k = 0;              // 0: off (negative values, vLLM's "off", become 0)
  float repeat_penalty = 1.0f;  // > 0; 1: off
  float presence_penalty = 0.0f;   // [-2, 2]; over the generated tokens (SamplerParams)
  float frequency_penalty = 0.0f;  // [-2, 2]
  float min_p = 0.0f;              // [0, 1]; 0: off
  // logit_bias: {"token id": bias in [-100, 100]}; ids are checked against the vocabulary by the server.
  std::vector<std::pair<int32_t, float>> logit_bias;
  std::optional<uint64_t> seed;  // absent (or llama.cpp's -1): the server picks one
  std::vector<std::string> stop;  // non-empty strings
  std::vector<int32_t> stop_token_ids;  // vLLM's: generation also ends on these ids (checked by the server)
  bool stream = false;
  bool include_usage_in_stream = false;  // stream_options.include_usage, only when streaming
  int n = 1;  // choices per prompt; copies fork the prompt's pages (the scheduler's prefix sharing)
  bool ignore_eos = false;
  // Log-probabilities: -1 none, else each token's with this many alternatives
  // (completions' integer `logprobs`, or chat's `logprobs: true` with `top_logprobs`), in [0, 20].
  int logprobs = -1;
  bool echo = false;  // completions: the prompt comes back in `text`, with its log-probabilities
  KvOverride kv;
  std::optional<double> timeout_s;  // > 0
};

std::variant<CompletionRequest, ApiError> ParseCompletionRequest(std::string_view body, bool chat,
                                                                 const ProtocolLimits& limits);

// POST /tokenize: {"content": "...", "add_special": false, "parse_special": true} (llama.cpp's
// fields and defaults), or {"prompt": "...", "add_special_tokens": true} (vLLM's: with `prompt`
// add_special defaults to true, as vLLM's does).
struct TokenizeRequest {
  std::string content;
  bool add_special = false;   // add BOS (and EOS where the vocab wants it)
  bool parse_special = true;  // "<|im_end|>" and the like in content become special tokens
};
std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body, const ProtocolLimits& limits);

// POST /detokenize: {"tokens": [1, 2, 3]}. Ids are checked non-negative here; the server checks
// them against the vocabulary.
struct DetokenizeRequest {
  std::vector<int32_t> tokens;
};
std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body);

// One token of a response's log-probabilities: its text, where that text starts in the choice's
// text, its log-probability (NaN: null, a prompt's first token) and the alternatives' texts.
struct LogprobEntry {
  std::string piece;
  size_t text_offset = 0;
  float logprob = 0.f;
  std::vector<std::pair<std::string, float>> top;
};

// One choice of a finished request, for the non-streaming responses.
struct ChoiceResult {
  std::string text;
  std::string finish_reason;  // "stop" or "length"
  // With logprobs (or echo): one entry per token of `text`, the echoed prompt's first. Completions
  // write OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset), chat its
  // content list (token, logprob, bytes, top_logprobs); without: "logprobs": null.
  std::optional<std::vector<LogprobEntry>> logprobs;
};

// What a finished request produced: its choices in index order (prompt * n + copy) and the usage
// of them all (each prompt's tokens counted once, as OpenAI does; kv_bytes the sum of the choices'
// peaks, an upper bound where copies share pages).
struct CompletionResult {
  std::string id;  // "cmpl-..." / "chatcmpl-..." (CompletionId)
  int64_t created = 0;  // Unix seconds
  std::string model;
  std::vector<ChoiceResult> choices;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  size_t kv_peak_bytes = 0;  // usage.kv_bytes
};

// "cmpl-<16 hex digits>" or "chatcmpl-<16 hex digits>"; `unique` comes from the server (a counter
// mixed with a random start), so ids differ across restarts too.
std::string CompletionId(bool chat, uint64_t unique);

// Non-streaming bodies. Invalid UTF-8 in generated text is replaced by U+FFFD, never an error.
std::string CompletionResponseBody(const CompletionResult& result);      // object "text_completion"
std::string ChatCompletionResponseBody(const CompletionResult& result);  // object "chat.completion"

// The fields every chunk of one streamed response repeats.
struct StreamMeta {
  std::string id;
  int64_t created = 0;
  std::string model;
};

// Each chunk carries one choice, `index` (prompt * n + copy), and with logprobs the entries of
// the tokens it brings (their text_offset within the choice's whole text; the text itself may
// come a chunk later while a stop string is possible).
// Streaming /v1/completions: choices[0].text; finish_reason is null until the choice's last chunk.
std::string CompletionChunk(const StreamMeta& meta, int index, std::string_view text,
                            std::string_view finish_reason = {}, const std::vector<LogprobEntry>* logprobs = nullptr);
// Streaming /v1/chat/completions: a choice's first chunk's delta carries role "assistant" (with
// `content`, possibly empty), later ones only content.
std::string ChatDeltaChunk(const StreamMeta& meta, int index, std::string_view content, bool first,
                           const std::vector<LogprobEntry>* logprobs = nullptr);
// A chat choice's last chunk: an empty delta and the finish_reason.
std::string ChatFinishChunk(const StreamMeta& meta, int index, std::string_view finish_reason);
// stream_options.include_usage: a last chunk with empty choices and the usage (with kv_bytes).
std::string UsageChunk(const StreamMeta& meta, bool chat, int prompt_tokens, int completion_tokens,
                       size_t kv_peak_bytes);

// One server-sent event: "data: <json>\n\n".
std::string SseEvent(std::string_view json);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// GET /v1/models: {"object":"list","data":[{"id":..,"object":"model","created":..,"owned_by":"kvsparse"}]}.
std::string ModelsBody(std::string_view model_id, int64_t created);

// /tokenize and /detokenize responses: {"tokens":[..]} and {"content":".."}.
// {"tokens": [...], "count": n, "max_model_len": max_model_len}: llama.cpp's field and vLLM's.
std::string TokenizeResponseBody(std::span<const int32_t> tokens, int max_model_len);
// GET /tokenizer_info (vLLM's endpoint): the special tokens as text and ids, the vocabulary size,
// the context, the tokenizer's kind and the chat template's name.
struct TokenizerInfo {
  std::string tokenizer_class;  // "kvsparse-spm", "kvsparse-bpe"
  std::string bos_token, eos_token;
  int32_t bos_token_id = -1, eos_token_id = -1;  // -1: none (null in the body)
  int32_t vocab_size = 0;
  int model_max_length = 0;
  bool add_bos_token = false;
  std::string chat_template;
};
std::string TokenizerInfoBody(const TokenizerInfo& info);
std::string DetokenizeResponseBody(std::string_view content);

}  // namespace kvsparse::server
