// Fixed-size pages for the paged KV cache, carved from one virtual-memory reservation.
//
// A PagePool reserves address space for every page its byte budget could ever hold
// (anonymous mmap, MAP_NORESERVE): nothing is resident until a page is first written, so
// resident memory follows the pages actually used. Freed pages go on a LIFO free list and are
// reused first (they are still resident and warm in cache); untouched pages are carved after.
//
// Several pools (one per page size) may share one PageBudget: the budget is a single byte
// counter charged on every allocation, so "bytes in use" is exact across pools while each pool
// keeps its own address range. Each page has a reference count (shared prefixes after Fork).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse {

// The byte budget shared by the pools of one cache.
class PageBudget {
 public:
  explicit PageBudget(size_t limit_bytes) : limit_bytes_(limit_bytes) {}
  PageBudget(const PageBudget&) = delete;
  PageBudget& operator=(const PageBudget&) = delete;

  size_t limit_bytes() const { return limit_bytes_; }
  size_t used_bytes() const { return used_bytes_; }
  size_t peak_bytes() const { return peak_bytes_; }
  size_t available_bytes() const { return limit_bytes_ - used_bytes_; }
  bool CanAfford(size_t bytes) const { return bytes <= available_bytes(); }
  // False (and nothing charged) when bytes exceed what is left.
  bool TryCharge(size_t bytes);
  void Refund(size_t bytes);

 private:
  size_t limit_bytes_;
  size_t used_bytes_ = 0;
  size_t peak_bytes_ = 0;
};

using PageId = uint32_t;

class PagePool {
 public:
  // Reserves room for budget->limit_bytes() / page_bytes pages. page_bytes must be a
  // positive multiple of 64 (pages stay cache-line aligned). `name` appears in error messages.
  static StatusOr<std::unique_ptr<PagePool>> Create(size_t page_bytes, PageBudget* budget, std::string name);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A page with reference count 1 (contents undefined). ResourceExhausted, naming the budget
  // and its usage, when the budget cannot pay for one more page; nothing changes then.
  StatusOr<PageId> Allocate();
  void Retain(PageId id);   // reference count + 1
  // Reference count - 1; returns true when it reached 0 and the page went back to the free list.
  bool Release(PageId id);
  int32_t refcount(PageId id) const;

  uint8_t* data(PageId id);
  const uint8_t* data(PageId id) const;

  // Hands the memory of every free page back to the OS (MADV_DONTNEED); they stay allocatable.
  // Returns the number of pages trimmed.
  int64_t TrimFreePages();

  const std::string& name() const { return name_; }
  size_t page_bytes() const { return page_bytes_; }
  int64_t capacity_pages() const { return capacity_pages_; }  // pages the reservation holds
  int64_t pages_in_use() const { return pages_in_use_; }
  int64_t pages_free() const { return capacity_pages_ - pages_in_use_; }
  int64_t pages_touched() const { return static_cast<int64_t>(refs_.size()); }  // ever carved
  int64_t peak_pages_in_use() const { return peak_pages_in_use_; }
  size_t bytes_in_use() const { return static_cast<size_t>(pages_in_use_) * page_bytes_; }

 private:
  PagePool(size_t page_bytes, PageBudget* budget, std::string name, uint8_t* base, size_t reserved_bytes,
           int64_t capacity_pages);
  void CheckLive(PageId id) const;

  size_t page_bytes_;
  PageBudget* budget_;
  std::string name_;
  uint8_t* base_;           // [capacity_pages, page_bytes] virtual reservation
  size_t reserved_bytes_;
  int64_t capacity_pages_;
  std::vector<int32_t> refs_;       // [pages_touched] reference counts; 0 = free
  std::vector<PageId> free_list_;   // LIFO stack of freed pages
  int64_t pages_in_use_ = 0;
  int64_t peak_pages_in_use_ = 0;
};

}  // namespace kvsparse
