// Shared helpers for the kernel tests: seeded random inputs (never all zeros) and quantized weights.
#pragma once

#include <cmath>
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

}  // namespace kvsparse::testing
