// Cumulative: cross-layer cumulative importance with nested, layer-wise retention and periodic
// global re-ranking (kvsparse's own method, from the design brief; its parts come from H2O's
// accumulated attention, Zhang et al. NeurIPS 2023, and PyramidKV's budgets decreasing with
// depth, Cai et al. 2024).
//
// - One ranking per sequence, shared by every cumulative layer (CumulativeRanking): a token's
//   importance is the attention it receives, summed over layers with weights ("layer_weight",
//   default 1 + depth / (n_layers - 1): 1 at the first layer, 2 at the last, since deep layers'
//   attention is the more selective) and smoothed over steps ("decay" per appended token,
//   default 0.99: a half-life of ~69 tokens). A prompt chunk of n tokens decays the scores by
//   decay^n once and then adds the attention of all its queries undecayed (the kernel gives their
//   sum, not each query's row): within a chunk, early and late queries weigh the same.
// - Layer l keeps its share r_l of the tokens seen: the config's budget is the mean share, and
//   "schedule" spreads it over depth, "linear" (default) or "cosine", from spread:1 (default 3)
//   at the first layer down to the last; "none" takes each layer's budget as given. A fraction
//   budget above (1 + spread) / (2 spread) (2/3 at spread 3) would need a first layer above 100%:
//   the spread is lowered to fit (CumulativeSpread) and the layer summary says so. The sets are nested: a token a deep
//   layer keeps is kept by every shallower one.
// - Incremental at every step: new tokens enter, and each layer drops its lowest-ranked tokens,
//   O(log n) each; a token a layer drops is dropped by every deeper layer too (nesting), which
//   frees it at its own next eviction. Every "rerank_period" appended tokens (default 16) a global
//   re-rank refreshes the order from the current importance.
// - "mode": "evict" (default) frees the tokens a layer drops, like every evicting method here;
//   "mask" keeps them in memory and only skips reading them at decode steps (prompt chunks stay
//   dense), so a re-rank can bring a token back: read sparsity, like Quest.
// The token just appended is always kept.
// - per_head false (default): one table per layer, attention averaged over the KV heads. per_head
//   true (evict mode): one table per (layer, KV head) and one ranking per KV head index, so head
//   h of every layer ranks by the attention of the heads h (a pairing of heads across layers by
//   index: a convention, as heads of different layers are unrelated) and nests across layers.
//   With "head_budgets": "adaptive" (AdaKV's split, Feng et al. 2024; "floor" default 0.5) each
//   layer's H·B is divided over its heads: the lowest key of all heads goes first, no head below
//   floor·B, so a head whose attention concentrates gives room to one whose attention spreads.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include <fmt/format.h>

#include "policy/cumulative_ranking.h"
#include "policy/policy_base.h"

namespace kvsparse {
namespace policy {
namespace {

class CumulativePolicy final : public BudgetedPolicy {
 public:
  CumulativePolicy(const KvBudget& layer_budget, const KvMethodParams& params, float weight, int kv_head)
      : BudgetedPolicy(layer_budget, params), weight_(weight), kv_head_(kv_head) {}

  std::string_view name() const override { return "cumulative"; }
  // The copy owns a copy of the ranking; LinkSequencePolicies makes a forked sequence's layers
  // share one again.
  std::unique_ptr<KvPolicy> Clone() const override {
    auto copy = std::make_unique<CumulativePolicy>(*this);
    if (ranking_) copy->ranking_ = std::make_shared<CumulativeRanking>(*ranking_);
    copy->heads_.reset();  // the original's rankings: the copy's are linked anew
    return copy;
  }
  uint32_t NeededObservations() const override { return kObserveSumAll; }
  bool mask() const { return params_.mode == CumulativeMode::kMask; }
  bool SelectsSpans() const override { return mask(); }
  // The layer's share, or fewer when shallower layers dropped tokens it holds (nesting): its
  // next eviction frees those. Mask mode never evicts. Adaptive heads: at most what the split can
  // give one head (H·B less the others' floors); the split (SplitHeadBudgets) has already trimmed
  // the head's ranking to its share.
  int32_t BudgetTokens(int32_t n_seen) const override {
    if (mask()) return std::numeric_limits<int32_t>::max();
    const int32_t own = ResolveBudget(budget_, n_seen);
    if (!ranking_) return own;
    int32_t most = own;
    if (heads_) {
      const auto n_heads = static_cast<int32_t>(heads_->size());
      most = own * n_heads - (n_heads - 1) * FloorTokens(own);
    }
    return std::min(most, ranking_->HeldBy(index_));
  }
  // AdaKV's split over the rankings of the layer's heads: while the layer holds more than H·B,
  // the head whose lowest-ranked token has the lowest key (above its floor) drops it.
  bool SplitHeadBudgets(int32_t min_excess) override {
    if (!heads_) return false;
    const std::vector<std::shared_ptr<CumulativeRanking>>& rankings = *heads_;
    const int32_t budget = ResolveBudget(budget_, ranking_->n_present());
    const int64_t layer_budget = static_cast<int64_t>(budget) * static_cast<int64_t>(rankings.size());
    held_.resize(rankings.size());
    int64_t total = 0;
    for (size_t h = 0; h < rankings.size(); ++h) total += held_[h] = rankings[h]->HeldBy(index_);
    if (total - layer_budget < min_excess) return true;
    const int32_t floor_tokens = FloorTokens(budget);
    while (total > layer_budget) {
      int best = -1;
      float best_key = 0;
      for (size_t h = 0; h < rankings.size(); ++h) {
        if (held_[h] <= floor_tokens) continue;
        const std::optional<float> key = rankings[h]->LowestKey(index_);
        if (key && (best < 0 || *key < best_key)) best = static_cast<int>(h), best_key = *key;
      }
      if (best < 0) break;
      rankings[static_cast<size_t>(best)]->Trim(index_, --held_[static_cast<size_t>(best)]);
      --total;
    }
    return true;
  }
  // Shallower layers dropped tokens this layer still caches: free them in this forward call.
  bool MustEvictNow(int32_t n_live) const override {
    return !mask() && ranking_ && ranking_->HeldBy(index_) < n_live;
  }
  // The shared ranking is counted by the shallowest layer, which owns its re-ranks too.
  size_t StateBytes() const override {
    return (ids_.capacity() + selected_rows_.capacity() + row_ids_.capacity()) * sizeof(int32_t) +
           mass_.capacity() * sizeof(float) + all_spans_.capacity() * sizeof(KvSpan) +
           (ranking_ && index_ == 0 ? ranking_->bytes() : 0);
  }
  std::pair<int64_t, double> TakeRerankWork() override {
    return ranking_ && index_ == 0 ? ranking_->TakeRerankWork() : std::pair<int64_t, double>{0, 0.0};
  }

  void Bind(std::shared_ptr<CumulativeRanking> ranking, int index) {
    ranking_ = std::move(ranking);
    index_ = index;
  }
  void BindHeads(std::shared_ptr<const std::vector<std::shared_ptr<CumulativeRanking>>> heads) {
    heads_ = std::move(heads);
  }
  int kv_head() const { return kv_head_; }
  bool adaptive() const { return params_.head_budgets == HeadBudgets::kAdaptive; }
  const std::shared_ptr<CumulativeRanking>& ranking() const { return ranking_; }
  float weight() const { return weight_; }
  const KvBudget& budget() const { return budget_; }
  const KvMethodParams& params() const { return params_; }

  void OnAppend(int32_t n_new) override {
    if (!ranking_) {  // a policy used on its own: a ranking of one layer
      Bind(std::make_shared<CumulativeRanking>(std::vector<CumulativeRanking::Layer>{{weight_, budget_}},
                                               params_.decay, params_.rerank_period, params_.mode),
           0);
    }
    if (index_ == 0) ranking_->Append(n_new);  // the shallowest layer appends for all
    for (int32_t i = 0; i < n_new; ++i) ids_.push_back(appended_ + i);
    appended_ += n_new;
    KVS_CHECK_MSG(appended_ == ranking_->n_ids(),
                  fmt::format("cumulative layer {}: {} tokens appended but the sequence's ranking has {}", index_,
                              appended_, ranking_->n_ids()));
    selection_valid_ = false;
  }

  void Observe(const AttentionObservation& obs) override {
    // A mask-mode decode step read only the tokens SelectSpans chose: rows are those.
    const bool selected = selection_valid_;
    selection_valid_ = false;
    const int32_t n_rows = selected ? static_cast<int32_t>(selected_rows_.size()) : static_cast<int32_t>(ids_.size());
    CheckObservation(obs, n_rows, obs.sum_all, "sum_all");
    mass_.assign(static_cast<size_t>(n_rows), 0.f);
    const float per_head = 1.f / static_cast<float>(obs.n_kv_heads);
    for (int h = 0; h < obs.n_kv_heads; ++h) {
      const float* row = obs.sum_all + static_cast<size_t>(h) * n_rows;
      for (int32_t i = 0; i < n_rows; ++i) mass_[i] += per_head * row[i];
    }
    if (selected) {
      row_ids_.resize(static_cast<size_t>(n_rows));
      for (int32_t i = 0; i < n_rows; ++i) row_ids_[i] = ids_[static_cast<size_t>(selected_rows_[i])];
      ranking_->AddAttention(index_, row_ids_.data(), mass_.data(), n_rows);
    } else {
      ranking_->AddAttention(index_, ids_.data(), mass_.data(), n_rows);
    }
  }

  // Mask mode: the layer's held tokens, as runs of the spans.
  void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) override {
    KVS_CHECK(mask() && ranking_);
    ranking_->Trim(index_, ResolveBudget(budget_, ranking_->n_present()));
    selected_rows_.clear();
    all_spans_.swap(*spans);
    spans->clear();
    int32_t row = 0;
    for (const KvSpan& s : all_spans_) {
      int32_t run = -1;
      for (int32_t i = 0; i <= s.n; ++i) {
        const bool held = i < s.n && ranking_->Held(index_, ids_[static_cast<size_t>(row + i)]);
        if (held) {
          selected_rows_.push_back(row + i);
          if (run < 0) run = i;
        } else if (run >= 0) {
          spans->push_back(SubSpan(ctx.storage, s, run, i - run, ctx.n_kv_heads, ctx.head_dim));
          run = -1;
        }
      }
      row += s.n;
    }
    KVS_CHECK_MSG(row == static_cast<int32_t>(ids_.size()),
                  fmt::format("cumulative: the spans hold {} tokens but {} were appended", row, ids_.size()));
    all_spans_.clear();
    selection_valid_ = true;
  }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, static_cast<int32_t>(ids_.size()));
    KVS_CHECK_MSG(!mask(), "cumulative in mask mode never evicts");
    // Tokens shallower layers dropped, and (when target is below what the layer holds) its own
    // lowest-ranked. An eviction the cache puts off leaves them dropped: the next one frees them.
    ranking_->Trim(index_, ctx.target);
    keep->resize(static_cast<size_t>(ctx.n_live));
    for (int32_t i = 0; i < ctx.n_live; ++i) (*keep)[i] = ranking_->Held(index_, ids_[static_cast<size_t>(i)]);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override {
    KVS_CHECK(keep.size() == ids_.size());
    size_t out = 0;
    for (size_t i = 0; i < ids_.size(); ++i) {
      const int32_t id = ids_[i];
      if (keep[i]) {
        ids_[out++] = id;  // (evict mode: possibly dropped, and freed at the next eviction)
      } else if (mask() || ranking_->Held(index_, id)) {
        ranking_->Remove(id);  // gone from the sequence (RemoveRange), not a selection of ours
      }
    }
    ids_.resize(out);
    selection_valid_ = false;
  }

 private:
  int32_t FloorTokens(int32_t budget) const {
    return std::max<int32_t>(1, static_cast<int32_t>(std::lround(params_.floor * budget)));
  }

  float weight_;
  int kv_head_;                          // the KV head of a per-head layer's table (0 for shared layers)
  std::shared_ptr<CumulativeRanking> ranking_;
  // Adaptive heads: the sequence's rankings by KV head (this one's among them), from the linker.
  std::shared_ptr<const std::vector<std::shared_ptr<CumulativeRanking>>> heads_;
  std::vector<int32_t> held_;            // [n_kv_heads] SplitHeadBudgets scratch
  int index_ = 0;                        // this layer among the sequence's cumulative layers
  int32_t appended_ = 0;                 // tokens appended to this layer
  std::vector<int32_t> ids_;             // [n_live] the layer's tokens, by live index
  std::vector<int32_t> selected_rows_;   // mask mode: live indices the decode step reads
  bool selection_valid_ = false;         // selected_rows_ describes the coming observation
  std::vector<KvSpan> all_spans_;        // SelectSpans scratch
  std::vector<float> mass_;              // [rows] Observe scratch
  std::vector<int32_t> row_ids_;         // [rows] Observe scratch
};

}  // namespace

std::unique_ptr<KvPolicy> MakeCumulativePolicy(const KvBudget& mean_budget, const KvMethodParams& params, int layer,
                                               int n_layers, int kv_head) {
  const double depth = n_layers > 1 ? static_cast<double>(layer) / (n_layers - 1) : 0.0;
  const float weight = static_cast<float>(params.layer_weight >= 0 ? params.layer_weight : 1.0 + depth);
  return std::make_unique<CumulativePolicy>(CumulativeLayerBudget(mean_budget, params, layer, n_layers), params,
                                            weight, std::max(kv_head, 0));
}

}  // namespace policy

double CumulativeSpread(const KvBudget& mean_budget, const KvMethodParams& params) {
  if (params.schedule == RetentionSchedule::kNone || !mean_budget.is_fraction() || mean_budget.fraction <= 0.5)
    return params.spread;
  return std::min(params.spread, 1.0 / (2.0 * std::min(1.0, mean_budget.fraction) - 1.0));
}

KvBudget CumulativeLayerBudget(const KvBudget& mean_budget, const KvMethodParams& params, int layer, int n_layers) {
  if (params.schedule == RetentionSchedule::kNone) return mean_budget;
  const double x = n_layers > 1 ? static_cast<double>(layer) / (n_layers - 1) : 0.5;
  // shape 1 at the first layer, 0 at the last; both shapes average 1/2 over evenly spaced layers,
  // so first = 2 s m / (1 + s) and last = 2 m / (1 + s) average to the mean m.
  const double shape = params.schedule == RetentionSchedule::kLinear ? 1.0 - x : 0.5 * (1.0 + std::cos(std::numbers::pi * x));
  const double s = CumulativeSpread(mean_budget, params);
  const double factor = (2.0 / (1.0 + s)) * (1.0 + (s - 1.0) * shape);  // share / mean share
  if (mean_budget.is_fraction()) return KvBudget::Fraction(std::min(1.0, mean_budget.fraction * factor));
  return KvBudget::Tokens(std::max<int32_t>(1, static_cast<int32_t>(std::lround(mean_budget.tokens * factor))));
}

namespace policy {

void LinkCumulativeLayers(std::span<KvPolicy* const> all_policies) {
  // By KV head (shared layers: all head 0), shallowest layer first.
  std::vector<std::vector<policy::CumulativePolicy*>> by_head;
  for (KvPolicy* p : all_policies) {
    auto* c = dynamic_cast<policy::CumulativePolicy*>(p);
    if (c == nullptr) continue;
    if (by_head.size() <= static_cast<size_t>(c->kv_head())) by_head.resize(static_cast<size_t>(c->kv_head()) + 1);
    by_head[static_cast<size_t>(c->kv_head())].push_back(c);
  }
  auto heads = std::make_shared<std::vector<std::shared_ptr<policy::CumulativeRanking>>>();
  for (const std::vector<policy::CumulativePolicy*>& layers : by_head) {
    KVS_CHECK_MSG(!layers.empty(), "cumulative: a per-head layer lacks a KV head's policy");
    // A forked sequence's shallowest layer holds a copy of the source's ranking (Clone): the
    // others share it. Fresh policies get a new ranking.
    std::shared_ptr<policy::CumulativeRanking> ranking = layers[0]->ranking();
    if (!ranking || ranking->n_layers() != static_cast<int>(layers.size())) {
      std::vector<policy::CumulativeRanking::Layer> config;
      for (const policy::CumulativePolicy* c : layers) config.push_back({c->weight(), c->budget()});
      const KvMethodParams& p = layers[0]->params();
      ranking = std::make_shared<policy::CumulativeRanking>(std::move(config), p.decay, p.rerank_period, p.mode);
    }
    for (size_t i = 0; i < layers.size(); ++i) layers[i]->Bind(ranking, static_cast<int>(i));
    heads->push_back(std::move(ranking));
  }
  if (by_head.empty() || !by_head[0][0]->adaptive()) return;
  for (const std::vector<policy::CumulativePolicy*>& layers : by_head)
    for (policy::CumulativePolicy* c : layers) c->BindHeads(heads);
}

}  // namespace policy
}  // namespace kvsparse
