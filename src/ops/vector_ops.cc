// Vector kernels used between matmuls.
#include "kvsparse/ops.h"

namespace kvsparse::ops {

float Dot(const float* a, const float* b, int64_t n) { return ref::Dot(a, b, n); }
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  ref::RmsNorm(x, weight, out, n, eps);
}
void Rope(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style) {
  ref::Rope(x, n_heads, head_dim, pos, inv_freq, style);
}
void SiluMul(float* gate, const float* up, int64_t n) { ref::SiluMul(gate, up, n); }
void Softmax(float* x, int64_t n) { ref::Softmax(x, n); }
void Add(float* y, const float* x, int64_t n) { ref::Add(y, x, n); }

}  // namespace kvsparse::ops
