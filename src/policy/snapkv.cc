// SnapKV — Y. Li, Y. Huang, B. Yang, B. Venkitesh, A. Locatelli, H. Ye, T. Cai, P. Lewis,
// D. Chen, "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
// arXiv:2404.14469.
//
// The last `window` prompt queries (default 32) vote: each earlier token's score is the
// attention those queries give it, summed (sum_window). Votes are smoothed with a 1-D
// pooling over neighbouring tokens (default max pooling, kernel 7) so that a selected
// token brings its neighbours, then folded over KV heads (mean by default). Kept: the
// window's own tokens plus the top-voted earlier tokens, budget in all.
//
// When: the paper compresses once, at the end of the prompt. Here every prompt chunk after
// which the layer is over budget is compressed with the same rule, the chunk's last
// `window` queries acting as the window (the prefix read so far is treated as the prompt);
// for the last chunk that is exactly the paper's rule. A call with at least `window`
// queries replaces the votes; a shorter call (a short last chunk, a decode step) adds to
// them, so a window split across two chunks is covered by the union of both windows.
// Generated tokens are all kept (EvictsDuringDecode false) unless "decode_evict" is set;
// then decode-time compression uses the votes of the queries since the previous one.
// Without it decode steps are not observed at all (ObservesDecode false: no scoring pass).
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

void SnapKvPolicy::Observe(const AttentionObservation& obs) {
  CheckObservation(obs, votes_.size(), obs.sum_window, "sum_window");
  if (obs.n_tokens == 0) return;
  votes_.SetHeads(obs.n_kv_heads);
  const bool full_window = obs.n_queries >= params_.obs_window;
  const int heads = obs.n_kv_heads;
  for (int h = 0; h < heads; ++h) {
    const float* window_votes = obs.sum_window + static_cast<size_t>(h) * obs.n_tokens;  // [n_tokens]
    for (int32_t t = 0; t < obs.n_tokens; ++t) {
      float& v = votes_.row(t)[h];
      v = full_window ? window_votes[t] : v + window_votes[t];
    }
  }
}

void SnapKvPolicy::SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) {
  CheckSelection(ctx, votes_.size());
  last_selection_in_prefill_ = ctx.in_prefill;
  const int32_t window = std::min(params_.obs_window, ctx.target);
  const int32_t n_candidates = ctx.n_live - window;  // tokens before the window: [0, n_candidates)
  scores_.assign(ctx.n_live, 0.f);
  const int heads = votes_.heads();
  if (heads > 0 && n_candidates > 0) {
    column_.resize(n_candidates);
    pooled_.resize(n_candidates);
    const bool mean = params_.head_reduce == HeadReduce::kMean;
    if (!mean) std::fill(scores_.begin(), scores_.begin() + n_candidates, -std::numeric_limits<float>::infinity());
    // Pool each head on its own (as the paper), then fold the heads.
    for (int h = 0; h < heads; ++h) {
      for (int32_t t = 0; t < n_candidates; ++t) column_[t] = votes_.row(t)[h];
      PoolVotes(column_.data(), n_candidates, params_.kernel, params_.pooling, pooled_.data());
      for (int32_t t = 0; t < n_candidates; ++t)
        scores_[t] = mean ? scores_[t] + pooled_[t] / heads : std::max(scores_[t], pooled_[t]);
    }
  }
  KeepSinksRecentAndTop(scores_.data(), ctx.n_live, ctx.target, /*n_sink=*/0, window, &scratch_, keep);
}

void SnapKvPolicy::OnEvict(const std::vector<uint8_t>& keep) {
  votes_.Compact(keep);
  // A decode-time compression consumed its window; the next one starts a fresh one.
  if (!last_selection_in_prefill_) votes_.Fill(0.f);
}

std::unique_ptr<KvPolicy> MakeSnapKvPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<SnapKvPolicy>(budget, params);
}

}  // namespace kvsparse::policy
