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
// The panel arithmetic (matmul_panel-inl.h), per super-block with its 8 sub-blocks j as the
// panel's 32-element blocks: codes u (0..15, unsigned as they stand, so the dots start at 0),
// and per row and sub-block the f32 factors d * sc_j and dmin * m_j. Per row and token:
//   sum = d_x * (sum_j (d sc_j) dot(u_j, x_j) - sum_j (dmin m_j) sum(x_j))
// with sum(x_j) from the activations' bsums, converted once per call.
struct Q4_KPanel {
  static constexpr int kBlockElems = kQK_K;
  static constexpr size_t kGroupBlockBytes = kSubBlocks * (kPanelCodeBytes + 2 * kPanelGroupRows * sizeof(float));
  // A super-block of the panel: codes [sub-block][group][512], then scales and mins
  // [sub-block][group][16 floats] each.
  static constexpr size_t kBlockBytes = kPanelGroups * kGroupBlockBytes;
  static constexpr size_t kScalesOffset = kSubBlocks * kPanelGroups * kPanelCodeBytes;
  static constexpr size_t kMinsOffset = kScalesOffset + kSubBlocks * kPanelGroups * kPanelGroupRows * sizeof(float);

  static std::vector<float>& SubBlockSums() {
    static thread_local std::vector<float> sums;  // [n_tokens, n_blocks, kSubBlocks] sum(x_j) as f32
    return sums;
  }
  static const BlockQ8_K* TokenBlocks(const TileArgs& a, int t) { return Q8KTokenBlocks(a, t); }

  static void PrepareTokens(const TileArgs& a, int64_t n_blocks) {
    std::vector<float>& sums = SubBlockSums();
    sums.resize(static_cast<size_t>(a.n_tokens) * n_blocks * kSubBlocks);
    for (int t = 0; t < a.n_tokens; ++t) {
      const BlockQ8_K* x = TokenBlocks(a, t);
      for (int64_t b = 0; b < n_blocks; ++b) {
        for (int j = 0; j < kSubBlocks; ++j) {
          sums[(t * n_blocks + b) * kSubBlocks + j] = static_cast<float>(x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
        }
      }
    }
  }

  static void PackGroup(const TileArgs& a, int row, int n_valid, int group, int64_t n_blocks, uint8_t* panel) {
    const BlockQ4_K* src[kPanelGroupRows];
    for (int j = 0; j < kPanelGroupRows; ++j) src[j] = WeightBlocks<BlockQ4_K>(a, row + (j < n_valid ? j : 0));
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < n_blocks; ++b) {
      uint8_t* block = panel + b * kBlockBytes;
      for (int pair = 0; pair < kSubBlocks / 2; ++pair) {
        for (int half = 0; half < 2; ++half) {
          const uint8_t* chunk[kPanelGroupRows];
          for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = src[j][b].qs + 32 * pair + 16 * half;
          __m512i quad[4];
          TransposeRowChunks(chunk, quad);
          // Low nibbles are sub-block 2 pair, high nibbles 2 pair + 1.
          uint8_t* lo = block + ((2 * pair) * kPanelGroups + group) * kPanelCodeBytes + 4 * half * 64;
          uint8_t* hi = block + ((2 * pair + 1) * kPanelGroups + group) * kPanelCodeBytes + 4 * half * 64;
          for (int c = 0; c < 4; ++c) {
            _mm512_store_si512(lo + 64 * c, _mm512_and_si512(quad[c], low_nibbles));
            _mm512_store_si512(hi + 64 * c, _mm512_and_si512(_mm512_srli_epi16(quad[c], 4), low_nibbles));
          }
        }
      }
      float* scales = reinterpret_cast<float*>(block + kScalesOffset);
      float* mins = reinterpret_cast<float*>(block + kMinsOffset);
      for (int k = 0; k < kPanelGroupRows; ++k) {
        const int r = PanelRow(k);
        const BlockQ4_K& w = src[r][b];
        const ScalesMins sm = Unpack(w);
        const float d = r < n_valid ? _cvtsh_ss(w.d) : 0.f, dmin = r < n_valid ? _cvtsh_ss(w.dmin) : 0.f;
        for (int j = 0; j < kSubBlocks; ++j) {
          scales[(j * kPanelGroups + group) * kPanelGroupRows + k] = d * static_cast<float>(sm.scale[j]);
          mins[(j * kPanelGroups + group) * kPanelGroupRows + k] = dmin * static_cast<float>(sm.min[j]);
        }
      }
      if (b + 2 < n_blocks) {  // the rows' next super-blocks, ahead of this walk
        for (int j = 0; j < n_valid; ++j) {
          for (size_t off = 0; off < sizeof(BlockQ4_K); off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(&src[j][b + 2]) + off, _MM_HINT_T0);
          }
        }
      }
    }
  }

  template <int G, int T>
  static void Sums(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, __m512 (&acc)[G][T]) {
    const float* sums = SubBlockSums().data();
    const BlockQ8_K* x[T];
    for (int t = 0; t < T; ++t) {
      x[t] = TokenBlocks(a, t0 + t);
      for (int g = 0; g < G; ++g) acc[g][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
      const uint8_t* block = panel + b * kBlockBytes;
      const float* scales = reinterpret_cast<const float*>(block + kScalesOffset);
      const float* mins = reinterpret_cast<const float*>(block + kMinsOffset);
      __m512 sb[G][T];  // the super-block's sum before d_x
      for (int j = 0; j < kSubBlocks; ++j) {
        const int8_t* xj[T];
        __m512i dot[G][T];
        for (int t = 0; t < T; ++t) {
          xj[t] = x[t][b].qs + 32 * j;
          for (int g = 0; g < G; ++g) dot[g][t] = _mm512_setzero_si512();
        }
        PanelBlockDots<G, T>(block + j * kPanelGroups * kPanelCodeBytes, kPanelCodeBytes, xj, dot);
        for (int g = 0; g < G; ++g) {
          const __m512 ws = _mm512_load_ps(scales + (j * kPanelGroups + g) * kPanelGroupRows);
          for (int t = 0; t < T; ++t) {
            sb[g][t] = j == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot[g][t]), ws)
                              : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][t]), ws, sb[g][t]);
          }
        }
      }
      for (int j = 0; j < kSubBlocks; ++j) {
        for (int g = 0; g < G; ++g) {
          const __m512 wm = _mm512_load_ps(mins + (j * kPanelGroups + g) * kPanelGroupRows);
          for (int t = 0; t < T; ++t) {
            const float sum_x = sums[((t0 + t) * n_blocks + b) * kSubBlocks + j];
            sb[g][t] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(sum_x), sb[g][t]);
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512 dx = _mm512_set1_ps(x[t][b].d);
        for (int g = 0; g < G; ++g) acc[g][t] = _mm512_fmadd_ps(sb[g][t], dx, acc[g][t]);
      }
    }
  }
};
#endif

// Q8_K blocks of one token, padded to 64 bytes.
size_t PackedBytes(int64_t cols) { return (static_cast<size_t>(cols / kQK_K) * sizeof(BlockQ8_K) + 63) / 64 * 64; }

void PackToken(const float* x, int64_t cols, uint8_t* dst) {
  quant::HWY_NAMESPACE::QuantizeRowQ8_K(x, reinterpret_cast<BlockQ8_K*>(dst), cols);
}

constexpr Kernel MakeKernel() {
  Kernel kernel{&PackedBytes, &PackToken, &DispatchTile<BlockTile<Q4_KSteps>>};
#if KVS_ISA_AVX512
  kernel.panel = &RunPanels<Q4_KPanel>;
#endif
  return kernel;
}
constexpr Kernel kKernel = MakeKernel();

}  // namespace

const Kernel& KernelQ4_K() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
