// Score gathering from the raw scores ops::Attention wrote during a decode step: no second
// pass over K, one exp2 per (query head, token). Probabilities are computed exactly as in
// ops::AttentionScores (same Exp2, same log2-domain max, same fold order), so the outputs
// match it to float rounding (bit for bit for a single query, within a kernel family).
//
// Work is split into units of (kv head, token chunk); a unit owns its output columns and walks
// its tokens in blocks of 16, folding every query's heads per block. Compiled once per kernel
// family (ops/simd_family.h); ops::GatherScoresFromRaw runs the active family's version.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvsparse/attention_scores.h"
#include "ops/attention_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/attention_scores_raw.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/attention_kernels-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

namespace {

using namespace attn_detail;  // NOLINT: the kernel's own primitives (this family's and the shared ones)

constexpr int64_t kMinChunkTokens = 256;                 // smallest token chunk worth a separate unit
constexpr int64_t kMinParallelWork = int64_t{1} << 15;   // exp2s below which threads cost more than they save

struct RawPlan {
  int n_heads = 0;
  int group = 0;
  int64_t n_tokens = 0;
  int32_t n_q = 0;
  const int32_t* q_pos = nullptr;
  const float* raw = nullptr;      // [n_q, n_heads, n_tokens]
  const float* row_max = nullptr;  // [n_q * n_heads] softmax max, log2 domain (0 for rows that see nothing)
  const float* row_inv = nullptr;  // [n_q * n_heads] 1 / softmax sum (0: the row sees nothing)
  ScoreGathering gathering;
  ScoreOutputs outputs;
};

void RunRawUnit(const RawPlan& plan, int kv_head, int64_t t_begin, int64_t t_end) {
  const bool max_fold = plan.gathering.aggregation == GqaAggregation::kMax;
  const float fold_scale = max_fold ? 1.f : 1.f / static_cast<float>(plan.group);
  const ScoreOutputs& out = plan.outputs;
  const size_t out_row = static_cast<size_t>(kv_head) * plan.n_tokens;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kBlock) {
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, t_end - t0));
#if KVS_ISA_AVX512
    const __mmask16 block_mask = static_cast<__mmask16>((1u << n_block) - 1);
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    __m512 sum_all = _mm512_setzero_ps(), sum_window = _mm512_setzero_ps(), last = _mm512_setzero_ps();
    for (int32_t i = 0; i < plan.n_q; ++i) {
      __m512 folded = _mm512_setzero_ps();
      for (int g = 0; g < plan.group; ++g) {
        const size_t row = static_cast<size_t>(i) * plan.n_heads + kv_head * plan.group + g;
        if (plan.row_inv[row] == 0.f) continue;  // the row sees nothing: p = 0
        const __m512 x = _mm512_maskz_loadu_ps(block_mask, plan.raw + row * plan.n_tokens + t0);
        // Tokens the query does not see hold -inf: p must be exactly 0 there (Exp2 clamps).
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(block_mask, x, neg_inf, _CMP_NEQ_OQ);
        const __m512 e = Exp2(_mm512_sub_ps(x, _mm512_set1_ps(plan.row_max[row])));
        const __m512 p = _mm512_maskz_mul_ps(seen, e, _mm512_set1_ps(plan.row_inv[row]));
        folded = max_fold ? _mm512_max_ps(folded, p) : _mm512_add_ps(folded, p);
      }
      folded = _mm512_mul_ps(folded, _mm512_set1_ps(fold_scale));
      sum_all = _mm512_add_ps(sum_all, folded);
      if (plan.q_pos[i] >= plan.gathering.window_start) sum_window = _mm512_add_ps(sum_window, folded);
      if (i == plan.n_q - 1) last = folded;
    }
    const size_t at = out_row + static_cast<size_t>(t0);
    if (out.sum_all != nullptr) _mm512_mask_storeu_ps(out.sum_all + at, block_mask, sum_all);
    if (out.sum_window != nullptr) _mm512_mask_storeu_ps(out.sum_window + at, block_mask, sum_window);
    if (out.last != nullptr) _mm512_mask_storeu_ps(out.last + at, block_mask, last);
#elif KVS_ISA_AVX2
    // Two halves of 8 tokens; the same operations as Probabilities (attention_kernels-inl.h).
    const __m256 neg_inf = _mm256_set1_ps(kNegInf);
    for (int half = 0; half < 2 && 8 * half < n_block; ++half) {
      const __m256 in_block = ValidLanes(n_block, 8 * half);
      const __m256i load_mask = _mm256_castps_si256(in_block);
      __m256 sum_all = _mm256_setzero_ps(), sum_window = _mm256_setzero_ps(), last = _mm256_setzero_ps();
      for (int32_t i = 0; i < plan.n_q; ++i) {
        __m256 folded = _mm256_setzero_ps();
        for (int g = 0; g < plan.group; ++g) {
          const size_t row = static_cast<size_t>(i) * plan.n_heads + kv_head * plan.group + g;
          if (plan.row_inv[row] == 0.f) continue;  // the row sees nothing: p = 0
          const __m256 x = _mm256_maskload_ps(plan.raw + row * plan.n_tokens + t0 + 8 * half, load_mask);
          // Tokens the query does not see hold -inf: p must be exactly 0 there.
          const __m256 seen = _mm256_and_ps(in_block, _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
          const __m256 e = Exp2(_mm256_sub_ps(x, _mm256_set1_ps(plan.row_max[row])));
          const __m256 p = _mm256_and_ps(seen, _mm256_mul_ps(e, _mm256_set1_ps(plan.row_inv[row])));
          folded = max_fold ? _mm256_max_ps(folded, p) : _mm256_add_ps(folded, p);
        }
        folded = _mm256_mul_ps(folded, _mm256_set1_ps(fold_scale));
        sum_all = _mm256_add_ps(sum_all, folded);
        if (plan.q_pos[i] >= plan.gathering.window_start) sum_window = _mm256_add_ps(sum_window, folded);
        if (i == plan.n_q - 1) last = folded;
      }
      const size_t at = out_row + static_cast<size_t>(t0) + 8 * half;
      if (out.sum_all != nullptr) _mm256_maskstore_ps(out.sum_all + at, load_mask, sum_all);
      if (out.sum_window != nullptr) _mm256_maskstore_ps(out.sum_window + at, load_mask, sum_window);
      if (out.last != nullptr) _mm256_maskstore_ps(out.last + at, load_mask, last);
    }
#else
    float sum_all[kBlock] = {}, sum_window[kBlock] = {}, last[kBlock] = {};
    for (int32_t i = 0; i < plan.n_q; ++i) {
      float folded[kBlock] = {};
      for (int g = 0; g < plan.group; ++g) {
        const size_t row = static_cast<size_t>(i) * plan.n_heads + kv_head * plan.group + g;
        if (plan.row_inv[row] == 0.f) continue;
        const float* x = plan.raw + row * plan.n_tokens + t0;
        for (int j = 0; j < n_block; ++j) {
          const float p = x[j] == kNegInf ? 0.f : std::exp2(x[j] - plan.row_max[row]) * plan.row_inv[row];
          folded[j] = max_fold ? std::max(folded[j], p) : folded[j] + p;
        }
      }
      for (int j = 0; j < n_block; ++j) {
        folded[j] *= fold_scale;
        sum_all[j] += folded[j];
        if (plan.q_pos[i] >= plan.gathering.window_start) sum_window[j] += folded[j];
        if (i == plan.n_q - 1) last[j] = folded[j];
      }
    }
    const size_t at = out_row + static_cast<size_t>(t0);
    if (out.sum_all != nullptr) std::copy(sum_all, sum_all + n_block, out.sum_all + at);
    if (out.sum_window != nullptr) std::copy(sum_window, sum_window + n_block, out.sum_window + at);
    if (out.last != nullptr) std::copy(last, last + n_block, out.last + at);
#endif
  }
}

}  // namespace

void GatherScoresFromRawImpl(const AttentionShape& shape, const int32_t* q_pos, int32_t n_q, int64_t n_tokens,
                             const float* raw_scores, const float* row_max_sum, const ScoreGathering& gathering,
                             const ScoreOutputs& outputs, int n_threads) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0);
  KVS_CHECK_MSG(shape.n_heads % shape.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  KVS_CHECK(n_q >= 0 && n_tokens >= 0);
  KVS_CHECK_MSG(n_q == 0 || n_tokens == 0 || (raw_scores != nullptr && row_max_sum != nullptr),
                "GatherScoresFromRaw needs the raw_scores and row_max_sum of ops::Attention");
  if (n_tokens == 0) return;
  if (n_threads <= 0) n_threads = omp_get_max_threads();

  // Per row: the max in the scores' log2 domain and 1 / sum, as ops::AttentionScores derives them.
  const size_t n_rows = static_cast<size_t>(n_q) * shape.n_heads;
  static thread_local std::vector<float> row_stats;  // [2, n_rows]
  row_stats.resize(2 * n_rows);
  float* row_max = row_stats.data();
  float* row_inv = row_max + n_rows;
  for (size_t row = 0; row < n_rows; ++row) {
    const float sum = row_max_sum[2 * row + 1];
    row_inv[row] = sum > 0.f ? 1.f / sum : 0.f;
    row_max[row] = sum > 0.f ? row_max_sum[2 * row] * kLog2e : 0.f;
  }

  RawPlan plan;
  plan.n_heads = shape.n_heads;
  plan.group = shape.n_heads / shape.n_kv_heads;
  plan.n_tokens = n_tokens;
  plan.n_q = n_q;
  plan.q_pos = q_pos;
  plan.raw = raw_scores;
  plan.row_max = row_max;
  plan.row_inv = row_inv;
  plan.gathering = gathering;
  plan.outputs = outputs;

  // Enough (kv head, chunk) units for every thread when the work pays for them.
  if (static_cast<int64_t>(n_rows) * n_tokens < kMinParallelWork) n_threads = 1;
  int64_t chunk_tokens = RoundUp(std::max<int64_t>(n_tokens, 1), kBlock);
  if (n_threads > 1) {
    const int64_t wanted = (2 * n_threads + shape.n_kv_heads - 1) / shape.n_kv_heads;  // chunks per kv head
    chunk_tokens = std::max<int64_t>(kMinChunkTokens, RoundUp((n_tokens + wanted - 1) / wanted, kBlock));
  }
  const int n_chunks = static_cast<int>((n_tokens + chunk_tokens - 1) / chunk_tokens);
  const int n_units = shape.n_kv_heads * n_chunks;
  const int threads = std::min(n_threads, n_units);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int u = 0; u < n_units; ++u) {
    const int64_t t_begin = static_cast<int64_t>(u / shape.n_kv_heads) * chunk_tokens;
    RunRawUnit(plan, u % shape.n_kv_heads, t_begin, std::min(n_tokens, t_begin + chunk_tokens));
  }
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(GatherScoresFromRawImpl);

void GatherScoresFromRaw(const AttentionShape& shape, const int32_t* q_pos, int32_t n_q, int64_t n_tokens,
                         const float* raw_scores, const float* row_max_sum, const ScoreGathering& gathering,
                         const ScoreOutputs& outputs, int n_threads) {
  KVS_DISPATCH(GatherScoresFromRawImpl)(shape, q_pos, n_q, n_tokens, raw_scores, row_max_sum, gathering, outputs,
                                        n_threads);
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
