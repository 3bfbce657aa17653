// Q4_K weights x Q8_K activations -- ggml's vec_dot_q4_K_q8_K arithmetic. Per 256-element
// super-block: sum = d_x * (d * sum_j sc_j * dot(q_j, x_j) - dmin * sum_j m_j * sum(x_j)),
// where the integer part is exact and sum(x_j) comes from the activations' bsums. Compiled once
// per kernel family; the tile loop is shared (BlockTile in matmul_tile-inl.h), this file holds
// one super-block step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q4_k.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/matmul_panel-inl.h"
#include "ops/quantize-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

constexpr int kSubBlocks = kQK_K / 32;


struct ScalesMins {
  uint8_t scale[kSubBlocks];
  uint8_t min[kSubBlocks];
};

// Unpacks all 8 six-bit scales and mins at once with 32-bit word operations (same result as
// GetScaleMinK4 for j = 0..7). Bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and
// the top 2 bits of scales / mins 4-7 in their high 2 bits; bytes 8-11 hold the low 4 bits of
// scale (low nibble) and min (high nibble) 4-7.
inline ScalesMins Unpack(const BlockQ4_K& block) {
  uint32_t words[3];
  std::memcpy(words, block.scales, sizeof(words));
  const uint32_t scale_lo = words[0] & 0x3F3F3F3Fu;
  const uint32_t min_lo = words[1] & 0x3F3F3F3Fu;
  const uint32_t scale_hi = (words[2] & 0x0F0F0F0Fu) | ((words[0] >> 2) & 0x30303030u);
  const uint32_t min_hi = ((words[2] >> 4) & 0x0F0F0F0Fu) | ((words[1] >> 2) & 0x30303030u);
  ScalesMins out;
  std::memcpy(out.scale, &scale_lo, 4);
  std::memcpy(out.scale + 4, &scale_hi, 4);
  std::memcpy(out.min, &min_lo, 4);
  std::memcpy(out.min + 4, &min_hi, 4);
  return out;
}

#if KVS_ISA_AVX512
// One weight row against one token's Q8_K blocks: the decode hot loop, kept lean and out of line
// (fewer instructions per weight byte let the core stream weights closer to DRAM bandwidth).
__attribute__((noinline)) float DotRowOneToken(const BlockQ4_K* blocks, int64_t n_blocks, const BlockQ8_K* x) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const BlockQ4_K& block = blocks[b];
    const BlockQ8_K& xb = x[b];
    const ScalesMins sm = Unpack(block);
    uint64_t sc8, m8;
    std::memcpy(&sc8, sm.scale, 8);
    std::memcpy(&m8, sm.min, 8);
    const __m512i scales16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
    const __m128i m = _mm_cvtsi64_si128(static_cast<long long>(m8));
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
    __m512i isum = _mm512_setzero_si512();
    for (int g = 0; g < kSubBlocks / 2; ++g) {
      const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(2 * g)),
                                              _mm256_set1_epi16(static_cast<short>(2 * g + 1)), 1);
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs + 32 * g));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
      const __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), low_nibbles);
      const __m512i xq = _mm512_loadu_si512(xb.qs + 64 * g);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w, xq), _mm512_permutexvar_epi16(pick, scales16));
    }
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
    const __m256 min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins16));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(_cvtsh_ss(block.d) * xb.d), acc);
    acc = _mm512_fmadd_ps(_mm512_zextps256_ps512(min_sum), _mm512_set1_ps(-_cvtsh_ss(block.dmin) * xb.d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

// One super-block per step.
struct Q4_KSteps {
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;

#if KVS_ISA_AVX512
  // Decode: rows one after another against one token.
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<BlockQ4_K>(a, r), n_blocks, x);
  }

  // Per 64 elements (sub-blocks 2g, 2g+1 share 32 bytes of nibbles): maddubs gives int16 pair sums,
  // vpdpwssd multiplies them by the sub-block scale and accumulates int32 over the super-block.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    __m128i scales16[R];  // [8] int16 sub-block scales
    __m256i mins16[R];    // [16] int16: m_j at lanes 2j, 2j+1 (matches bsums pairs)
    float d[R], dmin[R];
    for (int r = 0; r < R; ++r) {
      const BlockQ4_K& block = WeightBlocks<BlockQ4_K>(a, r)[b];
      PrefetchWeightBlock<BlockQ4_K>(a, r, b);
      const ScalesMins sm = Unpack(block);
      uint64_t sc8, m8;
      std::memcpy(&sc8, sm.scale, 8);
      std::memcpy(&m8, sm.min, 8);
      scales16[r] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8)));
      const __m128i m = _mm_cvtsi64_si128(static_cast<long long>(m8));
      mins16[r] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
      d[r] = _cvtsh_ss(block.d);
      dmin[r] = _cvtsh_ss(block.dmin);
    }
    // Unpacked nibbles and per-lane scales of the tile's rows for this super-block; they are
    // reused by every token, and holding them (rather than the int32 sums) in L1 keeps the
    // accumulators in registers.
    __m512i w[R][kSubBlocks / 2];
    __m512i sc[R][kSubBlocks / 2];
    for (int g = 0; g < kSubBlocks / 2; ++g) {
      // int16 lanes 0-15 get scale[2g], lanes 16-31 scale[2g+1].
      const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(2 * g)),
                                              _mm256_set1_epi16(static_cast<short>(2 * g + 1)), 1);
      for (int r = 0; r < R; ++r) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(WeightBlocks<BlockQ4_K>(a, r)[b].qs + 32 * g));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
        w[r][g] = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), low_nibbles);
        sc[r][g] = _mm512_permutexvar_epi16(pick, _mm512_castsi128_si512(scales16[r]));
      }
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      for (int g = 0; g < kSubBlocks / 2; ++g) {
        const __m512i xq = _mm512_loadu_si512(xb.qs + 64 * g);
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(w[r][g], xq), sc[r][g]);
      }
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
      for (int r = 0; r < R; ++r) {
        const __m256 min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins16[r]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d[r] * xb.d), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_zextps256_ps512(min_sum), _mm512_set1_ps(-dmin[r] * xb.d), acc[r][t]);
      }
    }
  }
#elif KVS_ISA_AVX2
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    ScalesMins sm[R];
    __m256i mins16[R];
    for (int r = 0; r < R; ++r) {
      const BlockQ4_K& block = WeightBlocks<BlockQ4_K>(a, r)[b];
      PrefetchWeightBlock<BlockQ4_K>(a, r, b);
      sm[r] = Unpack(block);
      uint64_t m8;
      std::memcpy(&m8, sm[r].min, 8);
      const __m128i m = _mm_cvtsi64_si128(static_cast<long long>(m8));
      mins16[r] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
    }
    __m256i isum[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) isum[r][t] = _mm256_setzero_si256();
    for (int g = 0; g < kSubBlocks / 2; ++g) {
      __m256i w_lo[R], w_hi[R];
      for (int r = 0; r < R; ++r) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(WeightBlocks<BlockQ4_K>(a, r)[b].qs + 32 * g));
        w_lo[r] = _mm256_and_si256(packed, low_nibbles);
        w_hi[r] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
      }
      for (int t = 0; t < T; ++t) {
        const int8_t* xq = Q8KTokenBlocks(a, t)[b].qs + 64 * g;
        const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        for (int r = 0; r < R; ++r) {
          const __m256i lo =
              _mm256_madd_epi16(_mm256_maddubs_epi16(w_lo[r], x_lo), _mm256_set1_epi16(sm[r].scale[2 * g]));
          const __m256i hi =
              _mm256_madd_epi16(_mm256_maddubs_epi16(w_hi[r], x_hi), _mm256_set1_epi16(sm[r].scale[2 * g + 1]));
          isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_add_epi32(lo, hi));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
      for (int r = 0; r < R; ++r) {
        const BlockQ4_K& block = WeightBlocks<BlockQ4_K>(a, r)[b];
        const __m256 min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins16[r]));
        acc[r][t] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t]), _mm256_set1_ps(_cvtsh_ss(block.d) * xb.d), acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(min_sum, _mm256_set1_ps(-_cvtsh_ss(block.dmin) * xb.d), acc[r][t]);
      }
    }
  }
#else
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    for (int r = 0; r < R; ++r) {
      const BlockQ4_K& block = WeightBlocks<BlockQ4_K>(a, r)[b];
      const ScalesMins sm = Unpack(block);
      for (int t = 0; t < T; ++t) {
        const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
        int32_t scaled = 0;
        int32_t mins = 0;
        for (int j = 0; j < kSubBlocks; ++j) {
          const uint8_t* q = block.qs + 32 * (j / 2);
          const int shift = 4 * (j % 2);
          int32_t dot = 0;
          for (int e = 0; e < 32; ++e) dot += ((q[e] >> shift) & 0x0F) * xb.qs[32 * j + e];
          scaled += sm.scale[j] * dot;
          mins += sm.min[j] * (xb.bsums[2 * j] + xb.bsums[2 * j + 1]);
        }
        acc[r][t] +=
            xb.d * (F16ToF32(block.d) * static_cast<float>(scaled) - F16ToF32(block.dmin) * static_cast<float>(mins));
      }
    }
  }
#endif
};

#if KVS_ISA_AVX512
// The panel's super-block packing (SuperBlockPanel in matmul_panel-inl.h): sub-blocks of 32 codes
// u = the nibbles (0..15), s_j = d * sc_j, m_j = dmin * m_j.
struct Q4_KPanelCodes {
  using Block = BlockQ4_K;
  static constexpr int kSubBlockElems = 32;
  using Panel = SuperBlockPanel<Q4_KPanelCodes>;
  static void PackSuperBlock(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    for (int pair = 0; pair < kSubBlocks / 2; ++pair) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t* chunk[kPanelGroupRows];
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qs + 32 * pair + 16 * half;
        __m512i quad[4];
        TransposeRowChunks(chunk, quad);
        // Low nibbles are sub-block 2 pair, high nibbles 2 pair + 1.
        uint8_t* lo = Panel::SubBlockCodes(block, 2 * pair, group) + 4 * half * 64;
        uint8_t* hi = Panel::SubBlockCodes(block, 2 * pair + 1, group) + 4 * half * 64;
        for (int c = 0; c < 4; ++c) {
          _mm512_store_si512(lo + 64 * c, _mm512_and_si512(quad[c], low_nibbles));
          _mm512_store_si512(hi + 64 * c, _mm512_and_si512(_mm512_srli_epi16(quad[c], 4), low_nibbles));
        }
      }
    }
    Panel::PackFactors(src, n_valid, b, group, block, [](const Block& w, float* s, float* m) {
      const ScalesMins sm = Unpack(w);
      for (int j = 0; j < kSubBlocks; ++j) {
        s[j] = _cvtsh_ss(w.d) * static_cast<float>(sm.scale[j]);
        m[j] = _cvtsh_ss(w.dmin) * static_cast<float>(sm.min[j]);
      }
    });
  }
};
#endif

// Q8_K blocks of one token, padded to 64 bytes.
size_t PackedBytes(int64_t cols) { return (static_cast<size_t>(cols / kQK_K) * sizeof(BlockQ8_K) + 63) / 64 * 64; }

void PackToken(const float* x, int64_t cols, uint8_t* dst) {
  quant::HWY_NAMESPACE::QuantizeRowQ8_K(x, reinterpret_cast<BlockQ8_K*>(dst), cols);
}

constexpr Kernel kRowKernel{&PackedBytes, &PackToken, &DispatchTile<BlockTile<Q4_KSteps>>};
#if KVS_ISA_AVX512
constexpr Kernel kKernel = WithPanels<Q4_KPanelCodes::Panel>(kRowKernel);
#else
constexpr Kernel kKernel = kRowKernel;
#endif

}  // namespace

const Kernel& KernelQ4_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
