#include "kvsparse/page_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

namespace kvsparse {

bool PageBudget::TryCharge(size_t bytes) {
  if (!CanAfford(bytes)) return false;
  used_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, used_bytes_);
  return true;
}

void PageBudget::Refund(size_t bytes) {
  KVS_CHECK_MSG(bytes <= used_bytes_, "page budget refund of " + std::to_string(bytes) + " bytes exceeds the " +
                                          std::to_string(used_bytes_) + " bytes in use");
  used_bytes_ -= bytes;
}

StatusOr<std::unique_ptr<PagePool>> PagePool::Create(size_t page_bytes, PageBudget* budget, std::string name) {
  KVS_CHECK(budget != nullptr);
  if (page_bytes == 0 || page_bytes % 64 != 0) {
    return InvalidArgumentError("page pool '" + name + "': page size " + std::to_string(page_bytes) +
                                " bytes must be a positive multiple of 64");
  }
  const int64_t capacity_pages = static_cast<int64_t>(budget->limit_bytes() / page_bytes);
  if (capacity_pages < 1) {
    return InvalidArgumentError("page pool '" + name + "': budget of " + std::to_string(budget->limit_bytes()) +
                                " bytes is smaller than one page (" + std::to_string(page_bytes) +
                                " bytes); raise the KV budget");
  }
  if (capacity_pages > static_cast<int64_t>(UINT32_MAX)) {
    return InvalidArgumentError("page pool '" + name + "': budget of " + std::to_string(budget->limit_bytes()) +
                                " bytes holds more than 2^32 pages of " + std::to_string(page_bytes) + " bytes");
  }
  const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t used = static_cast<size_t>(capacity_pages) * page_bytes;
  const size_t reserved = (used + os_page - 1) / os_page * os_page;
  void* base = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return ResourceExhaustedError("page pool '" + name + "': cannot reserve " + std::to_string(reserved) +
                                  " bytes of address space for the KV budget: " + std::strerror(errno));
  }
  return std::unique_ptr<PagePool>(new PagePool(page_bytes, budget, std::move(name), static_cast<uint8_t*>(base),
                                                reserved, capacity_pages));
}

PagePool::PagePool(size_t page_bytes, PageBudget* budget, std::string name, uint8_t* base, size_t reserved_bytes,
                   int64_t capacity_pages)
    : page_bytes_(page_bytes),
      budget_(budget),
      name_(std::move(name)),
      base_(base),
      reserved_bytes_(reserved_bytes),
      capacity_pages_(capacity_pages) {}

PagePool::~PagePool() {
  // Pages still in use go back to the shared budget, which may outlive this pool.
  budget_->Refund(bytes_in_use());
  munmap(base_, reserved_bytes_);
}

StatusOr<PageId> PagePool::Allocate() {
  const bool room = !free_list_.empty() || pages_touched() < capacity_pages_;
  if (!room || !budget_->TryCharge(page_bytes_)) {
    return ResourceExhaustedError(
        "KV page budget exhausted: pool '" + name_ + "' needs one more page of " + std::to_string(page_bytes_) +
        " bytes, but the budget of " + std::to_string(budget_->limit_bytes()) + " bytes has " +
        std::to_string(budget_->used_bytes()) + " in use (this pool: " + std::to_string(pages_in_use_) + " of " +
        std::to_string(capacity_pages_) + " pages); raise the KV budget or evict tokens");
  }
  PageId id;
  if (!free_list_.empty()) {
    id = free_list_.back();
    free_list_.pop_back();
  } else {
    id = static_cast<PageId>(refs_.size());
    refs_.push_back(0);
  }
  KVS_CHECK(refs_[id] == 0);
  refs_[id] = 1;
  ++pages_in_use_;
  peak_pages_in_use_ = std::max(peak_pages_in_use_, pages_in_use_);
  return id;
}

void PagePool::CheckLive(PageId id) const {
  KVS_CHECK_MSG(id < refs_.size() && refs_[id] > 0,
                "page pool '" + name_ + "': page " + std::to_string(id) + " is not allocated");
}

void PagePool::Retain(PageId id) {
  CheckLive(id);
  ++refs_[id];
}

bool PagePool::Release(PageId id) {
  CheckLive(id);  // a second release of a freed page (double free) aborts here
  if (--refs_[id] > 0) return false;
  free_list_.push_back(id);
  --pages_in_use_;
  budget_->Refund(page_bytes_);
  return true;
}

int32_t PagePool::refcount(PageId id) const {
  KVS_CHECK(id < refs_.size());
  return refs_[id];
}

uint8_t* PagePool::data(PageId id) {
  KVS_CHECK(id < refs_.size());
  return base_ + static_cast<size_t>(id) * page_bytes_;
}

const uint8_t* PagePool::data(PageId id) const { return const_cast<PagePool*>(this)->data(id); }

int64_t PagePool::TrimFreePages() {
  const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (PageId id : free_list_) {
    // Only whole OS pages inside this KV page can be dropped; neighbours may be in use.
    const uintptr_t begin = reinterpret_cast<uintptr_t>(base_) + static_cast<size_t>(id) * page_bytes_;
    const uintptr_t first = (begin + os_page - 1) / os_page * os_page;
    const uintptr_t last = (begin + page_bytes_) / os_page * os_page;
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
  return static_cast<int64_t>(free_list_.size());
}

}  // namespace kvsparse
