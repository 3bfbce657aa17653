#include "model/tokenizer_special.h"

#include <algorithm>
#include <unordered_set>

namespace kvsparse::tokenizer_internal {

SpecialTokenSplitter::SpecialTokenSplitter(const Vocab& vocab) : vocab_(vocab) {
  trie_token_.push_back(-1);  // root
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    const TokenType type = vocab_.type(id);
    if (type != TokenType::kControl && type != TokenType::kUnknown && type != TokenType::kUserDefined) continue;
    const std::string& text = vocab_.text(id);
    if (text.empty()) continue;
    int32_t node = 0;
    for (char c : text) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
      auto [it, inserted] = trie_edges_.try_emplace(key, static_cast<int32_t>(trie_token_.size()));
      if (inserted) trie_token_.push_back(-1);
      node = it->second;
    }
    if (trie_token_[node] < 0) trie_token_[node] = id;  // duplicate texts: the lowest id stands for all
  }
}

bool SpecialTokenSplitter::Allowed(int32_t token, bool parse_special) const {
  return parse_special || vocab_.type(token) == TokenType::kUserDefined;
}

std::vector<int32_t> SpecialTokenSplitter::OccurringCandidates(std::string_view text, bool parse_special) const {
  std::vector<int32_t> found;
  if (trie_edges_.empty()) return found;
  std::unordered_set<int32_t> seen;
  for (size_t start = 0; start < text.size(); ++start) {
    int32_t node = 0;
    for (size_t pos = start; pos < text.size(); ++pos) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(text[pos]);
      auto it = trie_edges_.find(key);
      if (it == trie_edges_.end()) break;
      node = it->second;
      const int32_t token = trie_token_[node];
      if (token >= 0 && Allowed(token, parse_special) && seen.insert(token).second) found.push_back(token);
    }
  }
  std::sort(found.begin(), found.end());
  std::stable_sort(found.begin(), found.end(),
                   [&](int32_t a, int32_t b) { return vocab_.text(a).size() > vocab_.text(b).size(); });
  return found;
}

std::vector<Fragment> SpecialTokenSplitter::Split(std::string_view text, bool parse_special) const {
  std::vector<Fragment> fragments;
  if (text.empty()) return fragments;
  fragments.push_back({-1, text});
  std::vector<Fragment> next;
  for (int32_t token : OccurringCandidates(text, parse_special)) {
    const std::string_view needle = vocab_.text(token);
    next.clear();
    for (const Fragment& fragment : fragments) {
      if (fragment.token >= 0) {
        next.push_back(fragment);
        continue;
      }
      std::string_view rest = fragment.text;
      for (size_t hit; (hit = rest.find(needle)) != std::string_view::npos;) {
        if (hit > 0) next.push_back({-1, rest.substr(0, hit)});
        next.push_back({token, rest.substr(hit, needle.size())});
        rest.remove_prefix(hit + needle.size());
      }
      if (!rest.empty()) next.push_back({-1, rest});
    }
    fragments.swap(next);
  }
  return fragments;
}

}  // namespace kvsparse::tokenizer_internal
