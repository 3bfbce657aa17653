// Scalar reference quantizers / dequantizers, following ggml's *_ref functions
// bit for bit (except Q4_K quantization, which is a simpler min/scale fit).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvsparse/ops.h"
#include "kvsparse/status.h"
#include "ops/quant_internal.h"

namespace kvsparse {
namespace quant {

// ggml's nearest_int (its 1.5*2^23 trick is round-half-to-even for |x| < 2^22). nearbyint
// under the default rounding mode gives the same result and cannot be fused with a caller's
// multiply.
int NearestInt(float x) { return static_cast<int>(std::nearbyint(x)); }

void GetScaleMinK4(int j, const uint8_t* scales, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

void PackScaleMinK4(const uint8_t* scale, const uint8_t* min, uint8_t* scales) {
  // Inverse of GetScaleMinK4: sub-blocks 0-3 keep 6 bits in bytes 0-7; sub-blocks 4-7 keep
  // their low 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-7.
  for (int j = 0; j < 4; ++j) {
    scales[j] = scale[j] & 63;
    scales[j + 4] = min[j] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    scales[j + 4] = static_cast<uint8_t>((scale[j] & 0xF) | ((min[j] & 0xF) << 4));
    scales[j - 4] |= static_cast<uint8_t>((scale[j] >> 4) << 6);
    scales[j] |= static_cast<uint8_t>((min[j] >> 4) << 6);
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ8_0Ref(const float* x, BlockQ8_0* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK8_0; ++b, x += kQK8_0) {
    float amax = 0.f;
    for (int j = 0; j < kQK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    y[b].d = F32ToF16(d);
    for (int j = 0; j < kQK8_0; ++j) y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ4_0Ref(const float* x, BlockQ4_0* y, int64_t n) {
  constexpr int kHalf = kQK4_0 / 2;
  for (int64_t b = 0; b < n / kQK4_0; ++b, x += kQK4_0) {
    // The signed value of largest magnitude maps to -8, so the full [-8, 7] range is used.
    float amax = 0.f;
    float max = 0.f;
    for (int j = 0; j < kQK4_0; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    y[b].d = F32ToF16(d);
    for (int j = 0; j < kHalf; ++j) {
      const float lo_scaled = x[j] * id;
      const float hi_scaled = x[kHalf + j] * id;
      const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(lo_scaled + 8.5f)));
      const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(hi_scaled + 8.5f)));
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ8_KRef(const float* x, BlockQ8_K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    float amax = 0.f;
    float max = 0.f;
    for (int j = 0; j < kQK_K; ++j) {
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    if (amax == 0.f) {
      std::memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kQK_K; ++j) {
      const float scaled = iscale * x[j];
      y[b].qs[j] = static_cast<int8_t>(std::min(127, NearestInt(scaled)));
    }
    for (int g = 0; g < kQK_K / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += y[b].qs[g * 16 + j];
      y[b].bsums[g] = static_cast<int16_t>(sum);
    }
    y[b].d = 1.f / iscale;
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ4_KRef(const float* x, BlockQ4_K* y, int64_t n) {
  constexpr int kSub = 32;
  constexpr int kNumSub = kQK_K / kSub;
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    // Per sub-block: value ~= scale * q - min_offset with q in [0, 15], min_offset >= 0.
    float sub_scale[kNumSub];
    float sub_min[kNumSub];
    for (int s = 0; s < kNumSub; ++s) {
      float lo = 0.f;  // 0 is always representable, so a block of zeros stays exact
      float hi = 0.f;
      for (int j = 0; j < kSub; ++j) {
        lo = std::min(lo, x[s * kSub + j]);
        hi = std::max(hi, x[s * kSub + j]);
      }
      sub_scale[s] = (hi - lo) / 15.f;
      sub_min[s] = -lo;
    }
    // Super-block scales map the per-sub-block scale/min onto 6-bit integers.
    float max_scale = 0.f;
    float max_min = 0.f;
    for (int s = 0; s < kNumSub; ++s) {
      max_scale = std::max(max_scale, sub_scale[s]);
      max_min = std::max(max_min, sub_min[s]);
    }
    const float d = max_scale / 63.f;
    const float dmin = max_min / 63.f;
    y[b].d = F32ToF16(d);
    y[b].dmin = F32ToF16(dmin);
    const float d_stored = F16ToF32(y[b].d);
    const float dmin_stored = F16ToF32(y[b].dmin);
    uint8_t scale_q[kNumSub];
    uint8_t min_q[kNumSub];
    for (int s = 0; s < kNumSub; ++s) {
      // Round the scale up and the min offset up so the sub-block's range stays covered.
      int sq = d_stored > 0.f ? static_cast<int>(std::ceil(sub_scale[s] / d_stored)) : 0;
      int mq = dmin_stored > 0.f ? static_cast<int>(std::ceil(sub_min[s] / dmin_stored)) : 0;
      scale_q[s] = static_cast<uint8_t>(std::clamp(sq, 0, 63));
      min_q[s] = static_cast<uint8_t>(std::clamp(mq, 0, 63));
    }
    std::memset(y[b].scales, 0, sizeof(y[b].scales));
    PackScaleMinK4(scale_q, min_q, y[b].scales);
    // Nibble layout: each 32-byte group holds sub-block 2g in the low nibbles, 2g+1 in the high.
    for (int g = 0; g < kNumSub / 2; ++g) {
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * g + half;
        const float step = d_stored * scale_q[s];
        const float offset = dmin_stored * min_q[s];
        const float inv_step = step > 0.f ? 1.f / step : 0.f;
        for (int j = 0; j < kSub; ++j) {
          const float shifted = x[s * kSub + j] + offset;
          const int q = std::clamp(NearestInt(shifted * inv_step), 0, 15);
          uint8_t& byte = y[b].qs[g * kSub + j];
          byte = half == 0 ? static_cast<uint8_t>(q) : static_cast<uint8_t>(byte | (q << 4));
        }
      }
    }
  }
}

void DequantizeRowQ8_0Ref(const BlockQ8_0* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK8_0; ++b) {
    const float d = F16ToF32(x[b].d);
    for (int j = 0; j < kQK8_0; ++j) y[b * kQK8_0 + j] = x[b].qs[j] * d;
  }
}

void DequantizeRowQ4_0Ref(const BlockQ4_0* x, float* y, int64_t n) {
  constexpr int kHalf = kQK4_0 / 2;
  for (int64_t b = 0; b < n / kQK4_0; ++b) {
    const float d = F16ToF32(x[b].d);
    for (int j = 0; j < kHalf; ++j) {
      y[b * kQK4_0 + j] = ((x[b].qs[j] & 0x0F) - 8) * d;
      y[b * kQK4_0 + kHalf + j] = ((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

KVS_NO_FP_CONTRACT void DequantizeRowQ4_KRef(const BlockQ4_K* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const float d = F16ToF32(x[b].d);
    const float dmin = F16ToF32(x[b].dmin);
    const uint8_t* q = x[b].qs;
    for (int g = 0; g < kQK_K / 64; ++g, q += 32) {
      uint8_t sc, m;
      GetScaleMinK4(2 * g, x[b].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      GetScaleMinK4(2 * g + 1, x[b].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    }
  }
}

void DequantizeRowQ8_KRef(const BlockQ8_K* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    for (int j = 0; j < kQK_K; ++j) y[b * kQK_K + j] = x[b].d * x[b].qs[j];
  }
}

}  // namespace quant

namespace ref {

void DequantizeRow(DType type, const void* src, float* dst, int64_t n) {
  KVS_CHECK(n >= 0 && n % DTypeBlockSize(type) == 0);
  switch (type) {
    case DType::kF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToF32(static_cast<const f16_bits*>(src)[i]);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToF32(static_cast<const bf16_bits*>(src)[i]);
      return;
    case DType::kQ8_0: return quant::DequantizeRowQ8_0Ref(static_cast<const BlockQ8_0*>(src), dst, n);
    case DType::kQ4_0: return quant::DequantizeRowQ4_0Ref(static_cast<const BlockQ4_0*>(src), dst, n);
    case DType::kQ4_K: return quant::DequantizeRowQ4_KRef(static_cast<const BlockQ4_K*>(src), dst, n);
    case DType::kQ8_K: return quant::DequantizeRowQ8_KRef(static_cast<const BlockQ8_K*>(src), dst, n);
    case DType::kQ4_1: return quant::DequantizeRowQ4_1Ref(static_cast<const BlockQ4_1*>(src), dst, n);
    case DType::kQ5_0: return quant::DequantizeRowQ5_0Ref(static_cast<const BlockQ5_0*>(src), dst, n);
    case DType::kQ5_1: return quant::DequantizeRowQ5_1Ref(static_cast<const BlockQ5_1*>(src), dst, n);
    case DType::kQ2_K: return quant::DequantizeRowQ2_KRef(static_cast<const BlockQ2_K*>(src), dst, n);
    case DType::kQ3_K: return quant::DequantizeRowQ3_KRef(static_cast<const BlockQ3_K*>(src), dst, n);
    case DType::kQ5_K: return quant::DequantizeRowQ5_KRef(static_cast<const BlockQ5_K*>(src), dst, n);
    case DType::kQ6_K: return quant::DequantizeRowQ6_KRef(static_cast<const BlockQ6_K*>(src), dst, n);
    case DType::kIQ4_NL: return quant::DequantizeRowIQ4_NLRef(static_cast<const BlockIQ4_NL*>(src), dst, n);
    case DType::kIQ4_XS: return quant::DequantizeRowIQ4_XSRef(static_cast<const BlockIQ4_XS*>(src), dst, n);
    case DType::kMXFP4: return quant::DequantizeRowMXFP4Ref(static_cast<const BlockMXFP4*>(src), dst, n);
  }
  KVS_CHECK_MSG(false, "DequantizeRow: unsupported dtype");
}

void QuantizeRow(DType type, const float* src, void* dst, int64_t n) {
  KVS_CHECK(n >= 0 && n % DTypeBlockSize(type) == 0);
  switch (type) {
    case DType::kF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) static_cast<f16_bits*>(dst)[i] = F32ToF16(src[i]);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) static_cast<bf16_bits*>(dst)[i] = F32ToBF16(src[i]);
      return;
    case DType::kQ8_0: return quant::QuantizeRowQ8_0Ref(src, static_cast<BlockQ8_0*>(dst), n);
    case DType::kQ4_0: return quant::QuantizeRowQ4_0Ref(src, static_cast<BlockQ4_0*>(dst), n);
    case DType::kQ4_K: return quant::QuantizeRowQ4_KRef(src, static_cast<BlockQ4_K*>(dst), n);
    case DType::kQ8_K: return quant::QuantizeRowQ8_KRef(src, static_cast<BlockQ8_K*>(dst), n);
    case DType::kQ4_1: return quant::QuantizeRowQ4_1Ref(src, static_cast<BlockQ4_1*>(dst), n);
    case DType::kQ5_0: return quant::QuantizeRowQ5_0Ref(src, static_cast<BlockQ5_0*>(dst), n);
    case DType::kQ5_1: return quant::QuantizeRowQ5_1Ref(src, static_cast<BlockQ5_1*>(dst), n);
    case DType::kQ2_K: return quant::QuantizeRowQ2_KRef(src, static_cast<BlockQ2_K*>(dst), n);
    case DType::kQ3_K: return quant::QuantizeRowQ3_KRef(src, static_cast<BlockQ3_K*>(dst), n);
    case DType::kQ5_K: return quant::QuantizeRowQ5_KRef(src, static_cast<BlockQ5_K*>(dst), n);
    case DType::kQ6_K: return quant::QuantizeRowQ6_KRef(src, static_cast<BlockQ6_K*>(dst), n);
    case DType::kIQ4_NL: return quant::QuantizeRowIQ4_NLRef(src, static_cast<BlockIQ4_NL*>(dst), n);
    case DType::kIQ4_XS: return quant::QuantizeRowIQ4_XSRef(src, static_cast<BlockIQ4_XS*>(dst), n);
    case DType::kMXFP4: return quant::QuantizeRowMXFP4Ref(src, static_cast<BlockMXFP4*>(dst), n);
  }
  KVS_CHECK_MSG(false, "QuantizeRow: unsupported dtype");
}

}  // namespace ref
}  // namespace kvsparse
