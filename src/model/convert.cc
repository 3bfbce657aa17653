#include "kvsparse/convert.h"

#include <fmt/format.h>

#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/model.h"
#include "kvsparse/ops.h"

namespace kvsparse {
namespace {

// Re-encodes an f32 matrix [rows, cols] into `type`, row by row.
GgufWriter::Filler EncodeRows(WeightView w, DType type) {
  return [w, type](void* dst, size_t nbytes) {
    const size_t out_row = DTypeRowBytes(type, w.cols);
    KVS_CHECK(out_row * w.rows == nbytes);
    const size_t in_row = DTypeRowBytes(w.type, w.cols);
    std::vector<float> row(w.cols);  // [cols]
    for (int64_t r = 0; r < w.rows; ++r) {
      ops::DequantizeRow(w.type, static_cast<const uint8_t*>(w.data) + r * in_row, row.data(), w.cols);
      ops::QuantizeRow(type, row.data(), static_cast<uint8_t*>(dst) + r * out_row, w.cols);
    }
  };
}

}  // namespace

Status ConvertLlama2cToGguf(const std::string& in_path, const std::string& out_path, const ConvertOptions& options) {
  if (!IsSupportedWeightType(options.weight_type)) {
    return InvalidArgumentError(fmt::format("convert {}: weight type {} (ggml type id {}) is not one of {}", in_path,
                                            DTypeName(options.weight_type),
                                            static_cast<uint32_t>(options.weight_type), SupportedWeightTypeNames()));
  }
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::LoadLlama2c(in_path));
  const ModelConfig& c = model->config();
  const int64_t block = DTypeBlockSize(options.weight_type);
  if (c.dim % block != 0 || c.hidden_dim % block != 0) {
    return InvalidArgumentError(fmt::format(
        "convert {}: weight type {} needs row lengths divisible by {}, but dim={} hidden_dim={}; use f32, f16 or q8_0",
        in_path, DTypeName(options.weight_type), block, c.dim, c.hidden_dim));
  }

  GgufWriter w;
  const std::string arch = "llama";
  w.SetString("general.architecture", arch);
  w.SetString("general.name", "llama2.c checkpoint " + in_path);
  w.SetU32("general.alignment", 32);
  w.SetU32(arch + ".context_length", c.max_context);
  w.SetU32(arch + ".embedding_length", c.dim);
  w.SetU32(arch + ".block_count", c.n_layers);
  w.SetU32(arch + ".feed_forward_length", c.hidden_dim);
  w.SetU32(arch + ".attention.head_count", c.n_heads);
  w.SetU32(arch + ".attention.head_count_kv", c.n_kv_heads);
  w.SetF32(arch + ".attention.layer_norm_rms_epsilon", c.rms_eps);
  w.SetF32(arch + ".rope.freq_base", c.rope_theta);
  w.SetU32(arch + ".rope.dimension_count", c.head_dim);
  w.SetU32(arch + ".vocab_size", c.n_vocab);

  if (!options.vocab_gguf.empty()) {
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> vocab, GgufFile::Open(options.vocab_gguf));
    KVS_ASSIGN_OR_RETURN(const std::vector<std::string_view>* tokens, vocab->GetStringArray("tokenizer.ggml.tokens"));
    if (static_cast<int64_t>(tokens->size()) != c.n_vocab) {
      return InvalidArgumentError(fmt::format("convert: vocab {} has {} tokens but model {} has n_vocab={}",
                                              options.vocab_gguf, tokens->size(), in_path, c.n_vocab));
    }
    // SetValue copies each key with its type and bytes unchanged (the writer owns the copy).
    for (const auto& [key, value] : vocab->metadata()) {
      if (key.rfind("tokenizer.", 0) == 0) w.SetValue(key, value);
    }
  }

  auto add_matrix = [&](const std::string& name, const WeightView& v) {
    w.AddTensor(name, options.weight_type, {v.cols, v.rows}, EncodeRows(v, options.weight_type));
  };
  auto add_vector = [&](const std::string& name, const float* data, int64_t n) {
    w.AddTensor(name, DType::kF32, {n}, data);
  };

  add_matrix("token_embd.weight", model->token_embedding);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = model->layers[l];
    const std::string p = fmt::format("blk.{}.", l);
    add_vector(p + "attn_norm.weight", L.attn_norm, c.dim);
    add_matrix(p + "attn_q.weight", L.wq);
    add_matrix(p + "attn_k.weight", L.wk);
    add_matrix(p + "attn_v.weight", L.wv);
    add_matrix(p + "attn_output.weight", L.wo);
    add_vector(p + "ffn_norm.weight", L.ffn_norm, c.dim);
    add_matrix(p + "ffn_gate.weight", L.w_gate);
    add_matrix(p + "ffn_up.weight", L.w_up);
    add_matrix(p + "ffn_down.weight", L.w_down);
  }
  add_vector("output_norm.weight", model->output_norm, c.dim);
  if (!c.tied_output) add_matrix("output.weight", model->output);
  return w.Write(out_path);
}

}  // namespace kvsparse
