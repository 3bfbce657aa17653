// AdaKV — Y. Feng, J. Lv, Y. Cao, X. Xie, S. K. Zhou, "Ada-KV: Optimizing KV Cache Eviction by
// Adaptive Budget Allocation for Efficient LLM Inference", arXiv:2407.11550 (NeurIPS 2025).
//
// A per-head layer's budget B per KV head becomes H·B for the layer, split by the heads' own
// scores: heads whose attention spreads get more than B, heads that concentrate it less. Each
// head keeps what its method protects (the newest token, sinks, the recent or observation
// window, as a selection keeping B would), then at least floor·(B - protected) of its best
// scored tokens (the safeguard; "floor", default 0.5), then the best of every head's remaining
// tokens together fill the layer's H·B. Scores are the wrapped method's (H2O's accumulated
// attention, SnapKV/PyramidKV's pooled votes: each head's attention sums to 1 per query, so they
// compare across heads). The controller evicts each head's table with its mask (really freeing
// its pages) and tells each head's policy (OnEvict).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvsparse/kv_policy.h"

namespace kvsparse::policy {

struct HeadTokens {
  int32_t n_live = 0;
  SelectionScoring scoring;  // the head's scores and protected tokens for a target of min(B, n_live)
};

// keeps[h] ([heads[h].n_live]): the tokens head h keeps; min(H·budget, Σ n_live) in all, each
// head at least its protected tokens and its floor.
// Ties: the higher score, then the newer token, then the lower head.
void AdaptiveHeadKeep(std::span<const HeadTokens> heads, int32_t budget_per_head, double floor,
                      std::vector<std::vector<uint8_t>>* keeps);

}  // namespace kvsparse::policy
