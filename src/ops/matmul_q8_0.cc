// Q8_0 weights x Q8_0 activations (packed_q8.h), integer dot products per 32-element block,
// scaled by d_w * d_x and accumulated in f32 -- ggml's vec_dot_q8_0_q8_0 scheme.
#include <algorithm>

#include "kvsparse/dtype.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"
#include "ops/simd_isa.h"
#include "ops/tile_dispatch.h"

namespace kvsparse::matmul {

namespace {

// VNNI multiplies unsigned by signed bytes: weights enter as (w + 128) and the packed
// activations' `init` subtracts 128 * sum(x) per lane. Without VNNI the sign trick is used.
constexpr int kWeightOffset = simd::kHasVnni ? 128 : 0;

inline const BlockQ8_0* RowBlocks(const TileArgs& a, int r) {
  return reinterpret_cast<const BlockQ8_0*>(a.w + r * a.w_row_bytes);
}

struct Q8_0Tile {
#if KVS_ISA_AVX512VNNI
  // One step = 2 blocks = 64 bytes per row; 16 int32 lanes, lanes 0-7 block 0, 8-15 block 1.
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK8_0;
    const int64_t n_steps = PackedSteps(a.cols);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n_steps; ++s) {
      const int64_t b0 = 2 * s;
      // An odd tail reuses block b0 as its partner; the padded activations (scale 0) cancel it.
      const int64_t b1 = std::min(b0 + 1, n_blocks - 1);
      __m512i w[R];
      __m512 w_scale[R];
      for (int r = 0; r < R; ++r) {
        const BlockQ8_0* blocks = RowBlocks(a, r);
        if (a.w_prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + s * 2 * sizeof(BlockQ8_0)),
                       _MM_HINT_T1);
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[b0].qs));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[b1].qs));
        w[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
        const __m128i d16 =
            _mm_cvtsi32_si128(static_cast<int>(blocks[b0].d | (static_cast<uint32_t>(blocks[b1].d) << 16)));
        w_scale[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(d16)));
      }
      for (int t = 0; t < T; ++t) {
        const uint8_t* step = a.x + t * a.x_token_bytes + s * kStepBytes;
        const __m512i xq = _mm512_load_si512(step);
        const __m512i init = _mm512_load_si512(step + 64);
        const __m512 x_scale = _mm512_load_ps(reinterpret_cast<const float*>(step + 128));
        for (int r = 0; r < R; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(init, w[r], xq);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale[r], x_scale), acc[r][t]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) a.y[t * a.y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
#elif KVS_ISA_AVX2
  // One step = 1 block = 32 bytes per row; 8 int32 lanes.
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_steps = PackedSteps(a.cols);
    __m256 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n_steps; ++s) {
      __m256i w[R];
      __m256 w_scale[R];
      for (int r = 0; r < R; ++r) {
        const BlockQ8_0& block = RowBlocks(a, r)[s];
        if (a.w_prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + s * sizeof(BlockQ8_0)),
                       _MM_HINT_T1);
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs));
        w_scale[r] = _mm256_set1_ps(_cvtsh_ss(block.d));
      }
      for (int t = 0; t < T; ++t) {
        const uint8_t* step = a.x + t * a.x_token_bytes + s * kStepBytes;
        const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(step));
        const __m256 x_scale = _mm256_load_ps(reinterpret_cast<const float*>(step + 64));
#if defined(KVS_DPBUSD256)
        const __m256i init = _mm256_load_si256(reinterpret_cast<const __m256i*>(step + 32));
#endif
        for (int r = 0; r < R; ++r) {
#if defined(KVS_DPBUSD256)
          const __m256i dot =
              KVS_DPBUSD256(init, _mm256_xor_si256(w[r], _mm256_set1_epi8(static_cast<char>(0x80))), xq);
#else
          // |w| * (x * sign(w)) keeps maddubs' u8 x s8 pairs within int16.
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[r], w[r]), _mm256_sign_epi8(xq, w[r]));
          const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w_scale[r], x_scale), acc[r][t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        const __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
        const __m128 v2 = _mm_add_ps(v, _mm_movehl_ps(v, v));
        a.y[t * a.y_stride + r] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
      }
    }
  }
#else
  // Portable fallback: one block per step, exact integer block dots.
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK8_0;
    float acc[R][T] = {};
    for (int64_t b = 0; b < n_blocks; ++b) {
      for (int t = 0; t < T; ++t) {
        const uint8_t* step = a.x + t * a.x_token_bytes + b * kStepBytes;
        const int8_t* xq = reinterpret_cast<const int8_t*>(step);
        const float x_scale = reinterpret_cast<const float*>(step + kStepElems + 4 * simd::kLanes)[0];
        for (int r = 0; r < R; ++r) {
          const BlockQ8_0& block = RowBlocks(a, r)[b];
          int32_t dot = 0;
          for (int e = 0; e < kQK8_0; ++e) dot += block.qs[e] * xq[e];
          acc[r][t] += static_cast<float>(dot) * (F16ToF32(block.d) * x_scale);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) a.y[t * a.y_stride + r] = acc[r][t];
  }
#endif
};

size_t PackedBytes(int64_t cols) { return PackedQ8TokenBytes(cols); }

void PackToken(const float* x, int64_t cols, uint8_t* dst) {
  PackQ8Token(x, cols, dst, kWeightOffset, Q8Order::kNatural);
}

}  // namespace

const Kernel& KernelQ8_0() {
  static const Kernel kernel{&PackedBytes, &PackToken, &DispatchTile<Q8_0Tile>};
  return kernel;
}

const char* IsaName() {
#if KVS_ISA_AVX512VNNI
  return "avx512-vnni";
#elif KVS_ISA_AVX2 && defined(KVS_DPBUSD256)
  return "avx2+vnni256";
#elif KVS_ISA_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace kvsparse::matmul
