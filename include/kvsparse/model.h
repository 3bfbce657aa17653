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

enum class Arch { kLlama, kQwen2, kQwen3 };
std::string_view ArchName(Arch a);

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
  bool qk_norm = false;      // qwen3: RMSNorm of each query and key head before RoPE
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [dim]
  WeightView wq, wk, wv, wo;         // [n_heads*head_dim, dim], [n_kv*hd, dim], [n_kv*hd, dim], [dim, n_heads*hd]
  const float* bq = nullptr;         // [n_heads*head_dim] (qwen2 only)
  const float* bk = nullptr;         // [n_kv_heads*head_dim]
  const float* bv = nullptr;         // [n_kv_heads*head_dim]
  const float* q_norm = nullptr;     // [head_dim] qwen3: RMSNorm weight of every query head, before RoPE
  const float* k_norm = nullptr;     // [head_dim] the same for every key head
  const float* ffn_norm = nullptr;   // [dim]
  WeightView w_gate, w_up, w_down;   // [hidden, dim], [hidden, dim], [dim, hidden]
};

class Model {
 public:
  // Detects the format from the file's magic: GGUF or a llama2.c checkpoint.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& path);
  static StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path);
  static StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  const GgufFile* gguf() const { return gguf_.get(); }  // null for llama2.c checkpoints

  WeightView token_embedding;            // [n_vocab, dim]
  std::vector<LayerWeights> layers;      // [n_layers]
  const float* output_norm = nullptr;    // [dim]
  WeightView output;                     // [n_vocab, dim] (== token_embedding when tied)
  std::vector<float> rope_inv_freq;      // [head_dim/2], includes rope_freqs scaling when present

  int64_t ParameterCount() const;
  size_t WeightBytes() const;  // bytes of all weight tensors as stored

 private:
  Model() = default;
  std::string path_;
  ModelConfig config_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<std::vector<uint8_t>> owned_;  // llama2.c weights (f32)
  friend class ModelLoader;
};

}  // namespace kvsparse
