// Q4_0 weights x Q8_0 activations (packed_q8.h). Weight nibbles are used as unsigned bytes
// (q in 0..15, value = q - 8); the packed activations' `init` holds -8 * sum(x) per lane, so
// the integer dot starts pre-corrected -- ggml's vec_dot_q4_0_q8_0 arithmetic. Compiled once per
// kernel family; the tile loops are shared (matmul_packed_q8-inl.h), this file holds the block
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
#define HWY_TARGET_INCLUDE "ops/matmul_q4_0.cc"
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

constexpr int kNibbleOffset = 8;

struct Q4_0Blocks {
  using Block = BlockQ4_0;
  static constexpr int kOffset = kNibbleOffset;

#if KVS_ISA_AVX512
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  static __m512i Load(const Block& b0, const Block& b1) { return NibblesOfPair(b0.qs, b1.qs); }
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) { PanelNibbles(rows, b, quad); }
  // dot(q, x) - dot(8, x).
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return UnbiasedDot(Load(b0, b1), xq, kNibbleOffset);
  }
#elif KVS_ISA_AVX2
  // One block per step: [e0-15 low nibbles | e16-31 high nibbles] is the natural order.
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) { return Nibbles(b.qs); }
  // Nibble x int8 pairs stay far inside int16 (2 * 15 * 127).
  static __m256i Dot(__m256i w, __m256i xq, __m256i init) { return UnsignedDot(w, xq, init); }
#else
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK4_0; ++e) dot += (NibbleAt(b.qs, e) - kNibbleOffset) * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<Q4_0Blocks>::Make();

}  // namespace

const Kernel& KernelQ4_0() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
