// Request bodies of the OpenAI-compatible API: /v1/completions and /v1/chat/completions (byte 0
// chooses), /tokenize and /detokenize, under the server's default limits. A request that parses
// has its fields in range.
#include <variant>

#include "fuzz_target.h"
#include "kvsparse/status.h"
#include "server/openai_protocol.h"

namespace kvsparse::fuzz {

int FuzzOpenAiRequest(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view body = AsText(data + 1, size - 1);
  const server::ProtocolLimits limits;
  auto parsed = server::ParseCompletionRequest(body, /*chat=*/data[0] & 1, limits);
  if (auto* r = std::get_if<server::CompletionRequest>(&parsed)) {
    KVS_CHECK(r->max_tokens >= 1 && r->n >= 1 && r->n <= limits.max_n);
    KVS_CHECK(r->temperature >= 0.0f && r->temperature <= 2.0f && r->top_p > 0.0f && r->top_p <= 1.0f);
    KVS_CHECK(r->chat ? !r->messages.empty() : !r->prompts.empty());
  } else {
    (void)server::ErrorBody(std::get<server::ApiError>(parsed));
  }
  (void)server::ParseTokenizeRequest(body, limits);
  (void)server::ParseDetokenizeRequest(body);
  return 0;
}

}  // namespace kvsparse::fuzz
