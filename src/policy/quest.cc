// Quest — J. Tang, Y. Zhao, K. Zhu, G. Xiao, B. Kasikci, S. Han, "Quest: Query-Aware Sparsity
// for Efficient Long-Context LLM Inference", ICML 2024, arXiv:2406.10774.
//
// Quest keeps the whole KV cache (it saves reads, not memory): it never evicts. At each decode
// step it bounds every page's best score against the current query from the element-wise key
// minimum and maximum of the page (quest_pages.h), and attention reads only the top pages whose
// tokens fit the budget, always including the most recent page. Prompt processing stays dense,
// as in the paper.
// Defaults (the paper's): pages of 16 tokens — here "page_tokens" 0 = the cache's page size,
// 16 by default; the bound is reduced over the query heads of a kv head's group and then over
// kv heads by the maximum ("head_reduce" "max"). The budget is a token count, or a fraction of
// the live tokens (= the tokens seen: nothing is evicted). The paper leaves the first two layers
// dense; express that per layer in the config ({"layers": "0-1", "method": "full"}).
#include <algorithm>
#include <limits>
#include <optional>

#include "kvsparse/quest_pages.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class QuestPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "quest"; }
  // The page index (bounds by value) is copied; scratch_ is dropped because after a selection
  // it holds the caller's input spans, pointers into the original sequence's cache pages.
  std::unique_ptr<KvPolicy> Clone() const override {
    auto copy = std::make_unique<QuestPolicy>(*this);
    copy->scratch_.clear();
    return copy;
  }
  // Never evicts: the budget bounds the tokens a decode step reads, not the tokens kept.
  int32_t BudgetTokens(int32_t) const override { return std::numeric_limits<int32_t>::max(); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    KVS_CHECK_MSG(ctx.target == ctx.n_live, "quest never evicts: target must equal n_live");
    keep->assign(ctx.n_live, 1);
  }
  void OnEvict(const std::vector<uint8_t>& keep) override {
    for (uint8_t k : keep) KVS_CHECK_MSG(k, "quest never evicts");
  }

  bool SelectsSpans() const override { return true; }
  // The page bounds and every buffer selection uses, allocated.
  size_t MetadataBytes() const override {
    return (index_ ? index_->bytes() : 0) + scores_.capacity() * sizeof(float) +
           (order_.capacity() + pages_.capacity()) * sizeof(int32_t) + scratch_.capacity() * sizeof(KvSpan);
  }

  void SelectSpans(const SpanSelectionContext& ctx, std::vector<KvSpan>* spans) override {
    int32_t n_live = 0;
    for (const KvSpan& s : *spans) n_live += s.n;
    KVS_CHECK_MSG(n_live == n_live_, "quest: the spans hold a different number of tokens than were appended");
    const int32_t budget = ResolveBudget(budget_, n_live);
    if (budget >= n_live) return;  // everything fits: read it all (bit-identical to Full)
    if (!index_) {
      const int32_t page = params_.page_tokens > 0 ? params_.page_tokens : ctx.cache_page_size;
      KVS_CHECK_MSG(page >= 1, "quest: no page size (cache_page_size unset and page_tokens 0)");
      index_.emplace(page, ctx.n_kv_heads, ctx.head_dim);
    }
    KVS_CHECK_MSG(index_->n_kv_heads() == ctx.n_kv_heads && index_->head_dim() == ctx.head_dim,
                  "quest: the table's shape changed");
    index_->Update(ctx.storage, spans->data(), static_cast<int32_t>(spans->size()));
    scores_.resize(static_cast<size_t>(index_->n_pages()));
    QuestPageScores(*index_, ctx.q, ctx.n_q_heads, params_.head_reduce, scores_.data());
    QuestSelectPages(scores_.data(), index_->n_pages(), index_->page_tokens(), n_live, budget, &order_, &pages_);
    QuestFilterSpans(ctx.storage, ctx.n_kv_heads, ctx.head_dim, pages_, index_->page_tokens(), spans, &scratch_);
  }

 private:
  int32_t n_live_ = 0;
  std::optional<QuestPageIndex> index_;  // built at the first decode step that selects
  std::vector<float> scores_;            // [n_pages]
  std::vector<int32_t> order_, pages_;
  std::vector<KvSpan> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeQuestPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<QuestPolicy>(budget, params);
}

}  // namespace kvsparse::policy
