// ops::ScoreMatrix: every row's dot product with every key, through the attention kernel's QK
// blocks (attention_kernels-inl.h): each block of 16 keys is packed once and scored against all
// rows, two at a time. The sparse prefill estimators score up to 64 queries x their group
// against every key with a head_dim (or stride x head_dim) inner dimension, a shape the weight
// GEMM (ops::MatMul) tiles poorly. Compiled once per kernel family (ops/simd_family.h).
#include <omp.h>

#include <algorithm>
#include <cstdlib>
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

// ---- int8 products (ops::ScoreMatrixInt8) ----

// The address that names this family's Int8Keys layout.
constexpr char kInt8KeysLayout = 0;

#if KVS_ISA_AVX512
// Scores of kRows rows (codes dp apart, from row_codes; their steps and code sums) against one
// packed key block (PackKCodes: codes + 128 as u8, so each dot is less 128 * the row's code sum),
// in lane order: (dot * step_r) * lane step.
template <int kRows>
void ScoreRowsInt8(const int8_t* row_codes, const float* row_steps, const int32_t* row_sums, int dp,
                   const uint8_t* k_codes, const float* lane_steps, ScoreVec* scores) {
  __m512i even[kRows], odd[kRows];  // two dependency chains per row
  for (int r = 0; r < kRows; ++r) even[r] = odd[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < dp / 4; c += 2) {
    const __m512i k0 = _mm512_load_si512(k_codes + c * 64), k1 = _mm512_load_si512(k_codes + (c + 1) * 64);
    for (int r = 0; r < kRows; ++r) {
      const int8_t* q = row_codes + static_cast<size_t>(r) * dp + 4 * c;
      even[r] = _mm512_dpbusd_epi32(even[r], k0, _mm512_set1_epi32(*reinterpret_cast<const AliasedI32*>(q)));
      odd[r] = _mm512_dpbusd_epi32(odd[r], k1, _mm512_set1_epi32(*reinterpret_cast<const AliasedI32*>(q + 4)));
    }
  }
  const __m512 steps = _mm512_load_ps(lane_steps);
  for (int r = 0; r < kRows; ++r) {
    const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(even[r], odd[r]), _mm512_set1_epi32(128 * row_sums[r]));
    scores[r] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(row_steps[r])), steps);
  }
}
#elif KVS_ISA_SCALAR
// The twin: plain integer sums over the key rows (PackKCodes keeps them as [kBlock, dp] codes),
// the same float operations in the same order.
template <int kRows>
void ScoreRowsInt8(const int8_t* row_codes, const float* row_steps, const int32_t* /*row_sums*/, int dp,
                   const uint8_t* k_codes, const float* lane_steps, ScoreVec* scores) {
  for (int r = 0; r < kRows; ++r) {
    const int8_t* q = row_codes + static_cast<size_t>(r) * dp;
    for (int j = 0; j < kBlock; ++j) {
      const int8_t* k = reinterpret_cast<const int8_t*>(k_codes) + static_cast<size_t>(j) * dp;
      int32_t dot = 0;
      for (int c = 0; c < dp; ++c) dot += int32_t{q[c]} * k[c];
      scores[r].s[j] = static_cast<float>(dot) * row_steps[r] * lane_steps[j];
    }
  }
}
#else
// No integer dots in this family (Int8ScoresAvailable is false): declared for the discarded branches.
template <int kRows>
void ScoreRowsInt8(const int8_t* row_codes, const float* row_steps, const int32_t* row_sums, int dp,
                   const uint8_t* k_codes, const float* lane_steps, ScoreVec* scores);
#endif

// Key blocks [first_block, end_block) of ScoreMatrixInt8: out columns of those keys, every row.
void ScoreKeyBlocksInt8(const int8_t* row_codes, const float* row_steps, const int32_t* row_sums, int64_t n_rows,
                        const Int8Keys& keys, int64_t first_block, int64_t end_block, float* out) {
  const int dp = keys.dp;
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t t0 = b * kBlock;
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, keys.n_keys - t0));
    const uint8_t* k_codes = keys.codes() + static_cast<size_t>(b) * kBlock * dp;
    const float* lane_steps = keys.lane_steps() + b * kBlock;
    auto rows = [&]<int kRows>(int64_t r) {
      ScoreVec scores[kRows];
      ScoreRowsInt8<kRows>(row_codes + r * dp, row_steps + r, row_sums + r, dp, k_codes, lane_steps, scores);
      for (int i = 0; i < kRows; ++i) StoreScoresInTokenOrder(scores[i], n_block, out + (r + i) * keys.n_keys + t0);
    };
    int64_t r = 0;
    for (; r + 4 <= n_rows; r += 4) rows.template operator()<4>(r);
    for (; r < n_rows; ++r) rows.template operator()<1>(r);
  }
}

}  // namespace

bool Int8ScoresAvailableImpl() { return kIntegerDots; }

void QuantizeKeysInt8Impl(const float* keys, int64_t n_keys, int dim, Int8Keys* out, int n_threads) {
  KVS_CHECK_MSG(kIntegerDots, "QuantizeKeysInt8: this kernel family has no integer dots (Int8ScoresAvailable)");
  KVS_CHECK(n_keys >= 0 && dim > 0);
  const int dp = static_cast<int>(RoundUp(dim, kBlock));
  const int64_t n_blocks = (n_keys + kBlock - 1) / kBlock;
  out->n_keys = n_keys;
  out->dim = dim;
  out->dp = dp;
  out->layout = &kInt8KeysLayout;
  const size_t bytes = out->CodeBytes() + static_cast<size_t>(n_blocks) * kBlock * sizeof(float);
  if (bytes > out->capacity) {
    out->buffer.reset(std::aligned_alloc(64, RoundUp(static_cast<int64_t>(bytes), 64)));
    KVS_CHECK_MSG(out->buffer != nullptr, "QuantizeKeysInt8: out of memory");
    out->capacity = bytes;
  }
  uint8_t* packed = static_cast<uint8_t*>(out->buffer.get());
  float* lane_steps = reinterpret_cast<float*>(packed + out->CodeBytes());
  static thread_local std::vector<int8_t> key_codes;  // [n_keys, dp]
  static thread_local std::vector<float> key_steps;   // [n_keys]
  key_codes.resize(static_cast<size_t>(n_keys) * dp);
  key_steps.resize(static_cast<size_t>(n_keys));
  int8_t* codes = key_codes.data();  // (the calling thread's buffers, shared with the workers)
  float* steps = key_steps.data();
  const int threads = static_cast<int>(std::min<int64_t>(n_threads > 0 ? n_threads : omp_get_max_threads(), n_blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t t0 = b * kBlock;
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, n_keys - t0));
    QuantizeInt8Rows(keys + t0 * dim, n_block, dim, dp, codes + t0 * dp, steps + t0, nullptr);
    const uint8_t* rows[kBlock];
    for (int j = 0; j < n_block; ++j) rows[j] = reinterpret_cast<const uint8_t*>(codes + (t0 + j) * dp);
    if constexpr (kIntegerDots) PackKCodes(rows, n_block, dp, packed + static_cast<size_t>(b) * kBlock * dp);
    ScalesInLaneOrder(steps + t0, n_block, lane_steps + t0);
  }
}

void ScoreMatrixInt8Impl(const float* rows, int64_t n_rows, const Int8Keys& keys, float* out, int n_threads) {
  KVS_CHECK_MSG(keys.layout == &kInt8KeysLayout, "ScoreMatrixInt8: keys packed by another kernel family");
  if (n_rows <= 0 || keys.n_keys <= 0) return;
  static thread_local std::vector<int8_t> row_codes;  // [n_rows, dp]
  static thread_local std::vector<float> row_steps;
  static thread_local std::vector<int32_t> row_sums;
  row_codes.resize(static_cast<size_t>(n_rows) * keys.dp);
  row_steps.resize(static_cast<size_t>(n_rows));
  row_sums.resize(static_cast<size_t>(n_rows));
  QuantizeInt8Rows(rows, n_rows, keys.dim, keys.dp, row_codes.data(), row_steps.data(), row_sums.data());
  const int8_t* codes = row_codes.data();  // (the calling thread's buffers, shared with the workers)
  const float* steps = row_steps.data();
  const int32_t* sums = row_sums.data();
  const int64_t n_blocks = (keys.n_keys + kBlock - 1) / kBlock;
  const int64_t n_units = (n_blocks + kBlocksPerUnit - 1) / kBlocksPerUnit;
  const int threads = static_cast<int>(std::min<int64_t>(n_threads > 0 ? n_threads : omp_get_max_threads(), n_units));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t u = 0; u < n_units; ++u) {
    if constexpr (kIntegerDots) {
      ScoreKeyBlocksInt8(codes, steps, sums, n_rows, keys, u * kBlocksPerUnit,
                         std::min(n_blocks, (u + 1) * kBlocksPerUnit), out);
    }
  }
}

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
HWY_EXPORT(Int8ScoresAvailableImpl);
HWY_EXPORT(QuantizeKeysInt8Impl);
HWY_EXPORT(ScoreMatrixInt8Impl);

bool Int8ScoresAvailable() { return KVS_DISPATCH(Int8ScoresAvailableImpl)(); }

void QuantizeKeysInt8(const float* keys, int64_t n_keys, int dim, Int8Keys* out, int n_threads) {
  KVS_DISPATCH(QuantizeKeysInt8Impl)(keys, n_keys, dim, out, n_threads);
}

void ScoreMatrixInt8(const float* rows, int64_t n_rows, const Int8Keys& keys, float* out, int n_threads) {
  KVS_DISPATCH(ScoreMatrixInt8Impl)(rows, n_rows, keys, out, n_threads);
}

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
