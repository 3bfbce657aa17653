// Cuts text at occurrences of special tokens before the SPM/BPE algorithms run, so
// e.g. "<|im_end|>" becomes one token rather than being spelled out. Follows
// llama.cpp: longer tokens are cut first, each at all its non-overlapping occurrences.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer_vocab.h"

namespace kvsparse::tokenizer_internal {

// A piece of the input: either a special token or raw text for the main algorithm.
struct Fragment {
  int32_t token = -1;     // >= 0: this special token
  std::string_view text;  // the covered input
};

class SpecialTokenSplitter {
 public:
  // Candidates: control, unknown and user-defined tokens with non-empty text.
  explicit SpecialTokenSplitter(const Vocab& vocab);

  // parse_special = false limits the candidates to user-defined tokens.
  std::vector<Fragment> Split(std::string_view text, bool parse_special) const;

 private:
  bool Allowed(int32_t token, bool parse_special) const;
  // Candidates that occur somewhere in text, longest first.
  std::vector<int32_t> OccurringCandidates(std::string_view text, bool parse_special) const;

  const Vocab& vocab_;
  // Byte trie over candidate texts: key (node << 8 | byte) → child node.
  std::unordered_map<uint64_t, int32_t> trie_edges_;
  std::vector<int32_t> trie_token_;  // [n_nodes] candidate ending at this node, -1 if none
};

}  // namespace kvsparse::tokenizer_internal
