// Q6_K weights x Q8_K activations -- ggml's vec_dot_q6_k_q8_K arithmetic (matmul_kquant-inl.h).
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
#define HWY_TARGET_INCLUDE "ops/matmul_q6_k.cc"
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

struct Q6_KInts {
  using Block = BlockQ6_K;
  static void Unpack(const Block& b, quant::KBlockInts* out) { quant::UnpackQ6_K(b, out); }
};

// Codes u = q + 32 (the raw 6 bits, 0..63); the offset comes back through m_g = 32 sc_g
// (KScales). Element i = 128h + 32k + l: low 4 bits in ql[64h + 32(k % 2) + l] (low nibble for
// k < 2, high for k >= 2), top 2 bits at bit 2k of qh[32h + l].
struct Q6_KCodes {
  using Block = BlockQ6_K;
  static constexpr bool kMinsAreCodeOffset = true;

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
  static KScales Scales(const Block& b) {
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    const float d = _cvtsh_ss(b.d);
    return {scales16, _mm256_slli_epi16(scales16, 5), d, d};
  }
#endif

#if KVS_ISA_AVX512
  // Chunks 2H, 2H+1 = elements 128H + 64s + j (s = 0, 1): k = 2s + j / 32, so both read the 64 ql
  // bytes 64H.. (nibble s) and the 32 qh bytes 32H.. (bits 4s + 2(j / 32)).
  template <int H>
  static void Codes(const Block& b, __m512i* codes) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    const __m512i ql = _mm512_loadu_si512(b.ql + 64 * H);
    const __m512i qh_both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * H)));
    // Lanes 32-63 (odd k) shifted by 2: every lane's pair for chunk s is now at bits 4s, 4s+1.
    const __m512i qh = _mm512_mask_srli_epi16(qh_both, 0xFFFF0000u, qh_both, 2);
    const __m512i high0 = _mm512_and_si512(_mm512_slli_epi16(qh, 4), bits45);
    const __m512i high1 = _mm512_and_si512(qh, bits45);
    // (ql & low_nibbles) | high: ternary-logic 0xEA is (A & B) | C.
    codes[0] = _mm512_ternarylogic_epi32(ql, low_nibbles, high0, 0xEA);
    codes[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), low_nibbles, high1, 0xEA);
  }
#elif KVS_ISA_AVX2
  // Chunks 4H + k = elements 128H + 32k + l.
  template <int H>
  static void Codes(const Block& b, __m256i* codes) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256i ql_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * H));      // k = 0, 2
    const __m256i ql_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * H + 32));  // k = 1, 3
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * H));
    const auto code = [&](__m256i low, __m256i high) {
      return _mm256_or_si256(_mm256_and_si256(low, low_nibbles), _mm256_and_si256(high, bits45));
    };
    codes[0] = code(ql_even, _mm256_slli_epi16(qh, 4));
    codes[1] = code(ql_odd, _mm256_slli_epi16(qh, 2));
    codes[2] = code(_mm256_srli_epi16(ql_even, 4), qh);
    codes[3] = code(_mm256_srli_epi16(ql_odd, 4), _mm256_srli_epi16(qh, 2));
  }
#endif
};

#if KVS_ISA_AVX512
using Q6_KSteps = KQuantAvx512Steps<Q6_KCodes>;
#elif KVS_ISA_AVX2
using Q6_KSteps = KQuantAvx2Steps<Q6_KCodes>;
#else
using Q6_KSteps = KQuantScalarSteps<Q6_KInts>;
#endif

#if KVS_ISA_AVX512
// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): sub-blocks of 16 codes
// u = q + 32 (0..63), s_g = d * sc_g and m_g = 32 * s_g. Element 128 h + 32 k + l takes its low 4
// bits from nibble k / 2 of ql[64 h + 32 (k % 2) + l] and its top 2 from bits 2k, 2k+1 of
// qh[32 h + l]: three 16-byte transposes give four sub-blocks.
struct Q6_KPanelCodes {
  using Block = BlockQ6_K;
  static constexpr int kSubBlockElems = 16;
  using Panel = SuperBlockPanel<Q6_KPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      for (int half = 0; half < 2; ++half) {  // l in [16 half, 16 half + 16)
        const uint8_t* chunk[kPanelGroupRows];
        __m512i ql[2][4], qh[4];
        for (int odd = 0; odd < 2; ++odd) {
          for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].ql + 64 * h + 32 * odd + 16 * half;
          TransposeRowChunks(chunk, ql[odd]);
        }
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qh + 32 * h + 16 * half;
        TransposeRowChunks(chunk, qh);
        for (int k = 0; k < 4; ++k) {
          uint8_t* dst = Panel::SubBlockCodes(block, 8 * h + 2 * k + half, group);
          for (int c = 0; c < 4; ++c) {
            // 16-bit shifts leak no neighbour bits into the kept ones (low 4 after >> 4, low 2).
            const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql[k % 2][c], 4 * (k / 2)), low4);
            const __m512i top = _mm512_and_si512(_mm512_srli_epi16(qh[c], 2 * k), low2);
            _mm512_store_si512(dst + 64 * c, _mm512_or_si512(low, _mm512_slli_epi16(top, 4)));
          }
        }
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      for (int g = 0; g < Panel::kSubBlocks; ++g) {
        s[g] = _cvtsh_ss(w.d) * static_cast<float>(w.scales[g]);
        m[g] = 32.f * s[g];
      }
    });
  }
};
#endif

constexpr Kernel kRowKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<Q6_KSteps>>};
#if KVS_ISA_AVX512
constexpr Kernel kKernel = WithPanels<Q6_KPanelCodes::Panel>(kRowKernel);
#else
constexpr Kernel kKernel = kRowKernel;
#endif

}  // namespace

const Kernel& KernelQ6_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
