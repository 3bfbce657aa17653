// Per-(token, KV head) policy state aligned with the live list of one (sequence, layer):
// rows are appended as tokens arrive and compacted with the cache's keep mask.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse::policy {

template <typename T>
class PerTokenHeads {
 public:
  explicit PerTokenHeads(T init) : init_(init) {}

  int32_t size() const { return n_; }
  // 0 until the first observation tells how many KV heads the layer has.
  int heads() const { return heads_; }

  void Append(int32_t n) {
    KVS_CHECK(n >= 0);
    n_ += n;
    if (heads_ > 0) Resize();
  }

  // Fixes the head count; rows appended before that start at the initial value.
  void SetHeads(int n_heads) {
    KVS_CHECK(n_heads > 0);
    if (heads_ == 0) {
      heads_ = n_heads;
      Resize();
    }
    KVS_CHECK_MSG(heads_ == n_heads, "observation changed the number of KV heads of a layer");
  }

  T* row(int32_t token) { return values_.data() + static_cast<size_t>(token) * heads_; }
  const T* row(int32_t token) const { return values_.data() + static_cast<size_t>(token) * heads_; }
  // [size(), heads()] row-major.
  T* data() { return values_.data(); }
  const T* data() const { return values_.data(); }

  size_t bytes() const { return values_.capacity() * sizeof(T); }  // allocated

  void Fill(T value) { std::fill(values_.begin(), values_.end(), value); }

  // Drops the rows whose keep flag is 0, preserving order (as the cache compacts).
  void Compact(const std::vector<uint8_t>& keep) {
    KVS_CHECK_MSG(keep.size() == static_cast<size_t>(n_), "keep mask size differs from the policy's token count");
    int32_t write = 0;
    for (int32_t t = 0; t < n_; ++t) {
      if (!keep[t]) continue;
      if (write != t && heads_ > 0) std::copy(row(t), row(t) + heads_, row(write));
      ++write;
    }
    n_ = write;
    values_.resize(static_cast<size_t>(n_) * heads_);
    // Evicted tokens free their state too once they are a third of the buffer (a prompt chunk
    // after its eviction); a decode step's few tokens keep the capacity.
    if (values_.capacity() > values_.size() + values_.size() / 2 + 1024) values_.shrink_to_fit();
  }

 private:
  // Grows by an eighth rather than the vector's doubling: this state is per (token, head) and
  // can rival the KV pages themselves (SnapKV's vote ring), so slack is memory.
  void Resize() {
    const size_t need = static_cast<size_t>(n_) * heads_;
    if (need > values_.capacity()) values_.reserve(need + need / 8 + 64);
    values_.resize(need, init_);
  }

  T init_;
  int32_t n_ = 0;
  int heads_ = 0;
  std::vector<T> values_;  // [n_, heads_]
};

}  // namespace kvsparse::policy
