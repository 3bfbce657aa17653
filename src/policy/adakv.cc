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

void AdaptiveHeadKeep(std::span<const HeadTokens> heads, int32_t budget_per_head, double floor,
                      std::vector<std::vector<uint8_t>>* keeps) {
  KVS_CHECK(budget_per_head >= 1 && floor >= 0.0 && floor <= 1.0);
  keeps->resize(heads.size());
  int64_t pool_budget = 0;  // the layer's budget left after protected tokens and floors
  std::vector<Candidate> rest;  // candidates beyond each head's floor
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
    const int32_t share = budget_per_head - sinks - recent;  // the head's uniform share of scored tokens
    pool_budget += std::max(share, 0);
    head_candidates.clear();
    for (int32_t t = sinks; t < head.n_live - recent; ++t)
      head_candidates.push_back({Key(head.scoring.scores[t]), t, static_cast<int>(h)});
    const int32_t n_floor =
        std::min(static_cast<int32_t>(std::floor(floor * std::max(share, 0))), static_cast<int32_t>(head_candidates.size()));
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
  for (int64_t i = 0; i < n_pick; ++i) (*keeps)[static_cast<size_t>(rest[i].head)][rest[i].token] = 1;
}

}  // namespace kvsparse::policy
