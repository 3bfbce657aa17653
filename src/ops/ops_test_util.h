// Shared helpers for the kernel tests: seeded random inputs (never all zeros) and quantized weights.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"

namespace kvsparse::testing {

// Uniform values in [-scale, scale] with a few larger outliers, like real activations.
inline std::vector<float> RandomFloats(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) {
    x = uniform(rng);
    if (x == 0.f) x = scale * 0.5f;
  }
  for (int64_t i = 0; i < n / 97; ++i) v[rng() % n] *= 8.f;
  return v;
}

// Quantizes a [rows, cols] f32 matrix row by row into `type` with the reference quantizer.
inline std::vector<uint8_t> QuantizeMatrix(DType type, const std::vector<float>& m, int64_t rows, int64_t cols) {
  const size_t row_bytes = DTypeRowBytes(type, cols);
  std::vector<uint8_t> out(row_bytes * rows);
  for (int64_t r = 0; r < rows; ++r) ref::QuantizeRow(type, m.data() + r * cols, out.data() + r * row_bytes, cols);
  return out;
}

// A [rows, cols] matrix of `type` with random bits in every code, scale and min field, except
// the f16 super-block scales (d, and dmin or m), which get small random finite values: every
// code and sub-block scale combination the format can hold, not only what a quantizer writes.
inline std::vector<uint8_t> RandomBitsMatrix(DType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(DTypeRowBytes(type, cols) * rows);
  for (auto& byte : out) byte = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> uniform(0.001f, 0.01f);
  auto set_f16 = [&](uint8_t* block, size_t offset, bool may_be_negative) {
    const float v = uniform(rng) * (may_be_negative && (rng() & 1) ? -1.f : 1.f);
    const f16_bits h = F32ToF16(v);
    std::memcpy(block + offset, &h, sizeof(h));
  };
  const size_t block_bytes = DTypeBlockBytes(type);
  for (size_t b = 0; b < out.size() / block_bytes; ++b) {
    uint8_t* block = out.data() + b * block_bytes;
    switch (type) {
      case DType::kQ4_1: set_f16(block, offsetof(BlockQ4_1, d), true); set_f16(block, offsetof(BlockQ4_1, m), true); break;
      case DType::kQ5_1: set_f16(block, offsetof(BlockQ5_1, d), true); set_f16(block, offsetof(BlockQ5_1, m), true); break;
      case DType::kQ5_0: set_f16(block, offsetof(BlockQ5_0, d), true); break;
      case DType::kIQ4_NL: set_f16(block, offsetof(BlockIQ4_NL, d), true); break;
      case DType::kQ2_K: set_f16(block, offsetof(BlockQ2_K, d), false); set_f16(block, offsetof(BlockQ2_K, dmin), false); break;
      case DType::kQ3_K: set_f16(block, offsetof(BlockQ3_K, d), true); break;
      case DType::kQ4_K: set_f16(block, offsetof(BlockQ4_K, d), false); set_f16(block, offsetof(BlockQ4_K, dmin), false); break;
      case DType::kQ5_K: set_f16(block, offsetof(BlockQ5_K, d), false); set_f16(block, offsetof(BlockQ5_K, dmin), false); break;
      case DType::kQ6_K: set_f16(block, offsetof(BlockQ6_K, d), true); break;
      case DType::kIQ4_XS: set_f16(block, offsetof(BlockIQ4_XS, d), true); break;
      case DType::kQ4_0: set_f16(block, offsetof(BlockQ4_0, d), true); break;
      case DType::kQ8_0: set_f16(block, offsetof(BlockQ8_0, d), true); break;
      // Exponents around those of real weights (2^-18 .. 2^-1 per level unit).
      case DType::kMXFP4: block[offsetof(BlockMXFP4, e)] = static_cast<uint8_t>(110 + rng() % 18); break;
      default: break;
    }
  }
  return out;
}

}  // namespace kvsparse::testing
