// Quest's page index and selection (J. Tang, Y. Zhao, K. Zhu, G. Xiao, B. Kasikci, S. Han,
// "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
// arXiv:2406.10774).
//
// Quest keeps the whole KV cache and, at each decode step, lets attention read only the pages
// whose keys can score highest against the current query. Per page and KV head it keeps the
// element-wise minimum and maximum of the keys over the page's tokens; for a query q,
//   bound(page) = Σ_c max(q_c · min_c, q_c · max_c)  >=  q · k  for every key k of the page,
// so a page holding a high-scoring key always has a high bound.
//
// A Quest page is `page_tokens` consecutive live tokens of one table (a layer's, or one KV
// head's in a per-head layer), aligned at multiples of page_tokens in the live list; with the
// cache's page size it is exactly a cache page, otherwise pages are cut from (or joined over)
// the cache's spans. The index is keyed by live-token index, which is stable because Quest
// layers never evict.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"

namespace kvsparse {

// Per-page key bounds of one table.
class QuestPageIndex {
 public:
  // page_tokens >= 1; n_kv_heads: heads in each span row (1 for HeadSpans); head_dim >= 1.
  QuestPageIndex(int32_t page_tokens, int n_kv_heads, int head_dim);

  // Brings the bounds up to date with the table's live tokens `spans` (all of them, ascending
  // positions, layer storage `storage`), reading keys as stored (dequantized). Folds only the
  // tokens appended since the last call. Re-folds pages whose stored keys changed: an int8_kivi
  // residual page quantized since it was folded, or every page when tokens already folded were
  // removed (RemoveRange, Clear: detected by the live count and the position of the last token
  // folded).
  void Update(KvStorage storage, const KvSpan* spans, int32_t n_spans);

  int32_t page_tokens() const { return page_tokens_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int32_t n_tokens() const { return n_folded_; }  // live tokens folded into the bounds
  int32_t n_pages() const { return (n_folded_ + page_tokens_ - 1) / page_tokens_; }
  // [n_kv_heads, head_dim] element-wise minimum / maximum of the page's keys.
  const float* page_min(int32_t page) const { return &min_[static_cast<size_t>(page) * row_]; }
  const float* page_max(int32_t page) const { return &max_[static_cast<size_t>(page) * row_]; }
  // Bytes allocated by the index: both bound arrays and its key-row scratch (capacities).
  size_t bytes() const { return (min_.capacity() + max_.capacity() + key_row_.capacity()) * sizeof(float); }

 private:
  void ResetPages(int32_t first_page, int32_t n_pages);

  int32_t page_tokens_;
  int n_kv_heads_;
  int head_dim_;
  size_t row_;                 // n_kv_heads * head_dim
  std::vector<float> min_;     // [n_pages, n_kv_heads, head_dim]
  std::vector<float> max_;     // [n_pages, n_kv_heads, head_dim]
  int32_t n_folded_ = 0;       // live tokens [0, n_folded_) are folded
  int32_t last_position_ = 0;  // position of live token n_folded_ - 1
  int32_t unstable_from_;      // first folded token read from a full-precision int8_kivi residual
  std::vector<float> key_row_; // [n_kv_heads, head_dim] scratch
};

// Upper bound of q · k over the keys of a page for one query head: Σ_c max(q_c min_c, q_c max_c).
// q, key_min, key_max: [head_dim].
float QuestBound(const float* q, const float* key_min, const float* key_max, int head_dim);

// Page scores for one decode query, folded over query heads (head_reduce "max" / "mean"). q:
// [n_q_heads, head_dim], the query heads of kv head h being h * group .. h * group + group - 1
// (group = n_q_heads / index.n_kv_heads()). Each kv head's score is `reduce` over its group's
// bounds, the page's score `reduce` over kv heads. scores: [index.n_pages()]; NaN bounds count
// as -inf. `reduce` must be kMax or kMean.
void QuestPageScores(const QuestPageIndex& index, const float* q, int n_q_heads, HeadReduce reduce, float* scores);

// Page scores of every query head on its own (head_reduce "none", the reference's): query head
// i against its kv head i / group. q: [n_q_heads, head_dim]; scores: [n_q_heads, index.n_pages()];
// NaN bounds count as -inf.
void QuestQueryHeadScores(const QuestPageIndex& index, const float* q, int n_q_heads, float* scores);

// Pages a decode step reads under a budget of budget_tokens, as the reference does:
// max(3, budget_tokens / page_tokens) (rounded down), the most recent page included.
int32_t QuestPagesRead(int32_t budget_tokens, int32_t page_tokens);

// The pages attention reads: the last (most recent, the current token's) page, then the
// n_read - 1 best of the others by descending score (ties: the earlier page); every page when
// n_read >= n_pages. *pages gets the selected page indices ascending; *order is scratch.
void QuestSelectPages(const float* scores, int32_t n_pages, int32_t n_read, std::vector<int32_t>* order,
                      std::vector<int32_t>* pages);

// The runs covering exactly the tokens of `pages` (ascending page indices of page_tokens
// tokens) within `spans` (a table's live spans, ascending, storage `storage`, rows of
// n_kv_heads x head_dim), in order; runs of one span that touch are merged. *out is replaced.
void QuestFilterSpans(KvStorage storage, int n_kv_heads, int head_dim, const std::vector<int32_t>& pages,
                      int32_t page_tokens, const std::vector<KvSpan>& spans, std::vector<KvSpan>* out);
// The same in place: *spans becomes the runs; *scratch is reused.
void QuestFilterSpans(KvStorage storage, int n_kv_heads, int head_dim, const std::vector<int32_t>& pages,
                      int32_t page_tokens, std::vector<KvSpan>* spans, std::vector<KvSpan>* scratch);

namespace ref {
// Scalar twin of QuestBound: double accumulation, in order.
double QuestBound(const float* q, const float* key_min, const float* key_max, int head_dim);
}  // namespace ref

}  // namespace kvsparse
