// Tensor element types, numbered and laid out exactly as ggml/GGUF defines them,
// so GGUF tensor data can be used in place (mmap) without conversion.
#pragma once

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
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ8_K = 15,  // activation-side type for Q4_K dot products (never a weight type here)
  kBF16 = 30,
};

inline constexpr int kQK8_0 = 32;   // elements per Q8_0 block
inline constexpr int kQK4_0 = 32;   // elements per Q4_0 block
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

// ggml block_q4_K: 8 sub-blocks of 32; 6-bit scales and mins packed in `scales`;
// value = d * sc[j] * q - dmin * m[j]
struct BlockQ4_K {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

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
