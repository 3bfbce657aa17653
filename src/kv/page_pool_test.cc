#include "kvsparse/page_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

namespace kvsparse {
namespace {

TEST(PagePoolTest, AllocatesUpToTheBudgetThenFailsCleanly) {
  PageBudget budget(10 * 128 + 100);  // room for 10 pages of 128 bytes, not 11
  auto pool_or = PagePool::Create(128, &budget, "test");
  ASSERT_TRUE(pool_or.ok()) << pool_or.status().ToString();
  PagePool& pool = **pool_or;
  EXPECT_EQ(pool.capacity_pages(), 10);
  std::set<PageId> ids;
  for (int i = 0; i < 10; ++i) {
    auto id = pool.Allocate();
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.insert(*id);
    std::memset(pool.data(*id), i + 1, 128);  // pages must not overlap
  }
  EXPECT_EQ(ids.size(), 10u);
  for (PageId id : ids) {
    const uint8_t first = pool.data(id)[0];
    for (int b = 0; b < 128; ++b) ASSERT_EQ(pool.data(id)[b], first);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.data(id)) % 64, 0u);
  }
  EXPECT_EQ(pool.pages_in_use(), 10);
  EXPECT_EQ(pool.pages_free(), 0);
  EXPECT_EQ(pool.bytes_in_use(), 1280u);
  EXPECT_EQ(budget.used_bytes(), 1280u);

  auto more = pool.Allocate();
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(more.status().message().find("1380"), std::string::npos) << more.status().message();  // budget
  EXPECT_NE(more.status().message().find("1280"), std::string::npos) << more.status().message();  // usage
  EXPECT_EQ(pool.pages_in_use(), 10);
  EXPECT_EQ(budget.used_bytes(), 1280u);

  for (PageId id : ids) EXPECT_TRUE(pool.Release(id));
  EXPECT_EQ(pool.pages_in_use(), 0);
  EXPECT_EQ(pool.pages_free(), 10);
  EXPECT_EQ(budget.used_bytes(), 0u);
  EXPECT_EQ(pool.peak_pages_in_use(), 10);
  EXPECT_EQ(budget.peak_bytes(), 1280u);
}

TEST(PagePoolTest, FreedPagesAreReusedLastInFirstOut) {
  PageBudget budget(1 << 20);
  auto pool_or = PagePool::Create(64, &budget, "lifo");
  ASSERT_TRUE(pool_or.ok());
  PagePool& pool = **pool_or;
  std::vector<PageId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(*pool.Allocate());
  EXPECT_EQ(pool.pages_touched(), 5);
  EXPECT_TRUE(pool.Release(ids[1]));
  EXPECT_TRUE(pool.Release(ids[3]));
  EXPECT_EQ(*pool.Allocate(), ids[3]);
  EXPECT_EQ(*pool.Allocate(), ids[1]);
  EXPECT_EQ(pool.pages_touched(), 5);  // no fresh page carved while freed ones remain
  const PageId fresh = *pool.Allocate();
  EXPECT_EQ(pool.pages_touched(), 6);
  EXPECT_EQ(pool.pages_in_use(), 6);
  for (PageId id : ids) pool.Release(id);
  pool.Release(fresh);
  EXPECT_EQ(pool.pages_in_use(), 0);
  EXPECT_EQ(pool.TrimFreePages(), 6);
  // Trimmed pages are still allocatable and writable.
  const PageId again = *pool.Allocate();
  std::memset(pool.data(again), 0x5a, 64);
  EXPECT_EQ(pool.data(again)[63], 0x5a);
  pool.Release(again);
}

TEST(PagePoolTest, ReferenceCountsKeepSharedPagesAlive) {
  PageBudget budget(4096);
  auto pool_or = PagePool::Create(256, &budget, "refs");
  ASSERT_TRUE(pool_or.ok());
  PagePool& pool = **pool_or;
  const PageId id = *pool.Allocate();
  EXPECT_EQ(pool.refcount(id), 1);
  pool.Retain(id);
  pool.Retain(id);
  EXPECT_EQ(pool.refcount(id), 3);
  EXPECT_FALSE(pool.Release(id));
  EXPECT_FALSE(pool.Release(id));
  EXPECT_EQ(pool.pages_in_use(), 1);
  EXPECT_TRUE(pool.Release(id));
  EXPECT_EQ(pool.refcount(id), 0);
  EXPECT_EQ(pool.pages_in_use(), 0);
}

TEST(PagePoolDeathTest, DoubleFreeAborts) {
  PageBudget budget(4096);
  auto pool_or = PagePool::Create(256, &budget, "double");
  ASSERT_TRUE(pool_or.ok());
  PagePool& pool = **pool_or;
  const PageId id = *pool.Allocate();
  EXPECT_TRUE(pool.Release(id));
  EXPECT_DEATH(pool.Release(id), "not allocated");
  EXPECT_DEATH(pool.Retain(id), "not allocated");
  EXPECT_DEATH(pool.Release(12345), "not allocated");
}

TEST(PagePoolTest, PoolsShareOneBudget) {
  PageBudget budget(1024);
  auto big_or = PagePool::Create(512, &budget, "big");
  auto small_or = PagePool::Create(128, &budget, "small");
  ASSERT_TRUE(big_or.ok());
  ASSERT_TRUE(small_or.ok());
  PagePool& big = **big_or;
  PagePool& small = **small_or;
  EXPECT_EQ(big.capacity_pages(), 2);
  EXPECT_EQ(small.capacity_pages(), 8);
  const PageId b = *big.Allocate();
  std::vector<PageId> s;
  for (int i = 0; i < 4; ++i) s.push_back(*small.Allocate());
  EXPECT_EQ(budget.used_bytes(), 1024u);
  EXPECT_EQ(big.Allocate().status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(small.Allocate().status().code(), StatusCode::kResourceExhausted);
  big.Release(b);
  EXPECT_TRUE(small.Allocate().ok());  // the freed big page's bytes pay for a small one
  EXPECT_EQ(budget.used_bytes(), 640u);
}

TEST(PagePoolTest, BadSizesAreInvalidArgument) {
  PageBudget budget(1000);
  EXPECT_EQ(PagePool::Create(0, &budget, "x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::Create(100, &budget, "x").status().code(), StatusCode::kInvalidArgument);  // not 64-aligned
  auto too_big = PagePool::Create(1024, &budget, "x");
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_big.status().message().find("1000"), std::string::npos) << too_big.status().message();
}

}  // namespace
}  // namespace kvsparse
