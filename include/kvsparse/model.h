// Model description, weights and the forward pass.
// Weights point into the mapped GGUF file (or into owned buffers for llama2.c checkpoints).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/ops.h"
#include "kvsparse/status.h"

namespace kvsparse {

enum class Arch { kLlama, kQwen2, kQwen3, kGemma2, kGemma3, kPhi3, kQwen2Moe, kQwen3Moe, kOlmoe, kDeepseek2, kGptOss };
std::string_view ArchName(Arch a);

// The FFN's gate activation: SwiGLU (llama, qwen, phi3) or GeGLU with tanh-approximated GELU (gemma).
// The gated FFN's activation: SwiGLU silu(gate) * up, GeGLU gelu_tanh(gate) * up, or gpt-oss's
// clamped SwiGLU (kSwigluClamped): g = min(gate, 7), u = clamp(up, -7, 7),
// g * sigmoid(1.702 g) * (u + 1) (the constants of OpenAI's reference and llama.cpp).
enum class FfnActivation { kSilu, kGeluTanh, kSwigluClamped };

// How a MoE router's logits become expert weights (llama.cpp's expert_gating_func): softmax over
// every expert (Mixtral, Qwen, OLMoE, DeepSeek-V2), each expert's sigmoid (DeepSeek-V3), or a
// softmax over the chosen experts' logits only (gpt-oss: llama.cpp's SOFTMAX_WEIGHT).
enum class ExpertGating { kSoftmax, kSigmoid, kSoftmaxChosen };

// Weight types the forward pass computes with (what loaders accept and converters write).
bool IsSupportedWeightType(DType t);
std::string_view SupportedWeightTypeNames();  // "f32, f16, bf16, q8_0, ..."

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int n_vocab = 0;
  int dim = 0;         // embedding width
  int hidden_dim = 0;  // FFN inner width
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;    // attention.key_length, else dim / n_heads (n_heads * head_dim may differ from dim)
  int max_context = 0; // training context length
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeStyle rope_style = RopeStyle::kAdjacentPairs;
  bool tied_output = false;  // output projection shares the token embedding
  bool qk_norm = false;      // qwen3, gemma3: RMSNorm of each query and key head before RoPE
  // olmoe: the Q/K norms span the whole projection ([n_heads * head_dim], [n_kv_heads * head_dim])
  // instead of one head.
  bool qk_norm_full_width = false;

  // Mixture of experts (llama.cpp's build_moe_ffn). n_experts 0: every FFN is dense. In a MoE
  // layer the router ffn_gate_inp scores n_experts SwiGLU FFNs of width expert_hidden_dim per
  // token; the n_experts_used best by softmax probability run, each weighted by its probability
  // (renormalized over the chosen when expert_weights_norm), times expert_weights_scale.
  int n_experts = 0;
  int n_experts_used = 0;
  int expert_hidden_dim = 0;
  bool expert_weights_norm = false;
  float expert_weights_scale = 1.0f;
  // qwen2moe: one shared expert of this width runs on every token, its output times
  // sigmoid(ffn_gate_inp_shexp . x); deepseek2: expert_shared_count experts of expert_hidden_dim
  // fused into one of their summed width, ungated. 0: none.
  int shared_expert_hidden_dim = 0;
  ExpertGating expert_gating = ExpertGating::kSoftmax;
  // deepseek2: the first n_dense_lead_layers layers have a dense FFN of hidden_dim
  // (leading_dense_block_count); the rest are MoE.
  int n_dense_lead_layers = 0;
  bool IsMoe() const { return n_experts > 0; }
  bool LayerIsMoe(int layer) const { return IsMoe() && layer >= n_dense_lead_layers; }

  // Multi-head latent attention (deepseek2; DeepSeek-AI 2024, "DeepSeek-V2", section 2.1). A
  // token's keys and values come from one latent of kv_lora_rank values (attn_kv_a_mqa, then
  // attn_kv_a_norm) plus one rotated key part of mla_rope_dim values shared by every head. The
  // engine runs it absorbed, as llama.cpp does: the cache holds [latent, rotated key part] per
  // token as one KV head (n_kv_heads = 1, head_dim = kv_lora_rank + mla_rope_dim) that serves as
  // the key and, its first kv_lora_rank values, as the value; attn_k_b maps each query head's
  // non-rotated part into the latent and attn_v_b maps each head's output back out of it.
  int kv_lora_rank = 0;    // 0: not MLA
  int q_lora_rank = 0;     // 0: attn_q; else attn_q_a -> attn_q_a_norm -> attn_q_b
  int mla_nope_dim = 0;    // a query head's non-rotated part (qk_nope_head_dim, 128)
  int mla_rope_dim = 0;    // its rotated part (qk_rope_head_dim, 64): rope.dimension_count
  int mla_v_head_dim = 0;  // a head's output width after attn_v_b (v_head_dim, 128)
  // YaRN's magnitude factor on the rotated parts only (1 when the file has a log multiplier, as
  // DeepSeek's do); the query scale carries the rest (attention_scale).
  float mla_rope_magnitude = 1.0f;
  bool IsMla() const { return kv_lora_rank > 0; }
  // Values RoPE rotates in each query and key head: the rotated part under MLA, else head_dim.
  int RopeDim() const { return IsMla() ? mla_rope_dim : head_dim; }
  // Width of one query head as projected (before MLA's absorption) and of one head's output fed
  // to attn_output.
  int QueryHeadDim() const { return IsMla() ? mla_nope_dim + mla_rope_dim : head_dim; }
  int OutputHeadDim() const { return IsMla() ? mla_v_head_dim : head_dim; }
  // The widest FFN buffer a token needs: the dense FFN's, or a MoE layer's expert or shared expert.
  int MaxFfnWidth() const;

  // What architectures add to the common decoder (src/model/arch_*.cc set them; the forward
  // pass reads only these fields, never the architecture's name).
  float embedding_scale = 1.0f;  // gemma: token embeddings times sqrt(dim)
  FfnActivation ffn_activation = FfnActivation::kSilu;
  bool post_norms = false;       // gemma2/3: RMSNorm of the attention and FFN outputs before each residual add
  float attention_scale = 0.f;   // query scale; 0: 1/sqrt(head_dim)
  float attn_softcap = 0.f;      // gemma2: scores become cap * tanh(score / cap); 0: none
  float final_softcap = 0.f;     // gemma2: the same on the logits
  // Sliding-window layers (gemma2: every other layer; gemma3: five of every six): a query at
  // position p sees keys at positions p - sliding_window < pos <= p.
  int32_t sliding_window = 0;
  std::vector<uint8_t> sliding_layers;  // [n_layers] 1: a sliding-window layer; empty: none
  float rope_theta_sliding = 10000.0f;  // RoPE base of the sliding layers (gemma3: 10000)
  // gemma3: the sliding layers ignore the file's RoPE scaling (their own unscaled table, no YaRN
  // magnitude); gemma2's share the global layers' RoPE.
  bool sliding_rope_unscaled = false;
  // Magnitudes of the rotated q and k: scores scale by their square, which the attention scale
  // absorbs. rope_attn_factor: the file's rope.scaling.attn_factor (LongRoPE), every layer;
  // rope_mscale: YaRN's 1 + 0.1 ln(factor), the layers the scaling applies to.
  float rope_attn_factor = 1.0f;
  float rope_mscale = 1.0f;

  bool IsSliding(int layer) const {
    return !sliding_layers.empty() && sliding_layers[static_cast<size_t>(layer)] != 0;
  }
  // The attention window of a layer: sliding_window on a sliding layer, else 0 (unbounded).
  int32_t LayerWindow(int layer) const { return IsSliding(layer) ? sliding_window : 0; }
  int NumSlidingLayers() const;
  // A layer's attention-logit scale: attention_scale (or 1/sqrt(head_dim)) times the square of
  // the q/k magnitude factors that apply to it.
  float AttentionLogitScale(int layer) const;
  // Values a token stores per layer: K and V of every KV head, or MLA's one latent row.
  int64_t KvValuesPerToken() const {
    return IsMla() ? head_dim : 2 * static_cast<int64_t>(n_kv_heads) * head_dim;
  }
  // Bytes a dense cache holds for a sequence of n_tokens at bytes_per_value per K or V element,
  // laid out as llama.cpp lays it out: global layers every token, sliding layers their window.
  // The "% of dense" baseline, so that a sliding-window model is not flattered by comparing
  // against a full cache nobody uses.
  double DenseKvBytes(int64_t n_tokens, double bytes_per_value) const;
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [dim]
  WeightView wq, wk, wv, wo;         // [n_heads*head_dim, dim], [n_kv*hd, dim], [n_kv*hd, dim], [dim, n_heads*hd]
  const float* bq = nullptr;         // [n_heads*head_dim] (qwen2 only)
  const float* bk = nullptr;         // [n_kv_heads*head_dim]
  const float* bv = nullptr;         // [n_kv_heads*head_dim]
  const float* bo = nullptr;         // [dim] attn_output.bias (gpt-oss)
  // gpt-oss's attention sinks (attn_sinks [n_heads]): one learned logit per query head that
  // joins each row's softmax denominator and carries no value (AttentionShape::sinks).
  const float* attn_sinks = nullptr;
  const float* q_norm = nullptr;     // [head_dim] qwen3/gemma3: RMSNorm weight of every query head, before RoPE
  const float* k_norm = nullptr;     // [head_dim] the same for every key head
  const float* post_attn_norm = nullptr;  // [dim] gemma2/3: RMSNorm of the attention output
  const float* ffn_norm = nullptr;   // [dim]
  WeightView w_gate, w_up, w_down;   // [hidden, dim], [hidden, dim], [dim, hidden]
  const float* post_ffn_norm = nullptr;   // [dim] gemma2/3: RMSNorm of the FFN output
  // phi3's fused attn_qkv and ffn_up are bound as row ranges of the fused matrix: wq/wk/wv and
  // w_gate/w_up then point into one tensor, so the forward pass is the same.

  // MoE layers (ModelConfig::n_experts > 0) leave w_gate/w_up/w_down empty and bind these. Each
  // expert's matrices are a row range of the file's 3-D ffn_*_exps tensor
  // ([n_experts, expert_hidden, dim] and [n_experts, dim, expert_hidden]), so nothing is copied.
  WeightView router;                                  // ffn_gate_inp [n_experts, dim]
  std::vector<WeightView> expert_gate, expert_up;     // [n_experts] each [expert_hidden, dim]
  std::vector<WeightView> expert_down;                // [n_experts] each [dim, expert_hidden]
  WeightView shared_gate, shared_up, shared_down;     // qwen2moe's shared expert ([shared_hidden, dim] ...)
  const float* shared_expert_gate = nullptr;          // ffn_gate_inp_shexp [dim] (null: ungated, deepseek2)
  const float* expert_selection_bias = nullptr;       // exp_probs_b [n_experts]: added for the choice only
  // gpt-oss: the router's bias (ffn_gate_inp.bias [n_experts], added to its logits) and each
  // expert's biases on gate/up (ffn_{gate,up}_exps.bias [n_experts, expert_hidden]) and down
  // (ffn_down_exps.bias [n_experts, dim]), added right after each product. Null: none.
  const float* router_bias = nullptr;
  const float* expert_gate_bias = nullptr;
  const float* expert_up_bias = nullptr;
  const float* expert_down_bias = nullptr;

  // MLA layers (ModelConfig::IsMla): wq is attn_q [n_heads * (nope + rope), dim] or, with a
  // q_lora_rank, attn_q_b [n_heads * (nope + rope), q_lora_rank] after wq_a; wk is
  // attn_kv_a_mqa [kv_lora_rank + rope, dim]; wv stays empty; wo is [dim, n_heads * v_head_dim].
  WeightView wq_a;                       // attn_q_a [q_lora_rank, dim]
  const float* q_a_norm = nullptr;       // [q_lora_rank]
  const float* kv_a_norm = nullptr;      // [kv_lora_rank]
  std::vector<WeightView> k_b;           // [n_heads] each [kv_lora_rank, nope]: query nope -> latent
  std::vector<WeightView> v_b;           // [n_heads] each [v_head_dim, kv_lora_rank]: latent -> output
};

struct ModelLoadOptions {
  // Pack the matrices into kept panels (Model::KeptPanelBytes). Off for a caller that never
  // multiplies (kvsparse inspect): loading then maps the file and reads only metadata and norms.
  bool keep_panels = true;
};

class Model {
 public:
  // Detects the format from the file's magic: GGUF or a llama2.c checkpoint.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& path, const ModelLoadOptions& options = {});
  static StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path, const ModelLoadOptions& options = {});
  static StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  const GgufFile* gguf() const { return gguf_.get(); }  // null for llama2.c checkpoints

  WeightView token_embedding;            // [n_vocab, dim]
  std::vector<LayerWeights> layers;      // [n_layers]
  const float* output_norm = nullptr;    // [dim]
  WeightView output;                     // [n_vocab, dim] (== token_embedding when tied)
  std::vector<float> rope_inv_freq;      // [RopeDim()/2] global layers; includes rope_freqs / scaling
  std::vector<float> rope_inv_freq_sliding;  // [RopeDim()/2] sliding-window layers (empty: none)
  // LongRoPE (phi3): the short- and long-context tables; rope_inv_freq is one of them, chosen by
  // the context the model runs with (SetContextLength), as llama.cpp does. Empty: not LongRoPE.
  std::vector<float> rope_inv_freq_short, rope_inv_freq_long;
  int32_t long_rope_original_context = 0;  // rope.scaling.original_context_length

  // RoPE frequencies of one layer.
  const float* RopeInvFreq(int layer) const {
    return config_.IsSliding(layer) && !rope_inv_freq_sliding.empty() ? rope_inv_freq_sliding.data()
                                                                      : rope_inv_freq.data();
  }
  // The context length sequences will run with: LongRoPE files switch to their long factors
  // above the original context (llama.cpp chooses by n_ctx the same way). Loading assumes the
  // training context, as llama.cpp does by default.
  void SetContextLength(int32_t n_ctx);

  int64_t ParameterCount() const;
  size_t WeightBytes() const;  // bytes of all weight tensors as stored
  // Bytes one decode step must read: every matrix but the token embedding (one row of it is
  // looked up), and in MoE layers the router, the shared expert and n_experts_used of the
  // experts (the average over tokens when all experts are equally likely). Equals WeightBytes()
  // less the embedding for a dense model.
  size_t ActiveWeightBytesPerToken() const;
  // ParameterCount() with only n_experts_used of each MoE layer's experts: the weights one token
  // multiplies (its arithmetic). Equals ParameterCount() for a dense model.
  int64_t ActiveParameterCount() const;
  // Bytes of the matrices packed at load into the active kernel family's panel layout
  // (ops::PackPanels; today Q8_0 on avx512): their file pages are released, so these replace
  // them in memory. 0 when none were packed, with KVSPARSE_REPACK=0 in the environment, or when
  // loaded with ModelLoadOptions::keep_panels off.
  size_t KeptPanelBytes() const { return kept_panel_bytes_; }
  // "llama 1.10B q8_0" (the first layer's weight type), plus ", kept panels 1049 MiB" when
  // there are some: what benchmark reports name the model by.
  std::string Summary() const;

 private:
  Model() = default;
  std::string path_;
  ModelConfig config_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<std::vector<uint8_t>> owned_;  // llama2.c weights (f32)
  // Packs every matrix the active family keeps panels for (see KeptPanelBytes).
  void KeepPanels();
  std::vector<std::unique_ptr<void, void (*)(void*)>> kept_panels_;
  size_t kept_panel_bytes_ = 0;
  friend class ModelLoader;
};

}  // namespace kvsparse
