// AdaKV — Y. Feng, J. Lv, Y. Cao, X. Xie, S. K. Zhou, "Ada-KV: Optimizing KV Cache Eviction by
// Adaptive Budget Allocation for Efficient LLM Inference", arXiv:2407.11550 (NeurIPS 2025).
//
// A per-head layer's budget B per KV head becomes H·B for the layer, split by the heads' own
// scores: heads whose attention spreads get more than B, heads that concentrate it less. Each
// head keeps what its method protects (the newest token, sinks, the recent or observation
// window, as a selection keeping B would); its uniform share of scored tokens is
// B_h = B - protected. Then, by the rule (AdaptiveSplit):
// - reference (AdaKV's adaptive_snapkv/monkeypatch/snapkv_utils.py, the default): c_h = how many
//   of head h's scored tokens are in the unconstrained top-(sum B_h) over every head; head h keeps
//   its best round((1 - alpha) c_h + floor(alpha B_h)) (round half to even, as torch.round),
//   alpha 0.2 (AdaKV's LongBench scripts). The reference lets the roundings (and floor(alpha B))
//   miss the layer's budget by a few tokens either way; here the layer keeps exactly min(H·B,
//   its scored tokens): an excess is given back one token at a time by the largest capacities,
//   a shortfall (or a head with fewer scored tokens than its capacity, possible once decode
//   evictions make the heads' lengths differ) goes to the best remaining tokens of all heads.
//   At AdaKV's budgets (128 and more per head) that moves at most a token or two per head.
// - kvpress (NVIDIA kvpress's AdaKV press): each head's best floor·B_h first (the safeguard;
//   "floor", default 0.5), then the best of every head's remaining tokens together fill H·B.
// Scores are the wrapped method's (H2O's accumulated attention, SnapKV/PyramidKV's pooled votes:
// each head's attention sums to 1 per query, so they compare across heads). The controller evicts
// each head's table with its mask (really freeing its pages) and tells each head's policy (OnEvict).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"

namespace kvsparse::policy {

struct HeadTokens {
  int32_t n_live = 0;
  SelectionScoring scoring;  // the head's scores and protected tokens for a target of min(B, n_live)
};

struct AdaptiveSplit {
  AdaptiveRule rule = AdaptiveRule::kReference;
  double alpha = 0.2;  // reference: the guaranteed share of B_h
  double floor = 0.5;  // kvpress: the guaranteed share of B_h
};

// keeps[h] ([heads[h].n_live]): the tokens head h keeps, min(H·budget, Σ n_live) in all, each
// head at least its protected tokens and (where it has them) its guaranteed share.
// Ties: the higher score, then the newer token, then the lower head.
void AdaptiveHeadKeep(std::span<const HeadTokens> heads, int32_t budget_per_head, const AdaptiveSplit& split,
                      std::vector<std::vector<uint8_t>>* keeps);

}  // namespace kvsparse::policy
