// Oracle: exact top-k attention, the upper bound of read-sparsity methods (no paper of its own;
// the "oracle top-k" against which Quest, Tang et al. ICML 2024, and TidalDecode, Yang et al.
// ICLR 2025, measure their selections).
//
// Like Quest it keeps the whole KV cache and never evicts; at each decode step every KV head
// reads exactly the `budget` tokens its query heads attend to most:
// - q·k over every live token (scale as the attention's), softmax per query head;
// - the probabilities of the KV head's query heads folded into one score per token
//   ("head_reduce": "mean", default, or "max"), the GQA fold of every method here;
// - the top `budget` tokens of that score per KV head (ties to the earlier token), the token
//   just appended always among them (every method here keeps it); every query head of the group
//   reads those tokens.
// Prompt processing is dense. Every layer selects (no dense layers). The budget is a token count
// or a fraction of the live tokens (= the tokens seen). A budget that covers every live token
// reads the whole table, bit-identical to Full.
// Cost: one scalar pass over every key per step and layer. It is an instrument for measuring how
// far a method's selection is from the best one, not a fast path.
//
// Reuse: cross-layer selection reuse, TidalDecode's position-persistent sparse attention (Yang et
// al., ICLR 2025; OmniKV, Hao et al., ICLR 2025, reuses selections across layers the same way).
// The first `dense_layers` (2) layers attend densely; a token-selection layer (the first layer
// after them, and the re-selection layer, "reselect_layer", default 13/32 of the depth: layer 13
// of Llama's 32, as the reference) attends densely too and takes, per query head as the reference
// does (modify_llama.py's top-k after repeat_kv; "head_reduce": "none", the default), the
// top-budget tokens of that attention (the probabilities the decode step's kernel already
// computed; the newest token always among them); every later layer's query head reads the same
// tokens, without scoring, until the next selection layer. "head_reduce" "mean" or "max" chooses
// per KV head instead (kvsparse's cheaper form: the group reads each chosen K/V row once), from
// the group's probabilities folded by the config's gqa_aggregation. Nothing is evicted; decode
// steps save the reads of the reusing layers.
// "selection": "quest" makes the selection layers choose by Quest's page bounds instead (OmniKV and
// TidalDecode name both kinds of selection): per query head (or per KV head, the bounds folded over
// the group by head_reduce), the QuestPagesRead(budget) pages of page_tokens (the cache's page by
// default) with the highest bounds, the current page among them; the selection layer then reads
// only those pages itself, and the later layers read the same tokens.
// The oracle chooses per KV head ("head_reduce" mean, default, or max) or per query head ("none").
// LinkSequencePolicies gives a sequence's reuse layers one ReuseSelection and their roles.
#include <algorithm>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "kvsparse/kv_types.h"
#include "kvsparse/quest_pages.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {

// The tokens the last selection layer of the current decode step chose, per query head (or per
// KV head).
struct ReuseSelection {
  int32_t n_live = -1;  // live tokens then (the reusing layers of the same step hold as many)
  bool whole = false;   // the budget covered every token: read everything
  std::vector<std::vector<int32_t>> heads;  // [n_q_heads or n_kv_heads] live indices, ascending
};

namespace {

enum class TopKRole {
  kOracle,  // selects at every step, for itself
  kSelect,  // selects and publishes the choice (reuse's selection layers)
  kReuse,   // reads the published choice
};

class OraclePolicy final : public ReadSparsePolicy {
 public:
  OraclePolicy(const KvBudget& budget, const KvMethodParams& params, TopKRole role)
      : ReadSparsePolicy(budget, params), role_(role) {}
  std::string_view name() const override { return role_ == TopKRole::kOracle ? "oracle" : "reuse"; }
  // all_spans_ is dropped: after a selection it points into the original sequence's pages. The
  // selection a reuse layer shares is per step: the copy gets its own (LinkSequencePolicies
  // shares it again).
  std::unique_ptr<KvPolicy> Clone() const override {
    auto copy = std::make_unique<OraclePolicy>(*this);
    copy->all_spans_.clear();
    if (shared_) copy->shared_ = std::make_shared<ReuseSelection>();
    return copy;
  }
  bool reuses() const { return role_ != TopKRole::kOracle; }
  void Bind(std::shared_ptr<ReuseSelection> shared, bool selects) {
    shared_ = std::move(shared);
    role_ = selects ? TopKRole::kSelect : TopKRole::kReuse;
  }
  const KvMethodParams& params() const { return params_; }
  bool SelectsPerQueryHead() const override { return true; }
  bool SelectsPerKvHead() const override { return !per_query_head(); }
  // A reuse selection layer reads the decode step's attention (dense) and chooses from it, unless
  // it chooses by Quest's page bounds; per query head it asks for the unfolded rows.
  uint32_t NeededObservations() const override {
    if (role_ != TopKRole::kSelect || by_pages()) return 0u;
    return kObserveLast | (per_query_head() ? kObserveQueryHeads : 0u);
  }
  bool ObservesPrompt() const override { return false; }
  void Observe(const AttentionObservation& obs) override {
    if (role_ != TopKRole::kSelect || obs.n_queries != 1) return;
    CheckObservation(obs, n_live_, obs.last, "last");
    if (!shared_) shared_ = std::make_shared<ReuseSelection>();  // used on its own
    const int32_t n_read = std::max(ResolveBudget(budget_, n_live_), 1);
    shared_->n_live = n_live_;
    shared_->whole = n_read >= n_live_;
    shared_->heads.resize(static_cast<size_t>(obs.heads()));  // query heads, or KV heads
    if (shared_->whole) return;
    for (int h = 0; h < obs.heads(); ++h) {
      TopTokens(obs.last + static_cast<size_t>(h) * n_live_, n_read);
      shared_->heads[static_cast<size_t>(h)] = chosen_;
    }
  }
  size_t MetadataBytes() const override {
    return (scores_.capacity() + logits_.capacity() + key_row_.capacity()) * sizeof(float) +
           (order_.capacity() + chosen_.capacity()) * sizeof(int32_t) + in_union_.capacity() +
           all_spans_.capacity() * sizeof(KvSpan) + (pages_index_ ? pages_index_->bytes() : 0);
  }
  // A selection layer counts the choice it publishes to the reuse layers.
  size_t StateBytes() const override {
    size_t published = 0;
    if (role_ == TopKRole::kSelect && shared_) {
      for (const std::vector<int32_t>& h : shared_->heads) published += h.capacity() * sizeof(int32_t);
    }
    return MetadataBytes() + published;
  }

  // One list for every head: the union of the heads' tokens.
  void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) override {
    const int32_t n_read = Begin(ctx, *spans);
    if (n_read == 0) return;
    in_union_.assign(static_cast<size_t>(n_live_), 0);
    for (int h = 0; h < Choosers(ctx); ++h) {
      ChooseHead(h, n_read);
      for (int32_t t : chosen_) in_union_[t] = 1;
    }
    chosen_.clear();
    for (int32_t t = 0; t < n_live_; ++t)
      if (in_union_[t]) chosen_.push_back(t);
    all_spans_ = *spans;
    Runs(ctx, all_spans_, spans);
  }

  bool SelectQueryHeadSpans(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans,
                            std::vector<KvSpan>* head_spans) override {
    const int32_t n_read = Begin(ctx, spans);
    if (n_read == 0) return false;
    const int group = ctx.n_q_heads / ctx.n_kv_heads;
    for (int h = 0; h < Choosers(ctx); ++h) {
      ChooseHead(h, n_read);
      // Per KV head: the group's first list (SelectsPerKvHead).
      Runs(ctx, spans, &head_spans[per_query_head() ? h : h * group]);
    }
    return true;
  }

 private:
  // "head_reduce": "none": a choice per query head (the reference's for reuse); else per KV head.
  bool per_query_head() const { return params_.head_reduce == HeadReduce::kNone; }
  int Choosers(const SpanSelectionContext& ctx) const { return per_query_head() ? ctx.n_q_heads : ctx.n_kv_heads; }

  // Tokens each KV head reads (0: the whole table). The oracle scores (Prepare); a reuse
  // selection layer reads everything (it chooses from the attention it then observes); a reusing
  // layer takes the choice of this step's selection layer.
  int32_t Begin(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    if (role_ == TopKRole::kOracle) return Prepare(ctx, spans);
    const int32_t n_live = CheckedLiveTokens(spans);
    if (role_ == TopKRole::kSelect) return by_pages() ? SelectPages(ctx, spans) : 0;
    KVS_CHECK_MSG(shared_ && shared_->n_live == n_live,
                  fmt::format("reuse: layer {} reuses a selection of {} tokens but holds {} (a selection layer "
                              "must come first in each step)",
                              ctx.layer, shared_ ? shared_->n_live : -1, n_live));
    return shared_->whole ? 0 : 1;
  }

  bool by_pages() const { return role_ == TopKRole::kSelect && params_.selection == ReuseSelectionKind::kQuest; }

  // A selection layer choosing by Quest's page bounds: per KV head, the pages whose bounds fold
  // highest over its query heads (head_reduce, mean by default), the current page always among
  // them (QuestPagesRead pages: Quest's count for the budget), published as live indices. 0 when
  // every page is read (the whole table: everything is published as such).
  int32_t SelectPages(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    if (!shared_) shared_ = std::make_shared<ReuseSelection>();  // used on its own
    const int32_t budget = ResolveBudget(budget_, n_live_);
    const int32_t page = params_.page_tokens > 0 ? params_.page_tokens : ctx.cache_page_size;
    KVS_CHECK_MSG(page >= 1, "reuse: no page size (cache_page_size unset and page_tokens 0)");
    const int32_t n_read = QuestPagesRead(budget, page);
    shared_->n_live = n_live_;
    shared_->whole = budget >= n_live_ || n_read >= (n_live_ + page - 1) / page;
    shared_->heads.resize(static_cast<size_t>(Choosers(ctx)));
    if (shared_->whole) return 0;
    if (!pages_index_) pages_index_.emplace(page, ctx.n_kv_heads, ctx.head_dim);
    KVS_CHECK_MSG(pages_index_->page_tokens() == page && pages_index_->n_kv_heads() == ctx.n_kv_heads &&
                      pages_index_->head_dim() == ctx.head_dim,
                  "reuse: the table's shape changed");
    pages_index_->Update(ctx.storage, spans.data(), static_cast<int32_t>(spans.size()));
    const int32_t n_pages = pages_index_->n_pages();
    const int group = ctx.n_q_heads / ctx.n_kv_heads;
    scores_.resize(static_cast<size_t>(ctx.n_q_heads) * n_pages);  // [n_q_heads, n_pages] bounds
    QuestQueryHeadScores(*pages_index_, ctx.q, ctx.n_q_heads, scores_.data());
    std::vector<float>& folded = logits_;  // [n_pages] one KV head's bounds, folded over its group
    std::vector<int32_t> pages;
    for (int h = 0; h < Choosers(ctx); ++h) {
      const float* bounds = scores_.data() + static_cast<size_t>(h) * n_pages;  // per query head: its own
      if (!per_query_head()) {
        folded.assign(static_cast<size_t>(n_pages), params_.head_reduce == HeadReduce::kMax ? -INFINITY : 0.f);
        for (int g = 0; g < group; ++g) {
          const float* row = scores_.data() + static_cast<size_t>(h * group + g) * n_pages;
          for (int32_t p = 0; p < n_pages; ++p) {
            folded[p] =
                params_.head_reduce == HeadReduce::kMax ? std::max(folded[p], row[p]) : folded[p] + row[p] / group;
          }
        }
        bounds = folded.data();
      }
      QuestSelectPages(bounds, n_pages, n_read, &order_, &pages);
      std::vector<int32_t>& tokens = shared_->heads[static_cast<size_t>(h)];
      tokens.clear();
      for (int32_t p : pages) {
        for (int32_t t = p * page; t < std::min(n_live_, (p + 1) * page); ++t) tokens.push_back(t);
      }
    }
    return 1;
  }

  // chosen_ = KV head h's tokens, selected (n_read of them) or reused.
  void ChooseHead(int h, int32_t n_read) {
    if (role_ == TopKRole::kReuse || by_pages()) {
      chosen_ = shared_->heads[static_cast<size_t>(h)];
    } else {
      TopTokens(scores_.data() + static_cast<size_t>(h) * n_live_, n_read);
    }
  }

  // Tokens each head reads (0: the whole table), with scores_ filled.
  int32_t Prepare(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    const int32_t n_live = CheckedLiveTokens(spans);
    KVS_CHECK_MSG(ctx.n_kv_heads >= 1 && ctx.n_q_heads % ctx.n_kv_heads == 0, "oracle: bad head counts");
    const int32_t budget = ResolveBudget(budget_, n_live);
    if (budget >= n_live) return 0;  // everything fits: read it all (bit-identical to Full)
    Score(ctx, spans);
    return std::max(budget, 1);
  }

  // scores_[h, t]: the folded softmax probability of token t for KV head h (per query head: query
  // head h's own).
  void Score(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    const int d = ctx.head_dim, n_q = ctx.n_q_heads, n_kv = ctx.n_kv_heads, group = n_q / n_kv;
    const float scale = ctx.scale > 0.f ? ctx.scale : 1.f / std::sqrt(static_cast<float>(d));
    logits_.resize(static_cast<size_t>(n_q) * n_live_);  // [n_q_heads, n_live]
    key_row_.resize(static_cast<size_t>(n_kv) * d);      // [n_kv_heads, head_dim]
    int32_t t = 0;
    for (const KvSpan& span : spans) {
      const KvStorage type = SpanStorage(ctx.storage, span);
      for (int32_t j = 0; j < span.n; ++j, ++t) {
        LoadSpanKeyRow(type, span, j, n_kv, d, key_row_.data());
        for (int i = 0; i < n_q; ++i) {
          const float* q = ctx.q + static_cast<size_t>(i) * d;
          const float* k = key_row_.data() + static_cast<size_t>(i / group) * d;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
          logits_[static_cast<size_t>(i) * n_live_ + t] = static_cast<float>(dot * scale);
        }
      }
    }
    scores_.assign(static_cast<size_t>(per_query_head() ? n_q : n_kv) * n_live_, 0.f);
    const bool max_fold = params_.head_reduce == HeadReduce::kMax;
    const int fold = per_query_head() ? 1 : group;  // query heads per scores_ row
    for (int i = 0; i < n_q; ++i) {
      float* row = logits_.data() + static_cast<size_t>(i) * n_live_;
      const float m = *std::max_element(row, row + n_live_);
      double sum = 0;
      for (int32_t u = 0; u < n_live_; ++u) {
        row[u] = std::exp(row[u] - m);  // the logit row becomes unnormalized probabilities
        sum += row[u];
      }
      float* out = scores_.data() + static_cast<size_t>(i / fold) * n_live_;
      for (int32_t u = 0; u < n_live_; ++u) {
        const float p = static_cast<float>(row[u] / sum);
        out[u] = max_fold ? std::max(out[u], p) : out[u] + p / static_cast<float>(fold);
      }
    }
  }

  // chosen_ = the n_read best tokens by score ([n_live]), ascending; the newest always among them.
  void TopTokens(const float* score, int32_t n_read) {
    const int32_t newest = n_live_ - 1;
    order_.resize(static_cast<size_t>(newest));
    for (int32_t t = 0; t < newest; ++t) order_[t] = t;
    const int32_t others = std::min(n_read - 1, newest);
    auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
    std::nth_element(order_.begin(), order_.begin() + others, order_.end(), better);
    chosen_.assign(order_.begin(), order_.begin() + others);
    chosen_.push_back(newest);
    std::sort(chosen_.begin(), chosen_.end());
  }

  // *out = the runs of chosen_ tokens in spans (consecutive tokens of one span form one run).
  void Runs(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans, std::vector<KvSpan>* out) const {
    out->clear();
    size_t next = 0;
    int32_t span_first = 0;
    for (const KvSpan& span : spans) {
      while (next < chosen_.size() && chosen_[next] < span_first + span.n) {
        const int32_t lo = chosen_[next] - span_first;
        int32_t hi = lo + 1;
        while (next + 1 < chosen_.size() && chosen_[next + 1] == span_first + hi && hi < span.n) {
          ++hi;
          ++next;
        }
        ++next;
        out->push_back(SubSpan(ctx.storage, span, lo, hi - lo, ctx.n_kv_heads, ctx.head_dim));
      }
      span_first += span.n;
    }
  }

  std::vector<float> logits_;    // [n_q_heads, n_live] scaled q·k
  std::vector<float> scores_;    // [n_kv_heads (or n_q_heads), n_live] folded probabilities
  std::vector<float> key_row_;   // [n_kv_heads, head_dim]
  std::vector<int32_t> order_;   // [n_live - 1] candidates
  std::vector<int32_t> chosen_;  // tokens read, ascending
  // SelectSpans only: [n_live] tokens some KV head reads; its input spans, copied (they are rewritten).
  std::vector<uint8_t> in_union_;
  std::vector<KvSpan> all_spans_;
  TopKRole role_;
  std::shared_ptr<ReuseSelection> shared_;  // reuse layers of one sequence: one object
  std::optional<QuestPageIndex> pages_index_;  // selection by page bounds: the table's key bounds
};

}  // namespace

std::unique_ptr<KvPolicy> MakeOraclePolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<OraclePolicy>(budget, params, TopKRole::kOracle);
}

std::unique_ptr<KvPolicy> MakeReusePolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<OraclePolicy>(budget, params, TopKRole::kSelect);  // LinkReuseLayers assigns the roles
}

int32_t ReuseReselectLayer(const KvMethodParams& params, int n_layers) {
  return params.reselect_layer >= 0 ? params.reselect_layer
                                    : static_cast<int32_t>(std::lround(n_layers * 13.0 / 32.0));
}

void LinkReuseLayers(std::span<KvPolicy* const> layer_policies) {
  std::shared_ptr<ReuseSelection> shared;
  const int n_layers = static_cast<int>(layer_policies.size());
  for (int layer = 0; layer < n_layers; ++layer) {
    auto* p = dynamic_cast<OraclePolicy*>(layer_policies[static_cast<size_t>(layer)]);
    if (p == nullptr || !p->reuses()) continue;
    const bool first = shared == nullptr;
    if (first) shared = std::make_shared<ReuseSelection>();
    p->Bind(shared, first || layer == ReuseReselectLayer(p->params(), n_layers));
  }
}

}  // namespace kvsparse::policy
