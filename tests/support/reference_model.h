// A deliberately plain float64 forward pass for llama / qwen2 GGUF models, written
// independently of Model/Engine: its own metadata parsing, weights dequantized once with
// ref::DequantizeRow into double matrices, RoPE written out from the formula for both
// styles, and attention as an explicit causal loop. Tests compare Engine logits to it.
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
    std::vector<double> bq, bk, bv;           // empty when absent
    std::vector<double> q_norm, k_norm;       // [head_dim] qwen3; empty when absent
  };

  ReferenceModel() = default;
  // y = W x (+ bias): x [cols] -> y [rows]
  static std::vector<double> Apply(const Matrix& m, const std::vector<double>& x,
                                   const std::vector<double>* bias = nullptr);
  std::vector<double> RmsNorm(const std::vector<double>& x, const std::vector<double>& weight) const;
  // RMSNorm of each head_dim slice of x [n_heads, head_dim], in place.
  void HeadNorm(std::vector<double>& x, int n_heads, const std::vector<double>& weight) const;
  void Rope(std::vector<double>& x, int n_heads, int pos) const;  // x [n_heads, head_dim]

  bool neox_rope_ = false;
  int n_vocab_ = 0, dim_ = 0, n_layers_ = 0, n_heads_ = 0, n_kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 1e-5;
  std::vector<double> freq_;  // [head_dim/2] rotation speed of pair i
  Matrix embedding_, output_;
  std::vector<double> output_norm_;
  std::vector<Layer> layers_;
};

}  // namespace kvsparse::testing
