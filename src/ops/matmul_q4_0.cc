// Q4_0 weights x Q8_0 activations (packed_q8.h). Weight nibbles are used as unsigned bytes
// (q in 0..15, value = q - 8); the packed activations' `init` holds -8 * sum(x) per lane, so
// the integer dot starts pre-corrected -- ggml's vec_dot_q4_0_q8_0 arithmetic. Compiled once per
// kernel family; the tile loops are shared (matmul_packed_q8-inl.h), this file holds the block
// arithmetic.
#include <cstdint>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q4_0.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/packed_q8-inl.h"
#include "ops/matmul_packed_q8-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

constexpr int kNibbleOffset = 8;

struct Q4_0Blocks {
  using Block = BlockQ4_0;
  static constexpr int kOffset = kNibbleOffset;

#if KVS_ISA_AVX512
  // Byte order [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31] falls straight out of the nibble
  // split, so int32 lanes 0-3, 8-11 are block 0 and 4-7, 12-15 block 1.
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  static __m512i Load(const Block& b0, const Block& b1) {
    const __m256i packed = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1.qs)),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0.qs)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
    // Upper 256 bits take the high nibbles.
    return _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), _mm512_set1_epi8(0x0F));
  }
  // dot(q, x) - dot(8, x).
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    const __m512i zero = _mm512_setzero_si512();
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, Load(b0, b1), xq),
                            _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(kNibbleOffset), xq));
  }
#elif KVS_ISA_AVX2
  // One block per step: [e0-15 low nibbles | e16-31 high nibbles] is the natural order.
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
  }
  static __m256i Dot(__m256i w, __m256i xq, __m256i init) {
    // Nibble x int8 pairs stay far inside int16 (2 * 15 * 127).
    return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1)));
  }
#else
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK4_0 / 2; ++e) {
      dot += ((b.qs[e] & 0x0F) - kNibbleOffset) * xq[e];
      dot += ((b.qs[e] >> 4) - kNibbleOffset) * xq[e + kQK4_0 / 2];
    }
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<Q4_0Blocks>::Make();

}  // namespace

const Kernel& KernelQ4_0() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
