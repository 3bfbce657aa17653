#include "kvsparse/prefix_cache.h"

#include <algorithm>

#include "kvsparse/status.h"

namespace kvsparse {

namespace {

// splitmix64's finalizer: every input bit reaches every output bit.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t HashTokens(uint64_t seed, std::span<const int32_t> tokens) {
  uint64_t h = Mix(seed);
  for (int32_t t : tokens) h = Mix(h ^ static_cast<uint32_t>(t));
  return h;
}

int32_t CommonPrefix(std::span<const int32_t> a, std::span<const int32_t> b, int32_t limit) {
  const int32_t n = std::min<int32_t>({limit, static_cast<int32_t>(a.size()), static_cast<int32_t>(b.size())});
  int32_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

PrefixCache::PrefixCache(int32_t page_size, int max_entries) : page_size_(page_size), max_entries_(max_entries) {
  KVS_CHECK(page_size >= 1 && max_entries >= 0);
}

std::vector<uint64_t> PrefixCache::PageHashes(uint64_t key, std::span<const int32_t> tokens, size_t n_pages) const {
  std::vector<uint64_t> hashes(n_pages);
  uint64_t h = key;
  for (size_t p = 0; p < n_pages; ++p) {
    h = HashTokens(h, tokens.subspan(p * static_cast<size_t>(page_size_), static_cast<size_t>(page_size_)));
    hashes[p] = h;
  }
  return hashes;
}

uint64_t PrefixCache::WholeHash(uint64_t key, std::span<const int32_t> tokens) {
  return HashTokens(Mix(key ^ 0x77686f6c65ull), tokens);  // apart from the page hashes
}

void PrefixCache::Index(size_t slot) {
  const Entry& e = entries_[slot];
  if (e.whole_only) {
    whole_index_.emplace(WholeHash(e.key, e.tokens), slot);
    return;
  }
  for (uint64_t h : PageHashes(e.key, e.tokens, e.tokens.size() / static_cast<size_t>(page_size_))) {
    page_index_.emplace(h, slot);
  }
}

void PrefixCache::Unindex(size_t slot) {
  const Entry& e = entries_[slot];
  auto erase = [slot](std::unordered_multimap<uint64_t, size_t>& index, uint64_t h) {
    auto [it, end] = index.equal_range(h);
    for (; it != end; ++it) {
      if (it->second == slot) {
        index.erase(it);
        return;
      }
    }
    KVS_CHECK_MSG(false, "prefix cache: an entry's hash is missing from the index");
  };
  if (e.whole_only) {
    erase(whole_index_, WholeHash(e.key, e.tokens));
    return;
  }
  for (uint64_t h : PageHashes(e.key, e.tokens, e.tokens.size() / static_cast<size_t>(page_size_))) {
    erase(page_index_, h);
  }
}

int PrefixCache::Remove(size_t slot) {
  KVS_CHECK(slot < entries_.size());
  const int seq = entries_[slot].seq;
  Unindex(slot);
  const size_t last = entries_.size() - 1;
  if (slot != last) {  // the last entry takes the freed slot
    Unindex(last);
    entries_[slot] = std::move(entries_[last]);
    entries_.pop_back();
    Index(slot);
  } else {
    entries_.pop_back();
  }
  return seq;
}

PrefixCache::Match PrefixCache::Find(uint64_t key, std::span<const int32_t> tokens, int32_t limit) const {
  limit = std::min<int32_t>(limit, static_cast<int32_t>(tokens.size()));
  if (limit < page_size_ || page_index_.empty()) return {};
  const std::vector<uint64_t> hashes = PageHashes(key, tokens, static_cast<size_t>(limit / page_size_));
  // The chain covers every page before it: the last page that has an entry is the longest match.
  size_t matched = 0;
  while (matched < hashes.size() && page_index_.count(hashes[matched]) > 0) ++matched;
  Match best;
  for (size_t back = matched; back > 0 && best.entry == nullptr; --back) {  // a collision: try shorter
    auto [it, end] = page_index_.equal_range(hashes[back - 1]);
    for (; it != end; ++it) {
      const Entry& e = entries_[it->second];
      if (e.key != key) continue;
      const int32_t common = CommonPrefix(tokens, e.tokens, limit);
      if (common >= page_size_ && common > best.common) best = Match{&e, common};
    }
  }
  return best;
}

const PrefixCache::Entry* PrefixCache::FindExact(uint64_t key, std::span<const int32_t> tokens) const {
  auto [it, end] = whole_index_.equal_range(WholeHash(key, tokens));
  for (; it != end; ++it) {
    const Entry& e = entries_[it->second];
    if (e.key == key && std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end())) return &e;
  }
  return nullptr;
}

std::vector<int> PrefixCache::Insert(int seq, uint64_t key, std::vector<int32_t> tokens, bool whole_only,
                                     uint64_t tick) {
  if (max_entries_ == 0 || tokens.empty() || (!whole_only && static_cast<int32_t>(tokens.size()) < page_size_)) {
    return {seq};
  }
  std::vector<int> release;
  if (whole_only) {
    if (const Entry* same = FindExact(key, tokens)) {
      Touch(same, tick);
      return {seq};
    }
  } else {
    const Match m = Find(key, tokens, static_cast<int32_t>(tokens.size()));
    if (m.entry != nullptr && m.common == static_cast<int32_t>(tokens.size())) {
      Touch(m.entry, tick);  // an entry already holds all of it
      return {seq};
    }
    if (m.entry != nullptr && m.common == static_cast<int32_t>(m.entry->tokens.size())) {
      release.push_back(Remove(static_cast<size_t>(m.entry - entries_.data())));  // the new one covers it
    }
  }
  entries_.push_back(Entry{seq, key, std::move(tokens), whole_only, tick});
  Index(entries_.size() - 1);
  while (entries_.size() > static_cast<size_t>(max_entries_)) release.push_back(EvictLeastRecentlyUsed());
  return release;
}

void PrefixCache::Touch(const Entry* entry, uint64_t tick) {
  KVS_CHECK(entry >= entries_.data() && entry < entries_.data() + entries_.size());
  entries_[static_cast<size_t>(entry - entries_.data())].last_used = tick;
}

int PrefixCache::EvictLeastRecentlyUsed(int keep_seq) {
  size_t victim = entries_.size();
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].seq == keep_seq) continue;
    if (victim == entries_.size() || entries_[i].last_used < entries_[victim].last_used) victim = i;
  }
  return victim == entries_.size() ? -1 : Remove(victim);
}

std::vector<int> PrefixCache::Clear() {
  std::vector<int> seqs = Sequences();
  entries_.clear();
  page_index_.clear();
  whole_index_.clear();
  return seqs;
}

std::vector<int> PrefixCache::Sequences() const {
  std::vector<int> seqs;
  for (const Entry& e : entries_) seqs.push_back(e.seq);
  return seqs;
}

}  // namespace kvsparse
