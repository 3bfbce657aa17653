#include "kvsparse/dtype.h"

#include <array>
#include <cctype>
#include <cstring>

namespace kvsparse {

namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  int64_t block_size;
  size_t block_bytes;
};

constexpr std::array<DTypeInfo, 17> kDTypes = {{
    {DType::kF32, "f32", 1, sizeof(float)},
    {DType::kF16, "f16", 1, sizeof(f16_bits)},
    {DType::kQ4_0, "q4_0", kQK4_0, sizeof(BlockQ4_0)},
    {DType::kQ4_1, "q4_1", kQK4_1, sizeof(BlockQ4_1)},
    {DType::kQ5_0, "q5_0", kQK5_0, sizeof(BlockQ5_0)},
    {DType::kQ5_1, "q5_1", kQK5_0, sizeof(BlockQ5_1)},
    {DType::kQ8_0, "q8_0", kQK8_0, sizeof(BlockQ8_0)},
    {DType::kQ2_K, "q2_K", kQK_K, sizeof(BlockQ2_K)},
    {DType::kQ3_K, "q3_K", kQK_K, sizeof(BlockQ3_K)},
    {DType::kQ4_K, "q4_K", kQK_K, sizeof(BlockQ4_K)},
    {DType::kQ5_K, "q5_K", kQK_K, sizeof(BlockQ5_K)},
    {DType::kQ6_K, "q6_K", kQK_K, sizeof(BlockQ6_K)},
    {DType::kQ8_K, "q8_K", kQK_K, sizeof(BlockQ8_K)},
    {DType::kIQ4_NL, "iq4_nl", kQK4_NL, sizeof(BlockIQ4_NL)},
    {DType::kIQ4_XS, "iq4_xs", kQK_K, sizeof(BlockIQ4_XS)},
    {DType::kBF16, "bf16", 1, sizeof(bf16_bits)},
    {DType::kMXFP4, "mxfp4", kQK_MXFP4, sizeof(BlockMXFP4)},
}};

const DTypeInfo* FindInfo(DType t) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.type == t) return &info;
  }
  return nullptr;
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

int64_t DTypeBlockSize(DType t) {
  const DTypeInfo* info = FindInfo(t);
  return info ? info->block_size : 0;
}

size_t DTypeBlockBytes(DType t) {
  const DTypeInfo* info = FindInfo(t);
  return info ? info->block_bytes : 0;
}

size_t DTypeRowBytes(DType t, int64_t n) {
  const DTypeInfo* info = FindInfo(t);
  if (info == nullptr || n < 0) return 0;
  return static_cast<size_t>(n / info->block_size) * info->block_bytes;
}

std::string_view DTypeName(DType t) {
  const DTypeInfo* info = FindInfo(t);
  return info ? info->name : std::string_view("unknown");
}

std::optional<DType> DTypeFromId(uint32_t ggml_id) {
  for (const DTypeInfo& info : kDTypes) {
    if (static_cast<uint32_t>(info.type) == ggml_id) return info.type;
  }
  return std::nullopt;
}

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name.size() != name.size()) continue;
    bool same = true;
    for (size_t i = 0; i < name.size() && same; ++i) {
      same =
          std::tolower(static_cast<unsigned char>(name[i])) == std::tolower(static_cast<unsigned char>(info.name[i]));
    }
    if (same) return info.type;
  }
  return std::nullopt;
}

float F16ToF32(f16_bits h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) {  // inf, or nan: keep the payload and make it quiet, like F16C
    const uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return BitsToFloat(sign | 0x7F800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {
    // Zero or subnormal: value = mantissa * 2^-24, exact in f32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return BitsToFloat(sign | FloatBits(magnitude));
  }
  return BitsToFloat(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

f16_bits F32ToF16(float f) {
  const uint32_t bits = FloatBits(f);
  const uint32_t sign = (bits >> 16) & 0x8000;
  uint32_t magnitude = bits & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) {  // nan: quiet it, keep the top payload bits (as F16C does)
    return static_cast<f16_bits>(sign | 0x7E00 | ((magnitude >> 13) & 0x3FF));
  }
  if (magnitude >= 0x477FF000) {  // >= 65520 rounds to inf (and inf itself)
    return static_cast<f16_bits>(sign | 0x7C00);
  }
  if (magnitude < 0x38800000) {  // below 2^-14: result is an f16 subnormal (or zero)
    // Adding 0.5 puts the f16 subnormal ulp (2^-24) at the f32 ulp position, so the
    // FPU's round-to-nearest-even does the rounding; the low bits are the result.
    const float shifted = BitsToFloat(magnitude) + 0.5f;
    return static_cast<f16_bits>(sign | (FloatBits(shifted) - FloatBits(0.5f)));
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even.
  const uint32_t mantissa_odd = (magnitude >> 13) & 1;
  magnitude += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFF + mantissa_odd;
  return static_cast<f16_bits>(sign | (magnitude >> 13));
}

float BF16ToF32(bf16_bits h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

bf16_bits F32ToBF16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7FFFFFFF) > 0x7F800000) {  // nan: truncate and force quiet, as ggml does
    return static_cast<bf16_bits>((bits >> 16) | 0x40);
  }
  return static_cast<bf16_bits>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

}  // namespace kvsparse
