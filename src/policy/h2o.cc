// H2O — Z. Zhang, Y. Sheng, T. Zhou, T. Chen, L. Zheng, R. Cai, Z. Song, Y. Tian, C. Ré,
// C. Barrett, Z. Wang, B. Chen, "H2O: Heavy-Hitter Oracle for Efficient Generative
// Inference of Large Language Models", NeurIPS 2023, arXiv:2306.14048.
//
// Score of a token = its attention summed over every query that has seen it (sum_all of
// each observation, accumulated since the token arrived). Tokens are chosen per KV head by
// default, as the reference (per_head true; the query heads of a group are averaged, GQA);
// "per_head": false folds the heads' scores (head_reduce, mean by default). Keeps the most
// recent tokens plus the highest-scored "heavy hitters"; by default half of the budget each, as
// in the paper (recent_ratio 0.5; "recent" sets the window in tokens instead). The prompt
// variant is the same rule: prompt queries add their attention, and the layer is trimmed to the
// budget after the prompt (or after each chunk). The paper evicts at every generated token:
// `bench` does (PaperEvictInterval); serving batches evictions (evict_interval 16).
#include "policy/per_token_heads.h"
#include "policy/policy_base.h"
#include "policy/selection.h"

namespace kvsparse::policy {
namespace {

class H2OPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "h2o"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<H2OPolicy>(*this); }
  uint32_t NeededObservations() const override { return kObserveSumAll; }
  void OnAppend(int32_t n_new) override { accumulated_.Append(n_new); }

  void Observe(const AttentionObservation& obs) override {
    CheckObservation(obs, accumulated_.size(), obs.sum_all, "sum_all");
    accumulated_.SetHeads(obs.n_kv_heads);
    const int heads = obs.n_kv_heads;
    for (int h = 0; h < heads; ++h) {
      const float* attention = obs.sum_all + static_cast<size_t>(h) * obs.n_tokens;  // [n_tokens]
      for (int32_t t = 0; t < obs.n_tokens; ++t) accumulated_.row(t)[h] += attention[t];
    }
  }

  bool ScoreForSelection(const SelectionContext& ctx, SelectionScoring* out) override {
    CheckSelection(ctx, accumulated_.size());
    scores_.assign(ctx.n_live, 0.f);  // never observed: every token scores 0
    if (accumulated_.heads() > 0)
      ReduceHeads(accumulated_.data(), ctx.n_live, accumulated_.heads(), params_.head_reduce, scores_.data());
    *out = {scores_.data(), params_.n_sink, RecentWindowTokens(params_, ctx.target)};
    return true;
  }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    SelectionScoring s;
    ScoreForSelection(ctx, &s);
    KeepSinksRecentAndTop(s.scores, ctx.n_live, ctx.target, s.n_sink, s.n_recent, &scratch_, keep);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override { accumulated_.Compact(keep); }
  size_t StateBytes() const override {
    return accumulated_.bytes() + scores_.capacity() * sizeof(float) + scratch_.capacity() * sizeof(int32_t);
  }

 private:
  PerTokenHeads<float> accumulated_{0.f};  // [n_live, n_kv_heads] Σ attention received
  std::vector<float> scores_;              // [n_live] scratch
  std::vector<int32_t> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeH2OPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<H2OPolicy>(budget, params);
}

}  // namespace kvsparse::policy
