// Vector kernels used between matmuls, written with Highway and compiled once per kernel family
// (see simd_family.h). Transcendentals use hwy/contrib/math; RoPE angles use libm (shared by heads).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvsparse/ops.h"
#include "kvsparse/status.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/vector_ops.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

namespace {

using DF = hn::ScalableTag<float>;

// Applies `body(v, offset)` to full vectors, then to a masked tail (lanes past n read as 0).
template <class Body>
HWY_INLINE void ForEachVector(int64_t n, const Body& body) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) body(i, hn::FirstN(d, static_cast<size_t>(lanes)), true);
  if (i < n) body(i, hn::FirstN(d, static_cast<size_t>(n - i)), false);
}

// Loads the lanes of `m` (a FirstN mask) from p and zeroes the rest, without reading past them.
// On AVX2/AVX-512 MaskedLoad is a masked move that never touches masked-off memory; Highway 1.0's
// emulated 128-bit target (the scalar family) loads the whole vector and then masks, which reads
// past the end of the array (AddressSanitizer under clang reports it): copy the tail lanes there.
template <class D, class M>
HWY_INLINE hn::Vec<D> LoadTail(M m, D d, const float* HWY_RESTRICT p) {
#if KVS_ISA_SCALAR
  const size_t count = hn::CountTrue(d, m);
  if (count == hn::Lanes(d)) return hn::LoadU(d, p);  // a full vector: one load, no copy
  HWY_ALIGN float lanes[hn::MaxLanes(D())] = {};
  for (size_t k = 0; k < count; ++k) lanes[k] = p[k];
  return hn::Load(d, lanes);
#else
  return hn::MaskedLoad(m, d, p);
#endif
}

}  // namespace

float DotImpl(const float* a, const float* b, int64_t n) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  auto acc0 = hn::Zero(d), acc1 = hn::Zero(d), acc2 = hn::Zero(d), acc3 = hn::Zero(d);
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    acc0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), acc0);
    acc1 = hn::MulAdd(hn::LoadU(d, a + i + lanes), hn::LoadU(d, b + i + lanes), acc1);
    acc2 = hn::MulAdd(hn::LoadU(d, a + i + 2 * lanes), hn::LoadU(d, b + i + 2 * lanes), acc2);
    acc3 = hn::MulAdd(hn::LoadU(d, a + i + 3 * lanes), hn::LoadU(d, b + i + 3 * lanes), acc3);
  }
  for (; i < n; i += lanes) {
    const auto m = hn::FirstN(d, static_cast<size_t>(std::min(lanes, n - i)));
    acc0 = hn::MulAdd(LoadTail(m, d, a + i), LoadTail(m, d, b + i), acc0);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3))));
}

void RmsNormImpl(const float* x, const float* weight, float* out, int64_t n, float eps) {
  KVS_CHECK(n > 0);
  const float mean_sq = DotImpl(x, x, n) / static_cast<float>(n);
  const DF d;
  const auto scale = hn::Set(d, 1.f / std::sqrt(mean_sq + eps));
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto v = hn::Mul(hn::Mul(LoadTail(m, d, x + i), scale), LoadTail(m, d, weight + i));
    if (full) {
      hn::StoreU(v, d, out + i);
    } else {
      hn::BlendedStore(v, m, d, out + i);
    }
  });
}

void RopeImpl(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style) {
  KVS_CHECK(head_dim % 2 == 0);
  const int half = head_dim / 2;
  // cos/sin per frequency, computed once and shared by all heads (same rounding as ref::Rope).
  thread_local std::vector<float> cos_sin;
  cos_sin.resize(2 * static_cast<size_t>(half));
  float* cos_t = cos_sin.data();
  float* sin_t = cos_sin.data() + half;
  for (int i = 0; i < half; ++i) {
    const float theta = static_cast<float>(pos) * inv_freq[i];
    cos_t[i] = std::cos(theta);
    sin_t[i] = std::sin(theta);
  }
  const DF d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int h = 0; h < n_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * head_dim;
    if (style == RopeStyle::kNeox) {
      // (head[i], head[i + half]) rotate together: contiguous halves vectorize directly.
      int i = 0;
      for (; i + lanes <= half; i += lanes) {
        const auto a = hn::LoadU(d, head + i), b = hn::LoadU(d, head + half + i);
        const auto c = hn::LoadU(d, cos_t + i), s = hn::LoadU(d, sin_t + i);
        hn::StoreU(hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), d, head + i);
        hn::StoreU(hn::Add(hn::Mul(a, s), hn::Mul(b, c)), d, head + half + i);
      }
      for (; i < half; ++i) {
        const float a = head[i], b = head[i + half];
        head[i] = a * cos_t[i] - b * sin_t[i];
        head[i + half] = a * sin_t[i] + b * cos_t[i];
      }
    } else {
      // Interleaved pairs: few elements per head (head_dim <= 256), scalar is fast enough.
      for (int i = 0; i < half; ++i) {
        const float a = head[2 * i], b = head[2 * i + 1];
        head[2 * i] = a * cos_t[i] - b * sin_t[i];
        head[2 * i + 1] = a * sin_t[i] + b * cos_t[i];
      }
    }
  }
}

void SiluMulImpl(float* gate, const float* up, int64_t n) {
  const DF d;
  const auto one = hn::Set(d, 1.f);
  // exp(-g) overflows past 88: clamp so silu(g) -> g / huge -> 0 for very negative g.
  const auto max_exp_arg = hn::Set(d, 88.f);
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto g = LoadTail(m, d, gate + i);
    const auto e = hn::Exp(d, hn::Min(hn::Neg(g), max_exp_arg));
    const auto v = hn::Mul(hn::Div(g, hn::Add(one, e)), LoadTail(m, d, up + i));
    if (full) {
      hn::StoreU(v, d, gate + i);
    } else {
      hn::BlendedStore(v, m, d, gate + i);
    }
  });
}

// GELU's tanh form (Hendrycks & Gimpel 2016), as Gemma and llama.cpp's ggml_gelu use it:
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
void GeluMulImpl(float* gate, const float* up, int64_t n) {
  const DF d;
  const auto half = hn::Set(d, 0.5f), one = hn::Set(d, 1.f);
  const auto k0 = hn::Set(d, 0.7978845608028654f), k1 = hn::Set(d, 0.044715f);
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto g = LoadTail(m, d, gate + i);
    const auto inner = hn::Mul(k0, hn::MulAdd(hn::Mul(k1, g), hn::Mul(g, g), g));
    const auto gelu = hn::Mul(hn::Mul(half, g), hn::Add(one, hn::Tanh(d, inner)));
    const auto v = hn::Mul(gelu, LoadTail(m, d, up + i));
    if (full) {
      hn::StoreU(v, d, gate + i);
    } else {
      hn::BlendedStore(v, m, d, gate + i);
    }
  });
}

// gpt-oss's SwiGLU: the gate capped above and the linear part clamped at kSwigluLimit, the
// sigmoid sharpened by kSwigluAlpha, the linear part shifted by one (OpenAI's reference model).
void SwigluClampedMulImpl(float* gate, const float* up, int64_t n) {
  const DF d;
  const auto one = hn::Set(d, 1.f), alpha = hn::Set(d, kSwigluAlpha), limit = hn::Set(d, kSwigluLimit);
  const auto max_exp_arg = hn::Set(d, 88.f);  // as SiluMul: exp(-alpha g) past 88 overflows
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto g = hn::Min(LoadTail(m, d, gate + i), limit);
    const auto u = hn::Clamp(LoadTail(m, d, up + i), hn::Neg(limit), limit);
    const auto e = hn::Exp(d, hn::Min(hn::Neg(hn::Mul(alpha, g)), max_exp_arg));
    const auto v = hn::Mul(hn::Div(g, hn::Add(one, e)), hn::Add(u, one));
    if (full) {
      hn::StoreU(v, d, gate + i);
    } else {
      hn::BlendedStore(v, m, d, gate + i);
    }
  });
}

void SoftcapInPlaceImpl(float* x, int64_t n, float cap) {
  const DF d;
  const auto vcap = hn::Set(d, cap), inv = hn::Set(d, 1.f / cap);
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto v = hn::Mul(vcap, hn::Tanh(d, hn::Mul(LoadTail(m, d, x + i), inv)));
    if (full) {
      hn::StoreU(v, d, x + i);
    } else {
      hn::BlendedStore(v, m, d, x + i);
    }
  });
}

void SoftmaxImpl(float* x, int64_t n) {
  if (n <= 0) return;
  const DF d;
  auto vmax = hn::Set(d, -std::numeric_limits<float>::infinity());
  ForEachVector(
      n, [&](int64_t i, auto m, bool) { vmax = hn::IfThenElse(m, hn::Max(vmax, LoadTail(m, d, x + i)), vmax); });
  const float max = hn::GetLane(hn::MaxOfLanes(d, vmax));
  const auto vmax_b = hn::Set(d, max);
  // exp arguments are <= 0; below -104 the result underflows to 0 anyway (and -inf stays safe).
  const auto min_arg = hn::Set(d, -104.f);
  auto vsum = hn::Zero(d);
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto e = hn::Exp(d, hn::Max(hn::Sub(LoadTail(m, d, x + i), vmax_b), min_arg));
    const auto e_masked = hn::IfThenElseZero(m, e);
    vsum = hn::Add(vsum, e_masked);
    if (full) {
      hn::StoreU(e, d, x + i);
    } else {
      hn::BlendedStore(e, m, d, x + i);
    }
  });
  const auto inv = hn::Set(d, 1.f / hn::GetLane(hn::SumOfLanes(d, vsum)));
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto v = hn::Mul(LoadTail(m, d, x + i), inv);
    if (full) {
      hn::StoreU(v, d, x + i);
    } else {
      hn::BlendedStore(v, m, d, x + i);
    }
  });
}

void AddImpl(float* y, const float* x, int64_t n) {
  const DF d;
  ForEachVector(n, [&](int64_t i, auto m, bool full) {
    const auto v = hn::Add(LoadTail(m, d, y + i), LoadTail(m, d, x + i));
    if (full) {
      hn::StoreU(v, d, y + i);
    } else {
      hn::BlendedStore(v, m, d, y + i);
    }
  });
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(DotImpl);
HWY_EXPORT(RmsNormImpl);
HWY_EXPORT(RopeImpl);
HWY_EXPORT(SiluMulImpl);
HWY_EXPORT(GeluMulImpl);
HWY_EXPORT(SwigluClampedMulImpl);
HWY_EXPORT(SoftcapInPlaceImpl);
HWY_EXPORT(SoftmaxImpl);
HWY_EXPORT(AddImpl);

float Dot(const float* a, const float* b, int64_t n) { return KVS_DISPATCH(DotImpl)(a, b, n); }
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  KVS_DISPATCH(RmsNormImpl)(x, weight, out, n, eps);
}
void Rope(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style) {
  KVS_DISPATCH(RopeImpl)(x, n_heads, head_dim, pos, inv_freq, style);
}
void SiluMul(float* gate, const float* up, int64_t n) { KVS_DISPATCH(SiluMulImpl)(gate, up, n); }
void GeluMul(float* gate, const float* up, int64_t n) { KVS_DISPATCH(GeluMulImpl)(gate, up, n); }
void SwigluClampedMul(float* gate, const float* up, int64_t n) { KVS_DISPATCH(SwigluClampedMulImpl)(gate, up, n); }
void SoftcapInPlace(float* x, int64_t n, float cap) { KVS_DISPATCH(SoftcapInPlaceImpl)(x, n, cap); }
void Softmax(float* x, int64_t n) { KVS_DISPATCH(SoftmaxImpl)(x, n); }
void Add(float* y, const float* x, int64_t n) { KVS_DISPATCH(AddImpl)(y, x, n); }

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
