// Scalar reference twins of the vector kernels: plain loops, double accumulation.
#include <algorithm>
#include <cmath>

#include "kvsparse/ops.h"
#include "kvsparse/status.h"

namespace kvsparse::ref {

float Dot(const float* a, const float* b, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i]) * b[i];
  return static_cast<float>(sum);
}

void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
  const float mean_sq = static_cast<float>(sum_sq / static_cast<double>(n));
  const float scale = 1.f / std::sqrt(mean_sq + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

void Rope(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style) {
  KVS_CHECK(head_dim % 2 == 0);
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const float theta = static_cast<float>(pos) * inv_freq[i];
      const float c = std::cos(theta);
      const float s = std::sin(theta);
      // Adjacent pairs rotate (2i, 2i+1); NeoX rotates the two halves against each other.
      const int i0 = style == RopeStyle::kAdjacentPairs ? 2 * i : i;
      const int i1 = style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
      const float a = head[i0];
      const float b = head[i1];
      head[i0] = a * c - b * s;
      head[i1] = a * s + b * c;
    }
  }
}

void SiluMul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

void GeluMul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double gelu = 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
    gate[i] = static_cast<float>(gelu * up[i]);
  }
}

void SwigluClampedMul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = std::min(static_cast<double>(gate[i]), static_cast<double>(ops::kSwigluLimit));
    const double u = std::clamp(static_cast<double>(up[i]), -static_cast<double>(ops::kSwigluLimit),
                                static_cast<double>(ops::kSwigluLimit));
    gate[i] = static_cast<float>(g / (1.0 + std::exp(-static_cast<double>(ops::kSwigluAlpha) * g)) * (u + 1.0));
  }
}

void SoftcapInPlace(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(cap * std::tanh(static_cast<double>(x[i]) / cap));
}

void Softmax(float* x, int64_t n) {
  if (n <= 0) return;
  const float max = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv_sum;
}

void Add(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace kvsparse::ref
