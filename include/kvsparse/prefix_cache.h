// The scheduler's cache of finished sequences, for later prompts that start like them (vLLM's
// automatic prefix caching, kept per sequence): each kept sequence's tokens are indexed page by
// page under a hash of the page's tokens and of everything before it, seeded with a key for the
// configuration whose pages these are (dense: the layers' storage types; a compressed context: the
// layers' methods, budgets and types). A prompt finds its longest cached prefix by walking its own
// page hashes; the match is then checked token by token (a hash collision only shortens it) and
// extended into the next page. Compressed contexts are found only whole (FindExact): a sparse
// table chose its tokens with all of its context in view.
//
// The cache owns sequence ids of the controller but never touches the controller: the scheduler
// releases what Insert and EvictLeastRecentlyUsed hand back. Not thread-safe (the step's thread).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace kvsparse {

class PrefixCache {
 public:
  struct Entry {
    int seq = -1;
    uint64_t key = 0;
    std::vector<int32_t> tokens;  // the sequence holds their KV at positions 0 .. size - 1
    bool whole_only = false;      // a compressed context: only FindExact returns it
    uint64_t last_used = 0;       // the scheduler's tick at insertion or the last hit
  };
  struct Match {
    const Entry* entry = nullptr;
    int32_t common = 0;  // leading tokens the prompt shares with entry->tokens
  };

  // max_entries: sequences kept at most (the least recently used goes first); 0 keeps none.
  PrefixCache(int32_t page_size, int max_entries);

  // The entry of `key` sharing the longest prefix (at most `limit` tokens, and a whole page or
  // more) with `tokens`; common 0 when none.
  Match Find(uint64_t key, std::span<const int32_t> tokens, int32_t limit) const;
  // The whole-only entry of `key` whose tokens are exactly `tokens`, or nullptr.
  const Entry* FindExact(uint64_t key, std::span<const int32_t> tokens) const;
  // Keeps seq, whose KV holds `tokens` (at least a page; whole_only entries any length). Returns
  // the sequence ids the caller must release: seq itself when an entry already covers it (or the
  // cache keeps nothing), entries the new one covers, and the least recently used beyond
  // max_entries.
  std::vector<int> Insert(int seq, uint64_t key, std::vector<int32_t> tokens, bool whole_only, uint64_t tick);
  void Touch(const Entry* entry, uint64_t tick);
  // Drops the least recently used entry, except the one of sequence `keep_seq` (a request is
  // about to use it); returns its sequence id, -1 when there is none to drop. Entry pointers from
  // Find do not survive an Insert, an eviction or Clear.
  int EvictLeastRecentlyUsed(int keep_seq = -1);
  // Drops every entry; returns their sequence ids.
  std::vector<int> Clear();

  size_t size() const { return entries_.size(); }
  std::vector<int> Sequences() const;
  int32_t page_size() const { return page_size_; }

 private:
  // Hash of page p of `tokens` chained over pages 0 .. p - 1 and the key: hashes[p].
  std::vector<uint64_t> PageHashes(uint64_t key, std::span<const int32_t> tokens, size_t n_pages) const;
  static uint64_t WholeHash(uint64_t key, std::span<const int32_t> tokens);
  void Index(size_t slot);
  void Unindex(size_t slot);
  int Remove(size_t slot);  // returns its seq

  int32_t page_size_;
  int max_entries_;
  std::vector<Entry> entries_;
  std::unordered_multimap<uint64_t, size_t> page_index_;   // page hash -> slot in entries_
  std::unordered_multimap<uint64_t, size_t> whole_index_;  // whole-only entries: hash of all tokens
};

}  // namespace kvsparse
