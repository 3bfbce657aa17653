// Test helpers for policies: hand-built observations and a stand-in for the cache that
// tracks the live positions, so tests can assert which positions survive.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"

namespace kvsparse::policy_test {

// Owns the arrays an AttentionObservation points into. Each field is [n_heads, n_tokens];
// window_rows is [n_window, n_heads, n_tokens] (empty: one row, `last`).
struct Observation {
  int n_heads = 1;
  int32_t n_tokens = 0;
  int32_t n_queries = 1;
  std::vector<int32_t> query_positions;
  std::vector<float> sum_all, sum_window, last;
  int32_t n_window = 0;
  std::vector<float> window_rows;

  AttentionObservation view() const {
    AttentionObservation obs;
    obs.n_queries = n_queries;
    obs.n_tokens = n_tokens;
    obs.n_kv_heads = n_heads;
    obs.query_positions = query_positions.empty() ? nullptr : query_positions.data();
    obs.sum_all = sum_all.empty() ? nullptr : sum_all.data();
    obs.sum_window = sum_window.empty() ? nullptr : sum_window.data();
    obs.last = last.empty() ? nullptr : last.data();
    if (!window_rows.empty()) {
      obs.n_window = n_window;
      obs.window_rows = window_rows.data();
    } else if (!last.empty()) {
      obs.n_window = 1;
      obs.window_rows = last.data();
    }
    return obs;
  }
};

// Every field set to the same per-token scores, repeated for each head.
inline Observation SameForAllHeads(const std::vector<float>& per_token, int n_heads = 2, int32_t n_queries = 1) {
  Observation o;
  o.n_heads = n_heads;
  o.n_tokens = static_cast<int32_t>(per_token.size());
  o.n_queries = n_queries;
  for (int h = 0; h < n_heads; ++h) {
    o.sum_all.insert(o.sum_all.end(), per_token.begin(), per_token.end());
    o.sum_window.insert(o.sum_window.end(), per_token.begin(), per_token.end());
    o.last.insert(o.last.end(), per_token.begin(), per_token.end());
  }
  return o;
}

// Every field set from per-head rows: per_head[h][t].
inline Observation PerHead(const std::vector<std::vector<float>>& per_head, int32_t n_queries = 1) {
  Observation o;
  o.n_heads = static_cast<int>(per_head.size());
  o.n_tokens = static_cast<int32_t>(per_head[0].size());
  o.n_queries = n_queries;
  for (const auto& row : per_head) {
    o.sum_all.insert(o.sum_all.end(), row.begin(), row.end());
    o.sum_window.insert(o.sum_window.end(), row.begin(), row.end());
    o.last.insert(o.last.end(), row.begin(), row.end());
  }
  return o;
}

inline LayerKvConfig Layer(KvMethod method, KvBudget budget) {
  LayerKvConfig config;
  config.method = method;
  config.budget = budget;
  config.params = DefaultMethodParams(method);
  return config;
}

// One (sequence, layer) driven like the engine does, with the cache reduced to the list
// of live positions.
class Harness {
 public:
  explicit Harness(const LayerKvConfig& config, int layer = 0, int n_layers = 1, uint64_t seed = 1) {
    auto created = CreatePolicy(config, layer, n_layers, seed);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    policy_ = std::move(created).value();
  }

  KvPolicy& policy() { return *policy_; }
  const std::vector<int32_t>& live() const { return live_; }
  int32_t n_live() const { return static_cast<int32_t>(live_.size()); }

  // Appends n tokens at the next positions.
  void Append(int32_t n) {
    for (int32_t i = 0; i < n; ++i) live_.push_back(next_position_++);
    policy_->OnAppend(n);
  }
  void Observe(const Observation& o) { policy_->Observe(o.view()); }

  // Selects `target` tokens, checks the mask, applies it, and returns the kept positions.
  std::vector<int32_t> Evict(int32_t target, bool in_prefill = false, const KvSpan* spans = nullptr,
                             int32_t n_spans = 0, KvStorage storage = KvStorage::kF32, int n_kv_heads = 0,
                             int head_dim = 0) {
    SelectionContext ctx;
    ctx.n_live = n_live();
    ctx.target = target;
    ctx.positions = live_.data();
    ctx.current_position = live_.empty() ? 0 : live_.back();
    ctx.in_prefill = in_prefill;
    ctx.spans = spans;
    ctx.n_spans = n_spans;
    ctx.storage = storage;
    ctx.n_kv_heads = n_kv_heads;
    ctx.head_dim = head_dim;
    policy_->SelectKeep(ctx, &keep_);
    EXPECT_EQ(keep_.size(), live_.size());
    EXPECT_EQ(std::accumulate(keep_.begin(), keep_.end(), 0), target);
    std::vector<int32_t> kept;
    for (size_t i = 0; i < live_.size(); ++i)
      if (keep_[i]) kept.push_back(live_[i]);
    live_ = kept;
    policy_->OnEvict(keep_);
    return kept;
  }

 private:
  std::unique_ptr<KvPolicy> policy_;
  std::vector<int32_t> live_;
  int32_t next_position_ = 0;
  std::vector<uint8_t> keep_;
};

using Positions = std::vector<int32_t>;

}  // namespace kvsparse::policy_test
