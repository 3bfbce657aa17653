// DeepSeek-V2 / V2-Lite / V2.5 / V3 (GGUF architecture deepseek2): multi-head latent attention
// (ModelConfig::IsMla), leading dense layers, routed experts with ungated shared ones, and
// softmax or sigmoid gating with a selection bias (exp_probs_b). The keys are llama.cpp's
// (src/models/deepseek2.cpp and its converter): a file written for the absorbed form has
// attention.key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank and the per-head
// sizes in key_length_mla / value_length_mla, with attn_k_b / attn_v_b; an older file has the
// per-head sizes in key_length / value_length and one attn_kv_b.
#include <fmt/format.h>

#include "model/arch.h"

namespace kvsparse {

namespace {

Status ReadDeepseek2(const ArchKeys& keys, ModelConfig* c) {
  const std::string& p = keys.prefix();
  const std::string& source = keys.source();
  auto required = [&](std::string_view key, int lo, int hi) -> StatusOr<int> {
    KVS_ASSIGN_OR_RETURN(const std::optional<int32_t> v, keys.Count(key));
    if (!v.has_value()) {
      return DataLossError(fmt::format("{}: required metadata key '{}{}' is missing (deepseek2 uses multi-head "
                                       "latent attention)",
                                       source, p, key));
    }
    if (*v < lo || *v > hi) {
      return DataLossError(fmt::format("{}: metadata '{}{}' = {} is out of range [{}, {}]", source, p, key, *v, lo, hi));
    }
    return static_cast<int>(*v);
  };
  auto optional = [&](std::string_view key, int dflt, int lo, int hi) -> StatusOr<int> {
    if (!keys.Has(key)) return dflt;
    return required(key, lo, hi);
  };
  constexpr int kMaxRank = 8192;
  KVS_ASSIGN_OR_RETURN(c->kv_lora_rank, required("attention.kv_lora_rank", 1, kMaxRank));
  KVS_ASSIGN_OR_RETURN(c->mla_rope_dim, required("rope.dimension_count", 2, 1024));
  if (c->mla_rope_dim % 2 != 0) {
    return DataLossError(fmt::format("{}: '{}rope.dimension_count' = {} must be even", source, p, c->mla_rope_dim));
  }
  // llama.cpp reads no q_lora_rank for the 27-layer Lite files (they have attn_q); a missing key
  // means the same here, and the tensors decide (attn_q_a present or not).
  KVS_ASSIGN_OR_RETURN(c->q_lora_rank, optional("attention.q_lora_rank", 0, 0, kMaxRank));
  if (keys.Has("attention.key_length_mla") || keys.Has("attention.value_length_mla")) {
    KVS_ASSIGN_OR_RETURN(const int key_mla, required("attention.key_length_mla", c->mla_rope_dim + 1, 1024));
    KVS_ASSIGN_OR_RETURN(c->mla_v_head_dim, required("attention.value_length_mla", 1, 1024));
    c->mla_nope_dim = key_mla - c->mla_rope_dim;
    // The absorbed form's cache row: the file must say so in key_length / value_length.
    if (c->head_dim != c->kv_lora_rank + c->mla_rope_dim) {
      return DataLossError(fmt::format("{}: '{}attention.key_length' = {} but an MLA cache row is kv_lora_rank + rope "
                                       "dims = {} + {}",
                                       source, p, c->head_dim, c->kv_lora_rank, c->mla_rope_dim));
    }
    KVS_ASSIGN_OR_RETURN(const int value_length, optional("attention.value_length", c->kv_lora_rank, 1, 1 << 20));
    if (value_length != c->kv_lora_rank) {
      return DataLossError(fmt::format("{}: '{}attention.value_length' = {} but the latent (kv_lora_rank) is {}",
                                       source, p, value_length, c->kv_lora_rank));
    }
  } else {  // an older file: per-head sizes, attn_kv_b
    if (c->head_dim <= c->mla_rope_dim) {
      return DataLossError(fmt::format("{}: '{}attention.key_length' = {} must exceed the rope dims {}", source, p,
                                       c->head_dim, c->mla_rope_dim));
    }
    c->mla_nope_dim = c->head_dim - c->mla_rope_dim;
    KVS_ASSIGN_OR_RETURN(c->mla_v_head_dim, optional("attention.value_length", c->head_dim, 1, 1024));
  }
  c->head_dim = c->kv_lora_rank + c->mla_rope_dim;  // the cache row, one KV head
  if (c->head_dim > 1024) {
    return DataLossError(fmt::format("{}: kv_lora_rank + rope dims = {} exceeds 1024", source, c->head_dim));
  }
  c->n_kv_heads = 1;
  c->rope_style = RopeStyle::kAdjacentPairs;

  if (!c->IsMoe()) return Status::Ok();
  KVS_ASSIGN_OR_RETURN(c->n_dense_lead_layers, optional("leading_dense_block_count", 0, 0, c->n_layers));
  KVS_ASSIGN_OR_RETURN(const int n_shared, optional("expert_shared_count", 0, 0, 64));
  c->shared_expert_hidden_dim = n_shared * c->expert_hidden_dim;
  KVS_ASSIGN_OR_RETURN(const float scale, keys.FloatOr("expert_weights_scale", 1.0f));
  if (!(scale >= 0.f) || scale > 1e4f) {
    return DataLossError(fmt::format("{}: '{}expert_weights_scale' = {} is out of range [0, 1e4]", source, p, scale));
  }
  c->expert_weights_scale = scale == 0.f ? 1.0f : scale;  // llama.cpp: 0 means none
  if (keys.Has("expert_weights_norm")) {
    KVS_ASSIGN_OR_RETURN(c->expert_weights_norm, keys.file().GetBool(p + "expert_weights_norm"));
  }
  KVS_ASSIGN_OR_RETURN(const int gating, optional("expert_gating_func", 0, 0, 1 << 20));
  if (gating == 2) {
    c->expert_gating = ExpertGating::kSigmoid;
  } else if (gating > 2) {
    return UnimplementedError(fmt::format("{}: '{}expert_gating_func' = {} is not supported; supported: 1 (softmax), "
                                          "2 (sigmoid)",
                                          source, p, gating));
  }
  KVS_ASSIGN_OR_RETURN(const int groups, optional("expert_group_count", 1, 0, 1 << 20));
  if (groups > 1) {
    return UnimplementedError(fmt::format("{}: '{}expert_group_count' = {}: group-limited expert routing "
                                          "(DeepSeek-V3) is not supported",
                                          source, p, groups));
  }
  return Status::Ok();
}

}  // namespace

const ArchSpec kDeepseek2ArchSpec = {
    .arch = Arch::kDeepseek2,
    .gguf_name = "deepseek2",
    .models = "DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-V2.5",
    .rope_style = RopeStyle::kAdjacentPairs,
    .read_config = ReadDeepseek2,
};

}  // namespace kvsparse
