// Gemma 2 and Gemma 3: embeddings scaled by sqrt(dim), RMSNorm after attention and after the
// FFN, GeGLU, sliding-window layers interleaved with global ones; Gemma 2 softcaps its
// attention logits and its final logits, Gemma 3 normalizes Q and K per head instead and runs
// its sliding layers at RoPE base 10000. Defaults follow llama.cpp's loaders (and through them
// gemma_pytorch's configs) where a file omits a key.
#include <cmath>
#include <fmt/format.h>

#include "model/arch.h"

namespace kvsparse {

namespace {

// Gemma's query scale is 1/sqrt(head_dim), except on the 27B models, whose
// query_pre_attn_scalar is dim / n_heads (gemma_pytorch config.py). A file's attention.scale wins.
Status ReadQueryScale(const ArchKeys& keys, int n_layers_27b, ModelConfig* c) {
  const bool is_27b = c->n_layers == n_layers_27b;
  const float dflt = 1.0f / std::sqrt(static_cast<float>(is_27b ? c->dim / c->n_heads : c->head_dim));
  KVS_ASSIGN_OR_RETURN(c->attention_scale, keys.FloatOr("attention.scale", dflt));
  if (!(c->attention_scale > 0.f)) {
    return DataLossError(fmt::format("{}: '{}attention.scale' must be positive, found {}", keys.source(),
                                     keys.prefix(), c->attention_scale));
  }
  return Status::Ok();
}

Status SoftcapKey(const ArchKeys& keys, std::string_view key, float dflt, float* out) {
  KVS_ASSIGN_OR_RETURN(*out, keys.FloatOr(key, dflt));
  // Tiny caps would divide by ~0 (real models use 30 and 50).
  if (*out < 0.f || (*out > 0.f && *out < 1e-3f)) {
    return DataLossError(fmt::format("{}: '{}{}' must be 0 (no softcap) or at least 0.001, found {}", keys.source(),
                                     keys.prefix(), key, *out));
  }
  return Status::Ok();
}

Status ReadGemma2Config(const ArchKeys& keys, ModelConfig* c) {
  // Gemma 2: window 4096 on every other layer; its sliding layers share the global RoPE.
  KVS_RETURN_IF_ERROR(ReadSlidingWindow(keys, /*dflt_window=*/4096, /*default_period=*/2, c));
  KVS_ASSIGN_OR_RETURN(c->rope_theta_sliding, keys.FloatOr("rope.freq_base_swa", c->rope_theta));
  KVS_RETURN_IF_ERROR(SoftcapKey(keys, "attn_logit_softcapping", 50.0f, &c->attn_softcap));
  KVS_RETURN_IF_ERROR(SoftcapKey(keys, "final_logit_softcapping", 30.0f, &c->final_softcap));
  return ReadQueryScale(keys, /*n_layers_27b=*/46, c);
}

Status ReadGemma3Config(const ArchKeys& keys, ModelConfig* c) {
  // Gemma 3: five sliding layers per global one, base 10000 on the sliding layers; no attention
  // softcap (Q/K norms instead); a final softcap only where the file states one.
  KVS_RETURN_IF_ERROR(ReadSlidingWindow(keys, /*dflt_window=*/0, /*default_period=*/6, c));
  KVS_ASSIGN_OR_RETURN(c->rope_theta_sliding, keys.FloatOr("rope.freq_base_swa", 10000.0f));
  c->sliding_rope_unscaled = true;  // llama.cpp's freq_scale_swa = 1: the file's scaling is for global layers
  KVS_RETURN_IF_ERROR(SoftcapKey(keys, "final_logit_softcapping", 0.0f, &c->final_softcap));
  return ReadQueryScale(keys, /*n_layers_27b=*/62, c);
}

}  // namespace

const ArchSpec kGemma2ArchSpec = {
    .arch = Arch::kGemma2,
    .gguf_name = "gemma2",
    .models = "Gemma 2",
    .rope_style = RopeStyle::kNeox,
    .ffn_activation = FfnActivation::kGeluTanh,
    .post_norms = true,
    .scale_embeddings = true,
    .read_config = ReadGemma2Config,
};

const ArchSpec kGemma3ArchSpec = {
    .arch = Arch::kGemma3,
    .gguf_name = "gemma3",
    .models = "Gemma 3 text",
    .rope_style = RopeStyle::kNeox,
    .ffn_activation = FfnActivation::kGeluTanh,
    .qk_norm = true,
    .post_norms = true,
    .scale_embeddings = true,
    .read_config = ReadGemma3Config,
};

}  // namespace kvsparse
