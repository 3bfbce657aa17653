// Q2_K weights x Q8_K activations -- ggml's vec_dot_q2_K_q8_K arithmetic (matmul_kquant-inl.h):
// per super-block, sum = d_x * (d * sum_g sc_g * dot(q_g, x_g) - dmin * sum_g m_g * bsum_g), with
// exact integer sums. Compiled once per kernel family; the tile loop is shared (BlockTile in
// matmul_tile-inl.h), this file holds one super-block step.
//
// In the prefill tiles both SIMD families multiply each 2-bit code by its 4-bit group scale once per
// row (q * sc <= 45 fits a byte; one vpmullw scales two codes per int16 lane without carries), so
// each token costs a plain u8 x s8 dot product: vpdpbusd on avx512, maddubs on avx2. The decode
// loops, which see each code once, apply the scales in the widening step instead.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/kquant_blocks.h"
#include "ops/matmul_kernels.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q2_k.cc"
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
// pshufb indices that spread group scales (bytes 0-15 of each 128-bit lane) over int16 lanes:
// 128-bit lane m of pick[k] selects byte group(k, m) into every int16 (high byte zeroed).
template <int kLanes>
constexpr std::array<std::array<int8_t, 16 * kLanes>, 4> ScalePicks(int (*group)(int k, int m)) {
  std::array<std::array<int8_t, 16 * kLanes>, 4> picks{};
  for (int k = 0; k < 4; ++k)
    for (int m = 0; m < kLanes; ++m)
      for (int i = 0; i < 16; i += 2) {
        picks[k][16 * m + i] = static_cast<int8_t>(group(k, m));
        picks[k][16 * m + i + 1] = static_cast<int8_t>(0x80);
      }
  return picks;
}
#endif

#if KVS_ISA_AVX512
// Activation layout: one 64-byte load of a block's qs holds, shifted right by 2k and masked,
// elements 32k..32k+31 (bytes 0-31) and 128+32k..128+32k+31 (bytes 32-63). Each Q8_K block's
// codes are reordered to match: x'[64k + 32h + l] = x[128h + 32k + l]; bsums keep ggml's order.
void PackQ8KQ2Order(const float* x, int64_t cols, uint8_t* dst) {
  PackQ8KToken(x, cols, dst);
  BlockQ8_K* blocks = reinterpret_cast<BlockQ8_K*>(dst);
  for (int64_t b = 0; b < cols / kQK_K; ++b) {
    int8_t ggml_order[kQK_K];
    std::memcpy(ggml_order, blocks[b].qs, kQK_K);
    for (int k = 0; k < 4; ++k)
      for (int h = 0; h < 2; ++h) std::memcpy(blocks[b].qs + 64 * k + 32 * h, ggml_order + 128 * h + 32 * k, 32);
  }
}

// 128-bit lane m of chunk k holds elements 128(m/2) + 32k + 16(m%2) .. +15: group 8(m/2) + 2k + m%2.
constexpr int ChunkGroup(int k, int m) { return 8 * (m / 2) + 2 * k + m % 2; }
alignas(64) constexpr auto kScalePicks = ScalePicks<4>(&ChunkGroup);

// One block's codes times their group scales, as 4 x 64 unsigned bytes in the activation order,
// and its mins as int16 pairs matching bsums.
struct ScaledCodes {
  __m512i chunk[4];
  __m256i mins16;
};

inline ScaledCodes Unpack(const BlockQ2_K& block) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m512i two_bits = _mm512_set1_epi8(3);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.scales));
  const __m512i scales = _mm512_broadcast_i32x4(_mm_and_si128(packed, low_nibbles));
  const __m512i codes = _mm512_loadu_si512(block.qs);
  ScaledCodes out;
  for (int k = 0; k < 4; ++k) {
    const __m512i pick = _mm512_load_si512(kScalePicks[k].data());
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(codes, 2 * k), two_bits);
    out.chunk[k] = _mm512_mullo_epi16(q, _mm512_shuffle_epi8(scales, pick));
  }
  out.mins16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(packed), 4);
  return out;
}

// Decode scales of chunk pair (2j, 2j+1), for int16 lanes of packs_epi32(dot(2j), dot(2j+1)):
// 128-bit lane m holds 4 sums of chunk 2j (group ChunkGroup(2j, m)), then 4 of chunk 2j+1.
constexpr std::array<std::array<int8_t, 64>, 2> PairScalePicks() {
  std::array<std::array<int8_t, 64>, 2> picks{};
  for (int j = 0; j < 2; ++j)
    for (int m = 0; m < 4; ++m)
      for (int i = 0; i < 8; ++i) {
        picks[j][16 * m + 2 * i] = static_cast<int8_t>(ChunkGroup(2 * j + i / 4, m));
        picks[j][16 * m + 2 * i + 1] = static_cast<int8_t>(0x80);
      }
  return picks;
}
alignas(64) constexpr auto kPairScalePicks = PairScalePicks();

// One weight row against one token's Q8_K blocks: the decode hot loop, kept lean and out of line
// (fewer instructions per weight byte let the core stream weights closer to DRAM bandwidth).
// Codes stay unscaled here: vpdpbusd sums of 4 codes (<= 1524) pack to int16, and one vpdpwssd
// scales two chunks. The block's sum and min term then share one conversion and one fmadd.
__attribute__((noinline)) float DotRowOneToken(const BlockQ2_K* blocks, int64_t n_blocks, const BlockQ8_K* x) {
  static_assert(offsetof(BlockQ2_K, dmin) == offsetof(BlockQ2_K, d) + 2);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i two_bits = _mm512_set1_epi8(3);
  const __m512i zero = _mm512_setzero_si512();
  // Lanes 0-7 take d * d_x, lanes 8-15 -dmin * d_x.
  const __m512i d_then_dmin = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const BlockQ2_K& block = blocks[b];
    const BlockQ8_K& xb = x[b];
    const __m128i packed_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.scales));
    const __m512i scales = _mm512_and_si512(_mm512_broadcast_i32x4(packed_scales), low_nibbles);
    const __m512i codes = _mm512_loadu_si512(block.qs);
    __m512i isum = zero;
    for (int j = 0; j < 2; ++j) {
      const __m512i q0 = _mm512_and_si512(_mm512_srli_epi16(codes, 4 * j), two_bits);
      const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(codes, 4 * j + 2), two_bits);
      const __m512i dot0 = _mm512_dpbusd_epi32(zero, q0, _mm512_loadu_si512(xb.qs + 128 * j));
      const __m512i dot1 = _mm512_dpbusd_epi32(zero, q1, _mm512_loadu_si512(xb.qs + 128 * j + 64));
      const __m512i pick = _mm512_load_si512(kPairScalePicks[j].data());
      isum = _mm512_dpwssd_epi32(isum, _mm512_packs_epi32(dot0, dot1), _mm512_shuffle_epi8(scales, pick));
    }
    const __m256i mins16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(packed_scales), 4);
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
    const __m256i min_sum = _mm256_madd_epi16(bsums, mins16);
    const __m256i isum8 = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(isum8), min_sum, 1));
    // d and -dmin (sign bit flipped in f16) converted together.
    uint32_t d_dmin;
    std::memcpy(&d_dmin, reinterpret_cast<const uint8_t*>(&block) + offsetof(BlockQ2_K, d), sizeof(d_dmin));
    const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin ^ 0x80000000u))),
                                 _mm_set1_ps(xb.d));
    acc = _mm512_fmadd_ps(sums, _mm512_permutexvar_ps(d_then_dmin, _mm512_castps128_ps512(dd)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

struct Q2_KSteps {
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;

  // Decode: rows one after another against one token.
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<BlockQ2_K>(a, r), n_blocks, x);
  }

  // Each row's block is unpacked and scaled once; every token then costs 4 vpdpbusd per row.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    ScaledCodes w[R];
    __m512 d[R], dmin[R];
    for (int r = 0; r < R; ++r) {
      const BlockQ2_K& block = WeightBlocks<BlockQ2_K>(a, r)[b];
      PrefetchWeightBlock<BlockQ2_K>(a, r, b);
      w[r] = Unpack(block);
      d[r] = _mm512_set1_ps(_cvtsh_ss(block.d));
      dmin[r] = _mm512_set1_ps(_cvtsh_ss(block.dmin));
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        const __m512i xq = _mm512_loadu_si512(xb.qs + 64 * k);
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], w[r].chunk[k], xq);
      }
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
      const __m512 dx = _mm512_set1_ps(xb.d);
      for (int r = 0; r < R; ++r) {
        // Scaled by the row's d / dmin first, then once by the token's d: one vector op per scale.
        const __m512 min_sum = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, w[r].mins16)));
        const __m512 sum = _mm512_fnmadd_ps(min_sum, dmin[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), d[r]));
        acc[r][t] = _mm512_fmadd_ps(sum, dx, acc[r][t]);
      }
    }
  }
};

// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): sub-blocks of 16 codes
// u = the 2-bit q (element 128 h + 32 k + l at bits 2k, 2k+1 of qs[32 h + l]), s_g = d * (sc_g &
// 15), m_g = dmin * (sc_g >> 4); the tokens' codes in PackQ8KQ2Order (group 8h + 2k + m at
// 64k + 32h + 16m).
struct Q2_KPanelCodes {
  using Block = BlockQ2_K;
  static constexpr int kSubBlockElems = 16;
  static constexpr int XOffset(int g) { return 64 * ((g % 8) / 2) + 32 * (g / 8) + 16 * (g % 2); }
  using Panel = SuperBlockPanel<Q2_KPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t* chunk[kPanelGroupRows];
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qs + 32 * h + 16 * half;
        __m512i q[4];
        TransposeRowChunks(chunk, q);
        for (int k = 0; k < 4; ++k) {
          uint8_t* dst = Panel::SubBlockCodes(block, 8 * h + 2 * k + half, group);
          // 16-bit shifts leak no neighbour bits into the kept low 2.
          for (int c = 0; c < 4; ++c) _mm512_store_si512(dst + 64 * c, _mm512_and_si512(_mm512_srli_epi16(q[c], 2 * k), low2));
        }
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      for (int g = 0; g < Panel::kSubBlocks; ++g) {
        s[g] = _cvtsh_ss(w.d) * static_cast<float>(w.scales[g] & 0xF);
        m[g] = _cvtsh_ss(w.dmin) * static_cast<float>(w.scales[g] >> 4);
      }
    });
  }
};

constexpr Kernel kKernel = WithPanels<Q2_KPanelCodes::Panel>({&Q8KPackedBytes, &PackQ8KQ2Order, &DispatchTile<BlockTile<Q2_KSteps>>});

#elif KVS_ISA_AVX2
// ggml's activation order: 32 bytes qs[32h..] shifted right by 2k hold elements 128h + 32k + l,
// and 128-bit lane m of them is group 8h + 2k + m.
constexpr int GroupInHalf(int k, int m) { return 2 * k + m; }  // the scales of half h start at group 8h
alignas(32) constexpr auto kScalePicks = ScalePicks<2>(&GroupInHalf);

// One weight row against one token's Q8_K blocks: the decode hot loop, kept lean and out of line.
// Here the scale multiply rides on the widening madd (one op fewer per chunk than scaling codes).
__attribute__((noinline)) float DotRowOneToken(const BlockQ2_K* blocks, int64_t n_blocks, const BlockQ8_K* x) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m256i two_bits = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  __m256 acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const BlockQ2_K& block = blocks[b];
    const BlockQ8_K& xb = x[b];
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.scales));
    const __m128i sc = _mm_and_si128(packed, low_nibbles);
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i scales = _mm256_broadcastsi128_si256(h == 0 ? sc : _mm_srli_si128(sc, 8));
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs + 32 * h));
      for (int k = 0; k < 4; ++k) {
        const __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePicks[k].data()));
        const __m256i q = _mm256_and_si256(_mm256_srli_epi16(codes, 2 * k), two_bits);
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs + 128 * h + 32 * k));
        const __m256i pairs = _mm256_maddubs_epi16(q, xq);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_shuffle_epi8(scales, pick)));
      }
    }
    const __m256i mins16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(packed), 4);
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
    const __m256 min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins16));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(block.d) * xb.d), acc);
    acc_min = _mm256_fmadd_ps(min_sum, _mm256_set1_ps(_cvtsh_ss(block.dmin) * xb.d), acc_min);
  }
  return ReduceAdd(_mm256_sub_ps(acc, acc_min));
}

struct Q2_KSteps {
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;

  // Decode: rows one after another against one token.
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<BlockQ2_K>(a, r), n_blocks, x);
  }

  // Per 64 elements (chunks k, k+1 of one half h) the rows' scaled codes are built once and reused
  // by every token. Scaled codes are <= 45, so maddubs pair sums are <= 11430 and two chunks add
  // up in int16 before the widening madd.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    const __m256i two_bits = _mm256_set1_epi8(3);
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i scales[R][2];  // group scales (low nibbles), groups 8h..8h+7 in both lanes, per half h
    __m256i mins16[R];
    for (int r = 0; r < R; ++r) {
      PrefetchWeightBlock<BlockQ2_K>(a, r, b);
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(WeightBlocks<BlockQ2_K>(a, r)[b].scales));
      const __m128i sc = _mm_and_si128(packed, low_nibbles);
      scales[r][0] = _mm256_broadcastsi128_si256(sc);
      scales[r][1] = _mm256_broadcastsi128_si256(_mm_srli_si128(sc, 8));
      mins16[r] = _mm256_srli_epi16(_mm256_cvtepu8_epi16(packed), 4);
    }
    __m256i isum[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; k += 2) {
        __m256i w0[R], w1[R];
        for (int r = 0; r < R; ++r) {
          const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(WeightBlocks<BlockQ2_K>(a, r)[b].qs + 32 * h));
          const __m256i q0 = _mm256_and_si256(_mm256_srli_epi16(codes, 2 * k), two_bits);
          const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(codes, 2 * k + 2), two_bits);
          const __m256i pick0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePicks[k].data()));
          const __m256i pick1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePicks[k + 1].data()));
          w0[r] = _mm256_mullo_epi16(q0, _mm256_shuffle_epi8(scales[r][h], pick0));
          w1[r] = _mm256_mullo_epi16(q1, _mm256_shuffle_epi8(scales[r][h], pick1));
        }
        for (int t = 0; t < T; ++t) {
          const int8_t* xq = Q8KTokenBlocks(a, t)[b].qs + 128 * h + 32 * k;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0[r], x0), _mm256_maddubs_epi16(w1[r], x1));
            isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_madd_epi16(pairs, ones16));
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
      for (int r = 0; r < R; ++r) {
        const BlockQ2_K& block = WeightBlocks<BlockQ2_K>(a, r)[b];
        const __m256 min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins16[r]));
        acc[r][t] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t]), _mm256_set1_ps(_cvtsh_ss(block.d) * xb.d), acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(min_sum, _mm256_set1_ps(-_cvtsh_ss(block.dmin) * xb.d), acc[r][t]);
      }
    }
  }
};

constexpr Kernel kKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<Q2_KSteps>>};

#else
struct Q2_KInts {
  using Block = BlockQ2_K;
  static void Unpack(const Block& b, quant::KBlockInts* out) { quant::UnpackQ2_K(b, out); }
};

using Q2_KSteps = KQuantScalarSteps<Q2_KInts>;

constexpr Kernel kKernel{&Q8KPackedBytes, &PackQ8KToken, &DispatchTile<BlockTile<Q2_KSteps>>};
#endif

}  // namespace

const Kernel& KernelQ2_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
