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
