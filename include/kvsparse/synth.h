// Random-weight GGUF models with the exact shapes (and llama.cpp tensor names/keys)
// of real models, so speed and memory work needs no download.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct SynthShape {
  std::string name;  // "tinyllama-1.1b", "tiny-llama", ...
  std::string arch;  // GGUF general.architecture: llama, qwen2, qwen3, gemma2, gemma3, phi3
  int n_vocab = 0;
  int dim = 0;         // embedding length
  int hidden_dim = 0;  // feed-forward length
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int context = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = false;  // no output.weight: the classifier reuses token_embd.weight
  bool qkv_bias = false;     // qwen2: attn_{q,k,v}.bias
  // Llama 3.1/3.2 "llama3" RoPE scaling factor (low 1, high 4, original context 8192),
  // written as llama.cpp does: a rope_freqs.weight tensor [head_dim/2]. 0 = none.
  float rope_llama3_factor = 0.0f;
  // > 0: the head size, written as attention.key_length / value_length (qwen3: n_heads * head_dim
  // may differ from dim). 0: dim / n_heads.
  int head_dim = 0;
  // gemma2/gemma3: attention.sliding_window (the layer pattern is the architecture's default).
  int sliding_window = 0;
  // gemma2: the softcaps written (the real models' are 50 and 30; tiny shapes use small ones so
  // that they bite on random weights).
  float attn_softcap = 0.0f, final_softcap = 0.0f;
  // YaRN (rope.scaling.type yarn) with this factor over `rope_original_context`. 0 = none.
  float rope_yarn_factor = 0.0f;
  // phi3 LongRoPE: rope_factors_short/long.weight, rope.scaling.attn_factor and
  // rope.scaling.original_context_length = rope_original_context.
  bool long_rope = false;
  int rope_original_context = 0;
  // Mixture of experts (llama.cpp's names: ffn_gate_inp, ffn_{gate,up,down}_exps; arch qwen2moe,
  // qwen3moe, olmoe, or llama for Mixtral). 0 experts: dense. expert_hidden_dim 0: hidden_dim.
  int n_experts = 0;
  int n_experts_used = 0;
  int expert_hidden_dim = 0;
  int shared_expert_hidden_dim = 0;  // qwen2moe: ffn_*_shexp and ffn_gate_inp_shexp; deepseek2: n_shared * expert width
  // deepseek2 (multi-head latent attention): kv_lora_rank > 0. The file is what llama.cpp's
  // converter writes for the absorbed form (attn_k_b / attn_v_b), or with mla_unsplit_kv_b an
  // older file's attn_kv_b and per-head key/value lengths.
  int kv_lora_rank = 0;
  int q_lora_rank = 0;        // 0: attn_q (DeepSeek-V2-Lite); else attn_q_a, attn_q_a_norm, attn_q_b
  int mla_nope_dim = 0;
  int mla_rope_dim = 0;
  int mla_v_head_dim = 0;
  bool mla_unsplit_kv_b = false;
  int n_dense_lead_layers = 0;  // leading_dense_block_count
  float yarn_log_multiplier = 0.0f;  // rope.scaling.yarn_log_multiplier (DeepSeek: 0.1 * mscale_all_dim)
  // DeepSeek-V3's routing: sigmoid gating (expert_gating_func 2) with an exp_probs_b selection
  // bias, renormalized and scaled weights.
  bool sigmoid_gating = false;
  float expert_weights_scale = 0.0f;  // written when > 0
  bool expert_weights_norm = false;   // written when true
};

// Real shapes (tinyllama-1.1b, llama-3.2-1b, qwen2.5-0.5b, llama-3.1-8b, the MoE models
// qwen3-30b-a3b, olmoe-1b-7b, mixtral-8x7b, qwen1.5-moe-a2.7b, ...) and tiny test shapes.
const std::vector<SynthShape>& SynthShapes();
// Errors list the valid names.
StatusOr<SynthShape> FindSynthShape(std::string_view name);

struct SynthOptions {
  DType weight_type = DType::kQ8_0;  // 2-D weights; norms and biases are always f32
  // A llama-quantize file type ("q4_k_m", "q5_k_m", ...; quant_mix.h): each matrix gets the type
  // llama-quantize would give it. Empty: every matrix `weight_type` (falling back per row length).
  std::string mix;
  uint64_t seed = 1;
  std::string vocab_gguf;  // copy tokenizer.* keys from this vocab GGUF when non-empty
  int n_layers_override = 0;  // > 0: use this many layers instead of the shape's
};

// Writes a GGUF v3 model with random weights scaled so activations stay finite.
Status WriteSynthModel(const SynthShape& shape, const SynthOptions& options, const std::string& out_path);

// The folder built-in models are cached in: $KVSPARSE_CACHE, else ~/.cache/kvsparse, else the
// temp folder's kvsparse/ (not created here).
std::filesystem::path ModelCacheDir();

}  // namespace kvsparse
