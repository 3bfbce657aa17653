// The super-block types with Q8_K activations (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS) read as plain
// integers: 256 codes and, per group of 16, an integer scale and min, so that
//   value[i] = d * scale[i / 16] * q[i] - dmin * min[i / 16]
// (ggml's dequantization order: (d * scale) * q - (dmin * min)). The reference dequantizers and the
// scalar kernel family use this form; the SIMD families unpack the same bits their own way.
// Baseline code: include it before any kernel family region.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvsparse/dtype.h"

namespace kvsparse::quant {

struct KBlockInts {
  int8_t q[kQK_K];        // codes (signed where the type has no min)
  int16_t scale[kQK_K / 16];
  int16_t min[kQK_K / 16];  // 0 for the types without a min
  float d = 0.f;
  float dmin = 0.f;
};

// ggml's 6-bit scale and min of sub-block j (0..7) of Q4_K / Q5_K `scales` (get_scale_min_k4).
inline void KScaleMin(int j, const uint8_t* scales, int* scale, int* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// Q3_K's 16 six-bit scales (stored + 32): low 4 bits in bytes 0-7 (group g: byte g % 8, nibble
// g / 8), top 2 bits in bytes 8-11 (group g: byte 8 + g % 4, bits 2 * (g / 4)).
inline int Q3KScale(const uint8_t* scales, int g) {
  const int low = (scales[g % 8] >> (4 * (g / 8))) & 0xF;
  const int high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Element i of a Q2_K / Q3_K super-block sits in qs byte 32 * (i / 128) + i % 32 at bit
// 2 * ((i % 128) / 32); in Q3_K its high bit is bit (i / 32) of hmask[i % 32].
inline void UnpackQ2_K(const BlockQ2_K& b, KBlockInts* out) {
  for (int i = 0; i < kQK_K; ++i) {
    out->q[i] = static_cast<int8_t>((b.qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3);
  }
  for (int g = 0; g < kQK_K / 16; ++g) {
    out->scale[g] = static_cast<int16_t>(b.scales[g] & 0xF);
    out->min[g] = static_cast<int16_t>(b.scales[g] >> 4);
  }
  out->d = F16ToF32(b.d);
  out->dmin = F16ToF32(b.dmin);
}

inline void UnpackQ3_K(const BlockQ3_K& b, KBlockInts* out) {
  for (int i = 0; i < kQK_K; ++i) {
    const int low = (b.qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
    const bool high = (b.hmask[i % 32] >> (i / 32)) & 1;
    out->q[i] = static_cast<int8_t>(low - (high ? 0 : 4));
  }
  for (int g = 0; g < kQK_K / 16; ++g) {
    out->scale[g] = static_cast<int16_t>(Q3KScale(b.scales, g));
    out->min[g] = 0;
  }
  out->d = F16ToF32(b.d);
  out->dmin = 0.f;
}

// Q5_K: Q4_K's nibbles (sub-blocks 2k / 2k+1 in the low / high nibbles of qs[32k..32k+31]) plus
// bit j of qh[i % 32] for element i of sub-block j.
inline void UnpackQ5_K(const BlockQ5_K& b, KBlockInts* out) {
  for (int i = 0; i < kQK_K; ++i) {
    const int j = i / 32;
    const int nibble = (b.qs[32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 0xF;
    out->q[i] = static_cast<int8_t>(nibble | (((b.qh[i % 32] >> j) & 1) << 4));
  }
  for (int j = 0; j < kQK_K / 32; ++j) {
    int scale, min;
    KScaleMin(j, b.scales, &scale, &min);
    out->scale[2 * j] = out->scale[2 * j + 1] = static_cast<int16_t>(scale);
    out->min[2 * j] = out->min[2 * j + 1] = static_cast<int16_t>(min);
  }
  out->d = F16ToF32(b.d);
  out->dmin = F16ToF32(b.dmin);
}

// Q6_K: element i = 128 h + 32 k + l (k = 0..3) has its low 4 bits in ql[64 h + 32 (k % 2) + l]
// (low nibble for k < 2, high for k >= 2) and its top 2 bits at bit 2 k of qh[32 h + l].
inline void UnpackQ6_K(const BlockQ6_K& b, KBlockInts* out) {
  for (int i = 0; i < kQK_K; ++i) {
    const int h = i / 128, k = (i % 128) / 32, l = i % 32;
    const int low = (b.ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
    const int high = (b.qh[32 * h + l] >> (2 * k)) & 3;
    out->q[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  for (int g = 0; g < kQK_K / 16; ++g) {
    out->scale[g] = b.scales[g];
    out->min[g] = 0;
  }
  out->d = F16ToF32(b.d);
  out->dmin = 0.f;
}

// IQ4_XS: sub-block j's 6-bit scale (stored + 32) is nibble j % 2 of scales_l[j / 2] with bits
// 2j, 2j+1 of scales_h on top; its 32 levels are laid out as an IQ4_NL block.
inline int IQ4XSScale(const BlockIQ4_XS& b, int j) {
  return (((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b.scales_h >> (2 * j)) & 3) << 4)) - 32;
}

inline void UnpackIQ4_XS(const BlockIQ4_XS& b, KBlockInts* out) {
  for (int i = 0; i < kQK_K; ++i) {
    const int j = i / 32, e = i % 32;
    const int nibble = (b.qs[16 * j + e % 16] >> (4 * (e / 16))) & 0xF;
    out->q[i] = kIq4NlValues[nibble];
  }
  for (int j = 0; j < kQK_K / 32; ++j) {
    out->scale[2 * j] = out->scale[2 * j + 1] = static_cast<int16_t>(IQ4XSScale(b, j));
    out->min[2 * j] = out->min[2 * j + 1] = 0;
  }
  out->d = F16ToF32(b.d);
  out->dmin = 0.f;
}

// value[i] as ggml's dequantizer computes it.
inline void DequantizeKBlockInts(const KBlockInts& k, float* y) {
  for (int i = 0; i < kQK_K; ++i) {
    const float step = k.d * static_cast<float>(k.scale[i / 16]);
    const float offset = k.dmin * static_cast<float>(k.min[i / 16]);
    y[i] = step * static_cast<float>(k.q[i]) - offset;
  }
}

}  // namespace kvsparse::quant
