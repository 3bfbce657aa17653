#include "model/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kvsparse {

std::vector<float> RopeInvFreq(int head_dim, float theta) {
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(theta), -2.0 * i / head_dim));
  }
  return inv_freq;
}

namespace {
// The dimension (of head_dim) whose rotation makes `n_rotations` turns over the original context.
float CorrectionDim(int head_dim, int32_t original_context, float n_rotations, float theta) {
  return static_cast<float>(head_dim) *
         std::log(static_cast<float>(original_context) / (n_rotations * 2.0f * std::numbers::pi_v<float>)) /
         (2.0f * std::log(theta));
}
}  // namespace

float ApplyYarn(const YarnParams& p, int head_dim, std::vector<float>* inv_freq) {
  const float freq_scale = 1.0f / p.factor;
  // The ramp runs from the first dimension that turns beta_fast times (kept: extrapolated) to
  // the last that turns beta_slow times (interpolated), in whole dimensions.
  const float low = std::max(0.0f, std::floor(CorrectionDim(head_dim, p.original_context, p.beta_fast, p.theta)));
  const float high =
      std::min(static_cast<float>(head_dim - 1), std::ceil(CorrectionDim(head_dim, p.original_context, p.beta_slow,
                                                                         p.theta)));
  for (size_t i = 0; i < inv_freq->size(); ++i) {
    // ggml's ramp over the pair index: 1 below `low` (extrapolate), 0 above `high` (interpolate).
    const float y = (static_cast<float>(i) - low) / std::max(0.001f, high - low);
    const float mix = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
    (*inv_freq)[i] *= freq_scale * (1.0f - mix) + mix;
  }
  if (p.factor <= 1.0f) return 1.0f;
  const float mscale = 1.0f + 0.1f * std::log(p.factor);
  if (p.log_multiplier != 0.0f) return mscale / (1.0f + 0.1f * p.log_multiplier * std::log(p.factor));
  return mscale;
}

}  // namespace kvsparse
