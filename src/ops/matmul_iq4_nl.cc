// IQ4_NL weights x Q8_0 activations (packed_q8.h): value = d * kIq4NlValues[nibble], Q4_0's
// nibble layout with 16 non-linear int8 levels looked up by a byte shuffle. avx512 looks up
// (level + 128) as unsigned bytes for vpdpbusd (4 products of at most 241 * 127 per int32 lane, no
// saturation) with `init` = -128 * sum(x); avx2's maddubs would saturate its int16 pairs
// (2 * 241 * 127), so it takes the signed levels with the sign trick and no bias. Compiled once per
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
#define HWY_TARGET_INCLUDE "ops/matmul_iq4_nl.cc"
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

struct IQ4_NLBlocks {
  using Block = BlockIQ4_NL;

#if KVS_ISA_AVX512
  static constexpr int kOffset = 128;
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  // The levels as (level + 128) u8: flipping the sign bit of the int8 table adds 128.
  static __m512i BiasedLevels() {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues))),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m512i Load(const Block& b0, const Block& b1) {
    return _mm512_shuffle_epi8(BiasedLevels(), NibblesOfPair(b0.qs, b1.qs));
  }
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) {
    PanelNibbles(rows, b, quad);
    const __m512i levels = BiasedLevels();
    for (int c = 0; c < 8; ++c) quad[c] = _mm512_shuffle_epi8(levels, quad[c]);
  }
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return UnbiasedDot(Load(b0, b1), xq, kOffset);
  }
#elif KVS_ISA_AVX2
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    return _mm256_shuffle_epi8(levels, Nibbles(b.qs));
  }
  static __m256i Dot(__m256i w, __m256i xq, __m256i /*init*/) { return SignedDot(w, xq); }
#else
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK4_NL; ++e) dot += kIq4NlValues[NibbleAt(b.qs, e)] * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<IQ4_NLBlocks>::Make();

}  // namespace

const Kernel& KernelIQ4_NL() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
