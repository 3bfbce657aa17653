// A tiny random-weight llama model with a real tokenizer, written once per test process: the
// model the server tests talk to over HTTP.
#pragma once

#include <cstdint>
#include <string>

#include "kvsparse/status.h"

namespace kvsparse::testing {

// tiny-llama's layers, f32 weights, context `context`; the 32000-token SentencePiece vocab of
// ../shared/vocab/ggml-vocab-llama-spm.gguf when present, else synth's generated 512-token
// SentencePiece vocab (same tokenizer code, smaller table). *note says which. Returns the path.
StatusOr<std::string> WriteTinyChatModel(const std::string& file_name, int32_t context, std::string* note);

}  // namespace kvsparse::testing
