// AdaKV's allocation: see adakv.h.
#include "policy/adakv.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsparse/status.h"

namespace kvsparse::policy {
namespace {

float Key(float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; }

struct Candidate {
  float score;
  int32_t token;
  int head;
};

// Higher score, then the newer token, then the lower head.
bool Better(const Candidate& a, const Candidate& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.token != b.token) return a.token > b.token;
  return a.head < b.head;
}

}  // namespace

void AdaptiveHeadKeep(std::span<const HeadTokens> heads, int32_t budget_per_head, const AdaptiveSplit& split,
                      std::vector<std::vector<uint8_t>>* keeps) {
  KVS_CHECK(budget_per_head >= 1 && split.floor >= 0.0 && split.floor <= 1.0 && split.alpha >= 0.0 &&
            split.alpha <= 1.0);
  const bool reference = split.rule == AdaptiveRule::kReference;
  keeps->resize(heads.size());
  int64_t pool_budget = 0;  // kvpress: the layer's budget left after protected tokens and floors
  std::vector<Candidate> rest;  // kvpress: candidates beyond each head's floor; reference: all of them
  std::vector<int32_t> shares(heads.size(), 0);  // B_h, each head's uniform share of scored tokens
  std::vector<Candidate> head_candidates;
  for (size_t h = 0; h < heads.size(); ++h) {
    const HeadTokens& head = heads[h];
    std::vector<uint8_t>& keep = (*keeps)[h];
    keep.assign(static_cast<size_t>(head.n_live), 0);
    if (head.n_live == 0) continue;
    // Protected as KeepSinksRecentAndTop does for a target of min(B, n_live): newest, sinks, window.
    const int32_t target = std::min(budget_per_head, head.n_live);
    const int32_t sinks = std::clamp(head.scoring.n_sink, 0, target - 1);
    const int32_t recent = std::clamp(std::max(head.scoring.n_recent, 1), 0, target - sinks);
    for (int32_t t = 0; t < sinks; ++t) keep[t] = 1;
    for (int32_t t = head.n_live - recent; t < head.n_live; ++t) keep[t] = 1;
    const int32_t share = std::max(budget_per_head - sinks - recent, 0);
    shares[h] = share;
    pool_budget += share;
    head_candidates.clear();
    for (int32_t t = sinks; t < head.n_live - recent; ++t)
      head_candidates.push_back({Key(head.scoring.scores[t]), t, static_cast<int>(h)});
    const int32_t n_floor =
        reference ? 0
                  : std::min(static_cast<int32_t>(std::floor(split.floor * share)),
                             static_cast<int32_t>(head_candidates.size()));
    if (n_floor > 0 && n_floor < static_cast<int32_t>(head_candidates.size()))
      std::nth_element(head_candidates.begin(), head_candidates.begin() + n_floor, head_candidates.end(), Better);
    for (int32_t i = 0; i < n_floor; ++i) keep[head_candidates[i].token] = 1;
    pool_budget -= n_floor;
    rest.insert(rest.end(), head_candidates.begin() + n_floor, head_candidates.end());
  }
  const int64_t n_pick = std::min<int64_t>(pool_budget, static_cast<int64_t>(rest.size()));
  if (n_pick <= 0) return;
  if (n_pick < static_cast<int64_t>(rest.size()))
    std::nth_element(rest.begin(), rest.begin() + n_pick, rest.end(), Better);
  if (!reference) {
    for (int64_t i = 0; i < n_pick; ++i) (*keeps)[static_cast<size_t>(rest[i].head)][rest[i].token] = 1;
    return;
  }
  // Reference: each head's count c_h in the unconstrained top, then its capacity.
  std::vector<int64_t> counts(heads.size(), 0);
  for (int64_t i = 0; i < n_pick; ++i) ++counts[static_cast<size_t>(rest[i].head)];
  std::vector<int64_t> capacity(heads.size(), 0);
  int64_t total = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    const double guaranteed = std::floor(split.alpha * shares[h]);
    capacity[h] = static_cast<int64_t>(std::nearbyint((1.0 - split.alpha) * static_cast<double>(counts[h]) + guaranteed));
    total += capacity[h];
  }
  while (total > pool_budget) {  // the roundings' excess: the largest capacity (then the lower head) gives one back
    const size_t h = static_cast<size_t>(std::max_element(capacity.begin(), capacity.end()) - capacity.begin());
    --capacity[h];
    --total;
  }
  // Each head's best `capacity` scored tokens: rest is grouped by head after a sort. What the
  // capacities leave of the layer's budget (the roundings; a head with fewer scored tokens than
  // its capacity) goes to the best remaining tokens of all heads.
  std::sort(rest.begin(), rest.end(), [](const Candidate& a, const Candidate& b) {
    return a.head != b.head ? a.head < b.head : Better(a, b);
  });
  std::vector<Candidate> remaining;
  int64_t kept_total = 0;
  for (size_t i = 0; i < rest.size();) {
    const size_t h = static_cast<size_t>(rest[i].head);
    int64_t kept = 0;
    for (; i < rest.size() && static_cast<size_t>(rest[i].head) == h; ++i) {
      if (kept < capacity[h]) {
        (*keeps)[h][rest[i].token] = 1;
        ++kept;
      } else {
        remaining.push_back(rest[i]);
      }
    }
    kept_total += kept;
  }
  const int64_t n_extra = std::min<int64_t>(pool_budget - kept_total, static_cast<int64_t>(remaining.size()));
  if (n_extra <= 0) return;
  if (n_extra < static_cast<int64_t>(remaining.size()))
    std::nth_element(remaining.begin(), remaining.begin() + n_extra, remaining.end(), Better);
  for (int64_t i = 0; i < n_extra; ++i) (*keeps)[static_cast<size_t>(remaining[i].head)][remaining[i].token] = 1;
}

}  // namespace kvsparse::policy
