// libFuzzer harnesses (fuzz/*_fuzz.cc): each defines one function taking the fuzzer's bytes.
// The same functions run in two ways:
//   - as libFuzzer binaries (`-DKVS_FUZZ=ON`, clang; fuzz/fuzzer_entry.cc calls the function),
//     scripts/fuzz.sh runs them;
//   - over the committed corpus and the crash regressions (fuzz/corpus/<harness>/,
//     fuzz/regressions/<harness>/) in every build's test suite (tests/fuzz_corpus_test.cc).
// A harness returns 0; a crash, a sanitizer report or a failed KVS_CHECK is the finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvsparse::fuzz {

int FuzzGguf(const uint8_t* data, size_t size);            // GGUF reader, model loader, tokenizer keys
int FuzzTokenizer(const uint8_t* data, size_t size);       // SPM and BPE (every pre-tokenizer)
int FuzzKvConfig(const uint8_t* data, size_t size);        // --kv-config JSON
int FuzzKvParam(const uint8_t* data, size_t size);         // --kv-param, --methods, --kv-budget strings
int FuzzUserTasks(const uint8_t* data, size_t size);       // bench user:data.jsonl
int FuzzOpenAiRequest(const uint8_t* data, size_t size);   // completions, chat, tokenize, detokenize bodies
int FuzzChatTemplate(const uint8_t* data, size_t size);    // template detection and rendering
int FuzzHttpServer(const uint8_t* data, size_t size);      // raw bytes to the server on loopback

// The input as text.
inline std::string_view AsText(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// ../shared beside the checkout (test data: vocab GGUFs); empty when absent.
std::string SharedDir();

}  // namespace kvsparse::fuzz
