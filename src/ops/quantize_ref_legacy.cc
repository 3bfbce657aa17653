// Scalar reference (de)quantizers of ggml's 32-element legacy types with a min or a fifth bit:
// Q4_1, Q5_0, Q5_1 (llama-quantize's fallbacks where a row is not a multiple of 256). The
// dequantizers follow ggml's layout bit for bit; the quantizers are plain min/max fits (any valid
// block is a valid file: synth and convert use them, the engine only reads).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvsparse/dtype.h"
#include "ops/quant_internal.h"

namespace kvsparse::quant {

namespace {

constexpr int kHalf = 32 / 2;

// Bit j of a Q5 block's qh word is element j's fifth bit (elements 0..31).
uint32_t LoadQh(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  return bits;
}

// 5-bit q of element j (0..31) of a Q5_0 / Q5_1 block.
int Q5Code(const uint8_t* qs, uint32_t qh, int j) {
  const int nibble = j < kHalf ? (qs[j] & 0x0F) : (qs[j - kHalf] >> 4);
  return nibble | static_cast<int>(((qh >> j) & 1u) << 4);
}

// Packs codes q[32] (each < 2^bits, bits 4 or 5) into nibbles and, for 5 bits, the qh word.
void PackCodes(const int* q, uint8_t* qs, uint8_t* qh) {
  uint32_t high = 0;
  for (int j = 0; j < kHalf; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | ((q[j + kHalf] & 0x0F) << 4));
  for (int j = 0; j < 32; ++j) high |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
  if (qh != nullptr) std::memcpy(qh, &high, sizeof(high));
}

// value ~ d * q + m with q in [0, q_max]: m = the block's minimum, d = its range / q_max.
KVS_NO_FP_CONTRACT void FitMinScale(const float* x, int q_max, float* d_out, float* m_out, int* q) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < 32; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const float d = F16ToF32(F32ToF16((hi - lo) / static_cast<float>(q_max)));
  const float m = F16ToF32(F32ToF16(lo));
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int j = 0; j < 32; ++j) {
    const float shifted = x[j] - m;
    q[j] = std::clamp(NearestInt(shifted * id), 0, q_max);
  }
  *d_out = d;
  *m_out = m;
}

}  // namespace

KVS_NO_FP_CONTRACT void QuantizeRowQ4_1Ref(const float* x, BlockQ4_1* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK4_1; ++b, x += kQK4_1) {
    int q[32];
    float d, m;
    FitMinScale(x, 15, &d, &m, q);
    y[b].d = F32ToF16(d);
    y[b].m = F32ToF16(m);
    PackCodes(q, y[b].qs, nullptr);
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ5_1Ref(const float* x, BlockQ5_1* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK5_0; ++b, x += kQK5_0) {
    int q[32];
    float d, m;
    FitMinScale(x, 31, &d, &m, q);
    y[b].d = F32ToF16(d);
    y[b].m = F32ToF16(m);
    PackCodes(q, y[b].qs, y[b].qh);
  }
}

KVS_NO_FP_CONTRACT void QuantizeRowQ5_0Ref(const float* x, BlockQ5_0* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK5_0; ++b, x += kQK5_0) {
    // As Q4_0: the signed value of largest magnitude maps to -16, the full [-16, 15] range is used.
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -16.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    y[b].d = F32ToF16(d);
    int q[32];
    for (int j = 0; j < 32; ++j) q[j] = std::clamp(NearestInt(x[j] * id) + 16, 0, 31);
    PackCodes(q, y[b].qs, y[b].qh);
  }
}

void DequantizeRowQ4_1Ref(const BlockQ4_1* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK4_1; ++b, y += kQK4_1) {
    const float d = F16ToF32(x[b].d), m = F16ToF32(x[b].m);
    for (int j = 0; j < kHalf; ++j) {
      y[j] = static_cast<float>(x[b].qs[j] & 0x0F) * d + m;
      y[j + kHalf] = static_cast<float>(x[b].qs[j] >> 4) * d + m;
    }
  }
}

void DequantizeRowQ5_0Ref(const BlockQ5_0* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK5_0; ++b, y += kQK5_0) {
    const float d = F16ToF32(x[b].d);
    const uint32_t qh = LoadQh(x[b].qh);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(Q5Code(x[b].qs, qh, j) - 16) * d;
  }
}

void DequantizeRowQ5_1Ref(const BlockQ5_1* x, float* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK5_0; ++b, y += kQK5_0) {
    const float d = F16ToF32(x[b].d), m = F16ToF32(x[b].m);
    const uint32_t qh = LoadQh(x[b].qh);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(Q5Code(x[b].qs, qh, j)) * d + m;
  }
}

}  // namespace kvsparse::quant
