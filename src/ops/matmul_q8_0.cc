// Q8_0 weights x Q8_0 activations (packed_q8.h), integer dot products per 32-element block,
// scaled by d_w * d_x and accumulated in f32 -- ggml's vec_dot_q8_0_q8_0 scheme. Compiled once
// per kernel family; the tile loops are shared (matmul_packed_q8-inl.h), this file holds the
// block arithmetic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q8_0.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/packed_q8-inl.h"
#include "ops/matmul_packed_q8-inl.h"
#include "ops/matmul_panel-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

struct Q8_0Blocks {
  using Block = BlockQ8_0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;

#if KVS_ISA_AVX512
  // VNNI multiplies unsigned by signed bytes: weights enter as (w + 128) and the packed
  // activations' `init` subtracts 128 * sum(x) per lane.
  static constexpr int kOffset = 128;
  static __m512i Signed(const Block& b0, const Block& b1) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0.qs));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1.qs));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  static __m512i Load(const Block& b0, const Block& b1) {
    return _mm512_xor_si512(Signed(b0, b1), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  // The sign trick: |w| times x carrying w's sign.
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    const __m512i w = Signed(b0, b1);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i x_signed = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(w), zero, xq);
    return _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(w), x_signed);
  }
#elif KVS_ISA_AVX2
  // No VNNI: the sign trick needs no bias.
  static constexpr int kOffset = 0;
  static __m256i Load(const Block& b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)); }
  static __m256i Dot(__m256i w, __m256i xq, __m256i /*init*/) { return SignedDot(w, xq); }
#else
  static constexpr int kOffset = 0;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK8_0; ++e) dot += b.qs[e] * xq[e];
    return dot;
  }
#endif
};

#if KVS_ISA_AVX512
// The panel arithmetic (matmul_panel-inl.h): per 32-element block and group, the codes (w + 128,
// as the tile steps feed them) and the rows' d; per token and block, the dot's start
// -128 * sum(x) (cancelling the + 128) and d_x, gathered from the packed steps once per call.
struct Q8_0Panel {
  static constexpr int kBlockElems = kQK8_0;
  static constexpr size_t kGroupBlockBytes = kPanelCodeBytes + kPanelGroupRows * sizeof(float);
  static constexpr size_t kBlockBytes = kPanelGroups * kGroupBlockBytes;  // codes of all groups, then scales
  struct TokenBlocks {
    std::vector<int32_t> init;  // [n_tokens, n_blocks]
    std::vector<float> scale;   // [n_tokens, n_blocks]
  };
  static TokenBlocks& Tokens() {
    static thread_local TokenBlocks tokens;
    return tokens;
  }

  static void PrepareTokens(const TileArgs& a, int64_t n_blocks) {
    TokenBlocks& tb = Tokens();
    tb.init.resize(static_cast<size_t>(a.n_tokens) * n_blocks);
    tb.scale.resize(tb.init.size());
    for (int t = 0; t < a.n_tokens; ++t) {
      const uint8_t* token = a.x + t * a.x_token_bytes;
      for (int64_t b = 0; b < n_blocks; ++b) {
        // Init lanes 8j..8j+7 and scale lane 8j of a step belong to its block j.
        const uint8_t* step = token + (b / kStepBlocks) * kStepBytes;
        const int lane = static_cast<int>(b % kStepBlocks) * 8;
        const int32_t* init = reinterpret_cast<const int32_t*>(step + kStepInitOffset) + lane;
        int32_t sum = 0;
        for (int i = 0; i < 8; ++i) sum += init[i];
        tb.init[t * n_blocks + b] = sum;
        tb.scale[t * n_blocks + b] = reinterpret_cast<const float*>(step + kStepScaleOffset)[lane];
      }
    }
  }

  // Lanes of rows past n_valid repeat the first row with scale 0.
  static void PackGroup(const TileArgs& a, int row, int n_valid, int group, int64_t n_blocks, uint8_t* panel) {
    const BlockQ8_0* src[kPanelGroupRows];
    for (int j = 0; j < kPanelGroupRows; ++j) src[j] = WeightBlocks<BlockQ8_0>(a, row + (j < n_valid ? j : 0));
    const __mmask16 valid_lanes = PanelValidLanes(n_valid);
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < n_blocks; ++b) {
      uint8_t* block = panel + b * kBlockBytes;
      for (int half = 0; half < 2; ++half) {
        const uint8_t* chunk[kPanelGroupRows];
        for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = reinterpret_cast<const uint8_t*>(src[j][b].qs) + 16 * half;
        __m512i quad[4];
        TransposeRowChunks(chunk, quad);
        uint8_t* dst = block + group * kPanelCodeBytes + 4 * half * 64;  // quads 4 half .. 4 half + 3
        for (int c = 0; c < 4; ++c) _mm512_store_si512(dst + 64 * c, _mm512_xor_si512(quad[c], offset));
      }
      alignas(32) f16_bits d[kPanelGroupRows];
      for (int k = 0; k < kPanelGroupRows; ++k) d[k] = src[PanelRow(k)][b].d;
      float* scales = reinterpret_cast<float*>(block + kPanelGroups * kPanelCodeBytes) + group * kPanelGroupRows;
      _mm512_store_ps(scales, _mm512_maskz_mov_ps(valid_lanes, _mm512_cvtph_ps(_mm256_load_si256(
                                                                   reinterpret_cast<const __m256i*>(d)))));
      // The rows' next blocks, ahead of this walk (16 row streams are more than the hardware
      // prefetcher follows).
      if (b + 8 < n_blocks) {
        for (int j = 0; j < n_valid; ++j) _mm_prefetch(reinterpret_cast<const char*>(&src[j][b + 8]), _MM_HINT_T0);
      }
    }
  }

  template <int G, int T>
  static void Sums(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, PanelPrefetch& prefetch,
                   __m512 (&acc)[G][T]) {
    const TokenBlocks& tb = Tokens();
    const uint8_t* x[T];
    const int32_t* init[T];
    const float* x_scale[T];
    for (int t = 0; t < T; ++t) {
      x[t] = a.x + (t0 + t) * a.x_token_bytes;
      init[t] = tb.init.data() + (t0 + t) * n_blocks;
      x_scale[t] = tb.scale.data() + (t0 + t) * n_blocks;
      for (int g = 0; g < G; ++g) acc[g][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
      prefetch.Step();
      const uint8_t* block = panel + b * kBlockBytes;
      const int8_t* xb[T];
      __m512i dot[G][T];
      for (int t = 0; t < T; ++t) {
        xb[t] = reinterpret_cast<const int8_t*>(x[t] + (b / kStepBlocks) * kStepBytes + (b % kStepBlocks) * 32);
        const __m512i start = _mm512_set1_epi32(init[t][b]);
        for (int g = 0; g < G; ++g) dot[g][t] = start;
      }
      PanelBlockDots<G, T>(block, kPanelCodeBytes, xb, dot);
      const float* w_scale = reinterpret_cast<const float*>(block + kPanelGroups * kPanelCodeBytes);
      for (int g = 0; g < G; ++g) {
        const __m512 ws = _mm512_load_ps(w_scale + g * kPanelGroupRows);
        for (int t = 0; t < T; ++t) {
          acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][t]), _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[t][b])),
                                      acc[g][t]);
        }
      }
    }
  }
};
#endif

constexpr Kernel MakeKernel() {
  Kernel kernel = PackedQ8Kernel<Q8_0Blocks>::Make();
#if KVS_ISA_AVX512
  kernel.panel = &RunPanels<Q8_0Panel>;
#endif
  return kernel;
}
constexpr Kernel kKernel = MakeKernel();

}  // namespace

const Kernel& KernelQ8_0() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
