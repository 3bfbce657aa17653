// Q4_0 weights x Q8_0 activations (packed_q8.h). Weight nibbles are used as unsigned bytes
// (q in 0..15, value = q - 8); the packed activations' `init` holds -8 * sum(x) per lane, so
// the integer dot starts pre-corrected -- ggml's vec_dot_q4_0_q8_0 arithmetic.

#include "kvsparse/dtype.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"
#include "ops/simd_isa.h"
#include "ops/tile_dispatch.h"

namespace kvsparse::matmul {

namespace {

constexpr int kNibbleOffset = 8;

inline const BlockQ4_0* RowBlocks(const TileArgs& a, int r) {
  return reinterpret_cast<const BlockQ4_0*>(a.w + r * a.w_row_bytes);
}

#if KVS_ISA_AVX512VNNI
// One weight row against one token (kQ4NibbleHalves order): the decode hot loop, kept minimal and
// out of line (see the Q8_0 twin for why). Nibbles q in 0..15 stand for q - 8:
//  - full layout: the packed `init` holds -8 * sum(x) per lane, scales are per lane;
//  - compact layout: dot(q, x) - dot(8, x), scales expanded per step.
template <bool kCompact>
__attribute__((noinline)) float DotRowOneToken(const BlockQ4_0* blocks, int64_t n_blocks, const uint8_t* x) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i eights = _mm512_set1_epi8(kNibbleOffset);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const int64_t n_steps = PackedSteps(n_blocks * kQK4_0);
  const float* compact_scales = CompactQ8Scales(x, n_blocks * kQK4_0);
  // Two accumulators: one FMA chain would cap a row at one step per FMA latency.
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  auto accumulate = [&](const BlockQ4_0& b0, const BlockQ4_0& b1, int64_t step, __m512& sum) {
    const __m256i packed = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1.qs)),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0.qs)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
    const __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), low_nibbles);
    // [d0 x 4 | d1 x 4 | d0 x 4 | d1 x 4] as f16, then one widening convert.
    const __m512 w_scale = _mm512_cvtph_ps(_mm256_blend_epi32(_mm256_set1_epi16(static_cast<short>(b0.d)),
                                                              _mm256_set1_epi16(static_cast<short>(b1.d)), 0xCC));
    __m512i dot;
    __m512 x_scale;
    if constexpr (kCompact) {
      const __m512i xq = _mm512_load_si512(x + step * kStepElems);
      dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, w, xq), _mm512_dpbusd_epi32(zero, eights, xq));
      const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(compact_scales + 2 * step)));
      x_scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(pair));
    } else {
      const uint8_t* packed_x = x + step * kStepBytes;
      dot = _mm512_dpbusd_epi32(_mm512_load_si512(packed_x + 64), w, _mm512_load_si512(packed_x));
      x_scale = _mm512_load_ps(reinterpret_cast<const float*>(packed_x + 128));
    }
    sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale, x_scale), sum);
  };
  const int64_t n_pairs = n_blocks / 2;
  int64_t p = 0;
  for (; p + 2 <= n_pairs; p += 2) {
    accumulate(blocks[2 * p], blocks[2 * p + 1], p, acc[0]);
    accumulate(blocks[2 * p + 2], blocks[2 * p + 3], p + 1, acc[1]);
  }
  if (p < n_pairs) accumulate(blocks[2 * p], blocks[2 * p + 1], p, acc[0]);
  if (n_pairs < n_steps) {  // odd tail: the block doubles as its own partner; its padded scale is 0
    accumulate(blocks[n_blocks - 1], blocks[n_blocks - 1], n_pairs, acc[1]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}
#endif

struct Q4_0Tile {
#if KVS_ISA_AVX512VNNI
  // Decode: rows one after another against one token in the compact layout.
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK4_0;
    if (DecodeUsesCompactLayout(a.cols)) {
      for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken<true>(RowBlocks(a, r), n_blocks, a.x);
    } else {
      for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken<false>(RowBlocks(a, r), n_blocks, a.x);
    }
  }

  // One step = 2 blocks. Byte order [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31] (kQ4NibbleHalves)
  // falls straight out of the nibble split, so int32 lanes 0-3, 8-11 are block 0 and 4-7, 12-15 block 1.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t s, int64_t b0, int64_t b1, __m512 (&acc)[R][T]) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    __m512i w[R];
    __m512 w_scale[R];
    for (int r = 0; r < R; ++r) {
      const BlockQ4_0* blocks = RowBlocks(a, r);
      if (a.w_prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + b0 * sizeof(BlockQ4_0)),
                     _MM_HINT_T1);
      }
      const __m256i packed = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b1].qs)),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b0].qs)));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
      // Upper 256 bits take the high nibbles.
      w[r] = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), low_nibbles);
      w_scale[r] = _mm512_cvtph_ps(_mm256_blend_epi32(_mm256_set1_epi16(static_cast<short>(blocks[b0].d)),
                                                      _mm256_set1_epi16(static_cast<short>(blocks[b1].d)), 0xCC));
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

  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK4_0;
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    // Block indices straight from s keep load addresses off dependency chains (decode streaming).
    for (int64_t s = 0; s < n_blocks / 2; ++s) Step<R, T>(a, s, 2 * s, 2 * s + 1, acc);
    if (n_blocks % 2 != 0) {
      // Odd tail: block b0 doubles as its own partner; the padded activations (scale 0) cancel it.
      Step<R, T>(a, n_blocks / 2, n_blocks - 1, n_blocks - 1, acc);
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) a.y[t * a.y_stride + r] = _mm512_reduce_add_ps(acc[r][t]);
  }
#elif KVS_ISA_AVX2
  // One step = 1 block: [e0-15 low nibbles | e16-31 high nibbles] is the natural order.
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_steps = PackedSteps(a.cols);
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    __m256 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n_steps; ++s) {
      __m256i w[R];
      __m256 w_scale[R];
      for (int r = 0; r < R; ++r) {
        const BlockQ4_0& block = RowBlocks(a, r)[s];
        if (a.w_prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + s * sizeof(BlockQ4_0)),
                       _MM_HINT_T1);
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs));
        w[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
        w_scale[r] = _mm256_set1_ps(_cvtsh_ss(block.d));
      }
      for (int t = 0; t < T; ++t) {
        const uint8_t* step = a.x + t * a.x_token_bytes + s * kStepBytes;
        const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(step));
        const __m256i init = _mm256_load_si256(reinterpret_cast<const __m256i*>(step + 32));
        const __m256 x_scale = _mm256_load_ps(reinterpret_cast<const float*>(step + 64));
        for (int r = 0; r < R; ++r) {
#if defined(KVS_DPBUSD256)
          const __m256i dot = KVS_DPBUSD256(init, w[r], xq);
#else
          // Nibble x int8 pairs stay far inside int16 (2 * 15 * 127).
          const __m256i dot =
              _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xq), _mm256_set1_epi16(1)));
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
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK4_0;
    float acc[R][T] = {};
    for (int64_t b = 0; b < n_blocks; ++b) {
      for (int t = 0; t < T; ++t) {
        const uint8_t* step = a.x + t * a.x_token_bytes + b * kStepBytes;
        const int8_t* xq = reinterpret_cast<const int8_t*>(step);
        const float x_scale = reinterpret_cast<const float*>(step + kStepElems + 4 * simd::kLanes)[0];
        for (int r = 0; r < R; ++r) {
          const BlockQ4_0& block = RowBlocks(a, r)[b];
          int32_t dot = 0;
          for (int e = 0; e < kQK4_0 / 2; ++e) {
            dot += ((block.qs[e] & 0x0F) - kNibbleOffset) * xq[e];
            dot += ((block.qs[e] >> 4) - kNibbleOffset) * xq[e + kQK4_0 / 2];
          }
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
  PackQ8Token(x, cols, dst, kNibbleOffset, KVS_ISA_AVX512VNNI ? Q8Order::kQ4NibbleHalves : Q8Order::kNatural);
}

#if KVS_ISA_AVX512VNNI
void PackDecodeToken(const float* x, int64_t cols, uint8_t* dst) {
  PackQ8DecodeToken(x, cols, dst, kNibbleOffset, Q8Order::kQ4NibbleHalves);
}
#endif

}  // namespace

const Kernel& KernelQ4_0() {
#if KVS_ISA_AVX512VNNI
  static const Kernel kernel{&PackedBytes,        &PackToken,      &DispatchTile<Q4_0Tile>, 0,
                             &DecodeQ8TokenBytes, &PackDecodeToken};
#else
  static const Kernel kernel{&PackedBytes, &PackToken, &DispatchTile<Q4_0Tile>};
#endif
  return kernel;
}

}  // namespace kvsparse::matmul
