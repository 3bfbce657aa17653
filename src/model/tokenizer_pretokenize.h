// Pre-tokenization for byte-level BPE: the regex list that tokenizer.ggml.pre selects
// cuts text into words before BPE runs on each word separately (so merges never cross
// word boundaries). Regexes use PCRE2 in UTF + UCP mode.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse::tokenizer_internal {

class PreTokenizer {
 public:
  // Unknown names yield InvalidArgument naming the value and the supported names.
  static StatusOr<std::unique_ptr<PreTokenizer>> Create(std::string_view pre_name);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Words of `text`, in order and covering it exactly. Each regex in turn splits every
  // current piece into its matches and the unmatched gaps between them (regexes see one
  // piece at a time, so anchors and lookaheads stop at piece boundaries). Bytes that are
  // not valid UTF-8 never match and so end up in gap words of their own.
  std::vector<std::string_view> Split(std::string_view text) const;

  // llama-3 style vocabularies emit a word whole when it is itself a token.
  bool ignore_merges() const { return ignore_merges_; }
  // Whether tokenizer.ggml.add_bos_token defaults to true for this pre-tokenizer.
  bool default_add_bos() const { return default_add_bos_; }

 private:
  struct Regex;
  PreTokenizer() = default;
  std::vector<std::unique_ptr<Regex>> regexes_;
  bool ignore_merges_ = false;
  bool default_add_bos_ = false;
};

}  // namespace kvsparse::tokenizer_internal
