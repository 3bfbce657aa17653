#include "model/tokenizer_vocab.h"

namespace kvsparse::tokenizer_internal {

Vocab::Vocab(std::vector<std::string> text, std::vector<float> score, std::vector<TokenType> type)
    : text_(std::move(text)), score_(std::move(score)), type_(std::move(type)) {
  KVS_CHECK(score_.size() == text_.size() && type_.size() == text_.size());
  index_.reserve(text_.size());
  for (int32_t id = 0; id < size(); ++id) index_[text_[id]] = id;
}

int32_t Vocab::Find(std::string_view piece) const {
  auto it = index_.find(piece);
  return it == index_.end() ? -1 : it->second;
}

}  // namespace kvsparse::tokenizer_internal
