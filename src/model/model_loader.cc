// GGUF model loader, following llama.cpp's metadata keys and tensor names.
// Weights stay in the mapped file (WeightView points into it); only small vectors that
// are not f32 (or not float-aligned) are converted into buffers the Model owns.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <string>
#include <string_view>

#include "model/model_loader.h"

namespace kvsparse {

namespace {

std::string ShapeString(const std::vector<int64_t>& ne) { return fmt::format("[{}]", fmt::join(ne, ", ")); }

// True when `ne` equals `want`, ignoring trailing dimensions of size 1.
bool SameShape(const std::vector<int64_t>& ne, const std::vector<int64_t>& want) {
  const size_t n = std::max(ne.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    const int64_t a = i < ne.size() ? ne[i] : 1;
    const int64_t b = i < want.size() ? want[i] : 1;
    if (a != b) return false;
  }
  return true;
}

constexpr std::string_view kSupportedArchs = "llama (Llama 2/3, TinyLlama, Mistral), qwen2, qwen3";

}  // namespace

class GgufModelBuilder {
 public:
  static StatusOr<std::unique_ptr<Model>> Build(const std::string& path) {
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
    std::unique_ptr<Model> model = ModelLoader::NewModel(path);
    const GgufFile& f = *file;
    ModelLoader::SetGguf(*model, std::move(file));
    GgufModelBuilder builder(model.get(), f);
    KVS_RETURN_IF_ERROR(builder.ReadConfig());
    KVS_RETURN_IF_ERROR(builder.BindTensors());
    return model;
  }

 private:
  GgufModelBuilder(Model* model, const GgufFile& file)
      : model_(*model), file_(file), config_(ModelLoader::Config(*model)),
        source_(fmt::format("GGUF model '{}'", file.path())) {}

  // ---- metadata ----

  // A required positive count that fits an int.
  StatusOr<int> RequiredCount(const std::string& key) const {
    StatusOr<uint64_t> v = file_.GetUInt(key);
    if (!v.ok()) {
      if (v.status().code() == StatusCode::kNotFound) {
        return DataLossError(fmt::format("{}: required metadata key '{}' is missing", source_, key));
      }
      return v.status();  // GgufFile's messages name the path and key
    }
    if (*v == 0 || *v > static_cast<uint64_t>(INT32_MAX)) {
      return DataLossError(fmt::format("{}: metadata '{}' = {} is out of range [1, {}]", source_, key, *v, INT32_MAX));
    }
    return static_cast<int>(*v);
  }

  Status ReadConfig() {
    StatusOr<std::string_view> arch_name = file_.GetString("general.architecture");
    if (!arch_name.ok()) {
      if (arch_name.status().code() == StatusCode::kNotFound) {
        return DataLossError(
            fmt::format("{}: metadata key 'general.architecture' is missing (not a model file? supported: {})",
                        source_, kSupportedArchs));
      }
      return arch_name.status();
    }
    const std::string arch(*arch_name);
    if (arch == "llama") {
      config_.arch = Arch::kLlama;
      config_.rope_style = RopeStyle::kAdjacentPairs;
    } else if (arch == "qwen2") {
      config_.arch = Arch::kQwen2;
      config_.rope_style = RopeStyle::kNeox;
    } else if (arch == "qwen3") {
      config_.arch = Arch::kQwen3;
      config_.rope_style = RopeStyle::kNeox;
      config_.qk_norm = true;
    } else {
      return UnimplementedError(
          fmt::format("{}: unsupported architecture '{}' (general.architecture); supported: {}", source_, arch,
                      kSupportedArchs));
    }
    const std::string p = arch + ".";
    KVS_ASSIGN_OR_RETURN(config_.max_context, RequiredCount(p + "context_length"));
    KVS_ASSIGN_OR_RETURN(config_.dim, RequiredCount(p + "embedding_length"));
    KVS_ASSIGN_OR_RETURN(config_.n_layers, RequiredCount(p + "block_count"));
    KVS_ASSIGN_OR_RETURN(config_.hidden_dim, RequiredCount(p + "feed_forward_length"));
    KVS_ASSIGN_OR_RETURN(config_.n_heads, RequiredCount(p + "attention.head_count"));
    if (file_.Find(p + "attention.head_count_kv") != nullptr) {
      KVS_ASSIGN_OR_RETURN(config_.n_kv_heads, RequiredCount(p + "attention.head_count_kv"));
    } else {
      config_.n_kv_heads = config_.n_heads;
    }
    StatusOr<double> eps = file_.GetFloat(p + "attention.layer_norm_rms_epsilon");
    if (!eps.ok()) {
      if (eps.status().code() == StatusCode::kNotFound) {
        return DataLossError(
            fmt::format("{}: required metadata key '{}attention.layer_norm_rms_epsilon' is missing", source_, p));
      }
      return eps.status();
    }
    config_.rms_eps = static_cast<float>(*eps);
    StatusOr<double> theta = file_.GetFloatOr(p + "rope.freq_base", 10000.0);
    if (!theta.ok()) return theta.status();
    config_.rope_theta = static_cast<float>(*theta);
    // Head size: attention.key_length where present (Qwen3, Gemma: n_heads * head_dim != dim),
    // else embedding_length / head_count. V must have the same size (value_length).
    if (file_.Find(p + "attention.key_length") != nullptr) {
      KVS_ASSIGN_OR_RETURN(config_.head_dim, RequiredCount(p + "attention.key_length"));
    } else if (config_.dim % config_.n_heads == 0) {
      config_.head_dim = config_.dim / config_.n_heads;
    } else {
      return DataLossError(fmt::format("{}: embedding_length {} is not a multiple of head_count {} and '{}attention."
                                       "key_length' is missing, so the head size is unknown",
                                       source_, config_.dim, config_.n_heads, p));
    }

    // n_vocab comes from the embedding's shape; everything else is validated against the config.
    // Checking ne[0] here also bounds dim by the file's size before anything is sized by it.
    const GgufTensorInfo* embd = file_.FindTensor("token_embd.weight");
    if (embd == nullptr) return MissingTensor("token_embd.weight");
    if (embd->ne.size() < 2 || embd->ne[0] != config_.dim || embd->ne[1] > INT32_MAX) {
      return DataLossError(fmt::format("{}: tensor 'token_embd.weight' has shape {}, expected [{} ({}embedding_length), "
                                       "n_vocab]",
                                       source_, ShapeString(embd->ne), config_.dim, p));
    }
    config_.n_vocab = static_cast<int>(embd->ne[1]);
    KVS_RETURN_IF_ERROR(ValidateModelConfig(config_, source_));

    // Features we do not implement must fail loudly rather than compute garbage.
    if (file_.Find(p + "attention.value_length") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const int value_length, RequiredCount(p + "attention.value_length"));
      if (value_length != config_.head_dim) {
        return UnimplementedError(fmt::format("{}: '{}attention.value_length' = {} differs from the key head size {}; "
                                              "different K and V head sizes are not supported",
                                              source_, p, value_length, config_.head_dim));
      }
    }
    if (file_.Find(p + "rope.dimension_count") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const int rope_dims, RequiredCount(p + "rope.dimension_count"));
      if (rope_dims != config_.head_dim) {
        return UnimplementedError(fmt::format("{}: '{}rope.dimension_count' = {} but head_dim = {}; partial RoPE is "
                                              "not supported",
                                              source_, p, rope_dims, config_.head_dim));
      }
    }
    KVS_RETURN_IF_ERROR(CheckTokenizerSize());

    model_.rope_inv_freq = ModelLoader::RopeInvFreq(config_.head_dim, config_.rope_theta);
    return ApplyRopeScaling(p);
  }

  // Linear scaling divides every frequency; Llama 3.1's rope_freqs divides each separately.
  Status ApplyRopeScaling(const std::string& p) {
    float linear_factor = 1.0f;
    if (file_.Find(p + "rope.scaling.type") != nullptr) {
      KVS_ASSIGN_OR_RETURN(std::string_view name, file_.GetString(p + "rope.scaling.type"));
      if (name == "linear") {
        KVS_ASSIGN_OR_RETURN(const double factor, file_.GetFloatOr(p + "rope.scaling.factor", 1.0));
        linear_factor = static_cast<float>(factor);
      } else if (name != "none") {
        return UnimplementedError(fmt::format("{}: RoPE scaling type '{}' ({}rope.scaling.type) is not supported; "
                                              "supported: none, linear, rope_freqs.weight (Llama 3.1)",
                                              source_, name, p));
      }
    } else if (file_.Find(p + "rope.scale_linear") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const double factor, file_.GetFloat(p + "rope.scale_linear"));
      linear_factor = static_cast<float>(factor);
    }
    if (!(linear_factor > 0.f) || !std::isfinite(linear_factor)) {
      return DataLossError(fmt::format("{}: RoPE linear scaling factor must be positive, found {}", source_,
                                       linear_factor));
    }
    for (float& f : model_.rope_inv_freq) f /= linear_factor;

    if (file_.FindTensor("rope_freqs.weight") != nullptr) {
      const int64_t n = config_.head_dim / 2;
      KVS_ASSIGN_OR_RETURN(const float* factors, Vector("rope_freqs.weight", n));
      for (int64_t i = 0; i < n; ++i) {
        if (!(factors[i] > 0.f) || !std::isfinite(factors[i])) {
          return DataLossError(fmt::format("{}: tensor 'rope_freqs.weight' element {} is {}; factors must be "
                                           "positive and finite",
                                           source_, i, factors[i]));
        }
        model_.rope_inv_freq[i] /= factors[i];
      }
    }
    return Status::Ok();
  }

  Status CheckTokenizerSize() const {
    const GgufValue* tokens = file_.Find("tokenizer.ggml.tokens");
    if (tokens == nullptr || tokens->type != GgufType::kArray) return Status::Ok();
    if (tokens->count != static_cast<uint64_t>(config_.n_vocab)) {
      return DataLossError(fmt::format("{}: the tokenizer has {} tokens (tokenizer.ggml.tokens) but "
                                       "token_embd.weight has {} rows",
                                       source_, tokens->count, config_.n_vocab));
    }
    return Status::Ok();
  }

  // ---- tensors ----

  Status MissingTensor(const std::string& name) const {
    return NotFoundError(fmt::format("{}: required tensor '{}' is missing{}", source_, name,
                                     file_.tensors().empty() ? " (the file has no tensors: a vocab-only GGUF?)" : ""));
  }

  // Looks up `name` and checks it has a type kvsparse computes with and exactly shape `ne`.
  StatusOr<const GgufTensorInfo*> Tensor(const std::string& name, const std::vector<int64_t>& ne) const {
    const GgufTensorInfo* t = file_.FindTensor(name);
    if (t == nullptr) return MissingTensor(name);
    if (!t->type.has_value() || !IsSupportedWeightType(*t->type)) {
      return UnimplementedError(fmt::format("{}: tensor '{}' has type {} (ggml type id {}), which kvsparse cannot "
                                            "compute with; supported: {}",
                                            source_, name, GgmlTypeName(t->ggml_type), t->ggml_type,
                                            SupportedWeightTypeNames()));
    }
    if (!SameShape(t->ne, ne)) {
      return DataLossError(fmt::format("{}: tensor '{}' has shape {}, expected {}", source_, name,
                                       ShapeString(t->ne), ShapeString(ne)));
    }
    const size_t want_bytes = DTypeRowBytes(*t->type, ne[0]) * static_cast<size_t>(t->NumElements() / ne[0]);
    if (ne[0] % DTypeBlockSize(*t->type) != 0 || t->data == nullptr || t->nbytes != want_bytes) {
      return DataLossError(fmt::format("{}: tensor '{}' of type {} and shape {} has unusable data ({} bytes; rows "
                                       "must be whole {}-element blocks)",
                                       source_, name, DTypeName(*t->type), ShapeString(t->ne), t->nbytes,
                                       DTypeBlockSize(*t->type)));
    }
    return t;
  }

  // Matrix [rows, cols] stored as GGUF ne = [cols, rows].
  StatusOr<WeightView> Matrix(const std::string& name, int64_t rows, int64_t cols) const {
    KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(name, {cols, rows}));
    return WeightView{*t->type, t->data, rows, cols};
  }

  // f32 vector of n elements; other float types (and misaligned f32) are converted into an owned copy.
  StatusOr<const float*> Vector(const std::string& name, int64_t n) {
    KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(name, {n}));
    const bool aligned = reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0;
    if (*t->type == DType::kF32 && aligned) return static_cast<const float*>(t->data);
    std::vector<uint8_t> owned(static_cast<size_t>(n) * sizeof(float));
    if (*t->type == DType::kF32) {
      std::memcpy(owned.data(), t->data, owned.size());
    } else {
      ops::DequantizeRow(*t->type, t->data, reinterpret_cast<float*>(owned.data()), n);
    }
    return reinterpret_cast<const float*>(ModelLoader::Own(model_, std::move(owned)));
  }

  Status BindTensors() {
    const int64_t dim = config_.dim, hidden = config_.hidden_dim, n_vocab = config_.n_vocab;
    const int64_t q_dim = static_cast<int64_t>(config_.n_heads) * config_.head_dim;
    const int64_t kv_dim = static_cast<int64_t>(config_.n_kv_heads) * config_.head_dim;
    KVS_ASSIGN_OR_RETURN(model_.token_embedding, Matrix("token_embd.weight", n_vocab, dim));
    KVS_ASSIGN_OR_RETURN(model_.output_norm, Vector("output_norm.weight", dim));
    config_.tied_output = file_.FindTensor("output.weight") == nullptr;
    if (config_.tied_output) {
      model_.output = model_.token_embedding;
    } else {
      KVS_ASSIGN_OR_RETURN(model_.output, Matrix("output.weight", n_vocab, dim));
    }
    // qwen2 always has Q/K/V biases; llama-architecture files may carry them too.
    const bool biases_required = config_.arch == Arch::kQwen2;
    // Layers are added as their tensors are found, so a hostile block_count fails at the
    // first missing tensor instead of allocating n_layers entries up front.
    model_.layers.clear();
    for (int i = 0; i < config_.n_layers; ++i) {
      LayerWeights& l = model_.layers.emplace_back();
      const std::string b = fmt::format("blk.{}.", i);
      KVS_ASSIGN_OR_RETURN(l.attn_norm, Vector(b + "attn_norm.weight", dim));
      KVS_ASSIGN_OR_RETURN(l.wq, Matrix(b + "attn_q.weight", q_dim, dim));
      KVS_ASSIGN_OR_RETURN(l.wk, Matrix(b + "attn_k.weight", kv_dim, dim));
      KVS_ASSIGN_OR_RETURN(l.wv, Matrix(b + "attn_v.weight", kv_dim, dim));
      KVS_ASSIGN_OR_RETURN(l.wo, Matrix(b + "attn_output.weight", dim, q_dim));
      if (config_.qk_norm) {
        KVS_ASSIGN_OR_RETURN(l.q_norm, Vector(b + "attn_q_norm.weight", config_.head_dim));
        KVS_ASSIGN_OR_RETURN(l.k_norm, Vector(b + "attn_k_norm.weight", config_.head_dim));
      }
      KVS_ASSIGN_OR_RETURN(l.ffn_norm, Vector(b + "ffn_norm.weight", dim));
      KVS_ASSIGN_OR_RETURN(l.w_gate, Matrix(b + "ffn_gate.weight", hidden, dim));
      KVS_ASSIGN_OR_RETURN(l.w_up, Matrix(b + "ffn_up.weight", hidden, dim));
      KVS_ASSIGN_OR_RETURN(l.w_down, Matrix(b + "ffn_down.weight", dim, hidden));
      struct Bias {
        const char* name;
        int64_t n;
        const float** dst;
      };
      for (const Bias& bias : {Bias{"attn_q.bias", q_dim, &l.bq}, Bias{"attn_k.bias", kv_dim, &l.bk},
                               Bias{"attn_v.bias", kv_dim, &l.bv}}) {
        if (!biases_required && file_.FindTensor(b + bias.name) == nullptr) continue;
        KVS_ASSIGN_OR_RETURN(*bias.dst, Vector(b + bias.name, bias.n));
      }
    }
    return Status::Ok();
  }

  Model& model_;
  const GgufFile& file_;
  ModelConfig& config_;
  std::string source_;
};

StatusOr<std::unique_ptr<Model>> ModelLoader::FromGguf(const std::string& path) {
  return GgufModelBuilder::Build(path);
}

}  // namespace kvsparse
