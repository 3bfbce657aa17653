// Vertical-Slash sparse prefill (MInference, Jiang et al., NeurIPS 2024; see sparse_prefill.h).
// Defaults: last_q 64, vertical 1000, slash 6096, 64-query blocks. The first 30 columns and the
// 100 nearest diagonals score +inf, so they are kept *within* those counts, and the counts are at
// least 30 and 50 (minference_forward.py's vertical_and_slash_kernel: `max(vertical_size, 30)`,
// `max(slash_size, 50)`): slash=32 keeps the 50 nearest diagonals, as the reference does.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvsparse/ops.h"
#include "kvsparse/sparse_prefill.h"
#include "policy/sparse_prefill_internal.h"

namespace kvsparse {

namespace {

// MInference's least counts of columns and diagonals, whatever the configured ones.
constexpr int64_t kLeastVertical = 30, kLeastSlash = 50;

// Indices of the `count` largest scores (all of them when there are fewer), ascending; of equal
// scores the lower index first (the earlier column, the nearer diagonal: among the forced ones,
// scored +inf, when the count is smaller than they are).
void TopIndices(const float* score, int64_t n, int64_t count, std::vector<int64_t>* index) {
  index->resize(static_cast<size_t>(n));
  std::iota(index->begin(), index->end(), int64_t{0});
  if (count < n) {
    std::nth_element(index->begin(), index->begin() + count, index->end(),
                     [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
    index->resize(static_cast<size_t>(count));
  }
  std::sort(index->begin(), index->end());
}

}  // namespace

void PrefillSelector::VerticalSlash(const PrefillSparsity& c, const AttentionShape& s, const float* q,
                                    const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens,
                                    int n_threads, PrefillSelection* out) {
  const int n_out = PrefillSelectionsPerKvHead(c, s.n_heads);
  patterns_.resize(static_cast<size_t>(n_out));
  EstimateVerticalSlash(c, s, q, visible, n_q, keys, n_tokens, n_threads, patterns_.data());
  for (int o = 0; o < n_out; ++o) AssembleVerticalSlash(c, visible, n_q, patterns_[o], &out[o]);
}

void PrefillSelector::EstimateVerticalSlash(const PrefillSparsity& c, const AttentionShape& s, const float* q,
                                            const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens,
                                            int n_threads, VerticalSlashPattern* out) {
  using namespace prefill_detail;  // NOLINT
  const int group = s.n_heads, d = s.head_dim;
  const int n_out = PrefillSelectionsPerKvHead(c, group);  // 1: the group's mean; group: each head its own
  const int32_t last_q = std::min<int32_t>(c.last_q, n_q);
  const int32_t first = n_q - last_q;        // the estimating queries: first .. n_q - 1
  const int64_t horizon = visible[n_q - 1];  // the last query sees the most
  std::vector<float>& vertical = b_;         // [n_out, horizon] column sums
  std::vector<float>& slash = c_;            // [n_out, horizon] diagonal sums: offset o = newest seen - key
  vertical.assign(static_cast<size_t>(n_out) * horizon, 0.f);
  slash.assign(static_cast<size_t>(n_out) * horizon, 0.f);
  std::vector<float>& mean = d_;  // [n_tokens] one query's probabilities, mean over its group
  const float inv_group = 1.f / static_cast<float>(group);
  // The estimating queries' scores against every key, kSlab queries at a time (a_: [kSlab * group,
  // n_tokens]), which bounds the scratch at long contexts.
  constexpr int32_t kSlab = 8;
  // The estimating queries times the softmax scale, so the products come out scaled.
  std::vector<float>& scaled_q = e_;  // [last_q, group, head_dim]
  scaled_q.assign(q + static_cast<size_t>(first) * group * d, q + static_cast<size_t>(n_q) * group * d);
  for (float& x : scaled_q) x *= s.scale;
  const ops::Int8Keys* int8_keys = PrepareEstimateKeys(c, keys, n_tokens, d, n_threads, &int8_keys_);
  for (int32_t i = 0; i < last_q; ++i) {
    const int32_t slab_row = i % kSlab;
    if (slab_row == 0) {
      const int32_t slab = std::min(kSlab, last_q - i);
      ScoreProducts(scaled_q.data() + static_cast<size_t>(i) * group * d, static_cast<int64_t>(slab) * group, keys,
                    n_tokens, d, n_threads, &a_, int8_keys);
    }
    const int64_t seen = visible[first + i];
    if (seen == 0) continue;
    if (n_out == 1) mean.assign(static_cast<size_t>(seen), 0.f);
    for (int g = 0; g < group; ++g) {
      float* row = a_.data() + (static_cast<size_t>(slab_row) * group + g) * n_tokens;  // causal: its first `seen` keys
      ops::Softmax(row, seen);
      if (n_out == 1) {
        ops::Add(mean.data(), row, seen);
        continue;
      }
      float* head_vertical = vertical.data() + static_cast<size_t>(g) * horizon;
      float* head_slash = slash.data() + static_cast<size_t>(g) * horizon;
      for (int64_t t = 0; t < seen; ++t) {
        head_vertical[t] += row[t];
        head_slash[seen - 1 - t] += row[t];
      }
    }
    if (n_out > 1) continue;
    for (int64_t t = 0; t < seen; ++t) {
      const float p = mean[t] * inv_group;
      vertical[t] += p;
      slash[seen - 1 - t] += p;
    }
  }
  for (int o = 0; o < n_out; ++o) {
    TopPattern(c, horizon, vertical.data() + static_cast<size_t>(o) * horizon,
               slash.data() + static_cast<size_t>(o) * horizon, &out[o]);
  }
}

void PrefillSelector::TopPattern(const PrefillSparsity& c, int64_t horizon, float* vertical_sums, float* slash_sums,
                                 VerticalSlashPattern* out) {
  const float kKeep = std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < std::min<int64_t>(c.sink_columns, horizon); ++t) vertical_sums[t] = kKeep;
  for (int64_t o = 0; o < std::min<int64_t>(c.local_diagonals, horizon); ++o) slash_sums[o] = kKeep;
  // The forced ones (scored +inf) count within the counts, as in the reference.
  TopIndices(vertical_sums, horizon, std::max<int64_t>(c.vertical, kLeastVertical), &out->columns);
  TopIndices(slash_sums, horizon, std::max<int64_t>(c.slash, kLeastSlash), &out->diagonals);
}

void PrefillSelector::AssembleVerticalSlash(const PrefillSparsity& c, const int64_t* visible, int32_t n_q,
                                            const VerticalSlashPattern& pattern, PrefillSelection* out) {
  using namespace prefill_detail;  // NOLINT
  const std::vector<int64_t>& columns = pattern.columns;
  const std::vector<int64_t>& diagonals = pattern.diagonals;
  RangeAssembler ranges(c.block, out);
  for (int32_t b0 = 0; b0 < n_q; b0 += c.block) {
    const int32_t b1 = std::min<int32_t>(n_q, b0 + c.block) - 1;  // the block's last query
    const int64_t limit = visible[b1];
    // Diagonal o of query i is its key visible[i] - 1 - o: over the block, a band. The bands
    // come farthest first (ascending begins) with the columns and the block's own tokens merged
    // in, so a block's ranges (about 7000 at the defaults) arrive sorted and EndBlock skips its sort.
    auto column = columns.begin();
    auto add_columns_up_to = [&](int64_t begin) {  // the columns t <= begin still to add, t < limit
      for (; column != columns.end() && *column <= begin && *column < limit; ++column) ranges.Add(*column, *column + 1);
    };
    for (auto o = diagonals.rbegin(); o != diagonals.rend(); ++o) {
      const int64_t band_begin = visible[b0] - 1 - *o;
      add_columns_up_to(band_begin);
      ranges.Add(band_begin, visible[b1] - *o);
    }
    const auto [own_begin, own_end] = OwnTokens(visible, b0, b1);
    add_columns_up_to(own_begin);
    ranges.Add(own_begin, own_end);
    add_columns_up_to(limit);
    ranges.EndBlock(limit);
  }
}

}  // namespace kvsparse
