// F32 / F16 / BF16 weights x f32 activations. Weights are widened to f32 in registers (F16C for
// f16, a 16-bit shift for bf16) and multiplied in f32 FMA; activations are used as given.
// Compiled once per kernel family; tiles are dispatched by the shared driver (matmul_tile-inl.h).
#include <cstdint>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_float.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

template <DType kType>
struct WeightElem;
template <>
struct WeightElem<DType::kF32> {
  using T = float;
  static float ToFloat(float v) { return v; }
};
template <>
struct WeightElem<DType::kF16> {
  using T = f16_bits;
  static float ToFloat(f16_bits v) { return F16ToF32(v); }
};
template <>
struct WeightElem<DType::kBF16> {
  using T = bf16_bits;
  static float ToFloat(bf16_bits v) { return BF16ToF32(v); }
};

#if KVS_ISA_AVX512
// Loads 16 weights starting at element c as f32; `mask` selects the valid ones of a tail.
template <DType kType>
inline __m512 LoadWeights16(const void* row, int64_t c, __mmask16 mask) {
  if constexpr (kType == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + c);
  } else if constexpr (kType == DType::kF16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const f16_bits*>(row) + c));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const bf16_bits*>(row) + c);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#elif KVS_ISA_AVX2
// Loads 8 weights starting at element c as f32 (caller guarantees 8 valid elements).
template <DType kType>
inline __m256 LoadWeights8(const void* row, int64_t c) {
  if constexpr (kType == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + c);
  } else if constexpr (kType == DType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const f16_bits*>(row) + c)));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const bf16_bits*>(row) + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
#endif

#if KVS_ISA_AVX512
// One weight row against one f32 token: the decode hot loop. Four accumulators hide the FMA
// latency (one chain would cap a row at 16 weights per FMA latency); only the tail is masked.
template <DType kType>
__attribute__((noinline)) float DotRowOneToken(const void* row, const float* x, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __mmask16 all = 0xFFFF;
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    for (int k = 0; k < 4; ++k) {
      acc[k] = _mm512_fmadd_ps(LoadWeights16<kType>(row, c + 16 * k, all), _mm512_loadu_ps(x + c + 16 * k), acc[k]);
    }
  }
  for (; c < n; c += 16) {
    const __mmask16 mask = n - c >= 16 ? all : static_cast<__mmask16>((1u << (n - c)) - 1);
    acc[0] = _mm512_fmadd_ps(LoadWeights16<kType>(row, c, mask), _mm512_maskz_loadu_ps(mask, x + c), acc[0]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#endif

template <DType kType>
struct FloatTile {
  using Elem = typename WeightElem<kType>::T;

#if KVS_ISA_AVX512
  // Decode: rows one after another against one token.
  static void RunStripOneToken(const TileArgs& a) {
    const float* x = reinterpret_cast<const float*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken<kType>(a.w + r * a.w_row_bytes, x, a.cols);
  }
#endif

  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n = a.cols;
    const Elem* w[R];
    const float* x[T];
    for (int r = 0; r < R; ++r) w[r] = reinterpret_cast<const Elem*>(a.w + r * a.w_row_bytes);
    for (int t = 0; t < T; ++t) x[t] = reinterpret_cast<const float*>(a.x + t * a.x_token_bytes);
#if KVS_ISA_AVX512
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 mask = n - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - c)) - 1);
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        if (a.w_prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + c * sizeof(Elem)), _MM_HINT_T1);
        wv[r] = LoadWeights16<kType>(w[r], c, mask);
      }
      for (int t = 0; t < T; ++t) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x[t] + c);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
      }
    }
    StoreTile<R, T>(a, acc);
#elif KVS_ISA_AVX2
    __m256 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) {
        if (a.w_prefetch)
          _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + c * sizeof(Elem)), _MM_HINT_T1);
        wv[r] = LoadWeights8<kType>(w[r], c);
      }
      for (int t = 0; t < T; ++t) {
        const __m256 xv = _mm256_loadu_ps(x[t] + c);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        float sum = ReduceAdd(acc[r][t]);
        for (int64_t i = c; i < n; ++i) sum += WeightElem<kType>::ToFloat(w[r][i]) * x[t][i];
        a.y[t * a.y_stride + r] = a.accumulate ? a.y[t * a.y_stride + r] + sum : sum;
      }
    }
#else
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) sum += WeightElem<kType>::ToFloat(w[r][i]) * x[t][i];
        a.y[t * a.y_stride + r] = a.accumulate ? a.y[t * a.y_stride + r] + sum : sum;
      }
    }
#endif
  }
};

// 512 columns: a 4-row chunk is 4-8 KiB and 4 tokens' activations 8 KiB, all L1-resident.
constexpr int64_t kFloatKChunk = 512;

constexpr Kernel kKernelF32{nullptr, nullptr, &DispatchTile<FloatTile<DType::kF32>>, kFloatKChunk};
constexpr Kernel kKernelF16{nullptr, nullptr, &DispatchTile<FloatTile<DType::kF16>>, kFloatKChunk};
constexpr Kernel kKernelBF16{nullptr, nullptr, &DispatchTile<FloatTile<DType::kBF16>>, kFloatKChunk};

}  // namespace

const Kernel& KernelF32() { return kKernelF32; }
const Kernel& KernelF16() { return kKernelF16; }
const Kernel& KernelBF16() { return kKernelBF16; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
