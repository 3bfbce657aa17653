// IQ4_XS weights x Q8_K activations -- ggml's vec_dot_iq4_xs_q8_K arithmetic (matmul_kquant-inl.h):
// per super-block, sum = d_x * d * sum_j (ls_j - 32) * dot(level(q_j), x_j) over 8 sub-blocks of 32,
// with exact integer sums. Compiled once per kernel family; the tile loop is shared (BlockTile in
// matmul_tile-inl.h), this file holds one super-block step.
//
// The levels reach -127 and 113, so a u8 x s8 product cannot take them offset by 128 without
// saturating int16: avx512 uses vpdpbusd (int32, no saturation) on level + 128 and subtracts
// 128 * sum(x) per sub-block from the bsums; avx2 uses maddubs(|level|, x * sign(level)).
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
#define HWY_TARGET_INCLUDE "ops/matmul_iq4_xs.cc"
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

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
// Activation layout: a 64-byte load of qs[64c..] holds sub-blocks 4c..4c+3, 16 bytes each; its
// low nibbles are their elements 0-15, its high nibbles elements 16-31. Each Q8_K block's codes
// are reordered to match: x'[128c + 16k + e] = x[128c + 32k + e] and
// x'[128c + 64 + 16k + e] = x[128c + 32k + 16 + e]. So nibbles need no lane shuffles, and each
// 128-bit lane of both halves belongs to one sub-block. bsums keep ggml's order.
void PackQ8KIQ4XSOrder(const float* x, int64_t cols, uint8_t* dst) {
  PackQ8KToken(x, cols, dst);
  BlockQ8_K* blocks = reinterpret_cast<BlockQ8_K*>(dst);
  for (int64_t b = 0; b < cols / kQK_K; ++b) {
    int8_t ggml_order[kQK_K];
    std::memcpy(ggml_order, blocks[b].qs, kQK_K);
    for (int c = 0; c < 2; ++c) {
      for (int k = 0; k < 4; ++k) {
        std::memcpy(blocks[b].qs + 128 * c + 16 * k, ggml_order + 128 * c + 32 * k, 16);
        std::memcpy(blocks[b].qs + 128 * c + 64 + 16 * k, ggml_order + 128 * c + 32 * k + 16, 16);
      }
    }
  }
}

// The 8 sub-block scales ls_j - 32 as int8 in bytes 0-7. Plain 64-bit bit spreading (no pdep,
// which is microcoded on pre-Zen3 CPUs): byte j gets nibble j of scales_l and bits 2j, 2j+1 of
// scales_h.
inline __m128i SubBlockScales(const BlockIQ4_XS& block) {
  uint32_t low_bits;
  std::memcpy(&low_bits, block.scales_l, sizeof(low_bits));
  uint64_t low = low_bits;
  low = (low | (low << 16)) & 0x0000FFFF0000FFFFull;
  low = (low | (low << 8)) & 0x00FF00FF00FF00FFull;
  low = (low | (low << 4)) & 0x0F0F0F0F0F0F0F0Full;
  uint64_t high = block.scales_h;
  high = (high | (high << 24)) & 0x000000FF000000FFull;
  high = (high | (high << 12)) & 0x000F000F000F000Full;
  high = (high | (high << 6)) & 0x0303030303030303ull;
  const __m128i biased = _mm_cvtsi64_si128(static_cast<long long>(low | (high << 4)));
  return _mm_sub_epi8(biased, _mm_set1_epi8(32));
}
#endif

#if KVS_ISA_AVX512
// One block's levels + 128 (unsigned) in the activation order, its scales per int32 lane
// (128-bit lane k of half c: sub-block 4c + k) and 128 * scale per bsums pair.
struct Levels {
  __m512i code[2][2];  // [half c][low / high nibbles]
  __m512i scale32[2];
  __m256i bias16;
};

inline Levels Unpack(const BlockIQ4_XS& block, __m512i levels_u8) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m128i scales8 = SubBlockScales(block);
  const __m512i scales32 = _mm512_castsi256_si512(_mm256_cvtepi8_epi32(scales8));
  Levels out;
  for (int c = 0; c < 2; ++c) {
    const __m512i packed = _mm512_loadu_si512(block.qs + 64 * c);
    out.code[c][0] = _mm512_shuffle_epi8(levels_u8, _mm512_and_si512(packed, low_nibbles));
    out.code[c][1] = _mm512_shuffle_epi8(levels_u8, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles));
    const __m512i pick = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                          4 * c + 2, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c, 4 * c, 4 * c, 4 * c);
    out.scale32[c] = _mm512_permutexvar_epi32(pick, scales32);
  }
  out.bias16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(scales8, scales8)), 7);
  return out;
}

inline __m512i LevelsU8() {
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
  return _mm512_broadcast_i32x4(_mm_xor_si128(levels, _mm_set1_epi8(static_cast<char>(0x80))));
}

// sum_j scale_j * dot(level_j, x_j) of one block and token, exact in int32 (summed over lanes).
inline __m512i BlockDot(const Levels& w, const BlockQ8_K& xb) {
  __m512i isum = _mm512_setzero_si512();
  for (int c = 0; c < 2; ++c) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.code[c][0], _mm512_loadu_si512(xb.qs + 128 * c));
    dot = _mm512_dpbusd_epi32(dot, w.code[c][1], _mm512_loadu_si512(xb.qs + 128 * c + 64));
    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(dot, w.scale32[c]));
  }
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
  return _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_madd_epi16(bsums, w.bias16)));
}

// One weight row against one token's Q8_K blocks: the decode hot loop, kept lean and out of line.
__attribute__((noinline)) float DotRowOneToken(const BlockIQ4_XS* blocks, int64_t n_blocks, const BlockQ8_K* x) {
  const __m512i levels_u8 = LevelsU8();
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const BlockIQ4_XS& block = blocks[b];
    const __m512i isum = BlockDot(Unpack(block, levels_u8), x[b]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(_cvtsh_ss(block.d) * x[b].d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

struct IQ4_XSSteps {
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;

  // Decode: rows one after another against one token.
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<BlockIQ4_XS>(a, r), n_blocks, x);
  }

  // Each row's block is unpacked once; every token then costs 4 vpdpbusd and 2 vpmulld per row.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    const __m512i levels_u8 = LevelsU8();
    Levels w[R];
    float d[R];
    for (int r = 0; r < R; ++r) {
      const BlockIQ4_XS& block = WeightBlocks<BlockIQ4_XS>(a, r)[b];
      PrefetchWeightBlock<BlockIQ4_XS>(a, r, b);
      w[r] = Unpack(block, levels_u8);
      d[r] = _cvtsh_ss(block.d);
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(BlockDot(w[r], xb)), _mm512_set1_ps(d[r] * xb.d), acc[r][t]);
      }
    }
  }
};

#elif KVS_ISA_AVX2
struct IQ4_XSSteps {
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;

  // Per 64 elements (32 bytes of qs = sub-blocks 2p, 2p+1, one per 128-bit lane) the rows' levels
  // are looked up once and reused by every token. Level products reach 2 * 127 * 127 per int16
  // pair, so the low- and high-nibble halves widen separately.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues)));
    __m256i scales16[R];  // int16 scales 0-7 in both lanes
    for (int r = 0; r < R; ++r) {
      PrefetchWeightBlock<BlockIQ4_XS>(a, r, b);
      scales16[r] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(SubBlockScales(WeightBlocks<BlockIQ4_XS>(a, r)[b])));
    }
    __m256i isum[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      // int16 lanes of 128-bit lane m get scale 2p + m.
      const __m256i pick = _mm256_setr_epi8(4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1,
                                            4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1,
                                            4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2,
                                            4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3,
                                            4 * p + 2, 4 * p + 3);
      __m256i w_lo[R], w_hi[R], abs_lo[R], abs_hi[R], sc[R];
      for (int r = 0; r < R; ++r) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(WeightBlocks<BlockIQ4_XS>(a, r)[b].qs + 32 * p));
        w_lo[r] = _mm256_shuffle_epi8(levels, _mm256_and_si256(packed, low_nibbles));
        w_hi[r] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles));
        abs_lo[r] = _mm256_abs_epi8(w_lo[r]);
        abs_hi[r] = _mm256_abs_epi8(w_hi[r]);
        sc[r] = _mm256_shuffle_epi8(scales16[r], pick);
      }
      // Half c = p / 2, 32-byte part p % 2 of its low- and high-nibble activations.
      const int x_offset = 128 * (p / 2) + 32 * (p % 2);
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = Q8KTokenBlocks(a, t)[b].qs + x_offset;
        const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64));
        for (int r = 0; r < R; ++r) {
          // |x| <= 127 (Q8_K), so sign() cannot overflow and maddubs cannot saturate.
          const __m256i lo = _mm256_maddubs_epi16(abs_lo[r], _mm256_sign_epi8(x_lo, w_lo[r]));
          const __m256i hi = _mm256_maddubs_epi16(abs_hi[r], _mm256_sign_epi8(x_hi, w_hi[r]));
          isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_add_epi32(_mm256_madd_epi16(lo, sc[r]),
                                                                     _mm256_madd_epi16(hi, sc[r])));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t]),
                                    _mm256_set1_ps(_cvtsh_ss(WeightBlocks<BlockIQ4_XS>(a, r)[b].d) * xb.d), acc[r][t]);
      }
    }
  }
};
#endif

#if KVS_ISA_AVX512
// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): sub-blocks of 32 codes
// u = level + 128 (qs[16 j ..] laid out as an IQ4_NL block), s_j = d * (ls_j - 32), m_j = 128 s_j;
// the tokens' codes in PackQ8KIQ4XSOrder (sub-block 4c + k at 128c + 16k, its elements 16.. 64
// further).
struct IQ4_XSPanelCodes {
  using Block = BlockIQ4_XS;
  static constexpr int kSubBlockElems = 32;
  static constexpr int XOffset(int j) { return 128 * (j / 4) + 16 * (j % 4); }
  static constexpr int kXHi = 64;
  using Panel = SuperBlockPanel<IQ4_XSPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    // The levels as (level + 128) u8: flipping the sign bit of the int8 table adds 128.
    const __m512i levels = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues))),
        _mm512_set1_epi8(static_cast<char>(0x80)));
    for (int j = 0; j < Panel::kSubBlocks; ++j) {
      const uint8_t* chunk[kPanelGroupRows];
      for (int r = 0; r < kPanelGroupRows; ++r) chunk[r] = src[r][b].qs + 16 * j;
      __m512i q[4];
      TransposeRowChunks(chunk, q);
      uint8_t* dst = Panel::SubBlockCodes(block, j, group);
      for (int c = 0; c < 4; ++c) {
        _mm512_store_si512(dst + 64 * c, _mm512_shuffle_epi8(levels, _mm512_and_si512(q[c], low_nibbles)));
        _mm512_store_si512(dst + 64 * (4 + c),
                           _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(q[c], 4), low_nibbles)));
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      for (int j = 0; j < Panel::kSubBlocks; ++j) {
        s[j] = _cvtsh_ss(w.d) * static_cast<float>(quant::IQ4XSScale(w, j));
        m[j] = 128.f * s[j];
      }
    });
  }
};

constexpr Kernel kKernel = WithPanels<IQ4_XSPanelCodes::Panel>({&Q8KPackedBytes, &PackQ8KIQ4XSOrder, &DispatchTile<BlockTile<IQ4_XSSteps>>});
#elif KVS_ISA_AVX2
constexpr Kernel kKernel{&Q8KPackedBytes, &PackQ8KIQ4XSOrder, &DispatchTile<BlockTile<IQ4_XSSteps>>};
#else
struct IQ4_XSInts {
  using Block = BlockIQ4_XS;
  static void Unpack(const Block& b, quant::KBlockInts* out) { quant::UnpackIQ4_XS(b, out); }
};

using IQ4_XSSteps = KQuantScalarSteps<IQ4_XSInts>;

constexpr Kernel kKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<IQ4_XSSteps>>};
#endif

}  // namespace

const Kernel& KernelIQ4_XS() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
