// Q3_K weights x Q8_K activations -- ggml's vec_dot_q3_k_q8_K arithmetic (matmul_kquant-inl.h).
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
#define HWY_TARGET_INCLUDE "ops/matmul_q3_k.cc"
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

struct Q3_KInts {
  using Block = BlockQ3_K;
  static void Unpack(const Block& b, quant::KBlockInts* out) { quant::UnpackQ3_K(b, out); }
};

// Codes u = q + 4 = low 2 bits + 4 * hmask bit (0..7); the offset comes back through m_g = 4 sc_g
// (KScales). Element i = 128h + 32k + l: low 2 bits at bit 2k of qs[32h + l], high bit at bit
// 4h + k of hmask[l].
struct Q3_KCodes {
  using Block = BlockQ3_K;
  static constexpr bool kMinsAreCodeOffset = true;

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
  // The 16 six-bit scales (Q3KScale) in vector registers: group g's low 4 bits are nibble g / 8 of
  // byte g % 8, its top 2 bits are bits 2(g / 4) of byte 8 + g % 4.
  static KScales Scales(const Block& b) {
    const __m128i low_bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales));  // bytes 0-7
    uint32_t top_word;
    std::memcpy(&top_word, b.scales + 8, sizeof(top_word));
    // [16] bytes: low nibbles of bytes 0-7 (groups 0-7), then their high nibbles (groups 8-15).
    const __m128i low4 =
        _mm_and_si128(_mm_unpacklo_epi64(low_bytes, _mm_srli_epi16(low_bytes, 4)), _mm_set1_epi8(0x0F));
    // Dword w holds groups 4w..4w+3, whose top bits are bits 2w of bytes 8-11.
    const __m128i top_shifted =
        _mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(top_word)), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i top2 = _mm_and_si128(top_shifted, _mm_set1_epi8(0x03));
    const __m128i stored = _mm_or_si128(low4, _mm_slli_epi32(top2, 4));  // [16] scale + 32
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(stored, _mm_set1_epi8(32)));
    const float d = _cvtsh_ss(b.d);
    return {scales16, _mm256_slli_epi16(scales16, 2), d, d};
  }
#endif

#if KVS_ISA_AVX512
  // Chunk c = 2H + s = elements 128H + 64s + j: k = 2s + j / 32, hmask bit 2c + j / 32.
  // qs2 has lanes 32-63 shifted by 2 (so chunk s's low bits are at bits 4s), hm lanes 32-63 by 1
  // (chunk c's high bits at bit 2c).
  template <int C>
  static __m512i Chunk(__m512i qs2, __m512i hm) {
    const __m512i low = _mm512_and_si512(ShiftBits16<-4 * (C % 2)>(qs2), _mm512_set1_epi8(0x03));
    // low | (hm' & 0x04): ternary-logic 0xF8 is A | (B & C).
    return _mm512_ternarylogic_epi32(low, ShiftBits16<2 - 2 * C>(hm), _mm512_set1_epi8(0x04), 0xF8);
  }
  template <int H>
  static void Codes(const Block& b, __m512i* codes) {
    const __m512i qs_both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * H)));
    const __m512i hm_both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.hmask)));
    const __m512i qs2 = _mm512_mask_srli_epi16(qs_both, 0xFFFF0000u, qs_both, 2);
    const __m512i hm = _mm512_mask_srli_epi16(hm_both, 0xFFFF0000u, hm_both, 1);
    codes[0] = Chunk<2 * H>(qs2, hm);
    codes[1] = Chunk<2 * H + 1>(qs2, hm);
  }
#elif KVS_ISA_AVX2
  // Chunk k = elements 128H + 32k + l.
  template <int H, int K>
  static __m256i Chunk(__m256i qs, __m256i hm) {
    const __m256i low = _mm256_and_si256(ShiftBits16<-2 * K>(qs), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(low, _mm256_and_si256(ShiftBits16<2 - (4 * H + K)>(hm), _mm256_set1_epi8(0x04)));
  }
  template <int H>
  static void Codes(const Block& b, __m256i* codes) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * H));
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.hmask));
    codes[0] = Chunk<H, 0>(qs, hm);
    codes[1] = Chunk<H, 1>(qs, hm);
    codes[2] = Chunk<H, 2>(qs, hm);
    codes[3] = Chunk<H, 3>(qs, hm);
  }
#endif
};

#if KVS_ISA_AVX512
using Q3_KSteps = KQuantAvx512Steps<Q3_KCodes>;
#elif KVS_ISA_AVX2
using Q3_KSteps = KQuantAvx2Steps<Q3_KCodes>;
#else
using Q3_KSteps = KQuantScalarSteps<Q3_KInts>;
#endif

#if KVS_ISA_AVX512
// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): sub-blocks of 16 codes
// u = low + 4 * high (0..7, q = u - 4), s_g = d * sc_g and m_g = 4 * s_g. Element 128 h + 32 k + l
// has its low 2 bits at bits 2k, 2k+1 of qs[32 h + l] and its high bit at bit 4h + k of hmask[l]:
// one qs transpose gives four sub-blocks, one hmask transpose serves both h.
struct Q3_KPanelCodes {
  using Block = BlockQ3_K;
  static constexpr int kSubBlockElems = 16;
  using Panel = SuperBlockPanel<Q3_KPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low2 = _mm512_set1_epi8(0x03), one = _mm512_set1_epi8(0x01);
    for (int half = 0; half < 2; ++half) {  // l in [16 half, 16 half + 16)
      const uint8_t* chunk[kPanelGroupRows];
      __m512i hmask[4];
      for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].hmask + 16 * half;
      TransposeRowChunks(chunk, hmask);
      for (int h = 0; h < 2; ++h) {
        __m512i qs[4];
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qs + 32 * h + 16 * half;
        TransposeRowChunks(chunk, qs);
        for (int k = 0; k < 4; ++k) {
          uint8_t* dst = Panel::SubBlockCodes(block, 8 * h + 2 * k + half, group);
          for (int c = 0; c < 4; ++c) {
            // 16-bit shifts leak no neighbour bits into the kept ones (low 2, bit 0).
            const __m512i low = _mm512_and_si512(_mm512_srli_epi16(qs[c], 2 * k), low2);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(hmask[c], 4 * h + k), one);
            _mm512_store_si512(dst + 64 * c, _mm512_or_si512(low, _mm512_slli_epi16(high, 2)));
          }
        }
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      for (int g = 0; g < Panel::kSubBlocks; ++g) {
        s[g] = _cvtsh_ss(w.d) * static_cast<float>(quant::Q3KScale(w.scales, g));
        m[g] = 4.f * s[g];
      }
    });
  }
};
#endif

constexpr Kernel kRowKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<Q3_KSteps>>};
#if KVS_ISA_AVX512
constexpr Kernel kKernel = WithPanels<Q3_KPanelCodes::Panel>(kRowKernel);
#else
constexpr Kernel kKernel = kRowKernel;
#endif

}  // namespace

const Kernel& KernelQ3_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
