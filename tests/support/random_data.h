// Random test inputs. Kernels and caches are tested on fresh random values, never zeros
// (a zero hides scale, sign and rounding bugs), so zeros are redrawn.
#pragma once

#include <random>
#include <vector>

namespace kvsparse::testing {

// n values uniform in [-amplitude, amplitude], none exactly zero.
inline std::vector<float> RandomNonZeroFloats(size_t n, std::mt19937& rng, float amplitude = 2.f) {
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<float> v(n);
  for (float& x : v) {
    do x = dist(rng); while (x == 0.f);
  }
  return v;
}

}  // namespace kvsparse::testing
