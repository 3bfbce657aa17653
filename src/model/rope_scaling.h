// Internal: RoPE frequency tables and their context-extension variants, as llama.cpp computes
// them. Every variant is a per-frequency factor on inv_freq (the rotation angle is linear in the
// position) plus at most one magnitude factor on the rotated q and k, which the attention scale
// absorbs (ModelConfig::rope_attn_factor).
#pragma once

#include <cstdint>
#include <vector>

namespace kvsparse {

// inv_freq[i] = theta^(-2i / head_dim), i in [0, head_dim/2).
std::vector<float> RopeInvFreq(int head_dim, float theta);

// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models";
// the form of ggml's rope_yarn): frequencies whose wavelength fits the original context many
// times keep their value, slow ones are interpolated by 1/factor, with a linear ramp between the
// dimensions where a rotation takes beta_fast and beta_slow turns over the original context.
struct YarnParams {
  float factor = 1.0f;            // rope.scaling.factor (> 1 extends)
  int32_t original_context = 0;   // rope.scaling.original_context_length
  float theta = 10000.0f;         // the base the table was built from
  float beta_fast = 32.0f;        // rope.scaling.yarn_beta_fast
  float beta_slow = 1.0f;         // rope.scaling.yarn_beta_slow
  float ext_factor = 1.0f;        // the ramp's weight (llama.cpp's yarn_ext_factor; 1 for YaRN files)
  float log_multiplier = 0.0f;    // rope.scaling.yarn_log_multiplier (0: the plain mscale)
};
// Scales inv_freq ([head_dim/2], possibly already divided by per-frequency factors) in place
// and returns the magnitude factor of q and k: 1 + 0.1 ln(factor), or with a log multiplier m,
// (1 + 0.1 ln factor) / (1 + 0.1 m ln factor).
float ApplyYarn(const YarnParams& p, int head_dim, std::vector<float>* inv_freq);

}  // namespace kvsparse
