// Quest's page index, bound, page choice and span filter (see quest_pages.h).
#include "kvsparse/quest_pages.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

namespace kvsparse {
namespace {

}  // namespace

QuestPageIndex::QuestPageIndex(int32_t page_tokens, int n_kv_heads, int head_dim)
    : page_tokens_(page_tokens),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      row_(static_cast<size_t>(n_kv_heads) * head_dim),
      unstable_from_(INT32_MAX),
      key_row_(row_) {
  KVS_CHECK_MSG(page_tokens >= 1 && n_kv_heads >= 1 && head_dim >= 1, "QuestPageIndex: bad shape");
}

void QuestPageIndex::ResetPages(int32_t first_page, int32_t n_pages) {
  const size_t need = static_cast<size_t>(n_pages) * row_;
  min_.resize(need);
  max_.resize(need);
  const size_t from = static_cast<size_t>(first_page) * row_;
  std::fill(min_.begin() + from, min_.end(), std::numeric_limits<float>::infinity());
  std::fill(max_.begin() + from, max_.end(), -std::numeric_limits<float>::infinity());
}

void QuestPageIndex::Update(KvStorage storage, const KvSpan* spans, int32_t n_spans) {
  int64_t n_live64 = 0;
  for (int32_t s = 0; s < n_spans; ++s) n_live64 += spans[s].n;
  KVS_CHECK(n_live64 <= INT32_MAX);
  const int32_t n_live = static_cast<int32_t>(n_live64);

  // Where folding starts: the first token not folded yet, or earlier when folded keys changed.
  int32_t from = n_folded_;
  if (n_folded_ > n_live) {
    from = 0;  // tokens were removed
  } else if (n_folded_ > 0) {
    // Tokens already folded are unchanged iff the last of them still sits at its index:
    // positions strictly increase, so removing any earlier token moves a later one there.
    int32_t index = 0;
    for (int32_t s = 0; s < n_spans; ++s) {
      const int32_t t = n_folded_ - 1 - index;
      if (t < spans[s].n) {
        if (spans[s].positions[t] != last_position_) from = 0;
        break;
      }
      index += spans[s].n;
    }
  }
  if (from > 0 && unstable_from_ < n_folded_) {
    // An int8_kivi residual folded at full precision: once quantized, its keys differ slightly.
    int32_t index = 0;
    for (int32_t s = 0; s < n_spans; ++s) {
      if (unstable_from_ < index + spans[s].n) {
        if (SpanStorage(storage, spans[s]) == storage) from = std::min(from, unstable_from_);
        break;
      }
      index += spans[s].n;
    }
  }
  const int32_t n_pages_now = (n_live + page_tokens_ - 1) / page_tokens_;
  if (from < n_folded_) {
    const int32_t first_page = from / page_tokens_;
    from = first_page * page_tokens_;
    ResetPages(first_page, n_pages_now);
  } else {
    ResetPages(n_pages(), n_pages_now);  // only the pages not begun yet
  }
  if (from <= unstable_from_) unstable_from_ = INT32_MAX;

  int32_t index = 0;  // live index of the span's first token
  for (int32_t s = 0; s < n_spans; ++s) {
    const KvSpan& span = spans[s];
    const KvStorage type = SpanStorage(storage, span);
    for (int32_t i = std::max(0, from - index); i < span.n; ++i) {
      const int32_t token = index + i;
      if (type != storage) unstable_from_ = std::min(unstable_from_, token);
      LoadSpanKeyRow(type, span, i, n_kv_heads_, head_dim_, key_row_.data());
      float* mn = &min_[static_cast<size_t>(token / page_tokens_) * row_];
      float* mx = &max_[static_cast<size_t>(token / page_tokens_) * row_];
      for (size_t e = 0; e < row_; ++e) {
        mn[e] = std::min(mn[e], key_row_[e]);
        mx[e] = std::max(mx[e], key_row_[e]);
      }
    }
    index += span.n;
  }
  n_folded_ = n_live;
  if (n_live > 0) last_position_ = spans[n_spans - 1].positions[spans[n_spans - 1].n - 1];
}

float QuestBound(const float* q, const float* key_min, const float* key_max, int head_dim) {
  // Eight independent partial sums so the loop vectorizes without reassociation flags.
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= head_dim; c += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float a = q[c + j] * key_min[c + j], b = q[c + j] * key_max[c + j];
      acc[j] += a > b ? a : b;
    }
  }
  float sum = 0.f;
  for (; c < head_dim; ++c) sum += std::max(q[c] * key_min[c], q[c] * key_max[c]);
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

namespace ref {
double QuestBound(const float* q, const float* key_min, const float* key_max, int head_dim) {
  double sum = 0.0;
  for (int c = 0; c < head_dim; ++c) {
    sum += std::max(static_cast<double>(q[c]) * key_min[c], static_cast<double>(q[c]) * key_max[c]);
  }
  return sum;
}
}  // namespace ref

void QuestPageScores(const QuestPageIndex& index, const float* q, int n_q_heads, HeadReduce reduce, float* scores) {
  const int heads = index.n_kv_heads(), d = index.head_dim();
  KVS_CHECK_MSG(n_q_heads >= heads && n_q_heads % heads == 0,
                "QuestPageScores: the query heads must be a multiple of the kv heads");
  KVS_CHECK_MSG(reduce != HeadReduce::kNone, "QuestPageScores folds heads: use QuestQueryHeadScores for none");
  const int group = n_q_heads / heads;
  const bool max = reduce == HeadReduce::kMax;
  for (int32_t page = 0; page < index.n_pages(); ++page) {
    const float* mn = index.page_min(page);
    const float* mx = index.page_max(page);
    float page_score = max ? -std::numeric_limits<float>::infinity() : 0.f;
    for (int h = 0; h < heads; ++h) {
      float head_score = max ? -std::numeric_limits<float>::infinity() : 0.f;
      for (int g = 0; g < group; ++g) {
        float b = QuestBound(q + static_cast<size_t>(h * group + g) * d, mn + static_cast<size_t>(h) * d,
                             mx + static_cast<size_t>(h) * d, d);
        if (std::isnan(b)) b = -std::numeric_limits<float>::infinity();
        head_score = max ? std::max(head_score, b) : head_score + b;
      }
      if (!max) head_score /= static_cast<float>(group);
      page_score = max ? std::max(page_score, head_score) : page_score + head_score;
    }
    if (!max) page_score /= static_cast<float>(heads);
    scores[page] = std::isnan(page_score) ? -std::numeric_limits<float>::infinity() : page_score;
  }
}

void QuestQueryHeadScores(const QuestPageIndex& index, const float* q, int n_q_heads, float* scores) {
  const int heads = index.n_kv_heads(), d = index.head_dim();
  KVS_CHECK_MSG(n_q_heads >= heads && n_q_heads % heads == 0,
                "QuestQueryHeadScores: the query heads must be a multiple of the kv heads");
  const int group = n_q_heads / heads;
  const int32_t n_pages = index.n_pages();
  // Page-major walk: each page's bounds are read once for all query heads.
  for (int32_t page = 0; page < n_pages; ++page) {
    const float* mn = index.page_min(page);
    const float* mx = index.page_max(page);
    for (int i = 0; i < n_q_heads; ++i) {
      const size_t kv = static_cast<size_t>(i / group) * d;
      const float b = QuestBound(q + static_cast<size_t>(i) * d, mn + kv, mx + kv, d);
      scores[static_cast<size_t>(i) * n_pages + page] = std::isnan(b) ? -std::numeric_limits<float>::infinity() : b;
    }
  }
}

int32_t QuestPagesRead(int32_t budget_tokens, int32_t page_tokens) {
  KVS_CHECK(page_tokens >= 1);
  return std::max<int32_t>(3, std::max(budget_tokens, 0) / page_tokens);
}

void QuestSelectPages(const float* scores, int32_t n_pages, int32_t n_read, std::vector<int32_t>* order,
                      std::vector<int32_t>* pages) {
  pages->clear();
  if (n_pages <= 0) return;
  const int32_t last = n_pages - 1;
  // The last page is always read and counts as one of n_read.
  const int32_t k = std::clamp(n_read - 1, 0, last);
  order->resize(static_cast<size_t>(last));
  for (int32_t p = 0; p < last; ++p) (*order)[p] = p;
  // (score descending, page ascending) is a strict total order: the choice is deterministic.
  auto better = [scores](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  if (k < last) std::nth_element(order->begin(), order->begin() + k, order->end(), better);
  pages->assign(order->begin(), order->begin() + k);
  pages->push_back(last);
  std::sort(pages->begin(), pages->end());
}

void QuestFilterSpans(KvStorage storage, int n_kv_heads, int head_dim, const std::vector<int32_t>& pages,
                      int32_t page_tokens, const std::vector<KvSpan>& spans, std::vector<KvSpan>* out) {
  KVS_CHECK(out != &spans);
  out->clear();
  size_t s = 0;
  int32_t span_first = 0;  // live index of spans[s]'s first token
  int32_t last_source = -1, last_end = -1;  // the run last emitted: its span and end (within the span)
  for (int32_t page : pages) {
    const int32_t first = page * page_tokens;
    const int32_t end = first + page_tokens;
    // Skip the spans that end before the page.
    while (s < spans.size() && span_first + spans[s].n <= first) span_first += spans[s++].n;
    // The spans the page overlaps (several when Quest pages are larger than cache pages).
    int32_t t_first = span_first;
    for (size_t t = s; t < spans.size() && t_first < end; t_first += spans[t++].n) {
      const KvSpan& span = spans[t];
      const int32_t lo = std::max(first, t_first) - t_first;
      const int32_t hi = std::min(end, t_first + span.n) - t_first;
      if (hi <= lo) continue;
      if (last_source == static_cast<int32_t>(t) && last_end == lo) {
        out->back().n += hi - lo;  // continues the previous run of the same span
      } else {
        out->push_back(SubSpan(storage, span, lo, hi - lo, n_kv_heads, head_dim));
      }
      last_source = static_cast<int32_t>(t);
      last_end = hi;
    }
  }
}

void QuestFilterSpans(KvStorage storage, int n_kv_heads, int head_dim, const std::vector<int32_t>& pages,
                      int32_t page_tokens, std::vector<KvSpan>* spans, std::vector<KvSpan>* scratch) {
  QuestFilterSpans(storage, n_kv_heads, head_dim, pages, page_tokens, *spans, scratch);
  spans->swap(*scratch);
}

}  // namespace kvsparse
