// CumulativeRanking: see cumulative_ranking.h.
#include "policy/cumulative_ranking.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include "kvsparse/status.h"

namespace kvsparse::policy {
namespace {

// 1/g beyond which S~ and the keys are rescaled (floats hold up to ~3e38).
constexpr double kMaxInvScale = 1e18;
constexpr auto kMinHeap = std::greater<>();

}  // namespace

CumulativeRanking::CumulativeRanking(std::vector<Layer> layers, double decay, int32_t rerank_period,
                                     CumulativeMode mode)
    : layers_(std::move(layers)),
      decay_(decay),
      rerank_period_(rerank_period),
      mode_(mode),
      depth_count_(layers_.size() + 1, 0),
      heaps_(layers_.size()) {
  KVS_CHECK(!layers_.empty() && layers_.size() < 32768 && decay_ > 0.0 && decay_ <= 1.0 && rerank_period_ >= 1);
}

void CumulativeRanking::Append(int32_t n_new) {
  KVS_CHECK(n_new >= 0);
  // A due re-rank runs first, on the scores of every step so far (new tokens have none yet).
  if (since_rerank_ >= rerank_period_) Rerank();
  inv_scale_ /= std::pow(decay_, n_new);
  if (inv_scale_ > kMaxInvScale) {
    // S~ = S / g: bring g back to 1 (a positive factor keeps every heap's order).
    const float factor = static_cast<float>(1.0 / inv_scale_);
    for (float& s : scaled_score_) s *= factor;
    for (std::vector<Entry>& heap : heaps_)
      for (Entry& e : heap) e.first *= factor;
    inv_scale_ = 1.0;
  }
  const int full = n_layers();
  for (int32_t i = 0; i < n_new; ++i) {
    pending_.push_back(n_ids());
    scaled_score_.push_back(0.f);
    depth_.push_back(static_cast<int16_t>(full));
  }
  depth_count_[static_cast<size_t>(full)] += n_new;
  n_present_ += n_new;
  since_rerank_ += n_new;
}

void CumulativeRanking::AddAttention(int layer, const int32_t* ids, const float* mass, int32_t n) {
  const float scale = static_cast<float>(layers_[static_cast<size_t>(layer)].weight * inv_scale_);
  for (int32_t i = 0; i < n; ++i) scaled_score_[static_cast<size_t>(ids[i])] += scale * mass[i];
}

int32_t CumulativeRanking::HeldBy(int layer) const {
  int32_t held = 0;
  for (int d = std::max(layer + 1, 0); d <= n_layers(); ++d) held += depth_count_[static_cast<size_t>(d)];
  return held;
}

void CumulativeRanking::SetDepth(int32_t id, int depth) {
  int16_t& d = depth_[static_cast<size_t>(id)];
  if (d >= 0) --depth_count_[static_cast<size_t>(d)];
  if (depth >= 0) ++depth_count_[static_cast<size_t>(depth)];
  d = static_cast<int16_t>(depth);
}

void CumulativeRanking::Push(int heap, Entry entry) {
  std::vector<Entry>& h = heaps_[static_cast<size_t>(heap)];
  h.push_back(entry);
  std::push_heap(h.begin(), h.end(), kMinHeap);
}

void CumulativeRanking::FlushPending() {
  for (int32_t id : pending_) {
    const int depth = depth_[static_cast<size_t>(id)];
    for (int c = 0; c < depth; ++c) Push(c, {scaled_score_[static_cast<size_t>(id)], id});
  }
  pending_.clear();
}

int32_t CumulativeRanking::Trim(int layer, int32_t target) {
  KVS_CHECK(layer >= 0 && layer < n_layers() && target >= 1);
  FlushPending();
  int32_t held = HeldBy(layer);
  std::vector<Entry>& heap = heaps_[static_cast<size_t>(layer)];
  const int32_t newest = n_ids() - 1;
  bool newest_popped = false;
  Entry newest_entry;
  int32_t dropped = 0;
  while (held > target && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), kMinHeap);
    const Entry e = heap.back();
    heap.pop_back();
    if (depth_[static_cast<size_t>(e.second)] <= layer) continue;  // stale: a shallower layer dropped it, or removed
    if (e.second == newest) {
      newest_popped = true;
      newest_entry = e;
      continue;
    }
    SetDepth(e.second, layer);
    ++dropped;
    --held;
  }
  if (newest_popped) Push(layer, newest_entry);
  return dropped;
}

std::optional<float> CumulativeRanking::LowestKey(int layer) {
  KVS_CHECK(layer >= 0 && layer < n_layers());
  FlushPending();
  std::vector<Entry>& heap = heaps_[static_cast<size_t>(layer)];
  const auto drop_stale = [&] {
    while (!heap.empty() && depth_[static_cast<size_t>(heap.front().second)] <= layer) {
      std::pop_heap(heap.begin(), heap.end(), kMinHeap);
      heap.pop_back();
    }
  };
  drop_stale();
  if (heap.empty()) return std::nullopt;
  if (heap.front().second != n_ids() - 1) return heap.front().first;
  // The newest token is never dropped: look under it.
  std::pop_heap(heap.begin(), heap.end(), kMinHeap);
  const Entry newest = heap.back();
  heap.pop_back();
  drop_stale();
  const std::optional<float> key = heap.empty() ? std::nullopt : std::optional<float>(heap.front().first);
  Push(layer, newest);
  return key;
}

void CumulativeRanking::Remove(int32_t id) {
  if (depth_[static_cast<size_t>(id)] < 0) return;
  SetDepth(id, -1);
  --n_present_;
}

void CumulativeRanking::Rerank() {
  const auto t0 = std::chrono::steady_clock::now();
  pending_.clear();
  for (std::vector<Entry>& heap : heaps_) heap.clear();
  const int32_t n = n_ids();
  if (mode_ == CumulativeMode::kMask) {
    // Every present token by score, best first (ties: the newer first); depth from the rank, so
    // the layers' sets are nested prefixes of one order. A layer keeps at most what a shallower
    // one keeps (prefix minimum of the budgets), and the newest token stays everywhere.
    order_.clear();
    for (int32_t id = 0; id < n; ++id)
      if (depth_[static_cast<size_t>(id)] >= 0) order_.push_back(id);
    std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
      const float sa = scaled_score_[static_cast<size_t>(a)], sb = scaled_score_[static_cast<size_t>(b)];
      return sa != sb ? sa > sb : a > b;
    });
    std::vector<int32_t> keep_count(layers_.size());
    int32_t shallower = n_present_;
    for (int c = 0; c < n_layers(); ++c) {
      shallower = std::min(shallower, ResolveBudget(layers_[static_cast<size_t>(c)].budget, n_present_));
      keep_count[static_cast<size_t>(c)] = shallower;
    }
    for (size_t rank = 0; rank < order_.size(); ++rank) {
      const int32_t id = order_[rank];
      int depth = 0;
      while (depth < n_layers() && static_cast<int32_t>(rank) < keep_count[static_cast<size_t>(depth)]) ++depth;
      if (id == n - 1) depth = n_layers();
      SetDepth(id, depth);
    }
  }
  for (int32_t id = 0; id < n; ++id) {
    const int depth = depth_[static_cast<size_t>(id)];
    for (int c = 0; c < depth; ++c) heaps_[static_cast<size_t>(c)].push_back({scaled_score_[static_cast<size_t>(id)], id});
  }
  for (std::vector<Entry>& heap : heaps_) std::make_heap(heap.begin(), heap.end(), kMinHeap);
  since_rerank_ = 0;
  ++reranks_;
  rerank_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::pair<int64_t, double> CumulativeRanking::TakeRerankWork() {
  const std::pair<int64_t, double> work{reranks_, rerank_s_};
  reranks_ = 0;
  rerank_s_ = 0;
  return work;
}

size_t CumulativeRanking::bytes() const {
  size_t heap_entries = 0;
  for (const std::vector<Entry>& heap : heaps_) heap_entries += heap.capacity();
  return scaled_score_.capacity() * sizeof(float) + depth_.capacity() * sizeof(int16_t) +
         (depth_count_.capacity() + pending_.capacity() + order_.capacity()) * sizeof(int32_t) +
         heap_entries * sizeof(Entry) + layers_.capacity() * sizeof(Layer);
}

}  // namespace kvsparse::policy
