// Q8_0 weights x Q8_0 activations (packed_q8.h), integer dot products per 32-element block,
// scaled by d_w * d_x and accumulated in f32 -- ggml's vec_dot_q8_0_q8_0 scheme. Compiled once
// per kernel family; the tile loops are shared (matmul_packed_q8-inl.h), this file holds the
// block arithmetic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q8_0.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/matmul_panel-inl.h"
#include "ops/packed_q8-inl.h"
#include "ops/matmul_packed_q8-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

struct Q8_0Blocks {
  using Block = BlockQ8_0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;

#if KVS_ISA_AVX512
  // VNNI multiplies unsigned by signed bytes: weights enter as (w + 128) and the packed
  // activations' `init` subtracts 128 * sum(x) per lane.
  static constexpr int kOffset = 128;
  static __m512i Signed(const Block& b0, const Block& b1) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0.qs));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1.qs));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static __m512i Load(const Block& b0, const Block& b1) {
    return _mm512_xor_si512(Signed(b0, b1), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // Panel codes (matmul_panel-inl.h): the block's 32 codes of 16 rows as (q + 128) u8, quads 0..7.
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int half = 0; half < 2; ++half) {
      const uint8_t* chunk[kPanelGroupRows];
      for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = reinterpret_cast<const uint8_t*>(rows[j][b].qs) + 16 * half;
      __m512i q[4];
      TransposeRowChunks(chunk, q);
      for (int c = 0; c < 4; ++c) quad[4 * half + c] = _mm512_xor_si512(q[c], offset);
    }
  }
  // The sign trick: |w| times x carrying w's sign.
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    const __m512i w = Signed(b0, b1);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i x_signed = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(w), zero, xq);
    return _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w), x_signed);
  }
#elif KVS_ISA_AVX2
  // No VNNI: the sign trick needs no bias.
  static constexpr int kOffset = 0;
  static __m256i Load(const Block& b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)); }
  static __m256i Dot(__m256i w, __m256i xq, __m256i /*init*/) { return SignedDot(w, xq); }
#else
  static constexpr int kOffset = 0;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK8_0; ++e) dot += b.qs[e] * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<Q8_0Blocks>::Make();

}  // namespace

const Kernel& KernelQ8_0() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
