// Tokenizers built from GGUF vocab metadata (tokenizer.ggml.*), with llama.cpp semantics:
//   - "llama": SentencePiece-style BPE over scored pieces with <0xNN> byte fallback (SPM).
//   - "gpt2":  byte-level BPE over ranked merges, pre-tokenized by the regexes that
//              tokenizer.ggml.pre selects.
// Control tokens (type 3) and unknown tokens (type 2) are recognised in text only when
// parse_special is true; user-defined tokens (type 4) always are, as llama.cpp and
// HF tokenizers do with added tokens (e.g. MPT's runs of spaces).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/status.h"

namespace kvsparse {

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Everything a tokenizer is built from, as plain data. Field comments name the GGUF
// key each comes from; validation errors name those keys.
struct TokenizerSpec {
  std::string model;                 // tokenizer.ggml.model: "llama" (SPM) or "gpt2" (BPE)
  std::string pre;                   // tokenizer.ggml.pre; empty = "default"
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens [n_vocab]
  std::vector<float> scores;         // tokenizer.ggml.scores [n_vocab]; empty = all 0
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type [n_vocab]; empty = all normal
  std::vector<std::string> merges;   // tokenizer.ggml.merges: "left right", rank = index (BPE only)
  int32_t bos = -1;                  // tokenizer.ggml.bos_token_id (-1: absent)
  int32_t eos = -1;                  // tokenizer.ggml.eos_token_id
  int32_t unk = -1;                  // tokenizer.ggml.unknown_token_id
  int32_t eot = -1;                  // tokenizer.ggml.eot_token_id
  int32_t eom = -1;                  // tokenizer.ggml.eom_token_id
  int32_t pad = -1;                  // tokenizer.ggml.padding_token_id
  std::optional<bool> add_bos;       // tokenizer.ggml.add_bos_token; absent: SPM true, BPE false
  std::optional<bool> add_eos;       // tokenizer.ggml.add_eos_token; absent: false
  std::optional<bool> add_space_prefix;  // tokenizer.ggml.add_space_prefix; absent: true (SPM only)
};

class Tokenizer {
 public:
  // Reads the tokenizer.ggml.* keys. Errors name the file and the key at fault. The
  // tokenizer copies what it needs, so `file` may be closed afterwards.
  static StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);
  // Validates the spec (array lengths, ids in range, merges over known tokens,
  // supported model/pre-tokenizer). Errors name the GGUF key at fault.
  static StatusOr<std::unique_ptr<Tokenizer>> FromSpec(TokenizerSpec spec);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // add_bos = llama.cpp's add_special: prepends BOS when tokenizer.ggml.add_bos_token
  // allows it (and appends EOS when tokenizer.ggml.add_eos_token is set).
  // Special tokens in text are not parsed.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const;
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool parse_special) const;

  // Decoded bytes of one token: SPM "▁" → " " and <0xNN> → that byte; BPE byte-level
  // characters → bytes; control/user-defined tokens → their text; out of range → "".
  std::string TokenToPiece(int32_t token) const;
  // Concatenated pieces, dropping control tokens (BOS/EOS/...); for SPM with a space
  // prefix the first piece's leading space is removed, so Decode(Encode(x)) == x.
  std::string Decode(const std::vector<int32_t>& tokens) const;

  int32_t n_vocab() const;
  int32_t bos() const;  // -1 when absent
  int32_t eos() const;  // -1 when absent
  bool IsEndOfGeneration(int32_t token) const;  // eos, eot, eom and known end-of-turn tokens
  std::string_view model_name() const;  // "llama" (SPM) or "gpt2" (BPE)
  std::string_view pre_name() const;    // tokenizer.ggml.pre ("default" when absent)

  // The token's text as stored in the vocab (not decoded); "" when out of range.
  std::string_view TokenText(int32_t token) const;
  TokenType GetTokenType(int32_t token) const;  // kUndefined when out of range

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Pre-tokenizer names accepted in tokenizer.ggml.pre for "gpt2" vocabularies.
std::vector<std::string_view> SupportedBpePreTokenizers();

}  // namespace kvsparse
