// Q4_1 weights x Q8_0 activations (packed_q8.h): value = d * q + m with unsigned nibbles q. The
// nibbles enter the u8 x s8 dots as they are (no bias); the min terms m * d_x * sum(x) are the
// shared kHasMin path of matmul_packed_q8-inl.h -- ggml's vec_dot_q4_1_q8_1 arithmetic with Q8_1's
// s in f32. Compiled once per kernel family; the tile loops are shared, this file holds the block
// arithmetic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q4_1.cc"
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

struct Q4_1Blocks {
  using Block = BlockQ4_1;
  static constexpr bool kHasMin = true;
  static constexpr int kOffset = 0;

#if KVS_ISA_AVX512
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  static __m512i Load(const Block& b0, const Block& b1) { return NibblesOfPair(b0.qs, b1.qs); }
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) { PanelNibbles(rows, b, quad); }
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), Load(b0, b1), xq);
  }
#elif KVS_ISA_AVX2
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) { return Nibbles(b.qs); }
  static __m256i Dot(__m256i w, __m256i xq, __m256i init) { return UnsignedDot(w, xq, init); }
#else
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK4_1; ++e) dot += NibbleAt(b.qs, e) * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<Q4_1Blocks>::Make();

}  // namespace

const Kernel& KernelQ4_1() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
