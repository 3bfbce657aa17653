// Quest — J. Tang, Y. Zhao, K. Zhu, G. Xiao, B. Kasikci, S. Han, "Quest: Query-Aware Sparsity
// for Efficient Long-Context LLM Inference", ICML 2024, arXiv:2406.10774; reference code
// github.com/mit-han-lab/Quest (evaluation/quest_attention.py, quest/utils/controller.py).
//
// Quest keeps the whole KV cache (it saves reads, not memory): it never evicts. At each decode
// step it bounds every page's best score against the current query from the element-wise key
// minimum and maximum of the page (quest_pages.h), and attention reads only the best pages.
// Prompt processing stays dense, as in the paper.
// Defaults (the reference's):
// - pages of 16 tokens: "page_tokens" 0 = the cache's page size, 16 by default (32 when a layer
//   stores a KIVI type: set "page_tokens" 16 there for the paper's pages);
// - selection per query head ("head_reduce" "none"): each query head bounds the pages of its
//   kv head with its own query and attends only the pages it picked (the reference repeats the
//   kv heads over the query heads and takes a top-k per query head). "max" / "mean" fold the
//   bounds over the query heads of each kv head, then over kv heads, into one choice per table;
// - pages read: max(3, budget / page_tokens), rounded down (the evaluation code's count), the
//   last page (holding the current token) always among them (the kernels' rule: the last page
//   is read and counted, the others are the top of the rest);
// - the first two layers dense (the reference's skip): the policy factory's "dense_layers".
// The budget is a token count, or a fraction of the live tokens (= the tokens seen: nothing is
// evicted).
// Deliberate differences: a budget that covers every live token reads the whole table (the
// reference rounds the budget down to whole pages and may drop one page of a table whose last
// page is partly filled), so such a budget is bit-identical to Full; the evaluation code does not
// force the last page into the top-k (its kernels do, as here); ties between equal bounds go to
// the earlier page (torch.topk leaves their order open).
#include <algorithm>
#include <optional>

#include "kvsparse/quest_pages.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class QuestPolicy final : public ReadSparsePolicy {
 public:
  using ReadSparsePolicy::ReadSparsePolicy;
  std::string_view name() const override { return "quest"; }
  // The page index (bounds by value) is copied; scratch_ is dropped because after a selection
  // it holds the caller's input spans, pointers into the original sequence's cache pages.
  std::unique_ptr<KvPolicy> Clone() const override {
    auto copy = std::make_unique<QuestPolicy>(*this);
    copy->scratch_.clear();
    return copy;
  }
  bool SelectsPerQueryHead() const override { return params_.head_reduce == HeadReduce::kNone; }
  // The page bounds and every buffer selection uses, allocated.
  size_t MetadataBytes() const override {
    return (index_ ? index_->bytes() : 0) + scores_.capacity() * sizeof(float) +
           (order_.capacity() + pages_.capacity()) * sizeof(int32_t) + chosen_.capacity() +
           scratch_.capacity() * sizeof(KvSpan);
  }

  // One list for every head. Per query head ("none"), a caller that attends all heads over one
  // list gets the union of the pages the query heads picked, so each still sees its own.
  void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) override {
    const int32_t n_read = Prepare(ctx, *spans);
    if (n_read == 0) return;
    const int32_t n_pages = index_->n_pages();
    if (SelectsPerQueryHead()) {
      ScoreQueryHeads(ctx);
      chosen_.assign(static_cast<size_t>(n_pages), 0);
      for (int i = 0; i < ctx.n_q_heads; ++i) {
        QuestSelectPages(scores_.data() + static_cast<size_t>(i) * n_pages, n_pages, n_read, &order_, &pages_);
        for (int32_t p : pages_) chosen_[p] = 1;
      }
      pages_.clear();
      for (int32_t p = 0; p < n_pages; ++p)
        if (chosen_[p]) pages_.push_back(p);
    } else {
      scores_.resize(static_cast<size_t>(n_pages));
      QuestPageScores(*index_, ctx.q, ctx.n_q_heads, params_.head_reduce, scores_.data());
      QuestSelectPages(scores_.data(), n_pages, n_read, &order_, &pages_);
    }
    QuestFilterSpans(ctx.storage, ctx.n_kv_heads, ctx.head_dim, pages_, index_->page_tokens(), spans, &scratch_);
  }

  bool SelectQueryHeadSpans(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans,
                            std::vector<KvSpan>* head_spans) override {
    const int32_t n_read = Prepare(ctx, spans);
    if (n_read == 0) return false;
    const int32_t n_pages = index_->n_pages();
    ScoreQueryHeads(ctx);
    for (int i = 0; i < ctx.n_q_heads; ++i) {
      QuestSelectPages(scores_.data() + static_cast<size_t>(i) * n_pages, n_pages, n_read, &order_, &pages_);
      QuestFilterSpans(ctx.storage, ctx.n_kv_heads, ctx.head_dim, pages_, index_->page_tokens(), spans,
                       &head_spans[i]);
    }
    return true;
  }

 private:
  // Pages a decode step reads, with the index brought up to date; 0 when the whole table is
  // read (nothing to select, and no index is built for it).
  int32_t Prepare(const SpanSelectionContext& ctx, const std::vector<KvSpan>& spans) {
    const int32_t n_live = CheckedLiveTokens(spans);
    const int32_t budget = ResolveBudget(budget_, n_live);
    if (budget >= n_live) return 0;  // everything fits: read it all (bit-identical to Full)
    const int32_t page = params_.page_tokens > 0 ? params_.page_tokens : ctx.cache_page_size;
    KVS_CHECK_MSG(page >= 1, "quest: no page size (cache_page_size unset and page_tokens 0)");
    const int32_t n_read = QuestPagesRead(budget, page);
    if (n_read >= (n_live + page - 1) / page) return 0;  // as many pages as the table has
    if (!index_) index_.emplace(page, ctx.n_kv_heads, ctx.head_dim);
    KVS_CHECK_MSG(index_->page_tokens() == page && index_->n_kv_heads() == ctx.n_kv_heads &&
                      index_->head_dim() == ctx.head_dim,
                  "quest: the table's shape changed");
    index_->Update(ctx.storage, spans.data(), static_cast<int32_t>(spans.size()));
    return n_read;
  }

  // scores_ = [n_q_heads, n_pages] each query head's bounds.
  void ScoreQueryHeads(const SpanSelectionContext& ctx) {
    scores_.resize(static_cast<size_t>(ctx.n_q_heads) * index_->n_pages());
    QuestQueryHeadScores(*index_, ctx.q, ctx.n_q_heads, scores_.data());
  }

  std::optional<QuestPageIndex> index_;  // built at the first decode step that selects
  std::vector<float> scores_;            // [n_pages] folded, or [n_q_heads, n_pages] per query head
  std::vector<int32_t> order_, pages_;
  std::vector<uint8_t> chosen_;          // [n_pages] union of the query heads' pages (SelectSpans)
  std::vector<KvSpan> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeQuestPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<QuestPolicy>(budget, params);
}

}  // namespace kvsparse::policy
