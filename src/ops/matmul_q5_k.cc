// Q5_K weights x Q8_K activations -- ggml's vec_dot_q5_k_q8_K arithmetic (matmul_kquant-inl.h).
// Compiled once per kernel family; the tile loop is shared (BlockTile in matmul_tile-inl.h), this
// file holds one super-block step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/kquant_blocks.h"
#include "ops/matmul_kernels.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q5_k.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/quantize-inl.h"
#include "ops/matmul_kquant-inl.h"
#include "ops/matmul_panel-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

struct Q5_KInts {
  using Block = BlockQ5_K;
  static void Unpack(const Block& b, quant::KBlockInts* out) { quant::UnpackQ5_K(b, out); }
};

// Codes u = q (0..31) with Q4_K's 6-bit scales and mins per 32-element sub-block j, each
// duplicated over its two groups of 16. Element 32j + l: nibble j % 2 of qs[32(j / 2) + l], fifth
// bit at bit j of qh[l].
struct Q5_KCodes {
  using Block = BlockQ5_K;
  static constexpr bool kMinsAreCodeOffset = false;

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
  // All 8 six-bit scales and mins (KScaleMin for j = 0..7) in one vector register. In 32-bit words
  // w0..w2 of `scales`: scales / mins 0-3 are the low 6 bits of w0 / w1; scales / mins 4-7 take
  // their low 4 bits from the low / high nibbles of w2 and their top 2 bits from the top 2 bits of
  // w0 / w1.
  static KScales Scales(const Block& b) {
    // Bytes 12-15 are qh (the block continues): the load stays inside the block, they are unused.
    const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
    const __m128i low_src = _mm_shuffle_epi32(words, 0xA4);  // [w0, w1, w2, w2]
    const __m128i top_src = _mm_shuffle_epi32(words, 0x44);  // [w0, w1, w0, w1]
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(low_src, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0x3F3F3F3F, 0x3F3F3F3F, 0x0F0F0F0F, 0x0F0F0F0F));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(top_src, 2), _mm_setr_epi32(0, 0, 0x30303030, 0x30303030));
    const __m128i packed = _mm_or_si128(low, top);  // [16] bytes: scales 0-3, mins 0-3, scales 4-7, mins 4-7
    // [16] int16 each: sub-block j's value at groups 2j, 2j+1.
    const __m128i scales =
        _mm_shuffle_epi8(packed, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 8, 8, 9, 9, 10, 10, 11, 11));
    const __m128i mins =
        _mm_shuffle_epi8(packed, _mm_setr_epi8(4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15));
    return {_mm256_cvtepu8_epi16(scales), _mm256_cvtepu8_epi16(mins), _cvtsh_ss(b.d), _cvtsh_ss(b.dmin)};
  }
#endif

#if KVS_ISA_AVX512
  // Chunk c = sub-blocks 2c (lanes 0-31: low nibbles of qs[32c..]) and 2c+1 (lanes 32-63: high
  // nibbles), fifth bits 2c / 2c+1 of qh.
  template <int C>
  static __m512i Chunk(const Block& b, __m512i qh) {
    const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * C)));
    const __m512i nibbles = _mm512_mask_srli_epi16(packed, 0xFFFF0000u, packed, 4);  // still unmasked
    const __m512i high = _mm512_and_si512(ShiftBits16<4 - 2 * C>(qh), _mm512_set1_epi8(0x10));
    // (nibbles & 0x0F) | high: ternary-logic 0xEA is (A & B) | C.
    return _mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi8(0x0F), high, 0xEA);
  }
  template <int H>
  static void Codes(const Block& b, __m512i* codes) {
    const __m512i qh_both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh)));
    // Lanes 32-63 (odd sub-blocks) shifted by 1: chunk c's bits are at bit 2c in every lane.
    const __m512i qh = _mm512_mask_srli_epi16(qh_both, 0xFFFF0000u, qh_both, 1);
    codes[0] = Chunk<2 * H>(b, qh);
    codes[1] = Chunk<2 * H + 1>(b, qh);
  }
#elif KVS_ISA_AVX2
  // Chunk k = sub-block j = 4H + k.
  template <int H, int K>
  static __m256i Chunk(const Block& b, __m256i qh) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 64 * H + 32 * (K / 2)));
    const __m256i shifted = K % 2 == 0 ? packed : _mm256_srli_epi16(packed, 4);
    const __m256i nibbles = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(ShiftBits16<4 - (4 * H + K)>(qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles, high);
  }
  template <int H>
  static void Codes(const Block& b, __m256i* codes) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
    codes[0] = Chunk<H, 0>(b, qh);
    codes[1] = Chunk<H, 1>(b, qh);
    codes[2] = Chunk<H, 2>(b, qh);
    codes[3] = Chunk<H, 3>(b, qh);
  }
#endif
};

#if KVS_ISA_AVX512
using Q5_KSteps = KQuantAvx512Steps<Q5_KCodes>;
#elif KVS_ISA_AVX2
using Q5_KSteps = KQuantAvx2Steps<Q5_KCodes>;
#else
using Q5_KSteps = KQuantScalarSteps<Q5_KInts>;
#endif

#if KVS_ISA_AVX512
// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): Q4_K's with the fifth
// bit of element 32j + l (bit j of qh[l]) on top, so u = 0..31; s_j = d * sc_j, m_j = dmin * m_j.
struct Q5_KPanelCodes {
  using Block = BlockQ5_K;
  static constexpr int kSubBlockElems = 32;
  using Panel = SuperBlockPanel<Q5_KPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(0x01);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* chunk[kPanelGroupRows];
      __m512i qh[4];
      for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qh + 16 * half;
      TransposeRowChunks(chunk, qh);
      for (int pair = 0; pair < Panel::kSubBlocks / 2; ++pair) {
        __m512i qs[4];
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qs + 32 * pair + 16 * half;
        TransposeRowChunks(chunk, qs);
        for (int nibble = 0; nibble < 2; ++nibble) {
          const int sub = 2 * pair + nibble;
          uint8_t* dst = Panel::SubBlockCodes(block, sub, group) + 4 * half * 64;
          for (int c = 0; c < 4; ++c) {
            // 16-bit shifts leak no neighbour bits into the kept ones (low 4 after >> 4, bit 0).
            const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs[c], 4 * nibble), low4);
            const __m512i fifth = _mm512_and_si512(_mm512_srli_epi16(qh[c], sub), one);
            _mm512_store_si512(dst + 64 * c, _mm512_or_si512(low, _mm512_slli_epi16(fifth, 4)));
          }
        }
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      for (int j = 0; j < Panel::kSubBlocks; ++j) {
        int scale, min;
        quant::KScaleMin(j, w.scales, &scale, &min);
        s[j] = _cvtsh_ss(w.d) * static_cast<float>(scale);
        m[j] = _cvtsh_ss(w.dmin) * static_cast<float>(min);
      }
    });
  }
};
#endif

constexpr Kernel kRowKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<Q5_KSteps>>};
#if KVS_ISA_AVX512
constexpr Kernel kKernel = WithPanels<Q5_KPanelCodes::Panel>(kRowKernel);
#else
constexpr Kernel kKernel = kRowKernel;
#endif

}  // namespace

const Kernel& KernelQ5_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
