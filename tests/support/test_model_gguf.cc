#include "support/test_model_gguf.h"

#include <cmath>
#include <random>

#include "kvsparse/ops.h"

namespace kvsparse::testing {

namespace {

// FNV-1a, so each tensor's values depend only on (seed, name), not on which others exist.
uint64_t NameHash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

class TinyGgufBuilder {
 public:
  explicit TinyGgufBuilder(const TinyModelSpec& spec) : spec_(spec) {}

  Status Write(const std::string& path) {
    const TinyModelSpec& s = spec_;
    const std::string p = s.arch + ".";
    w_.SetString("general.architecture", s.arch);
    w_.SetString("general.name", "kvsparse tiny test model");
    w_.SetU32(p + "context_length", static_cast<uint32_t>(s.context));
    w_.SetU32(p + "embedding_length", static_cast<uint32_t>(s.dim));
    w_.SetU32(p + "block_count", static_cast<uint32_t>(s.n_layers));
    w_.SetU32(p + "feed_forward_length", static_cast<uint32_t>(s.hidden_dim));
    w_.SetU32(p + "attention.head_count", static_cast<uint32_t>(s.n_heads));
    w_.SetU32(p + "attention.head_count_kv", static_cast<uint32_t>(s.n_kv_heads));
    w_.SetF32(p + "attention.layer_norm_rms_epsilon", s.rms_eps);
    if (s.rope_theta) w_.SetF32(p + "rope.freq_base", *s.rope_theta);
    if (s.head_dim > 0) {
      w_.SetU32(p + "attention.key_length", static_cast<uint32_t>(s.head_dim));
      w_.SetU32(p + "attention.value_length", static_cast<uint32_t>(s.head_dim));
    }
    if (s.extra_metadata) s.extra_metadata(w_);

    const int64_t head_dim = s.head_dim > 0 ? s.head_dim : s.dim / s.n_heads;
    const int64_t q_dim = s.n_heads * head_dim, kv_dim = s.n_kv_heads * head_dim;
    // Also the tied classifier: this range gives logits of standard deviation ~3 at dim 256.
    Matrix("token_embd.weight", s.n_vocab, s.dim, 0.35f);
    Norm("output_norm.weight");
    if (!s.tied_output) Matrix("output.weight", s.n_vocab, s.dim, 0.0f);
    if (s.rope_freqs) {
      // Llama 3.1 divides low frequencies by up to 8 and keeps high ones; random factors in [1, 8].
      Vector("rope_freqs.weight", head_dim / 2, 4.5f, 3.5f);
    }
    for (int l = 0; l < s.n_layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      Norm(b + "attn_norm.weight");
      Matrix(b + "attn_q.weight", q_dim, s.dim, 0.0f);
      Matrix(b + "attn_k.weight", kv_dim, s.dim, 0.0f);
      Matrix(b + "attn_v.weight", kv_dim, s.dim, 0.0f);
      Matrix(b + "attn_output.weight", s.dim, q_dim, 0.0f);
      if (s.qk_norm) {
        Vector(b + "attn_q_norm.weight", head_dim, 1.0f, 0.2f);
        Vector(b + "attn_k_norm.weight", head_dim, 1.0f, 0.2f);
      }
      if (s.qkv_bias) {
        Vector(b + "attn_q.bias", q_dim, 0.0f, 0.5f);
        Vector(b + "attn_k.bias", kv_dim, 0.0f, 0.5f);
        Vector(b + "attn_v.bias", kv_dim, 0.0f, 0.5f);
      }
      Norm(b + "ffn_norm.weight");
      Matrix(b + "ffn_gate.weight", s.hidden_dim, s.dim, 0.0f);
      Matrix(b + "ffn_up.weight", s.hidden_dim, s.dim, 0.0f);
      Matrix(b + "ffn_down.weight", s.dim, s.hidden_dim, 0.0f);
    }
    return w_.Write(path);
  }

 private:
  // rows x cols weights, uniform with variance 1/cols (keeps activations O(1)), or in
  // [-fixed_range, fixed_range] when fixed_range > 0.
  void Matrix(const std::string& name, int64_t rows, int64_t cols, float fixed_range) {
    const float range = fixed_range > 0 ? fixed_range : std::sqrt(3.0f / static_cast<float>(cols));
    std::vector<float> values = Random(name, rows * cols, 0.0f, range);
    Add(name, spec_.weight_type, {cols, rows}, values);
  }
  void Norm(const std::string& name) {
    Add(name, spec_.norm_type, {spec_.dim}, Random(name, spec_.dim, 1.0f, 0.2f));
  }
  void Vector(const std::string& name, int64_t n, float center, float range) {
    Add(name, DType::kF32, {n}, Random(name, n, center, range));
  }

  std::vector<float> Random(const std::string& name, int64_t n, float center, float range) const {
    std::mt19937_64 rng(spec_.seed ^ NameHash(name));
    std::uniform_real_distribution<float> dist(center - range, center + range);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng);
    return v;
  }

  void Add(const std::string& name, DType type, std::vector<int64_t> ne, const std::vector<float>& values) {
    if (name == spec_.omit_tensor) return;
    if (name == spec_.reshape_tensor) {
      int64_t n = 1;
      for (int64_t d : spec_.reshape_ne) n *= d;
      Store(name, DType::kF32, spec_.reshape_ne, Random(name, n, 0.0f, 1.0f));
      return;
    }
    if (name == spec_.retype_tensor) {
      // Random bytes of the requested type's size (0 for an unknown id, which Write rejects).
      int64_t n = 1;
      for (int64_t d : ne) n *= d;
      std::vector<uint8_t> raw(GgmlTypeBytes(spec_.retype_id, n).value_or(0));
      std::mt19937 rng(7);
      for (uint8_t& byte : raw) byte = static_cast<uint8_t>(rng());
      storage_.push_back(std::move(raw));
      w_.AddTensor(name, spec_.retype_id, std::move(ne), storage_.back().data());
      return;
    }
    Store(name, type, std::move(ne), values);
  }

  // Quantizes row by row (ne[0] is the row length) into an owned buffer that outlives Write.
  void Store(const std::string& name, DType type, std::vector<int64_t> ne, const std::vector<float>& values) {
    const int64_t cols = ne[0];
    const int64_t rows = static_cast<int64_t>(values.size()) / cols;
    const size_t row_bytes = DTypeRowBytes(type, cols);
    std::vector<uint8_t> bytes(row_bytes * static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      ref::QuantizeRow(type, &values[static_cast<size_t>(r * cols)], &bytes[static_cast<size_t>(r) * row_bytes], cols);
    }
    storage_.push_back(std::move(bytes));
    w_.AddTensor(name, type, std::move(ne), storage_.back().data());
  }

  const TinyModelSpec& spec_;
  GgufWriter w_;
  std::vector<std::vector<uint8_t>> storage_;  // tensor bytes, alive until Write
};

}  // namespace

Status WriteTinyModelGguf(const TinyModelSpec& spec, const std::string& path) {
  TinyGgufBuilder builder(spec);
  return builder.Write(path);
}

}  // namespace kvsparse::testing
