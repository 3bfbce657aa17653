// Scalar reference (de)quantizers of the K-quant super-blocks beside Q4_K (Q2_K, Q3_K, Q5_K,
// Q6_K) and of the non-linear IQ4_NL / IQ4_XS. Dequantization follows ggml's layout bit for bit
// (through kquant_blocks.h); quantization is a plain per-group min/max fit, not ggml's search:
// synth and convert only need valid blocks close to the input, and the engine only reads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvsparse/dtype.h"
#include "ops/kquant_blocks.h"
#include "ops/quant_internal.h"

namespace kvsparse::quant {

namespace {

constexpr int kGroups16 = kQK_K / 16;

// The value of largest magnitude in x[0..n), with its sign.
float SignedMax(const float* x, int n) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < n; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// Symmetric fit of a super-block: per group of `group` values a signed step s_g = max / q_lowest
// (so the largest magnitude maps to the most negative code), quantized to integer scales
// sc_g = round(s_g / d) in [-scale_max, scale_max] against d = max|s_g| / scale_max; then
// codes q = round(x / (d sc_g)) in [q_lowest, q_highest]. Returns the stored d.
KVS_NO_FP_CONTRACT float FitSymmetric(const float* x, int group, int q_lowest, int q_highest, int scale_max,
                                      int* scales, int* codes) {
  const int n_groups = kQK_K / group;
  float step[kGroups16];
  float max_step = 0.f;
  for (int g = 0; g < n_groups; ++g) {
    step[g] = SignedMax(x + g * group, group) / static_cast<float>(q_lowest);
    max_step = std::max(max_step, std::fabs(step[g]));
  }
  const float d = F16ToF32(F32ToF16(max_step / static_cast<float>(scale_max)));
  const float inv_d = d != 0.f ? 1.f / d : 0.f;
  for (int g = 0; g < n_groups; ++g) {
    scales[g] = std::clamp(NearestInt(step[g] * inv_d), -scale_max, scale_max);
    const float group_step = d * static_cast<float>(scales[g]);
    const float inv_step = group_step != 0.f ? 1.f / group_step : 0.f;
    for (int j = 0; j < group; ++j) {
      codes[g * group + j] = std::clamp(NearestInt(x[g * group + j] * inv_step), q_lowest, q_highest);
    }
  }
  return d;
}

// Min/scale fit of a super-block: per group value ~ d sc_g q - dmin m_g, q in [0, q_max],
// sc_g, m_g in [0, scale_max] (rounded up, so the group's range stays covered).
KVS_NO_FP_CONTRACT void FitMinScale(const float* x, int group, int q_max, int scale_max, float* d_out,
                                    float* dmin_out, int* scales, int* mins, int* codes) {
  const int n_groups = kQK_K / group;
  float step[kGroups16], offset[kGroups16];
  float max_step = 0.f, max_offset = 0.f;
  for (int g = 0; g < n_groups; ++g) {
    float lo = 0.f, hi = 0.f;  // 0 stays representable, so a block of zeros is exact
    for (int j = 0; j < group; ++j) {
      lo = std::min(lo, x[g * group + j]);
      hi = std::max(hi, x[g * group + j]);
    }
    step[g] = (hi - lo) / static_cast<float>(q_max);
    offset[g] = -lo;
    max_step = std::max(max_step, step[g]);
    max_offset = std::max(max_offset, offset[g]);
  }
  const float d = F16ToF32(F32ToF16(max_step / static_cast<float>(scale_max)));
  const float dmin = F16ToF32(F32ToF16(max_offset / static_cast<float>(scale_max)));
  for (int g = 0; g < n_groups; ++g) {
    scales[g] = d > 0.f ? std::clamp(static_cast<int>(std::ceil(step[g] / d)), 0, scale_max) : 0;
    mins[g] = dmin > 0.f ? std::clamp(static_cast<int>(std::ceil(offset[g] / dmin)), 0, scale_max) : 0;
    const float group_step = d * static_cast<float>(scales[g]);
    const float group_offset = dmin * static_cast<float>(mins[g]);
    const float inv_step = group_step > 0.f ? 1.f / group_step : 0.f;
    for (int j = 0; j < group; ++j) {
      const float shifted = x[g * group + j] + group_offset;
      codes[g * group + j] = std::clamp(NearestInt(shifted * inv_step), 0, q_max);
    }
  }
  *d_out = d;
  *dmin_out = dmin;
}

// Two-bit codes u[256] into Q2_K / Q3_K's qs layout (see kquant_blocks.h).
void PackTwoBitCodes(const int* u, uint8_t* qs) {
  std::memset(qs, 0, kQK_K / 4);
  for (int i = 0; i < kQK_K; ++i) qs[32 * (i / 128) + i % 32] |= static_cast<uint8_t>((u[i] & 3) << (2 * ((i % 128) / 32)));
}

// Index of the IQ4 level nearest to v.
int NearestIq4Level(float v) {
  int best = 0;
  for (int k = 1; k < 16; ++k) {
    if (std::fabs(v - kIq4NlValues[k]) < std::fabs(v - kIq4NlValues[best])) best = k;
  }
  return best;
}

// IQ4 nibbles of 32 values x / step into qs[16] (element e: nibble e / 16 of qs[e % 16]).
KVS_NO_FP_CONTRACT void PackIq4Group(const float* x, float step, uint8_t* qs) {
  const float inv = step != 0.f ? 1.f / step : 0.f;
  for (int e = 0; e < 16; ++e) {
    const int lo = NearestIq4Level(x[e] * inv), hi = NearestIq4Level(x[e + 16] * inv);
    qs[e] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

}  // namespace

void QuantizeRowQ2_KRef(const float* x, BlockQ2_K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    int scales[kGroups16], mins[kGroups16], codes[kQK_K];
    float d, dmin;
    FitMinScale(x, 16, 3, 15, &d, &dmin, scales, mins, codes);
    for (int g = 0; g < kGroups16; ++g) y[b].scales[g] = static_cast<uint8_t>(scales[g] | (mins[g] << 4));
    PackTwoBitCodes(codes, y[b].qs);
    y[b].d = F32ToF16(d);
    y[b].dmin = F32ToF16(dmin);
  }
}

void QuantizeRowQ3_KRef(const float* x, BlockQ3_K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    int scales[kGroups16], codes[kQK_K];
    const float d = FitSymmetric(x, 16, -4, 3, 31, scales, codes);
    std::memset(y[b].scales, 0, sizeof(y[b].scales));
    for (int g = 0; g < kGroups16; ++g) {
      const int stored = scales[g] + 32;
      y[b].scales[g % 8] |= static_cast<uint8_t>((stored & 0xF) << (4 * (g / 8)));
      y[b].scales[8 + g % 4] |= static_cast<uint8_t>((stored >> 4) << (2 * (g / 4)));
    }
    // Code q in [-4, 3] is u = q + 4: two low bits in qs, the third in hmask.
    int low[kQK_K];
    std::memset(y[b].hmask, 0, sizeof(y[b].hmask));
    for (int i = 0; i < kQK_K; ++i) {
      const int u = codes[i] + 4;
      low[i] = u & 3;
      y[b].hmask[i % 32] |= static_cast<uint8_t>((u >> 2) << (i / 32));
    }
    PackTwoBitCodes(low, y[b].qs);
    y[b].d = F32ToF16(d);
  }
}

void QuantizeRowQ5_KRef(const float* x, BlockQ5_K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    int scales[kQK_K / 32], mins[kQK_K / 32], codes[kQK_K];
    float d, dmin;
    FitMinScale(x, 32, 31, 63, &d, &dmin, scales, mins, codes);
    uint8_t scale_bytes[8], min_bytes[8];
    for (int j = 0; j < 8; ++j) {
      scale_bytes[j] = static_cast<uint8_t>(scales[j]);
      min_bytes[j] = static_cast<uint8_t>(mins[j]);
    }
    std::memset(y[b].scales, 0, sizeof(y[b].scales));
    PackScaleMinK4(scale_bytes, min_bytes, y[b].scales);
    std::memset(y[b].qs, 0, sizeof(y[b].qs));
    std::memset(y[b].qh, 0, sizeof(y[b].qh));
    for (int i = 0; i < kQK_K; ++i) {
      const int j = i / 32;
      y[b].qs[32 * (j / 2) + i % 32] |= static_cast<uint8_t>((codes[i] & 0xF) << (4 * (j % 2)));
      y[b].qh[i % 32] |= static_cast<uint8_t>((codes[i] >> 4) << j);
    }
    y[b].d = F32ToF16(d);
    y[b].dmin = F32ToF16(dmin);
  }
}

void QuantizeRowQ6_KRef(const float* x, BlockQ6_K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    int scales[kGroups16], codes[kQK_K];
    const float d = FitSymmetric(x, 16, -32, 31, 127, scales, codes);
    for (int g = 0; g < kGroups16; ++g) y[b].scales[g] = static_cast<int8_t>(scales[g]);
    std::memset(y[b].ql, 0, sizeof(y[b].ql));
    std::memset(y[b].qh, 0, sizeof(y[b].qh));
    for (int i = 0; i < kQK_K; ++i) {
      const int u = codes[i] + 32;
      const int h = i / 128, k = (i % 128) / 32, l = i % 32;
      y[b].ql[64 * h + 32 * (k % 2) + l] |= static_cast<uint8_t>((u & 0xF) << (4 * (k / 2)));
      y[b].qh[32 * h + l] |= static_cast<uint8_t>((u >> 4) << (2 * k));
    }
    y[b].d = F32ToF16(d);
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowIQ4_NLRef(const float* x, BlockIQ4_NL* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK4_NL; ++b, x += kQK4_NL) {
    // The signed value of largest magnitude maps to the level -127.
    const float d = F16ToF32(F32ToF16(SignedMax(x, kQK4_NL) / -127.f));
    y[b].d = F32ToF16(d);
    PackIq4Group(x, d, y[b].qs);
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowIQ4_XSRef(const float* x, BlockIQ4_XS* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    float step[8];
    float max_step = 0.f;
    for (int j = 0; j < 8; ++j) {
      step[j] = SignedMax(x + 32 * j, 32) / -127.f;
      max_step = std::max(max_step, std::fabs(step[j]));
    }
    const float d = F16ToF32(F32ToF16(max_step / 31.f));
    const float inv_d = d != 0.f ? 1.f / d : 0.f;
    y[b].d = F32ToF16(d);
    y[b].scales_h = 0;
    std::memset(y[b].scales_l, 0, sizeof(y[b].scales_l));
    for (int j = 0; j < 8; ++j) {
      const int ls = std::clamp(NearestInt(step[j] * inv_d), -32, 31);
      const int stored = ls + 32;
      y[b].scales_l[j / 2] |= static_cast<uint8_t>((stored & 0xF) << (4 * (j % 2)));
      y[b].scales_h = static_cast<uint16_t>(y[b].scales_h | ((stored >> 4) << (2 * j)));
      PackIq4Group(x + 32 * j, d * static_cast<float>(ls), y[b].qs + 16 * j);
    }
  }
}

namespace {
template <class Block, void (*Unpack)(const Block&, KBlockInts*)>
void DequantizeKRow(const Block* x, float* y, int64_t n) {
  KBlockInts ints;
  for (int64_t b = 0; b < n / kQK_K; ++b, y += kQK_K) {
    Unpack(x[b], &ints);
    DequantizeKBlockInts(ints, y);
  }
}
}  // namespace

void DequantizeRowQ2_KRef(const BlockQ2_K* x, float* y, int64_t n) { DequantizeKRow<BlockQ2_K, UnpackQ2_K>(x, y, n); }
void DequantizeRowQ3_KRef(const BlockQ3_K* x, float* y, int64_t n) { DequantizeKRow<BlockQ3_K, UnpackQ3_K>(x, y, n); }
void DequantizeRowQ5_KRef(const BlockQ5_K* x, float* y, int64_t n) { DequantizeKRow<BlockQ5_K, UnpackQ5_K>(x, y, n); }
void DequantizeRowQ6_KRef(const BlockQ6_K* x, float* y, int64_t n) { DequantizeKRow<BlockQ6_K, UnpackQ6_K>(x, y, n); }
void DequantizeRowIQ4_XSRef(const BlockIQ4_XS* x, float* y, int64_t n) {
  DequantizeKRow<BlockIQ4_XS, UnpackIQ4_XS>(x, y, n);
}

void DequantizeRowIQ4_NLRef(const BlockIQ4_NL* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK4_NL; ++b, y += kQK4_NL) {
    const float d = F16ToF32(x[b].d);
    for (int e = 0; e < 16; ++e) {
      y[e] = d * static_cast<float>(kIq4NlValues[x[b].qs[e] & 0xF]);
      y[e + 16] = d * static_cast<float>(kIq4NlValues[x[b].qs[e] >> 4]);
    }
  }
}

// MXFP4 as ggml's quantize_row_mxfp4_ref: the shared exponent puts the block's largest
// magnitude in [4, 8) times 2^(e - 128) (so 12, the largest level, may round it), each value to
// its nearest level (the first of equals).
KVS_NO_FP_CONTRACT void QuantizeRowMXFP4Ref(const float* x, BlockMXFP4* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_MXFP4; ++b, x += kQK_MXFP4) {
    float amax = 0.f;
    for (int i = 0; i < kQK_MXFP4; ++i) amax = std::max(amax, std::fabs(x[i]));
    // (Clamped to the format's exponents, so tiny or huge blocks cannot overflow the cast.)
    const float exponent = std::clamp(std::floor(std::log2(amax)) - 2 + 127, 0.f, 254.f);
    const uint8_t e = amax > 0.f ? static_cast<uint8_t>(exponent) : 0;
    const float d = Mxfp4Scale(e);
    auto nearest = [d](float v) {
      int best = 0;
      float best_err = std::fabs(kMxfp4Values[0] * d - v);
      for (int i = 1; i < 16; ++i) {
        const float err = std::fabs(kMxfp4Values[i] * d - v);
        if (err < best_err) {
          best = i;
          best_err = err;
        }
      }
      return static_cast<uint8_t>(best);
    };
    y[b].e = e;
    for (int j = 0; j < kQK_MXFP4 / 2; ++j) {
      y[b].qs[j] = static_cast<uint8_t>(nearest(x[j]) | nearest(x[j + kQK_MXFP4 / 2]) << 4);
    }
  }
}

void DequantizeRowMXFP4Ref(const BlockMXFP4* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK_MXFP4; ++b, y += kQK_MXFP4) {
    const float d = Mxfp4Scale(x[b].e);
    for (int e = 0; e < 16; ++e) {
      y[e] = d * static_cast<float>(kMxfp4Values[x[b].qs[e] & 0xF]);
      y[e + 16] = d * static_cast<float>(kMxfp4Values[x[b].qs[e] >> 4]);
    }
  }
}

}  // namespace kvsparse::quant
