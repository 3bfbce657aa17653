#include "kvsparse/prefix_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace kvsparse {
namespace {

constexpr int32_t kPage = 4;

std::vector<int32_t> Tokens(int n, int32_t first = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(PrefixCache, FindsTheLongestCachedPrefixAndExtendsIntoThePartialPage) {
  PrefixCache cache(kPage, 8);
  EXPECT_EQ(cache.Insert(1, 7, Tokens(10), false, 1), std::vector<int>{});
  std::vector<int32_t> other = Tokens(6);
  other.push_back(5);  // shares 6 tokens with the first
  other.push_back(6);
  other.push_back(7);
  EXPECT_EQ(cache.Insert(2, 7, other, false, 2), std::vector<int>{});

  std::vector<int32_t> prompt = Tokens(12);
  PrefixCache::Match m = cache.Find(7, prompt, 100);
  ASSERT_NE(m.entry, nullptr);
  EXPECT_EQ(m.entry->seq, 1);
  EXPECT_EQ(m.common, 10) << "two whole pages by hash, then two tokens of the third page";
  EXPECT_EQ(cache.Find(7, prompt, 9).common, 9) << "the limit (the prompt's last token is computed)";
  EXPECT_EQ(cache.Find(8, prompt, 100).entry, nullptr) << "another configuration's pages";
  EXPECT_EQ(cache.Find(7, Tokens(12, 101), 100).entry, nullptr) << "no common first page";
  prompt[2] = 0;
  EXPECT_EQ(cache.Find(7, prompt, 100).entry, nullptr) << "less than a page in common";
  std::vector<int32_t> branch = other;
  branch.push_back(9);
  m = cache.Find(7, branch, 100);
  ASSERT_NE(m.entry, nullptr);
  EXPECT_EQ(m.entry->seq, 2);
  EXPECT_EQ(m.common, 9);
}

TEST(PrefixCache, InsertKeepsOneEntryPerPrefix) {
  PrefixCache cache(kPage, 8);
  EXPECT_EQ(cache.Insert(1, 0, Tokens(8), false, 1), std::vector<int>{});
  EXPECT_EQ(cache.Insert(2, 0, Tokens(6), false, 2), std::vector<int>{2}) << "covered: the new one goes back";
  EXPECT_EQ(cache.Insert(3, 0, Tokens(13), false, 3), std::vector<int>{1}) << "it covers the old one";
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.Insert(4, 0, Tokens(3), false, 4), std::vector<int>{4}) << "under a page";
  PrefixCache off(kPage, 0);
  EXPECT_EQ(off.Insert(5, 0, Tokens(8), false, 1), std::vector<int>{5});
}

TEST(PrefixCache, EvictsTheLeastRecentlyUsed) {
  PrefixCache cache(kPage, 3);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(cache.Insert(i, 0, Tokens(8, 1000 * (i + 1)), false, i).empty());
  cache.Touch(cache.Find(0, Tokens(8, 1000), 8).entry, 10);  // entry 0 used last
  EXPECT_EQ(cache.Insert(3, 0, Tokens(8, 9000), false, 11), std::vector<int>{1});
  const PrefixCache::Entry* keep = cache.Find(0, Tokens(8, 3000), 8).entry;
  ASSERT_NE(keep, nullptr);
  EXPECT_EQ(cache.EvictLeastRecentlyUsed(keep->seq), 0) << "entry 2 (tick 2) is kept for the caller";
  EXPECT_NE(cache.Find(0, Tokens(8, 3000), 8).entry, nullptr);
  std::vector<int> rest = cache.Clear();
  std::sort(rest.begin(), rest.end());
  EXPECT_EQ(rest, (std::vector<int>{2, 3}));
  EXPECT_EQ(cache.EvictLeastRecentlyUsed(), -1);
}

TEST(PrefixCache, CompressedContextsAreFoundOnlyWhole) {
  PrefixCache cache(kPage, 8);
  EXPECT_TRUE(cache.Insert(1, 5, Tokens(9), /*whole_only=*/true, 1).empty());
  EXPECT_EQ(cache.Find(5, Tokens(20), 100).entry, nullptr) << "a compressed context is no dense prefix";
  const PrefixCache::Entry* e = cache.FindExact(5, Tokens(9));
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->seq, 1);
  EXPECT_EQ(cache.FindExact(5, Tokens(8)), nullptr);
  EXPECT_EQ(cache.FindExact(6, Tokens(9)), nullptr);
  EXPECT_EQ(cache.Insert(2, 5, Tokens(9), true, 2), std::vector<int>{2}) << "already kept";
  EXPECT_TRUE(cache.Insert(3, 5, Tokens(2), true, 3).empty()) << "any length";
}

}  // namespace
}  // namespace kvsparse
