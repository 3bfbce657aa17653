// A deliberately plain float64 forward pass for llama (with or without experts) / qwen2 / qwen3 /
// gemma2 / gemma3 / phi3 / qwen2moe / qwen3moe / olmoe / deepseek2 GGUF models, written
// independently of Model/Engine: its own metadata parsing, weights dequantized once with
// ref::DequantizeRow into double matrices, RoPE written out from the formula for both
// styles, and attention as an explicit causal loop (deepseek2's latent attention expanded to
// per-head keys and values, the form the engine never computes). Tests compare Engine logits to it.
// Only for tiny models (it holds every weight as double).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse::testing {

class ReferenceModel {
 public:
  static StatusOr<std::unique_ptr<ReferenceModel>> Load(const std::string& gguf_path);

  // Logits [tokens.size(), n_vocab] for tokens at positions 0 .. n-1.
  std::vector<double> Forward(const std::vector<int32_t>& tokens) const;
  int n_vocab() const { return n_vocab_; }

 private:
  struct Matrix {
    int64_t rows = 0, cols = 0;
    std::vector<double> w;  // [rows, cols]
  };
  struct Layer {
    std::vector<double> attn_norm, ffn_norm;  // [dim]
    Matrix wq, wk, wv, wo, gate, up, down;
    std::vector<double> bq, bk, bv, bo;       // empty when absent (bo: gpt-oss)
    std::vector<double> sinks;                // [n_heads] gpt-oss attention sinks; empty when absent
    // gpt-oss: the router's bias [n_experts] and each expert's gate/up [hidden] and down [dim] biases.
    std::vector<double> router_bias;
    std::vector<std::vector<double>> expert_gate_bias, expert_up_bias, expert_down_bias;  // [n_experts]
    std::vector<double> q_norm, k_norm;       // [head_dim] qwen3, gemma3; empty when absent
    std::vector<double> post_attn_norm, post_ffn_norm;  // [dim] gemma; empty when absent
    int window = 0;                           // sliding-window layer: keys with t - s < window; 0: all
    // Mixture of experts: router [n_experts, dim], each expert's gate/up/down; shared expert.
    Matrix router;
    std::vector<Matrix> expert_gate, expert_up, expert_down;  // [n_experts]
    Matrix shared_gate, shared_up, shared_down;
    std::vector<double> shared_expert_gate;   // [dim] qwen2moe; empty when absent
    std::vector<double> freq;                 // [head_dim/2] this layer's rotation speeds
    double rope_magnitude = 1.0;              // YaRN mscale / LongRoPE attn_factor on q and k
    std::vector<double> selection_bias;       // [n_experts] deepseek2 exp_probs_b; empty when absent
    // deepseek2: attn_q (or q_a, its norm, q_b), kv_a_mqa and its norm, and per head the
    // latent's key and value maps: k_nope = k_up[h] latent, v = v_up[h] latent.
    Matrix wq_a, wkv_a;
    std::vector<double> q_a_norm, kv_a_norm;
    std::vector<Matrix> k_up, v_up;           // [n_heads] [nope, rank], [v_head, rank]
    bool moe = false;                         // a MoE layer (deepseek2's leading layers are dense)
  };

  ReferenceModel() = default;
  // y = W x (+ bias): x [cols] -> y [rows]
  static std::vector<double> Apply(const Matrix& m, const std::vector<double>& x,
                                   const std::vector<double>* bias = nullptr);
  std::vector<double> RmsNorm(const std::vector<double>& x, const std::vector<double>& weight) const;
  // RMSNorm of each head_dim slice of x [n_heads, head_dim], in place.
  void HeadNorm(std::vector<double>& x, int n_heads, const std::vector<double>& weight) const;
  // x [n_heads, head_dim]: rotated by pos * freq[i], times `magnitude`.
  void Rope(std::vector<double>& x, int n_heads, int pos, const std::vector<double>& freq, double magnitude) const;

  // A gated SwiGLU/GeGLU FFN: down(act(gate h) * up h).
  std::vector<double> Ffn(const Matrix& gate, const Matrix& up, const Matrix& down, const std::vector<double>& h,
                          const std::vector<double>* gate_bias = nullptr, const std::vector<double>* up_bias = nullptr,
                          const std::vector<double>* down_bias = nullptr) const;
  std::vector<double> Moe(const Layer& L, const std::vector<double>& h) const;
  // deepseek2's attention of every token, expanded: outputs after attn_output [n][dim].
  std::vector<std::vector<double>> LatentAttention(const Layer& L, const std::vector<std::vector<double>>& x) const;

  int n_experts_ = 0, n_experts_used_ = 0;
  bool expert_weights_norm_ = false;
  bool sigmoid_gating_ = false;
  double expert_weights_scale_ = 1.0;
  bool mla_ = false;
  int kv_lora_rank_ = 0, mla_nope_ = 0, mla_v_head_ = 0;  // (head_dim_ is the rotated part under MLA)
  bool qk_norm_full_width_ = false;  // olmoe
  bool neox_rope_ = false;
  bool gelu_ = false;               // GeGLU (gemma) instead of SwiGLU
  bool gpt_oss_ = false;            // clamped SwiGLU, softmax over the chosen experts' logits
  double embedding_scale_ = 1.0;
  double query_scale_ = 0.0;        // scores = query_scale * q.k
  double attn_softcap_ = 0.0, final_softcap_ = 0.0;
  int n_vocab_ = 0, dim_ = 0, n_layers_ = 0, n_heads_ = 0, n_kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 1e-5;
  Matrix embedding_, output_;
  std::vector<double> output_norm_;
  std::vector<Layer> layers_;
};

// Logits [rows, vocab] against the reference's: the worst over rows of max_i |got_i - want_i| /
// max(1, max_i |want_i|).
double WorstRowError(const std::vector<float>& got, const std::vector<double>& want, size_t vocab);

}  // namespace kvsparse::testing
