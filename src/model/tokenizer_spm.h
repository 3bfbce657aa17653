// SentencePiece-style BPE as llama.cpp runs it on "llama" vocabularies: start from
// single UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is
// the highest-scoring token, and spell leftovers with <0xNN> byte tokens.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "model/tokenizer_vocab.h"

namespace kvsparse::tokenizer_internal {

class SpmEncoder {
 public:
  // `vocab` must outlive the encoder. unk_id (-1: none) stands in for bytes that have
  // no <0xNN> token.
  SpmEncoder(const Vocab& vocab, int32_t unk_id);

  // Appends the tokens of `text`, whose spaces are already escaped as "▁".
  // O(n log n) in the length of text.
  void Encode(std::string_view text, std::vector<int32_t>* out) const;

 private:
  void AppendBytes(std::string_view piece, std::vector<int32_t>* out) const;

  const Vocab& vocab_;
  int32_t unk_id_;
  std::array<int32_t, 256> byte_token_;  // <0xNN> token per byte, -1 when missing
};

}  // namespace kvsparse::tokenizer_internal
