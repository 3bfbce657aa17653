// ops::ScoreMatrix: every row's dot product with every key, through the attention kernel's QK
// blocks (attention_kernels-inl.h): each block of 16 keys is packed once and scored against all
// rows, two at a time. The sparse prefill estimators score up to 64 queries x their group
// against every key with a head_dim (or stride x head_dim) inner dimension, a shape the weight
// GEMM (ops::MatMul) tiles poorly. Compiled once per kernel family (ops/simd_family.h).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "kvsparse/ops.h"
#include "ops/attention_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/score_matrix.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

// The family region's pragmas come before the kernel primitives it compiles.
// clang-format off
#include "ops/family_begin-inl.h"
#include "ops/attention_kernels-inl.h"
// clang-format on
namespace kvsparse::ops::HWY_NAMESPACE {

namespace {

using namespace attn_detail;  // NOLINT: the kernel's own primitives

constexpr int64_t kBlocksPerUnit = 16;  // key blocks one thread scores at a time

// Key blocks [first_block, end_block): out columns of those keys, every row.
void ScoreKeyBlocks(const float* padded_rows, int64_t n_rows, int dp, const float* keys, int64_t n_keys, int dim,
                    int64_t first_block, int64_t end_block, float* out) {
  static thread_local AlignedBuffer pack_buffer;
  float* k_block = pack_buffer.Get(static_cast<size_t>(kBlock) * dp);  // packed as the family lays K out
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t t0 = b * kBlock;
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, n_keys - t0));
    const uint8_t* key_rows[kBlock];
    for (int j = 0; j < n_block; ++j) key_rows[j] = reinterpret_cast<const uint8_t*>(keys + (t0 + j) * dim);
    PackK(KvStorage::kF32, key_rows, nullptr, nullptr, n_block, dim, dp, k_block);
    int64_t r = 0;
    for (; r + 2 <= n_rows; r += 2) {
      ScoreVec scores[2];
      ScoreRows<2>(padded_rows + r * dp, dp, k_block, scores);
      StoreScoresInTokenOrder(scores[0], n_block, out + r * n_keys + t0);
      StoreScoresInTokenOrder(scores[1], n_block, out + (r + 1) * n_keys + t0);
    }
    if (r < n_rows) {
      ScoreVec scores[1];
      ScoreRows<1>(padded_rows + r * dp, dp, k_block, scores);
      StoreScoresInTokenOrder(scores[0], n_block, out + r * n_keys + t0);
    }
  }
}

}  // namespace

void ScoreMatrixImpl(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, float* out,
                     int n_threads) {
  if (n_rows <= 0 || n_keys <= 0) return;
  const int dp = static_cast<int>(RoundUp(dim, kBlock));
  static thread_local AlignedBuffer row_buffer;
  float* padded_rows = row_buffer.Get(static_cast<size_t>(n_rows) * dp);  // [n_rows, dp], zero-padded
  for (int64_t r = 0; r < n_rows; ++r) {
    std::copy_n(rows + r * dim, dim, padded_rows + r * dp);
    std::fill(padded_rows + r * dp + dim, padded_rows + (r + 1) * dp, 0.f);
  }
  const int64_t n_blocks = (n_keys + kBlock - 1) / kBlock;
  const int64_t n_units = (n_blocks + kBlocksPerUnit - 1) / kBlocksPerUnit;
  const int threads = static_cast<int>(std::min<int64_t>(n_threads > 0 ? n_threads : omp_get_max_threads(), n_units));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t u = 0; u < n_units; ++u) {
    ScoreKeyBlocks(padded_rows, n_rows, dp, keys, n_keys, dim, u * kBlocksPerUnit,
                   std::min(n_blocks, (u + 1) * kBlocksPerUnit), out);
  }
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(ScoreMatrixImpl);

void ScoreMatrix(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, float* out,
                 int n_threads) {
  KVS_DISPATCH(ScoreMatrixImpl)(rows, n_rows, keys, n_keys, dim, out, n_threads);
}

}  // namespace kvsparse::ops

namespace kvsparse::ref {

void ScoreMatrix(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, float* out) {
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t t = 0; t < n_keys; ++t) {
      double sum = 0;
      for (int c = 0; c < dim; ++c) sum += static_cast<double>(rows[r * dim + c]) * keys[t * dim + c];
      out[r * n_keys + t] = static_cast<float>(sum);
    }
  }
}

}  // namespace kvsparse::ref
#endif  // HWY_ONCE
