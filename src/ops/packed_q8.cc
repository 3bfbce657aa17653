// Packers of the Q8 activation layout (packed_q8.h), compiled once per kernel family: the layout
// and the block quantizer are the family's.
#include <cstring>

#include "kvsparse/dtype.h"
#include "ops/packed_q8.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/packed_q8.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/packed_q8-inl.h"
#include "ops/quantize-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {

// d * sum(q) of one quantized block (exact in f32: an 11-bit d times a 9-bit sum; 0 for padding).
inline float BlockSum(float d, const int8_t* block_q) {
  int32_t sum = 0;
  for (int e = 0; e < kQK8_0; ++e) sum += block_q[e];
  return d * static_cast<float>(sum);
}

// Zeroes the block sums past the steps' blocks: the min kernels read them a vector at a time.
inline void ZeroBlockSumPadding(float* sums, int64_t cols) {
  for (int64_t b = PackedSteps(cols) * kStepBlocks; b < BlockSumCount(cols); ++b) sums[b] = 0.f;
}

// Both element orders keep each 16-element half of a block contiguous.
inline void PlaceBlock(const int8_t* block_q, Q8Order order, int j, int8_t* step_q) {
  for (int half = 0; half < kQK8_0; half += 16) {
    std::memcpy(step_q + PositionInStep(order, j, half), block_q + half, 16);
  }
}

void PackQ8Token(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order, bool block_sums) {
  const int64_t n_blocks = cols / kQK8_0;
  const int64_t n_steps = PackedSteps(cols);
  float* block_sum = reinterpret_cast<float*>(dst + PackedBlockSumsOffset(cols));
  if (block_sums) ZeroBlockSumPadding(block_sum, cols);
#if KVS_ISA_AVX512
  // The lanes whose scale is the step's second block's.
  __mmask16 second_block_lanes = 0;
  for (int lane = 0; lane < kLanes; ++lane) {
    second_block_lanes |= static_cast<__mmask16>(BlockOfLane(order, lane) << lane);
  }
#endif
  for (int64_t s = 0; s < n_steps; ++s) {
    uint8_t* step = dst + s * kStepBytes;
    int8_t* q = reinterpret_cast<int8_t*>(step);
    int32_t* init = reinterpret_cast<int32_t*>(step + kStepInitOffset);
    float* scale = reinterpret_cast<float*>(step + kStepScaleOffset);
    float block_scale[kStepBlocks];
    for (int j = 0; j < kStepBlocks; ++j) {
      const int64_t b = s * kStepBlocks + j;
      int8_t block_q[kQK8_0];
      if (b < n_blocks) {
        // The kernels multiply by the f16-rounded scale, exactly what a stored Q8_0 block holds.
        block_scale[j] = F16ToF32(quant::HWY_NAMESPACE::QuantizeBlockQ8_0(x + b * kQK8_0, block_q));
      } else {
        std::memset(block_q, 0, sizeof(block_q));
        block_scale[j] = 0.f;
      }
      PlaceBlock(block_q, order, j, q);
    }
    // init[lane] = -offset * (sum of the lane's 4 q's); scale[lane] = its block's scale. The block
    // sums add up the lanes' sums (padding blocks come out 0), rather than reread block_q.
    float* step_block_sum = block_sum + s * kStepBlocks;
#if KVS_ISA_AVX512
    const __m512i lane_sums =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_loadu_si512(q));
    _mm512_storeu_si512(init, _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-offset)));
    _mm512_storeu_ps(scale, _mm512_mask_blend_ps(second_block_lanes, _mm512_set1_ps(block_scale[0]),
                                                 _mm512_set1_ps(block_scale[1])));
    if (block_sums) {
      step_block_sum[0] = block_scale[0] * static_cast<float>(_mm512_mask_reduce_add_epi32(
                                               static_cast<__mmask16>(~second_block_lanes), lane_sums));
      step_block_sum[1] =
          block_scale[1] * static_cast<float>(_mm512_mask_reduce_add_epi32(second_block_lanes, lane_sums));
    }
#elif KVS_ISA_AVX2
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<__m256i*>(q)));
    const __m256i lane_sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(init), _mm256_mullo_epi32(lane_sums, _mm256_set1_epi32(-offset)));
    _mm256_storeu_ps(scale, _mm256_set1_ps(block_scale[0]));
    if (block_sums) {
      const __m128i quads = _mm_add_epi32(_mm256_castsi256_si128(lane_sums), _mm256_extracti128_si256(lane_sums, 1));
      const __m128i pairs_of_quads = _mm_add_epi32(quads, _mm_unpackhi_epi64(quads, quads));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(pairs_of_quads, _mm_srli_epi64(pairs_of_quads, 32)));
      step_block_sum[0] = block_scale[0] * static_cast<float>(sum);
    }
#else
    int32_t sum[kStepBlocks] = {};
    for (int lane = 0; lane < kLanes; ++lane) {
      const int8_t* group = q + 4 * lane;
      const int32_t lane_sum = group[0] + group[1] + group[2] + group[3];
      init[lane] = -offset * lane_sum;
      scale[lane] = block_scale[BlockOfLane(order, lane)];
      sum[BlockOfLane(order, lane)] += lane_sum;
    }
    if (block_sums) {
      for (int j = 0; j < kStepBlocks; ++j) step_block_sum[j] = block_scale[j] * static_cast<float>(sum[j]);
    }
#endif
  }
}

void PackQ8TokenCompact(const float* x, int64_t cols, uint8_t* dst, Q8Order order, bool block_sums) {
  const int64_t n_blocks = cols / kQK8_0;
  const int64_t n_steps = PackedSteps(cols);
  float* block_sum = reinterpret_cast<float*>(dst + CompactBlockSumsOffset(cols));
  if (block_sums) ZeroBlockSumPadding(block_sum, cols);
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  float* scales = reinterpret_cast<float*>(dst + n_steps * kStepElems);
  for (int64_t b = 0; b < n_steps * kStepBlocks; ++b) {
    int8_t block_q[kQK8_0] = {};
    scales[b] = b < n_blocks ? F16ToF32(quant::HWY_NAMESPACE::QuantizeBlockQ8_0(x + b * kQK8_0, block_q)) : 0.f;
    if (block_sums) block_sum[b] = BlockSum(scales[b], block_q);
    PlaceBlock(block_q, order, static_cast<int>(b % kStepBlocks), q + (b / kStepBlocks) * kStepElems);
  }
}

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
