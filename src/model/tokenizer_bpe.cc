#include "model/tokenizer_bpe.h"

#include <queue>

#include "model/tokenizer_bytes.h"

namespace kvsparse::tokenizer_internal {
namespace {

struct Symbol {
  int prev;
  int next;
  int32_t id;  // token of this run of characters; -1 for a character with no token
  size_t start;
  size_t len;  // 0 once merged into its left neighbour
};

struct Bigram {
  int32_t rank;
  int left;
  int right;
  int32_t left_id;   // ids when queued; a mismatch later means the pair is stale
  int32_t right_id;
  int32_t merged_id;

  // Priority: lowest rank first, then the leftmost pair.
  struct LowerPriority {
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
  };
};

}  // namespace

StatusOr<std::unique_ptr<BpeEncoder>> BpeEncoder::Create(const Vocab& vocab, const std::vector<std::string>& merges,
                                                         bool ignore_merges, int32_t unk_id) {
  std::unique_ptr<BpeEncoder> encoder(new BpeEncoder(vocab, ignore_merges, unk_id));
  encoder->merges_.reserve(merges.size());
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& entry = merges[rank];
    const auto describe = [&] { return "tokenizer.ggml.merges[" + std::to_string(rank) + "] = '" + entry + "'"; };
    // Search from 1 so that a merge whose left side starts with ' ' still splits right.
    const size_t space = entry.size() > 1 ? entry.find(' ', 1) : std::string::npos;
    if (space == std::string::npos || space + 1 >= entry.size()) {
      return InvalidArgumentError(describe() + " is not of the form 'left right'");
    }
    const std::string_view left(entry.data(), space);
    const std::string_view right(entry.data() + space + 1, entry.size() - space - 1);
    const int32_t left_id = vocab.Find(left);
    const int32_t right_id = vocab.Find(right);
    merged.assign(left);
    merged.append(right);
    const int32_t merged_id = vocab.Find(merged);
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      const std::string_view missing = left_id < 0 ? left : right_id < 0 ? right : std::string_view(merged);
      return InvalidArgumentError(describe() + " refers to '" + std::string(missing) +
                                  "', which is not in tokenizer.ggml.tokens");
    }
    // The first (best-ranked) occurrence of a pair wins.
    encoder->merges_.try_emplace(PairKey(left_id, right_id), Merge{static_cast<int32_t>(rank), merged_id});
  }
  return encoder;
}

void BpeEncoder::EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  const std::string text = ByteLevelEncode(word);
  if (ignore_merges_) {
    const int32_t whole = vocab_.Find(text);
    if (whole >= 0) {
      out->push_back(whole);
      return;
    }
  }

  std::vector<Symbol> symbols;  // [n_chars]
  symbols.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t len = Utf8CharLengthAt(text, pos);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({index - 1, pos + len == text.size() ? -1 : index + 1,
                       vocab_.Find(std::string_view(text).substr(pos, len)), pos, len});
    pos += len;
  }

  std::priority_queue<Bigram, std::vector<Bigram>, Bigram::LowerPriority> queue;
  const auto try_add_bigram = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const int32_t left_id = symbols[left].id;
    const int32_t right_id = symbols[right].id;
    if (left_id < 0 || right_id < 0) return;
    auto it = merges_.find(PairKey(left_id, right_id));
    if (it == merges_.end()) return;
    queue.push({it->second.rank, left, right, left_id, right_id, it->second.merged_id});
  };
  for (size_t i = 1; i < symbols.size(); ++i) try_add_bigram(static_cast<int>(i) - 1, static_cast<int>(i));

  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    if (left.len == 0 || right.len == 0 || left.next != bigram.right || left.id != bigram.left_id ||
        right.id != bigram.right_id) {
      continue;  // stale: one side has merged since this pair was queued
    }
    left.id = bigram.merged_id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add_bigram(left.prev, bigram.left);
    try_add_bigram(bigram.left, left.next);
  }

  for (int i = 0; i != -1; i = symbols[i].next) {
    if (symbols[i].id >= 0) {
      out->push_back(symbols[i].id);
    } else if (unk_id_ >= 0) {
      out->push_back(unk_id_);
    }
  }
}

}  // namespace kvsparse::tokenizer_internal
