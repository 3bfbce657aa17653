// MXFP4 weights (gpt-oss's experts) x Q8_0 activations (packed_q8.h): value = 2^(e - 128) *
// kMxfp4Values[nibble], Q4_0's nibble layout with 16 signed levels (|level| <= 12) looked up by
// a byte shuffle, as IQ4_NL's; only the scale differs: an E8M0 exponent, turned into the exact f32
// power of two (Mxfp4Scale) instead of read as f16. avx512 looks up (level + 128) as unsigned
// bytes for vpdpbusd with `init` = -128 * sum(x); avx2 takes the signed levels with the sign
// trick (pairs of at most 12 * 127 * 2 fit maddubs' int16). No kept panels: their scales are f16,
// which holds 2^(e - 128) only for e in [104, 143].
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_mxfp4.cc"
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

struct MXFP4Blocks {
  using Block = BlockMXFP4;
  static float Scale(const Block& b) { return Mxfp4Scale(b.e); }

#if KVS_ISA_AVX512
  static constexpr int kOffset = 128;
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  // The levels as (level + 128) u8: flipping the sign bit of the int8 table adds 128.
  static __m512i BiasedLevels() {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m512i Load(const Block& b0, const Block& b1) {
    return _mm512_shuffle_epi8(BiasedLevels(), NibblesOfPair(b0.qs, b1.qs));
  }
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return UnbiasedDot(Load(b0, b1), xq, kOffset);
  }
#elif KVS_ISA_AVX2
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    return _mm256_shuffle_epi8(levels, Nibbles(b.qs));
  }
  static __m256i Dot(__m256i w, __m256i xq, __m256i /*init*/) { return SignedDot(w, xq); }
#else
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK_MXFP4; ++e) dot += kMxfp4Values[NibbleAt(b.qs, e)] * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<MXFP4Blocks>::Make();

}  // namespace

const Kernel& KernelMXFP4() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
