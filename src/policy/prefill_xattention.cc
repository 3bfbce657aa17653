// XAttention sparse prefill (Xu et al., "XAttention: Block Sparse Attention with Antidiagonal
// Scoring", ICML 2025; see sparse_prefill.h). Defaults: 128-token blocks, stride 8, threshold 0.9.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvsparse/ops.h"
#include "kvsparse/sparse_prefill.h"
#include "kvsparse/status.h"
#include "policy/sparse_prefill_internal.h"

namespace kvsparse {

void PrefillSelector::XAttention(const PrefillSparsity& c, const AttentionShape& s, const float* q,
                                 const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens,
                                 int n_threads, PrefillSelection* out) {
  using namespace prefill_detail;  // NOLINT
  const int group = s.n_heads, d = s.head_dim, S = c.stride, B = c.block;
  KVS_CHECK_MSG(B % S == 0, "xattention: the block must be a multiple of the stride");
  const int32_t n_qt = (n_q + S - 1) / S;       // query tiles
  const int64_t n_kt = (n_tokens + S - 1) / S;  // key tiles; keys holds n_kt * S rows (zero padded)
  // Strided queries [n_qt, group, S * d]: tile a, head g holds q[aS + S-1-t] for t = 0..S-1, so
  // that its product with key tile b's S consecutive rows (one row of S * d) sums the tile's
  // antidiagonal. Queries past the chunk are zero.
  std::vector<float>& strided_q = b_;
  strided_q.assign(static_cast<size_t>(n_qt) * group * S * d, 0.f);
  for (int32_t a = 0; a < n_qt; ++a) {
    for (int g = 0; g < group; ++g) {
      float* dst = strided_q.data() + (static_cast<size_t>(a) * group + g) * S * d;
      for (int t = 0; t < S; ++t) {
        const int32_t i = a * S + S - 1 - t;
        if (i < n_q) std::copy_n(q + (static_cast<size_t>(i) * group + g) * d, d, dst + static_cast<size_t>(t) * d);
      }
    }
  }
  // a_: [n_qt * group, n_kt] antidiagonal scores.
  ScoreProducts(strided_q.data(), static_cast<int64_t>(n_qt) * group, keys, n_kt, S * d, n_threads, &a_,
                PrepareEstimateKeys(c, keys, n_kt, S * d, n_threads, &int8_keys_));

  // Per query tile: softmax over the key tiles it reaches (its last query's view, the tile's
  // diagonal tile included whole, as in the reference), mean over the group, summed into the
  // block grid [n_qb, n_kb].
  const int tiles_per_block = B / S;
  const int32_t n_qb = (n_q + B - 1) / B;
  const int64_t n_kb = (n_tokens + B - 1) / B;
  const int n_out = PrefillSelectionsPerKvHead(c, group);  // 1: the group's mean; group: each head its own
  std::vector<float>& block_score = c_;  // [n_out, n_qb, n_kb]
  block_score.assign(static_cast<size_t>(n_out) * n_qb * n_kb, 0.f);
  const float scale = s.scale / static_cast<float>(S);
  const float fold = n_out == 1 ? 1.f / static_cast<float>(group) : 1.f;
  for (int32_t a = 0; a < n_qt; ++a) {
    const int64_t seen = visible[std::min(n_q - 1, a * S + S - 1)];
    const int64_t tiles = (seen + S - 1) / S;
    if (tiles == 0) continue;
    for (int g = 0; g < group; ++g) {
      const size_t grid = n_out == 1 ? 0 : static_cast<size_t>(g);
      float* grid_row = block_score.data() + (grid * n_qb + static_cast<size_t>(a / tiles_per_block)) * n_kb;
      float* row = a_.data() + (static_cast<size_t>(a) * group + g) * n_kt;
      for (int64_t b = 0; b < tiles; ++b) row[b] *= scale;
      ops::Softmax(row, tiles);
      for (int64_t b = 0; b < tiles; ++b) grid_row[b / tiles_per_block] += row[b] * fold;
    }
  }

  std::vector<char> keep(static_cast<size_t>(n_kb));
  for (int o = 0; o < n_out; ++o) {
    RangeAssembler ranges(B, &out[o]);
    for (int32_t qb = 0; qb < n_qb; ++qb) {
      const int32_t b0 = qb * B, b1 = std::min(n_q, b0 + B) - 1;
      const int64_t limit = visible[b1];
      const int64_t causal_blocks = (limit + B - 1) / B;
      const float* score = block_score.data() + (static_cast<size_t>(o) * n_qb + qb) * n_kb;
      double total = 0;
      for (int64_t kb = 0; kb < causal_blocks; ++kb) total += score[kb];
      // Forced: the sink block and the blocks of the query block's own tokens.
      std::fill(keep.begin(), keep.begin() + causal_blocks, 0);
      const auto [own_begin, own_end] = OwnTokens(visible, b0, b1);
      keep[0] = 1;
      for (int64_t kb = own_begin / B; kb * B < own_end; ++kb) keep[kb] = 1;
      double kept = 0;
      for (int64_t kb = 0; kb < causal_blocks; ++kb) kept += keep[kb] ? score[kb] : 0.0;
      // Then by descending score while the kept share is below the threshold.
      index_.clear();
      for (int64_t kb = 0; kb < causal_blocks; ++kb) {
        if (!keep[kb]) index_.push_back(kb);
      }
      std::sort(index_.begin(), index_.end(), [&](int64_t x, int64_t y) { return score[x] > score[y]; });
      for (int64_t kb : index_) {
        if (kept >= c.threshold * total) break;
        keep[kb] = 1;
        kept += score[kb];
      }
      for (int64_t kb = 0; kb < causal_blocks; ++kb) {
        if (keep[kb]) ranges.Add(kb * B, (kb + 1) * B);
      }
      ranges.EndBlock(limit);
    }
  }
}

}  // namespace kvsparse
