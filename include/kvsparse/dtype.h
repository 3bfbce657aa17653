// Tensor element types, numbered and laid out exactly as ggml/GGUF defines them,
// so GGUF tensor data can be used in place (mmap) without conversion.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvsparse {

// Values are the ggml_type ids stored in GGUF tensor infos.
enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,  // activation-side type for K-quant and IQ4_XS dot products (never a weight type here)
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30,
  kMXFP4 = 39,  // OCP microscaling FP4 (gpt-oss's expert weights)
};

inline constexpr int kQK8_0 = 32;   // elements per Q8_0 block
inline constexpr int kQK4_0 = 32;   // elements per Q4_0 block
inline constexpr int kQK4_1 = 32;   // elements per Q4_1 block
inline constexpr int kQK5_0 = 32;   // elements per Q5_0 / Q5_1 block
inline constexpr int kQK4_NL = 32;  // elements per IQ4_NL block
inline constexpr int kQK_MXFP4 = 32;  // elements per MXFP4 block
inline constexpr int kQK_K = 256;   // elements per K-quant super-block
inline constexpr int kKScaleBytes = 12;

using f16_bits = uint16_t;   // IEEE binary16 bit pattern
using bf16_bits = uint16_t;  // bfloat16 bit pattern

// ggml block_q8_0: value[i] = d * qs[i]
struct BlockQ8_0 {
  f16_bits d;
  int8_t qs[kQK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34);

// ggml block_q4_0: value[i] = d * ((qs[i] & 0xF) - 8) for i < 16, d * ((qs[i-16] >> 4) - 8) for i >= 16
struct BlockQ4_0 {
  f16_bits d;
  uint8_t qs[kQK4_0 / 2];
};
static_assert(sizeof(BlockQ4_0) == 18);

// ggml block_q4_1: value[i] = d * q[i] + m, q[i] the low nibbles of qs for i < 16, the high ones after.
struct BlockQ4_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qs[kQK4_1 / 2];
};
static_assert(sizeof(BlockQ4_1) == 20);

// ggml block_q5_0: 5-bit q = nibble (as Q4_0) | bit i of the 32-bit qh << 4; value = d * (q - 16).
struct BlockQ5_0 {
  f16_bits d;
  uint8_t qh[4];
  uint8_t qs[kQK5_0 / 2];
};
static_assert(sizeof(BlockQ5_0) == 22);

// ggml block_q5_1: Q5_0's 5-bit q without the offset; value = d * q + m.
struct BlockQ5_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qh[4];
  uint8_t qs[kQK5_0 / 2];
};
static_assert(sizeof(BlockQ5_1) == 24);

// ggml block_q2_K: 16 groups of 16; scales[g] = 4-bit scale | 4-bit min << 4; 2-bit q, four
// groups of 32 per 32 bytes of qs (shift 0, 2, 4, 6); value = d * sc * q - dmin * m.
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  f16_bits d;
  f16_bits dmin;
};
static_assert(sizeof(BlockQ2_K) == 84);

// ggml block_q3_K: 16 groups of 16 with 6-bit scales (stored - 32) packed in 12 bytes; q = 2 low
// bits (as Q2_K) - 4 where the hmask bit is clear; value = d * (sc - 32) * q.
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[kKScaleBytes];
  f16_bits d;
};
static_assert(sizeof(BlockQ3_K) == 110);

// ggml block_q4_K: 8 sub-blocks of 32; 6-bit scales and mins packed in `scales`;
// value = d * sc[j] * q - dmin * m[j]
struct BlockQ4_K {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

// ggml block_q5_K: Q4_K's scales and nibbles plus a fifth bit per value in qh (bit 2g / 2g+1 of
// qh[l] for sub-blocks 2g / 2g+1); value = d * sc[j] * q - dmin * m[j], q in 0..31.
struct BlockQ5_K {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ5_K) == 176);

// ggml block_q6_K: 16 groups of 16 with int8 scales; 6-bit q = 4 bits of ql | 2 bits of qh << 4;
// value = d * scales[g] * (q - 32).
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  f16_bits d;
};
static_assert(sizeof(BlockQ6_K) == 210);

// The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
inline constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// ggml block_iq4_nl: Q4_0's nibble layout; value = d * kIq4NlValues[nibble].
struct BlockIQ4_NL {
  f16_bits d;
  uint8_t qs[kQK4_NL / 2];
};
static_assert(sizeof(BlockIQ4_NL) == 18);

// MXFP4 (OCP Microscaling Formats v1.0): 32 E2M1 values sharing one E8M0 power-of-two scale.
// ggml stores the E2M1 codes doubled as int8 levels (kMxfp4Values) and halves the scale, so
// value = 2^(e - 128) * kMxfp4Values[nibble]; Q4_0's nibble layout (element e < 16 the low
// nibble of qs[e], e >= 16 the high nibble of qs[e - 16]).
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
struct BlockMXFP4 {
  uint8_t e;  // E8M0 exponent
  uint8_t qs[kQK_MXFP4 / 2];
};
static_assert(sizeof(BlockMXFP4) == 17);
// 2^(e - 128) as f32 for every e, exact (ggml's GGML_E8M0_TO_FP32_HALF: e < 2 is subnormal): a
// table, so a kernel's scale is one broadcast load.
inline constexpr std::array<float, 256> kMxfp4Scales = [] {
  std::array<float, 256> table{};
  for (uint32_t e = 0; e < 256; ++e) table[e] = std::bit_cast<float>(e < 2 ? 0x00200000u << e : (e - 1) << 23);
  return table;
}();
inline float Mxfp4Scale(uint8_t e) { return kMxfp4Scales[e]; }

// ggml block_iq4_xs: 8 sub-blocks of 32 with 6-bit scales (low 4 bits in scales_l, two per byte;
// top 2 bits in scales_h), each sub-block laid out as IQ4_NL; value = d * (ls - 32) * level.
struct BlockIQ4_XS {
  f16_bits d;
  uint16_t scales_h;
  uint8_t scales_l[kQK_K / 64];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockIQ4_XS) == 136);

// ggml block_q8_K: activations quantized for K-quant dot products; bsums = sums of 16 qs each.
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};
static_assert(sizeof(BlockQ8_K) == 292);

// Elements per block (1 for plain float types).
int64_t DTypeBlockSize(DType t);
// Bytes per block.
size_t DTypeBlockBytes(DType t);
// Bytes of a row of n elements; n must be a multiple of the block size.
size_t DTypeRowBytes(DType t, int64_t n);
std::string_view DTypeName(DType t);              // "f32", "q8_0", ...
std::optional<DType> DTypeFromId(uint32_t ggml_id);  // nullopt for ids we do not support
std::optional<DType> DTypeFromName(std::string_view name);  // "q8_0" -> kQ8_0 (case-insensitive)

float F16ToF32(f16_bits h);
f16_bits F32ToF16(float f);    // round to nearest even
float BF16ToF32(bf16_bits h);
bf16_bits F32ToBF16(float f);  // round to nearest even

}  // namespace kvsparse
