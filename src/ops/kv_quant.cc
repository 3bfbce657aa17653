// Fast KV quantizers (ops/kv_quant.h), compiled once per kernel family (see simd_family.h).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/kv_quant.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/kv_quant.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

#if KVS_ISA_AVX512

namespace {
inline __mmask16 TailMask(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }
}  // namespace

void QuantizeKvRowsInt8Impl(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales) {
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    __m512 vmax = _mm512_setzero_ps();
    for (int i = 0; i < row_len; i += 16) {
      const __mmask16 m = TailMask(row_len - i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + i)));
    }
    const float scale = _mm512_reduce_max_ps(vmax) / 127.f;
    scales[r] = scale;
    if (scale == 0.f) {
      for (int i = 0; i < row_len; ++i) q[i] = 0;
      continue;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int i = 0; i < row_len; i += 16) {
      const __mmask16 m = TailMask(row_len - i);
      __m512 t = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vscale);
      t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
      // MXCSR's default mode is round-half-even, like std::nearbyint in the twin.
      const __m512i qi = _mm512_cvtps_epi32(t);
      _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(qi));
    }
  }
}

void DequantizeKvRowsInt8Impl(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    const __m512 vscale = _mm512_set1_ps(scales[r]);
    for (int i = 0; i < row_len; i += 16) {
      const __mmask16 m = TailMask(row_len - i);
      const __m512i qi = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + i));
      _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), vscale));
    }
  }
}

void QuantizeKvColumnsInt8Impl(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales) {
  // Column maxima, row by row (rows are contiguous), accumulated in channel_scales.
  for (int c = 0; c < row_len; c += 16) {
    _mm512_mask_storeu_ps(channel_scales + c, TailMask(row_len - c), _mm512_setzero_ps());
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = x + r * row_len;
    for (int c = 0; c < row_len; c += 16) {
      const __mmask16 m = TailMask(row_len - c);
      const __m512 cur = _mm512_maskz_loadu_ps(m, channel_scales + c);
      const __m512 x_abs = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + c));
      _mm512_mask_storeu_ps(channel_scales + c, m, _mm512_max_ps(cur, x_abs));
    }
  }
  const __m512 inv = _mm512_set1_ps(127.f);
  for (int c = 0; c < row_len; c += 16) {
    const __mmask16 m = TailMask(row_len - c);
    _mm512_mask_storeu_ps(channel_scales + c, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, channel_scales + c), inv));
  }
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = x + r * row_len;
    int8_t* out = q + r * row_len;
    for (int c = 0; c < row_len; c += 16) {
      const __mmask16 m = TailMask(row_len - c);
      const __m512 scale = _mm512_maskz_loadu_ps(m, channel_scales + c);
      // Zero-scale columns (all zeros) stay 0 instead of 0/0.
      const __mmask16 nonzero = _mm512_mask_cmp_ps_mask(m, scale, _mm512_setzero_ps(), _CMP_NEQ_OQ);
      __m512 t = _mm512_maskz_div_ps(nonzero, _mm512_maskz_loadu_ps(m, row + c), scale);
      t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
      _mm_mask_storeu_epi8(out + c, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));  // round-half-even
    }
  }
}

void DequantizeKvColumnsInt8Impl(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x) {
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    for (int c = 0; c < row_len; c += 16) {
      const __mmask16 m = TailMask(row_len - c);
      const __m512i qi = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + c));
      const __m512 scale = _mm512_maskz_loadu_ps(m, channel_scales + c);
      _mm512_mask_storeu_ps(x + c, m, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), scale));
    }
  }
}

#elif KVS_ISA_AVX2

void QuantizeKvRowsInt8Impl(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t r = 0; r < n_rows; ++r, x += row_len, q += row_len) {
    __m256 vmax = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= row_len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.f;
    for (float l : lanes) amax = std::max(amax, l);
    for (; i < row_len; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f;
    scales[r] = scale;
    if (scale == 0.f) {
      for (i = 0; i < row_len; ++i) q[i] = 0;
      continue;
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= row_len; i += 8) {
      __m256 t = _mm256_div_ps(_mm256_loadu_ps(x + i), vscale);
      t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
      const __m256i qi = _mm256_cvtps_epi32(t);  // round-half-even (MXCSR default)
      alignas(32) int32_t w[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), qi);
      for (int j = 0; j < 8; ++j) q[i + j] = static_cast<int8_t>(w[j]);
    }
    for (; i < row_len; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / scale), -127.f, 127.f));
  }
}

#else

void QuantizeKvRowsInt8Impl(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales) {
  ref::QuantizeKvRowsInt8(x, n_rows, row_len, q, scales);
}

#endif

#if !KVS_ISA_AVX512
// Only row quantization runs on every appended token; the rest run on evictions and page fills,
// where the scalar twins serve the AVX2 family.
void DequantizeKvRowsInt8Impl(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x) {
  ref::DequantizeKvRowsInt8(q, scales, n_rows, row_len, x);
}

void QuantizeKvColumnsInt8Impl(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales) {
  ref::QuantizeKvColumnsInt8(x, n_rows, row_len, q, channel_scales);
}

void DequantizeKvColumnsInt8Impl(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x) {
  ref::DequantizeKvColumnsInt8(q, channel_scales, n_rows, row_len, x);
}
#endif

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(QuantizeKvRowsInt8Impl);
HWY_EXPORT(DequantizeKvRowsInt8Impl);
HWY_EXPORT(QuantizeKvColumnsInt8Impl);
HWY_EXPORT(DequantizeKvColumnsInt8Impl);

void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales) {
  KVS_DISPATCH(QuantizeKvRowsInt8Impl)(x, n_rows, row_len, q, scales);
}
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x) {
  KVS_DISPATCH(DequantizeKvRowsInt8Impl)(q, scales, n_rows, row_len, x);
}
void QuantizeKvColumnsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales) {
  KVS_DISPATCH(QuantizeKvColumnsInt8Impl)(x, n_rows, row_len, q, channel_scales);
}
void DequantizeKvColumnsInt8(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x) {
  KVS_DISPATCH(DequantizeKvColumnsInt8Impl)(q, channel_scales, n_rows, row_len, x);
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
