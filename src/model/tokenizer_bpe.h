// Byte-level BPE (GPT-2 style) over ranked merges: a word's bytes become byte-level
// characters, then the adjacent pair with the lowest merge rank is merged until no
// ranked pair remains.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvsparse/status.h"
#include "model/tokenizer_vocab.h"

namespace kvsparse::tokenizer_internal {

class BpeEncoder {
 public:
  // Parses "left right" merges (rank = index). Every merge must name two tokens whose
  // concatenation is also a token; errors name tokenizer.ggml.merges and the entry.
  // ignore_merges: a word that is itself a token is emitted whole (llama-3 style).
  // `vocab` must outlive the encoder; unk_id (-1: none) replaces characters with no token.
  static StatusOr<std::unique_ptr<BpeEncoder>> Create(const Vocab& vocab, const std::vector<std::string>& merges,
                                                      bool ignore_merges, int32_t unk_id);

  // Appends the tokens of one pre-tokenized word given as raw bytes. O(n log n).
  void EncodeWord(std::string_view word, std::vector<int32_t>* out) const;

  size_t n_merges() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  BpeEncoder(const Vocab& vocab, bool ignore_merges, int32_t unk_id)
      : vocab_(vocab), ignore_merges_(ignore_merges), unk_id_(unk_id) {}

  const Vocab& vocab_;
  bool ignore_merges_;
  int32_t unk_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) → rank and result
};

}  // namespace kvsparse::tokenizer_internal
