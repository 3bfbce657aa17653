// TOVA — M. Oren, M. Hassid, N. Yarden, Y. Adi, R. Schwartz, "Transformers are Multi-State
// RNNs", EMNLP 2024, arXiv:2401.06104.
//
// Token Omission Via Attention: when the cache is over budget, drop the tokens with the
// lowest attention from the current (last) query, averaged over heads (the paper's choice
// over per-head decisions; head_reduce "max" is offered). With evict_interval N the N
// lowest under the latest query go at once. Defaults: no sinks, no protected window (the
// paper protects neither); "n_sink", "recent", "recent_ratio" can add them. Deliberate
// difference: the token just appended is always kept (as kvpress's TOVA; the next step attends
// to it).
#include <limits>

#include "policy/per_token_heads.h"
#include "policy/policy_base.h"
#include "policy/selection.h"

namespace kvsparse::policy {
namespace {

class TovaPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "tova"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<TovaPolicy>(*this); }
  uint32_t NeededObservations() const override { return kObserveLast; }
  void OnAppend(int32_t n_new) override { last_.Append(n_new); }

  void Observe(const AttentionObservation& obs) override {
    CheckObservation(obs, last_.size(), obs.last, "last");
    last_.SetHeads(obs.n_kv_heads);
    const int heads = obs.n_kv_heads;
    for (int h = 0; h < heads; ++h) {
      const float* attention = obs.last + static_cast<size_t>(h) * obs.n_tokens;  // [n_tokens]
      for (int32_t t = 0; t < obs.n_tokens; ++t) last_.row(t)[h] = attention[t];
    }
  }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, last_.size());
    // Tokens no query has seen yet (appended after the last observation) rank first.
    scores_.assign(ctx.n_live, std::numeric_limits<float>::infinity());
    if (last_.heads() > 0) ReduceHeads(last_.data(), ctx.n_live, last_.heads(), params_.head_reduce, scores_.data());
    KeepSinksRecentAndTop(scores_.data(), ctx.n_live, ctx.target, params_.n_sink,
                          RecentWindowTokens(params_, ctx.target), &scratch_, keep);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override { last_.Compact(keep); }
  size_t StateBytes() const override {
    return last_.bytes() + scores_.capacity() * sizeof(float) + scratch_.capacity() * sizeof(int32_t);
  }

 private:
  // [n_live, n_kv_heads] attention of the latest query; +inf until a query has seen the token.
  PerTokenHeads<float> last_{std::numeric_limits<float>::infinity()};
  std::vector<float> scores_;  // [n_live] scratch
  std::vector<int32_t> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeTovaPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<TovaPolicy>(budget, params);
}

}  // namespace kvsparse::policy
