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
#include <algorithm>
#include <cmath>

#include "kvsparse/kv_types.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class OraclePolicy final : public ReadSparsePolicy {
 public:
  using ReadSparsePolicy::ReadSparsePolicy;
  std::string_view name() const override { return "oracle"; }
  // all_spans_ is dropped: after a selection it points into the original sequence's pages.
  std::unique_ptr<KvPolicy> Clone() const override {
    auto copy = std::make_unique<OraclePolicy>(*this);
    copy->all_spans_.clear();
    return copy;
  }
  bool SelectsPerQueryHead() const override { return true; }
  size_t MetadataBytes() const override {
    return (scores_.capacity() + logits_.capacity() + key_row_.capacity()) * sizeof(float) +
           (order_.capacity() + chosen_.capacity()) * sizeof(int32_t) + in_union_.capacity() +
           all_spans_.capacity() * sizeof(KvSpan);
  }

  // One list for every head: the union of the KV heads' tokens.
  void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) override {
    const int32_t n_read = Prepare(ctx, *spans);
    if (n_read == 0) return;
    in_union_.assign(static_cast<size_t>(n_live_), 0);
    for (int h = 0; h < ctx.n_kv_heads; ++h) {
      SelectHead(h, n_read);
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
    const int32_t n_read = Prepare(ctx, spans);
    if (n_read == 0) return false;
    const int group = ctx.n_q_heads / ctx.n_kv_heads;
    for (int h = 0; h < ctx.n_kv_heads; ++h) {
      SelectHead(h, n_read);
      Runs(ctx, spans, &head_spans[h * group]);
      for (int g = 1; g < group; ++g) head_spans[h * group + g] = head_spans[h * group];
    }
    return true;
  }

 private:
  // Tokens each KV head reads (0: the whole table), with scores_ [n_kv_heads, n_live] filled.
  int32_t Prepare(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    const int32_t n_live = CheckedLiveTokens(spans);
    KVS_CHECK_MSG(ctx.n_kv_heads >= 1 && ctx.n_q_heads % ctx.n_kv_heads == 0, "oracle: bad head counts");
    const int32_t budget = ResolveBudget(budget_, n_live);
    if (budget >= n_live) return 0;  // everything fits: read it all (bit-identical to Full)
    Score(ctx, spans);
    return std::max(budget, 1);
  }

  // scores_[h, t]: the folded softmax probability of token t for KV head h.
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
    scores_.assign(static_cast<size_t>(n_kv) * n_live_, 0.f);
    const bool max_fold = params_.head_reduce == HeadReduce::kMax;
    for (int i = 0; i < n_q; ++i) {
      float* row = logits_.data() + static_cast<size_t>(i) * n_live_;
      const float m = *std::max_element(row, row + n_live_);
      double sum = 0;
      for (int32_t u = 0; u < n_live_; ++u) {
        row[u] = std::exp(row[u] - m);  // the logit row becomes unnormalized probabilities
        sum += row[u];
      }
      float* out = scores_.data() + static_cast<size_t>(i / group) * n_live_;
      for (int32_t u = 0; u < n_live_; ++u) {
        const float p = static_cast<float>(row[u] / sum);
        out[u] = max_fold ? std::max(out[u], p) : out[u] + p / static_cast<float>(group);
      }
    }
  }

  // chosen_ = the n_read best tokens of KV head h, ascending; the newest always among them.
  void SelectHead(int h, int32_t n_read) {
    const float* score = scores_.data() + static_cast<size_t>(h) * n_live_;
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
  std::vector<float> scores_;    // [n_kv_heads, n_live] folded probabilities
  std::vector<float> key_row_;   // [n_kv_heads, head_dim]
  std::vector<int32_t> order_;   // [n_live - 1] candidates
  std::vector<int32_t> chosen_;  // tokens read, ascending
  // SelectSpans only: [n_live] tokens some KV head reads; its input spans, copied (they are rewritten).
  std::vector<uint8_t> in_union_;
  std::vector<KvSpan> all_spans_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeOraclePolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<OraclePolicy>(budget, params);
}

}  // namespace kvsparse::policy
