// gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): a mixture of experts whose
// attention has a learned sink logit per head, a 128-token sliding window on every other layer
// (the even ones), biases on Q/K/V and the output, and YaRN; its experts are biased and use a
// clamped SwiGLU, weighted by a softmax over the chosen experts' router logits only. As
// llama.cpp's graph for it (src/models/openai-moe.cpp, arch name "gpt-oss").
#include <fmt/format.h>

#include "model/arch.h"

namespace kvsparse {

namespace {

Status ReadGptOssConfig(const ArchKeys& keys, ModelConfig* c) {
  c->expert_gating = ExpertGating::kSoftmaxChosen;
  if (!keys.Has("attention.sliding_window")) {
    return DataLossError(fmt::format("{}: required metadata key '{}attention.sliding_window' is missing (gpt-oss "
                                     "slides a window over every other layer)",
                                     keys.source(), keys.prefix()));
  }
  KVS_RETURN_IF_ERROR(ReadSlidingWindow(keys, /*dflt_window=*/0, /*default_period=*/2, c));
  // The sliding layers share the global layers' RoPE (base and YaRN) unless the file says otherwise.
  KVS_ASSIGN_OR_RETURN(c->rope_theta_sliding, keys.FloatOr("rope.freq_base_swa", c->rope_theta));
  return Status::Ok();
}

}  // namespace

const ArchSpec kGptOssArchSpec = {
    .arch = Arch::kGptOss,
    .gguf_name = "gpt-oss",
    .models = "gpt-oss-20b, gpt-oss-120b",
    .rope_style = RopeStyle::kNeox,
    .ffn_activation = FfnActivation::kSwigluClamped,
    .experts_required = true,
    .expert_weights_norm = false,
    .gpt_oss_biases = true,
    .attention_sinks = true,
    .ffn_norm_tensor = "post_attention_norm",
    .read_config = &ReadGptOssConfig,
};

}  // namespace kvsparse
