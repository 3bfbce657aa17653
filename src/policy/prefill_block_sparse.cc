// Block-Sparse sparse prefill (MInference, Jiang et al., NeurIPS 2024; see sparse_prefill.h).
// Defaults: 64-token blocks, the top 100 key blocks per query block, plus (our addition) the
// blocks holding the query block's own tokens.
#include <algorithm>
#include <limits>
#include <numeric>

#include "kvsparse/sparse_prefill.h"
#include "policy/sparse_prefill_internal.h"

namespace kvsparse {

void PrefillSelector::BlockSparse(const PrefillSparsity& c, const AttentionShape& s, const float* q,
                                  const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens,
                                  int n_threads, PrefillSelection* out) {
  using namespace prefill_detail;  // NOLINT
  const int group = s.n_heads, d = s.head_dim, B = c.block;
  const int32_t n_qb = (n_q + B - 1) / B;
  const int64_t n_kb = (n_tokens + B - 1) / B;
  // Mean-pooled keys [n_kb, d] and queries [n_qb, group, d] (a short last block: its own mean).
  std::vector<float>& pooled_k = b_;
  pooled_k.assign(static_cast<size_t>(n_kb) * d, 0.f);
  for (int64_t kb = 0; kb < n_kb; ++kb) {
    const int64_t t0 = kb * B, t1 = std::min<int64_t>(n_tokens, t0 + B);
    float* dst = pooled_k.data() + static_cast<size_t>(kb) * d;
    for (int64_t t = t0; t < t1; ++t) {
      const float* k = keys + static_cast<size_t>(t) * d;
      for (int e = 0; e < d; ++e) dst[e] += k[e];
    }
    const float inv = 1.f / static_cast<float>(t1 - t0);
    for (int e = 0; e < d; ++e) dst[e] *= inv;
  }
  std::vector<float>& pooled_q = c_;
  pooled_q.assign(static_cast<size_t>(n_qb) * group * d, 0.f);
  for (int32_t qb = 0; qb < n_qb; ++qb) {
    const int32_t i0 = qb * B, i1 = std::min(n_q, i0 + B);
    float* dst = pooled_q.data() + static_cast<size_t>(qb) * group * d;
    for (int32_t i = i0; i < i1; ++i) {
      const float* row = q + static_cast<size_t>(i) * group * d;
      for (int e = 0; e < group * d; ++e) dst[e] += row[e];
    }
    const float inv = 1.f / static_cast<float>(i1 - i0);
    for (int e = 0; e < group * d; ++e) dst[e] *= inv;
  }
  // a_: [n_qb * group, n_kb] pooled products, unscaled (MInference ranks them as they are).
  ScoreProducts(pooled_q.data(), static_cast<int64_t>(n_qb) * group, pooled_k.data(), n_kb, d, n_threads, &a_,
                PrepareEstimateKeys(c, pooled_k.data(), n_kb, d, n_threads, &int8_keys_));

  const int n_out = PrefillSelectionsPerKvHead(c, group);  // 1: the group's sum; group: each head its own
  std::vector<float> score(static_cast<size_t>(n_kb));
  for (int o = 0; o < n_out; ++o) {
    RangeAssembler ranges(B, &out[o]);
    const int g_begin = n_out == 1 ? 0 : o, g_end = n_out == 1 ? group : o + 1;
    for (int32_t qb = 0; qb < n_qb; ++qb) {
      const int32_t b0 = qb * B, b1 = std::min(n_q, b0 + B) - 1;
      const int64_t limit = visible[b1];
      const int64_t causal_blocks = (limit + B - 1) / B;  // key blocks the block's last query reaches
      std::fill(score.begin(), score.begin() + causal_blocks, 0.f);
      for (int g = g_begin; g < g_end; ++g) {
        const float* row = a_.data() + (static_cast<size_t>(qb) * group + g) * n_kb;
        for (int64_t kb = 0; kb < causal_blocks; ++kb) score[kb] += row[kb];
      }
      // The blocks of the query block's own tokens first, then the best others.
      const auto [own_begin, own_end] = OwnTokens(visible, b0, b1);
      for (int64_t kb = own_begin / B; kb * B < own_end; ++kb) score[kb] = std::numeric_limits<float>::infinity();
      index_.resize(static_cast<size_t>(causal_blocks));
      std::iota(index_.begin(), index_.end(), int64_t{0});
      const int64_t keep = std::min<int64_t>(causal_blocks, c.top_blocks);
      std::nth_element(index_.begin(), index_.begin() + keep, index_.end(),
                       [&](int64_t a, int64_t b) { return score[a] > score[b]; });
      for (int64_t j = 0; j < keep; ++j) ranges.Add(index_[j] * B, (index_[j] + 1) * B);
      ranges.Add(own_begin, own_end);  // (when own blocks outnumber top_blocks)
      ranges.EndBlock(limit);
    }
  }
}

}  // namespace kvsparse
