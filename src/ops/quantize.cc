// Row (de)quantization entry points, compiled once per kernel family (see simd_family.h). Q8_0 and
// Q8_K quantization (the activation paths of the quantized matmuls) and the f16 conversions are
// vectorized; the rest defer to the ggml-exact reference. Every fast path is bit-identical to its
// scalar twin.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "kvsparse/status.h"
#include "ops/quant_internal.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/quantize.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/quantize-inl.h"
namespace kvsparse::quant::HWY_NAMESPACE {

#if KVS_ISA_AVX2
inline __m256 Abs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline float ReduceMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int ReduceAdd(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Narrows 4 x 8 int32 (each in [-128, 127]) to 32 int8 in order. The packs work per 128-bit lane,
// leaving 4-byte groups in the order a0 b0 c0 d0 a1 b1 c1 d1 (x0 = x's low half); the permute
// restores a0 a1 b0 b1 c0 c1 d0 d1.
inline __m256i PackI32ToI8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

f16_bits QuantizeBlockQ8_0(const float* x, int8_t* q) {
#if KVS_ISA_AVX512
  const __m512 v0 = _mm512_loadu_ps(x);
  const __m512 v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  // round() semantics (half away from zero), matching the scalar reference bit for bit.
  auto round_away = [](__m512 t) {
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, whole)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.f), _mm512_and_ps(t, _mm512_set1_ps(-0.f)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(whole, up, whole, one));
  };
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(round_away(_mm512_mul_ps(v0, vid))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(round_away(_mm512_mul_ps(v1, vid))));
  return F32ToF16(d);
#elif KVS_ISA_AVX2
  // The avx512 path with 8-wide vectors: 4 vectors per block.
  const __m256 v0 = _mm256_loadu_ps(x);
  const __m256 v1 = _mm256_loadu_ps(x + 8);
  const __m256 v2 = _mm256_loadu_ps(x + 16);
  const __m256 v3 = _mm256_loadu_ps(x + 24);
  const float amax = ReduceMax(_mm256_max_ps(_mm256_max_ps(Abs(v0), Abs(v1)), _mm256_max_ps(Abs(v2), Abs(v3))));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  // round() semantics (half away from zero): truncate, then step one away from zero where the
  // dropped fraction is >= 0.5 (t - trunc(t) is exact, so the comparison sees the true fraction).
  auto round_away = [](__m256 t) {
    const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(Abs(_mm256_sub_ps(t, whole)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.f), _mm256_and_ps(t, _mm256_set1_ps(-0.f)));
    return _mm256_cvttps_epi32(_mm256_add_ps(whole, _mm256_and_ps(up, one)));
  };
  // |q| <= 127, so the saturating packs are plain narrowing here.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      PackI32ToI8(round_away(_mm256_mul_ps(v0, vid)), round_away(_mm256_mul_ps(v1, vid)),
                                  round_away(_mm256_mul_ps(v2, vid)), round_away(_mm256_mul_ps(v3, vid))));
  return F32ToF16(d);
#else
  BlockQ8_0 block;
  QuantizeRowQ8_0Ref(x, &block, kQK8_0);
  std::memcpy(q, block.qs, kQK8_0);
  return block.d;
#endif
}

void QuantizeRowQ8_K(const float* x, BlockQ8_K* y, int64_t n) {
#if KVS_ISA_AVX512
  constexpr int kVectors = kQK_K / 16;
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    __m512 v[kVectors];
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < kVectors; ++i) {
      v[i] = _mm512_loadu_ps(x + 16 * i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[i]));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    if (amax == 0.f) {
      std::memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    // The reference keeps the first element reaching amax; its sign sets the scale's sign.
    float max = 0.f;
    for (int i = 0; i < kVectors; ++i) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(v[i]), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) {
        max = x[16 * i + __builtin_ctz(hit)];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m512 vscale = _mm512_set1_ps(iscale);
    for (int i = 0; i < kVectors; ++i) {
      // cvtps rounds half to even under the default MXCSR mode, like the reference's nearest_int.
      const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], vscale)), _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16 * i), _mm512_cvtepi32_epi8(q));
      y[b].bsums[i] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
    y[b].d = 1.f / iscale;
  }
#elif KVS_ISA_AVX2
  // The avx512 path with 8-wide vectors. A block is 32 vectors, twice the register file, so each
  // pass reloads x (from L1) instead of keeping the block in registers.
  constexpr int kVectors = kQK_K / 8;
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    __m256 vmax = _mm256_setzero_ps();
    for (int i = 0; i < kVectors; ++i) vmax = _mm256_max_ps(vmax, Abs(_mm256_loadu_ps(x + 8 * i)));
    const float amax = ReduceMax(vmax);
    if (amax == 0.f) {
      std::memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    // The reference keeps the first element reaching amax; its sign sets the scale's sign.
    float max = 0.f;
    for (int i = 0; i < kVectors; ++i) {
      const __m256 hit = _mm256_cmp_ps(Abs(_mm256_loadu_ps(x + 8 * i)), _mm256_set1_ps(amax), _CMP_EQ_OQ);
      const int mask = _mm256_movemask_ps(hit);
      if (mask) {
        max = x[8 * i + __builtin_ctz(mask)];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m256 vscale = _mm256_set1_ps(iscale);
    // cvtps rounds half to even under the default MXCSR mode, like the reference's nearest_int.
    auto quantize = [&](int i) {
      return _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vscale)),
                              _mm256_set1_epi32(127));
    };
    // 32 quants per iteration: two bsums groups of 16.
    for (int i = 0; i < kVectors; i += 4) {
      const __m256i q0 = quantize(i), q1 = quantize(i + 1), q2 = quantize(i + 2), q3 = quantize(i + 3);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + 8 * i), PackI32ToI8(q0, q1, q2, q3));
      y[b].bsums[i / 2] = static_cast<int16_t>(ReduceAdd(_mm256_add_epi32(q0, q1)));
      y[b].bsums[i / 2 + 1] = static_cast<int16_t>(ReduceAdd(_mm256_add_epi32(q2, q3)));
    }
    y[b].d = 1.f / iscale;
  }
#else
  QuantizeRowQ8_KRef(x, y, n);
#endif
}

void QuantizeRowQ8_0Impl(const float* x, BlockQ8_0* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK8_0; ++b) y[b].d = QuantizeBlockQ8_0(x + b * kQK8_0, y[b].qs);
}

// F16C converts with round-to-nearest-even (immediate 0, whatever MXCSR says), as F32ToF16 does;
// for NaNs it also keeps the sign and the top 10 payload bits and sets the quiet bit, as
// F32ToF16 does, so the two agree on every input (under the default MXCSR: no DAZ).
void QuantizeRowF16Impl(const float* x, f16_bits* h, int64_t n) {
  int64_t i = 0;
#if KVS_ISA_AVX512
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), 0));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(h + i, tail, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(tail, x + i), 0));
  }
#elif KVS_ISA_AVX2
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
  }
  for (; i < n; ++i) h[i] = F32ToF16(x[i]);
#else
  for (; i < n; ++i) h[i] = F32ToF16(x[i]);
#endif
}

void DequantizeRowF16Impl(const f16_bits* h, float* x, int64_t n) {
  int64_t i = 0;
#if KVS_ISA_AVX512
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(x + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, tail, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, h + i)));
  }
#elif KVS_ISA_AVX2
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < n; ++i) x[i] = F16ToF32(h[i]);
#else
  for (; i < n; ++i) x[i] = F16ToF32(h[i]);
#endif
}

}  // namespace kvsparse::quant::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse {
namespace quant {

HWY_EXPORT(QuantizeRowQ8_0Impl);
HWY_EXPORT(QuantizeRowQ8_K);
HWY_EXPORT(QuantizeRowF16Impl);
HWY_EXPORT(DequantizeRowF16Impl);

}  // namespace quant

namespace ops {

void DequantizeRow(DType type, const void* src, float* dst, int64_t n) {
  KVS_CHECK(n >= 0 && n % DTypeBlockSize(type) == 0);
  if (type == DType::kF16) {
    KVS_DISPATCH(quant::DequantizeRowF16Impl)(static_cast<const f16_bits*>(src), dst, n);
    return;
  }
  ref::DequantizeRow(type, src, dst, n);
}

void QuantizeRow(DType type, const float* src, void* dst, int64_t n) {
  KVS_CHECK(n >= 0 && n % DTypeBlockSize(type) == 0);
  switch (type) {
    case DType::kQ8_0: return KVS_DISPATCH(quant::QuantizeRowQ8_0Impl)(src, static_cast<BlockQ8_0*>(dst), n);
    case DType::kQ8_K: return KVS_DISPATCH(quant::QuantizeRowQ8_K)(src, static_cast<BlockQ8_K*>(dst), n);
    case DType::kF16: return KVS_DISPATCH(quant::QuantizeRowF16Impl)(src, static_cast<f16_bits*>(dst), n);
    default: break;
  }
  ref::QuantizeRow(type, src, dst, n);
}

}  // namespace ops
}  // namespace kvsparse
#endif  // HWY_ONCE
