// SnapKV — Y. Li, Y. Huang, B. Yang, B. Venkitesh, A. Locatelli, H. Ye, T. Cai, P. Lewis,
// D. Chen, "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
// arXiv:2404.14469.
//
// The last `window` prompt queries (default 32) vote: each earlier token's score is the
// attention those queries give it, summed. Votes are smoothed with a 1-D pooling over
// neighbouring tokens (default max pooling, kernel 7) so that a selected token brings its
// neighbours. Tokens are chosen per KV head (per_head true by default, as the reference);
// "per_head": false folds the heads' pooled votes (head_reduce, mean by default). Kept: the
// window's own tokens plus the top-voted earlier tokens, budget in all.
//
// The window is exactly the latest `window` queries, whatever the chunking: the policy keeps
// each token's attention from each of them (the observation's window_rows), so a short last
// chunk is completed by the previous chunk's last queries. When: the paper compresses once, at
// the end of the prompt (prefill_eviction "prompt_end" does exactly that); with the default
// every-chunk eviction each prompt chunk after which the layer is over budget is compressed by
// the same rule, the prompt read so far acting as the prompt.
// Small budgets: when the target does not exceed the window (a fraction budget of a short
// prompt), the window shrinks to half the target, so earlier tokens are still chosen by votes
// instead of SnapKV silently becoming "keep the last tokens".
// Generated tokens are all kept (EvictsDuringDecode false) unless "decode_evict" is set; then
// decode-time compression uses the latest `window` queries the same way. Without it decode
// steps are not observed at all (ObservesDecode false: no scoring pass).
#include "policy/snapkv.h"

#include <algorithm>
#include <limits>

#include "policy/selection.h"

namespace kvsparse::policy {

void PoolVotes(const float* votes, int32_t n, int kernel, VotePooling pooling, float* out) {
  KVS_CHECK(kernel >= 1);
  const int32_t radius = kernel / 2;
  for (int32_t t = 0; t < n; ++t) {
    const int32_t lo = std::max<int32_t>(0, t - radius), hi = std::min<int32_t>(n - 1, t + radius);
    if (pooling == VotePooling::kMax) {
      float best = -std::numeric_limits<float>::infinity();
      for (int32_t j = lo; j <= hi; ++j) best = std::max(best, votes[j]);
      out[t] = best;
    } else {
      float sum = 0.f;
      for (int32_t j = lo; j <= hi; ++j) sum += votes[j];
      out[t] = sum / static_cast<float>(kernel);  // padding counts as zeros
    }
  }
}

int32_t SnapKvPolicy::EffectiveWindow(int32_t obs_window, int32_t target) {
  return target > obs_window ? obs_window : std::max<int32_t>(1, target / 2);
}

float SnapKvPolicy::WindowVote(const float* ring, int32_t window, int32_t, bool) const {
  float votes = 0.f;
  for (int32_t age = 0; age < window; ++age) votes += ring[age];
  return votes;
}

void SnapKvPolicy::Observe(const AttentionObservation& obs) {
  CheckObservation(obs, rows_.size(), obs.window_rows, "window_rows");
  if (obs.n_tokens == 0 || obs.n_window == 0) return;
  const int32_t depth = params_.obs_window;
  KVS_CHECK_MSG(obs.n_window <= depth, "snapkv: more window rows than the observation window");
  if (heads_ == 0) heads_ = obs.heads();  // KV heads, or query heads (CAKE's per-query-head scores)
  KVS_CHECK_MSG(heads_ == obs.heads(), "snapkv: observation changed the number of heads");
  rows_.SetHeads(heads_ * depth);
  const int32_t fresh = obs.n_window;  // queries this call adds to the window
  queries_seen_ = std::min(depth, queries_seen_ + fresh);
  for (int32_t t = 0; t < obs.n_tokens; ++t) {
    for (int h = 0; h < heads_; ++h) {
      float* ring = rows_.row(t) + static_cast<size_t>(h) * depth;  // [depth] newest first
      std::copy_backward(ring, ring + depth - fresh, ring + depth);
      for (int32_t age = 0; age < fresh; ++age) {
        const int32_t w = fresh - 1 - age;  // window_rows are oldest first
        ring[age] = obs.window_rows[(static_cast<size_t>(w) * heads_ + h) * obs.n_tokens + t];
      }
    }
  }
}

void SnapKvPolicy::SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) {
  SelectionScoring s;
  ScoreForSelection(ctx, &s);
  KeepSinksRecentAndTop(s.scores, ctx.n_live, ctx.target, s.n_sink, s.n_recent, &scratch_, keep);
}

bool SnapKvPolicy::ScoreForSelection(const SelectionContext& ctx, SelectionScoring* out) {
  CheckSelection(ctx, rows_.size());
  const int32_t window = std::min(EffectiveWindow(params_.obs_window, ctx.target), ctx.target);
  const int32_t n_candidates = ctx.n_live - window;  // tokens before the window: [0, n_candidates)
  const int32_t depth = params_.obs_window;
  scores_.assign(ctx.n_live, 0.f);
  if (heads_ > 0 && n_candidates > 0) {
    column_.resize(n_candidates);
    pooled_.resize(n_candidates);
    const bool mean = params_.head_reduce == HeadReduce::kMean;
    if (!mean) std::fill(scores_.begin(), scores_.begin() + n_candidates, -std::numeric_limits<float>::infinity());
    // Votes of the latest `window` queries; pool each head on its own (as the paper), then fold the heads.
    for (int h = 0; h < heads_; ++h) {
      for (int32_t t = 0; t < n_candidates; ++t) {
        column_[t] = WindowVote(rows_.row(t) + static_cast<size_t>(h) * depth, window, std::min(window, queries_seen_),
                                ctx.in_prefill);
      }
      PoolVotes(column_.data(), n_candidates, params_.kernel, params_.pooling, pooled_.data());
      for (int32_t t = 0; t < n_candidates; ++t)
        scores_[t] = mean ? scores_[t] + pooled_[t] / heads_ : std::max(scores_[t], pooled_[t]);
    }
  }
  *out = {scores_.data(), /*n_sink=*/0, window};
  return true;
}

std::unique_ptr<KvPolicy> MakeSnapKvPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<SnapKvPolicy>(budget, params);
}

}  // namespace kvsparse::policy
