// The token table shared by the SPM and BPE algorithms: text, score and type per id,
// plus a text → id index (later duplicates win, as in llama.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvsparse/tokenizer.h"

namespace kvsparse::tokenizer_internal {

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

class Vocab {
 public:
  // Takes the validated arrays ([n_vocab] each) and builds the text index.
  Vocab(std::vector<std::string> text, std::vector<float> score, std::vector<TokenType> type);

  int32_t size() const { return static_cast<int32_t>(text_.size()); }
  bool Contains(int32_t id) const { return id >= 0 && id < size(); }
  const std::string& text(int32_t id) const { return text_[id]; }
  float score(int32_t id) const { return score_[id]; }
  TokenType type(int32_t id) const { return type_[id]; }
  int32_t Find(std::string_view piece) const;  // -1 when no token has this text

 private:
  std::vector<std::string> text_;   // [n_vocab]
  std::vector<float> score_;        // [n_vocab]
  std::vector<TokenType> type_;     // [n_vocab]
  std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>> index_;
};

}  // namespace kvsparse::tokenizer_internal
