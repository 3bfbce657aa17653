#include "model/tokenizer_spm.h"

#include <cstdio>
#include <queue>

#include "model/tokenizer_bytes.h"

namespace kvsparse::tokenizer_internal {
namespace {

// A run of text bytes in a doubly linked list of symbols; len == 0 once merged away.
struct SpmSymbol {
  int prev;
  int next;
  size_t start;
  size_t len;
};

struct SpmBigram {
  float score;
  int left;
  int right;
  size_t len;  // bytes covered when queued; a later mismatch means the pair is stale

  // Priority: higher score first, then the leftmost pair (llama.cpp's order).
  struct LowerPriority {
    bool operator()(const SpmBigram& a, const SpmBigram& b) const {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
  };
};

}  // namespace

SpmEncoder::SpmEncoder(const Vocab& vocab, int32_t unk_id) : vocab_(vocab), unk_id_(unk_id) {
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    int32_t id = vocab_.Find(name);
    const char raw = static_cast<char>(b);
    if (id < 0) id = vocab_.Find(std::string_view(&raw, 1));  // raw byte token
    byte_token_[b] = id;
  }
}

void SpmEncoder::AppendBytes(std::string_view piece, std::vector<int32_t>* out) const {
  for (char c : piece) {
    const int32_t id = byte_token_[static_cast<uint8_t>(c)];
    if (id >= 0) {
      out->push_back(id);
    } else if (unk_id_ >= 0) {
      out->push_back(unk_id_);
    }
  }
}

void SpmEncoder::Encode(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  std::vector<SpmSymbol> symbols;  // [n_chars]
  symbols.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t len = Utf8CharLengthAt(text, pos);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({index - 1, pos + len == text.size() ? -1 : index + 1, pos, len});
    pos += len;
  }

  std::priority_queue<SpmBigram, std::vector<SpmBigram>, SpmBigram::LowerPriority> queue;
  const auto try_add_bigram = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t len = symbols[left].len + symbols[right].len;
    const int32_t id = vocab_.Find(text.substr(symbols[left].start, len));
    if (id < 0) return;
    queue.push({vocab_.score(id), left, right, len});
  };
  for (size_t i = 1; i < symbols.size(); ++i) try_add_bigram(static_cast<int>(i) - 1, static_cast<int>(i));

  while (!queue.empty()) {
    const SpmBigram bigram = queue.top();
    queue.pop();
    SpmSymbol& left = symbols[bigram.left];
    SpmSymbol& right = symbols[bigram.right];
    // Symbols only grow, so an unchanged total length means the pair is still current.
    if (left.len == 0 || right.len == 0 || left.len + right.len != bigram.len) continue;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add_bigram(left.prev, bigram.left);
    try_add_bigram(bigram.left, left.next);
  }

  // Merged symbols are tokens by construction; single characters may not be.
  for (int i = 0; i != -1; i = symbols[i].next) {
    const std::string_view piece = text.substr(symbols[i].start, symbols[i].len);
    const int32_t id = vocab_.Find(piece);
    if (id >= 0) {
      out->push_back(id);
    } else {
      AppendBytes(piece, out);
    }
  }
}

}  // namespace kvsparse::tokenizer_internal
