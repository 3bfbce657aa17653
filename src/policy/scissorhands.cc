// Scissorhands — Z. Liu, A. Desai, F. Liao, W. Wang, V. Xie, Z. Xu, A. Kyrillidis,
// A. Shrivastava, "Scissorhands: Exploiting the Persistence of Importance Hypothesis for
// LLM KV Cache Compression at Test Time", NeurIPS 2023, arXiv:2305.17118.
//
// Persistence of importance (the paper's rule, §4): a token that mattered recently keeps
// mattering. Over the history window of the latest `history_window` queries, count how often
// each token's attention fell below the average 1 / t, t being the tokens that query saw
// ("unimportant"); when over budget, drop the tokens with the highest counts (those judged
// important least persistently), never the recent window. Tokens younger than the history have
// been judged fewer times and so are favoured, as in the paper's counter. Every query counts,
// prompt queries included: a prompt chunk contributes its last history_window queries (the
// observation's window_rows), so the counts after a prompt do not depend on how it was chunked.
//
// Defaults (ours; the paper leaves them to the deployment): history_window 32 queries,
// recent_ratio 0.1 of the budget protected, no sinks, counts averaged over KV heads
// (head_reduce "max" keeps a token a single head finds important). The newest token is always
// kept. Per token and head the history is a 64-bit shift register (one bit per query), so the
// count over the last w queries is a popcount.
#include <bit>
#include <limits>

#include "policy/per_token_heads.h"
#include "policy/policy_base.h"
#include "policy/selection.h"

namespace kvsparse::policy {
namespace {

class ScissorhandsPolicy final : public BudgetedPolicy {
 public:
  ScissorhandsPolicy(const KvBudget& budget, const KvMethodParams& params)
      : BudgetedPolicy(budget, params),
        history_mask_(params.history_window >= 64 ? ~uint64_t{0} : (uint64_t{1} << params.history_window) - 1) {}
  std::string_view name() const override { return "scissorhands"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<ScissorhandsPolicy>(*this); }
  uint32_t NeededObservations() const override { return kObserveWindowRows; }
  int32_t ObservationWindow() const override { return params_.history_window; }
  void OnAppend(int32_t n_new) override { unimportant_.Append(n_new); }

  void Observe(const AttentionObservation& obs) override {
    CheckObservation(obs, unimportant_.size(), obs.window_rows, "window_rows");
    if (obs.n_tokens == 0) return;
    unimportant_.SetHeads(obs.n_kv_heads);
    const int heads = obs.n_kv_heads;
    // The call's queries are its last n_queries tokens, so window query w (oldest first) saw
    // every token before it in the live list and itself: t = n_tokens - (n_window - 1 - w).
    for (int32_t w = 0; w < obs.n_window; ++w) {
      const int32_t visible = obs.n_tokens - (obs.n_window - 1 - w);
      const float threshold = 1.f / static_cast<float>(visible);
      for (int h = 0; h < heads; ++h) {
        const float* attention = obs.window_rows + (static_cast<size_t>(w) * heads + h) * obs.n_tokens;  // [n_tokens]
        for (int32_t t = 0; t < obs.n_tokens; ++t) {
          uint64_t& bits = unimportant_.row(t)[h];
          bits = (bits << 1) | static_cast<uint64_t>(t < visible && attention[t] < threshold);
        }
      }
    }
  }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, unimportant_.size());
    scores_.assign(ctx.n_live, 0.f);
    const int heads = unimportant_.heads();
    for (int32_t t = 0; heads > 0 && t < ctx.n_live; ++t) {
      const uint64_t* row = unimportant_.row(t);
      int total = 0, fewest = std::numeric_limits<int>::max();
      for (int h = 0; h < heads; ++h) {
        const int count = std::popcount(row[h] & history_mask_);
        total += count;
        fewest = std::min(fewest, count);
      }
      // Importance is minus the unimportance count: mean over heads, or the best head.
      scores_[t] = params_.head_reduce == HeadReduce::kMean ? -static_cast<float>(total) / heads
                                                            : -static_cast<float>(fewest);
    }
    KeepSinksRecentAndTop(scores_.data(), ctx.n_live, ctx.target, params_.n_sink,
                          RecentWindowTokens(params_, ctx.target), &scratch_, keep);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override { unimportant_.Compact(keep); }
  size_t StateBytes() const override {
    return unimportant_.bytes() + scores_.capacity() * sizeof(float) + scratch_.capacity() * sizeof(int32_t);
  }

 private:
  const uint64_t history_mask_;                 // the last history_window bits
  PerTokenHeads<uint64_t> unimportant_{0};      // [n_live, n_kv_heads] bit i: unimportant i queries ago
  std::vector<float> scores_;                   // [n_live] scratch
  std::vector<int32_t> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeScissorhandsPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<ScissorhandsPolicy>(budget, params);
}

}  // namespace kvsparse::policy
