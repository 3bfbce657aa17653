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

#include "model/arch.h"
#include "model/model_loader.h"
#include "model/rope_scaling.h"

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

}  // namespace

class GgufModelBuilder {
 public:
  static StatusOr<std::unique_ptr<Model>> Build(const std::string& path, const ModelLoadOptions& options) {
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
    std::unique_ptr<Model> model = ModelLoader::NewModel(path);
    const GgufFile& f = *file;
    ModelLoader::SetGguf(*model, std::move(file));
    GgufModelBuilder builder(model.get(), f);
    KVS_RETURN_IF_ERROR(builder.ReadConfig());
    KVS_RETURN_IF_ERROR(builder.BindTensors());
    if (options.keep_panels) ModelLoader::KeepPanels(*model);
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
                        source_, SupportedArchNames()));
      }
      return arch_name.status();
    }
    const std::string arch(*arch_name);
    spec_ = FindArchSpec(arch);
    if (spec_ == nullptr) {
      return UnimplementedError(fmt::format("{}: unsupported architecture '{}' (general.architecture); supported: {}",
                                            source_, arch, SupportedArchNames()));
    }
    config_.arch = spec_->arch;
    config_.rope_style = spec_->rope_style;
    config_.qk_norm = spec_->qk_norm;
    config_.qk_norm_full_width = spec_->qk_norm_full_width;
    config_.post_norms = spec_->post_norms;
    config_.ffn_activation = spec_->ffn_activation;
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
    // Every layer has tensors of its own: a block_count beyond the file's tensors is hostile, and
    // must fail before anything (the sliding-layer pattern) is sized by it.
    if (static_cast<uint64_t>(config_.n_layers) > file_.tensors().size()) {
      return DataLossError(fmt::format("{}: '{}block_count' = {} but the file holds only {} tensors", source_, p,
                                       config_.n_layers, file_.tensors().size()));
    }
    if (spec_->scale_embeddings) config_.embedding_scale = std::sqrt(static_cast<float>(config_.dim));
    KVS_RETURN_IF_ERROR(ReadExperts(p));
    if (spec_->read_config != nullptr) {
      KVS_RETURN_IF_ERROR(spec_->read_config(ArchKeys(file_, p, source_), &config_));
    }

    // Features we do not implement must fail loudly rather than compute garbage. (MLA's hook
    // checked its own key and value sizes and its partial RoPE.)
    if (!config_.IsMla() && file_.Find(p + "attention.value_length") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const int value_length, RequiredCount(p + "attention.value_length"));
      if (value_length != config_.head_dim) {
        return UnimplementedError(fmt::format("{}: '{}attention.value_length' = {} differs from the key head size {}; "
                                              "different K and V head sizes are not supported",
                                              source_, p, value_length, config_.head_dim));
      }
    }
    if (!config_.IsMla() && file_.Find(p + "rope.dimension_count") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const int rope_dims, RequiredCount(p + "rope.dimension_count"));
      if (rope_dims != config_.head_dim) {
        return UnimplementedError(fmt::format("{}: '{}rope.dimension_count' = {} but head_dim = {}; partial RoPE is "
                                              "not supported",
                                              source_, p, rope_dims, config_.head_dim));
      }
    }
    KVS_RETURN_IF_ERROR(CheckTokenizerSize());

    model_.rope_inv_freq = RopeInvFreq(config_.RopeDim(), config_.rope_theta);
    KVS_RETURN_IF_ERROR(ApplyRopeScaling(p));
    if (!config_.sliding_layers.empty() &&
        (config_.sliding_rope_unscaled || config_.rope_theta_sliding != config_.rope_theta)) {
      // Sliding layers with their own base; gemma3's without the file's context scaling (llama.cpp's
      // freq_scale_swa = 1). (A gemma2 file with its own freq_base_swa: also unscaled here.)
      if (!(config_.rope_theta_sliding > 0.f)) {
        return DataLossError(fmt::format("{}: the sliding layers' RoPE base ('{}rope.freq_base_swa') must be "
                                         "positive, found {}",
                                         source_, p, config_.rope_theta_sliding));
      }
      model_.rope_inv_freq_sliding = RopeInvFreq(config_.RopeDim(), config_.rope_theta_sliding);
    }
    return Status::Ok();
  }

  // An optional count: absent gives `dflt`; present must be a positive int ("<p>key").
  StatusOr<int> OptionalCount(const std::string& key, int dflt) const {
    const GgufValue* v = file_.Find(key);
    if (v == nullptr) return dflt;
    if (v->type == GgufType::kArray) {
      return UnimplementedError(fmt::format("{}: metadata '{}' is an array (a value per layer); kvsparse reads one "
                                            "value for every layer",
                                            source_, key));
    }
    return RequiredCount(key);
  }

  // The mixture-of-experts keys (llama.cpp's names): expert_count, expert_used_count,
  // expert_feed_forward_length, expert_shared_feed_forward_length.
  Status ReadExperts(const std::string& p) {
    const bool has_count = file_.Find(p + "expert_count") != nullptr;
    if (!has_count && !spec_->experts_required) {
      if (file_.FindTensor("blk.0.ffn_gate_inp.weight") != nullptr) {
        return DataLossError(fmt::format("{}: the file has expert tensors (blk.0.ffn_gate_inp.weight) but no '{}"
                                         "expert_count'",
                                         source_, p));
      }
      return Status::Ok();
    }
    if (!has_count) {
      return DataLossError(fmt::format("{}: required metadata key '{}expert_count' is missing ({} is a mixture of "
                                       "experts)",
                                       source_, p, spec_->gguf_name));
    }
    KVS_ASSIGN_OR_RETURN(const uint64_t count, file_.GetUInt(p + "expert_count"));
    if (count == 0 && !spec_->experts_required) return Status::Ok();  // converters write 0 for dense llama files
    // Real models have 8 to 384 experts; the bound keeps a hostile count from sizing tables.
    constexpr uint64_t kMaxExperts = 4096;
    if (count == 0 || count > kMaxExperts) {
      return DataLossError(fmt::format("{}: metadata '{}expert_count' = {} is out of range [1, {}]", source_, p, count,
                                       kMaxExperts));
    }
    config_.n_experts = static_cast<int>(count);
    KVS_ASSIGN_OR_RETURN(config_.n_experts_used, RequiredCount(p + "expert_used_count"));
    if (config_.n_experts_used > config_.n_experts) {
      return DataLossError(fmt::format("{}: metadata '{}expert_used_count' = {} exceeds '{}expert_count' = {}", source_,
                                       p, config_.n_experts_used, p, config_.n_experts));
    }
    // llama.cpp: the experts' width defaults to feed_forward_length (olmoe, Mixtral write only that).
    KVS_ASSIGN_OR_RETURN(config_.expert_hidden_dim, OptionalCount(p + "expert_feed_forward_length", config_.hidden_dim));
    config_.expert_weights_norm = spec_->expert_weights_norm;
    if (spec_->shared_expert) {
      KVS_ASSIGN_OR_RETURN(config_.shared_expert_hidden_dim,
                           OptionalCount(p + "expert_shared_feed_forward_length", config_.hidden_dim));
    }
    return Status::Ok();
  }

  // A per-frequency factor table [RopeDim()/2] (rope_freqs, rope_factors_short/long), checked.
  StatusOr<const float*> RopeFactors(const std::string& name) {
    const int64_t n = config_.RopeDim() / 2;
    KVS_ASSIGN_OR_RETURN(const float* factors, Vector(name, n));
    for (int64_t i = 0; i < n; ++i) {
      if (!(factors[i] > 0.f) || !std::isfinite(factors[i])) {
        return DataLossError(fmt::format("{}: tensor '{}' element {} is {}; factors must be positive and finite",
                                         source_, name, i, factors[i]));
      }
    }
    return factors;
  }

  // RoPE context extension, as llama.cpp applies it:
  // - rope.scaling.type linear: every frequency divided by the factor;
  // - yarn: ApplyYarn (rope_scaling.h), with its magnitude factor;
  // - rope_freqs.weight (Llama 3.1): each frequency divided by its own factor;
  // - rope_factors_short/long.weight (Phi-3 LongRoPE): the same with one of two tables, chosen
  //   by the context (Model::SetContextLength), and rope.scaling.attn_factor on q and k.
  Status ApplyRopeScaling(const std::string& p) {
    std::string type = "none";
    float factor = 1.0f;
    if (file_.Find(p + "rope.scaling.type") != nullptr) {
      KVS_ASSIGN_OR_RETURN(std::string_view name, file_.GetString(p + "rope.scaling.type"));
      type = std::string(name);
      if (type != "none" && type != "linear" && type != "yarn") {
        return UnimplementedError(fmt::format("{}: RoPE scaling type '{}' ({}rope.scaling.type) is not supported; "
                                              "supported: none, linear, yarn, rope_freqs.weight (Llama 3.1), "
                                              "rope_factors_short/long.weight (Phi-3 LongRoPE)",
                                              source_, type, p));
      }
      if (type != "none") {
        KVS_ASSIGN_OR_RETURN(const double f, file_.GetFloatOr(p + "rope.scaling.factor", 1.0));
        factor = static_cast<float>(f);
      }
    } else if (file_.Find(p + "rope.scale_linear") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const double f, file_.GetFloat(p + "rope.scale_linear"));
      type = "linear";
      factor = static_cast<float>(f);
    }
    if (!(factor > 0.f) || !std::isfinite(factor) || factor > 1e6f) {
      return DataLossError(fmt::format("{}: RoPE scaling factor ({}rope.scaling.factor) must be in (0, 1e6], found {}",
                                       source_, p, factor));
    }
    KVS_ASSIGN_OR_RETURN(const double attn_factor, file_.GetFloatOr(p + "rope.scaling.attn_factor", 1.0));
    if (!(attn_factor > 0.0) || !std::isfinite(attn_factor) || attn_factor > 100.0) {
      return DataLossError(fmt::format("{}: '{}rope.scaling.attn_factor' must be in (0, 100], found {}", source_, p,
                                       attn_factor));
    }
    config_.rope_attn_factor = static_cast<float>(attn_factor);
    KVS_ASSIGN_OR_RETURN(const uint64_t original_context,
                         file_.GetUIntOr(p + "rope.scaling.original_context_length",
                                         static_cast<uint64_t>(config_.max_context)));
    if (original_context == 0 || original_context > static_cast<uint64_t>(INT32_MAX)) {
      return DataLossError(fmt::format("{}: '{}rope.scaling.original_context_length' = {} is out of range", source_,
                                       p, original_context));
    }

    auto divide = [](std::vector<float>* inv_freq, const float* factors) {
      for (size_t i = 0; i < inv_freq->size(); ++i) (*inv_freq)[i] /= factors[i];
    };
    if (file_.FindTensor("rope_freqs.weight") != nullptr) {
      KVS_ASSIGN_OR_RETURN(const float* factors, RopeFactors("rope_freqs.weight"));
      divide(&model_.rope_inv_freq, factors);
    }
    const bool long_rope = file_.FindTensor("rope_factors_long.weight") != nullptr ||
                           file_.FindTensor("rope_factors_short.weight") != nullptr;
    if (long_rope) {
      KVS_ASSIGN_OR_RETURN(const float* short_factors, RopeFactors("rope_factors_short.weight"));
      KVS_ASSIGN_OR_RETURN(const float* long_factors, RopeFactors("rope_factors_long.weight"));
      model_.rope_inv_freq_short = model_.rope_inv_freq;
      model_.rope_inv_freq_long = model_.rope_inv_freq;
      divide(&model_.rope_inv_freq_short, short_factors);
      divide(&model_.rope_inv_freq_long, long_factors);
      model_.long_rope_original_context = static_cast<int32_t>(original_context);
    }

    if (type == "linear") {
      for (float& f : model_.rope_inv_freq) f /= factor;
      for (float& f : model_.rope_inv_freq_short) f /= factor;
      for (float& f : model_.rope_inv_freq_long) f /= factor;
    } else if (type == "yarn") {
      YarnParams yarn;
      yarn.factor = factor;
      yarn.original_context = static_cast<int32_t>(original_context);
      yarn.theta = config_.rope_theta;
      KVS_ASSIGN_OR_RETURN(const double beta_fast, file_.GetFloatOr(p + "rope.scaling.yarn_beta_fast", 32.0));
      KVS_ASSIGN_OR_RETURN(const double beta_slow, file_.GetFloatOr(p + "rope.scaling.yarn_beta_slow", 1.0));
      KVS_ASSIGN_OR_RETURN(const double log_mul, file_.GetFloatOr(p + "rope.scaling.yarn_log_multiplier", 0.0));
      if (!(beta_fast > 0.0) || !(beta_slow > 0.0) || !std::isfinite(beta_fast) || !std::isfinite(beta_slow) ||
          !std::isfinite(log_mul)) {
        return DataLossError(fmt::format("{}: YaRN's beta_fast / beta_slow must be positive and finite, found {} / {}",
                                         source_, beta_fast, beta_slow));
      }
      yarn.beta_fast = static_cast<float>(beta_fast);
      yarn.beta_slow = static_cast<float>(beta_slow);
      yarn.log_multiplier = static_cast<float>(log_mul);
      float mscale = ApplyYarn(yarn, config_.RopeDim(), &model_.rope_inv_freq);
      if (long_rope) {
        ApplyYarn(yarn, config_.RopeDim(), &model_.rope_inv_freq_short);
        mscale = ApplyYarn(yarn, config_.RopeDim(), &model_.rope_inv_freq_long);
      }
      config_.rope_mscale = mscale;
    }
    if (config_.IsMla()) {
      KVS_ASSIGN_OR_RETURN(const double log_mul, file_.GetFloatOr(p + "rope.scaling.yarn_log_multiplier", 0.0));
      SetMlaScales(type, factor, static_cast<float>(attn_factor), static_cast<float>(log_mul));
    }
    if (long_rope) model_.SetContextLength(config_.max_context);  // llama.cpp's default: the training context
    return Status::Ok();
  }

  // deepseek2's RoPE magnitude and query scale, as llama.cpp's graph computes them: the rotated
  // parts are multiplied by the rope's attn_factor (after llama.cpp cancels YaRN's own factor,
  // 1 for DeepSeek's files, which have a log multiplier), and the scores by mscale^2 with
  // mscale = attn_factor (1 + 0.1 ln s) (1 + m ln s), s the scaling factor and m the file's
  // yarn_log_multiplier (0.1 mscale_all_dim). Only part of each head rotates, so the magnitude
  // cannot move into the scale as it does for the other architectures.
  void SetMlaScales(const std::string& type, float factor, float attn_factor, float log_mul) {
    const bool yarn = type == "yarn";
    const float s = type == "none" ? 1.0f : factor;
    const float ln_s = std::log(s);
    float rope_attn = attn_factor;
    if (yarn) {
      const float yarn_mscale = log_mul != 0.f || s <= 1.0f ? 1.0f : 1.0f + 0.1f * ln_s;
      rope_attn = attn_factor * yarn_mscale / (1.0f + 0.1f * ln_s);
    }
    config_.mla_rope_magnitude = yarn ? rope_attn * (1.0f + 0.1f * ln_s) : rope_attn;
    const float mscale = rope_attn * (1.0f + 0.1f * ln_s) * (1.0f + log_mul * ln_s);
    config_.attention_scale = mscale * mscale / std::sqrt(static_cast<float>(config_.QueryHeadDim()));
    config_.rope_mscale = 1.0f;
    config_.rope_attn_factor = 1.0f;
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
  StatusOr<const float*> Vector(const std::string& name, int64_t n) { return Floats(name, {n}); }

  // The same for a tensor of shape ne (a per-expert bias table [n_experts, n]: ne = {n, n_experts}).
  StatusOr<const float*> Floats(const std::string& name, std::initializer_list<int64_t> ne) {
    KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(name, ne));
    int64_t n = 1;
    for (int64_t d : ne) n *= d;
    const bool aligned = reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0;
    if (*t->type == DType::kF32 && aligned) return static_cast<const float*>(t->data);
    std::vector<uint8_t> owned(static_cast<size_t>(n) * sizeof(float));
    if (*t->type == DType::kF32) {
      std::memcpy(owned.data(), t->data, owned.size());
    } else {
      const int64_t row = *ne.begin();
      const size_t row_bytes = DTypeRowBytes(*t->type, row);
      for (int64_t r = 0; r < n / row; ++r) {
        ops::DequantizeRow(*t->type, static_cast<const uint8_t*>(t->data) + r * row_bytes,
                           reinterpret_cast<float*>(owned.data()) + r * row, row);
      }
    }
    return reinterpret_cast<const float*>(ModelLoader::Own(model_, std::move(owned)));
  }

  // Row range [first, first + rows) of a matrix, as a view of its own (fused projections).
  static WeightView Rows(const WeightView& w, int64_t first, int64_t rows) {
    const size_t row_bytes = DTypeRowBytes(w.type, w.cols);
    return WeightView{w.type, static_cast<const uint8_t*>(w.data) + static_cast<size_t>(first) * row_bytes, rows,
                      w.cols};
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
    const ArchSpec& spec = *spec_;
    // Layers are added as their tensors are found, so a hostile block_count fails at the
    // first missing tensor instead of allocating n_layers entries up front.
    model_.layers.clear();
    for (int i = 0; i < config_.n_layers; ++i) {
      LayerWeights& l = model_.layers.emplace_back();
      const std::string b = fmt::format("blk.{}.", i);
      KVS_ASSIGN_OR_RETURN(l.attn_norm, Vector(b + "attn_norm.weight", dim));
      if (config_.IsMla()) {
        KVS_RETURN_IF_ERROR(BindLatentAttention(b, &l));
      } else if (spec.fused_qkv && file_.FindTensor(b + "attn_q.weight") == nullptr) {
        // attn_qkv rows: Q's, then K's, then V's.
        KVS_ASSIGN_OR_RETURN(const WeightView qkv, Matrix(b + "attn_qkv.weight", q_dim + 2 * kv_dim, dim));
        l.wq = Rows(qkv, 0, q_dim);
        l.wk = Rows(qkv, q_dim, kv_dim);
        l.wv = Rows(qkv, q_dim + kv_dim, kv_dim);
      } else {
        KVS_ASSIGN_OR_RETURN(l.wq, Matrix(b + "attn_q.weight", q_dim, dim));
        KVS_ASSIGN_OR_RETURN(l.wk, Matrix(b + "attn_k.weight", kv_dim, dim));
        KVS_ASSIGN_OR_RETURN(l.wv, Matrix(b + "attn_v.weight", kv_dim, dim));
      }
      if (!config_.IsMla()) {
        KVS_ASSIGN_OR_RETURN(l.wo, Matrix(b + "attn_output.weight", dim, q_dim));
      }
      if (spec.qk_norm) {
        KVS_ASSIGN_OR_RETURN(l.q_norm, Vector(b + "attn_q_norm.weight", spec.qk_norm_full_width ? q_dim : config_.head_dim));
        KVS_ASSIGN_OR_RETURN(l.k_norm, Vector(b + "attn_k_norm.weight", spec.qk_norm_full_width ? kv_dim : config_.head_dim));
      }
      if (spec.post_norms) {
        KVS_ASSIGN_OR_RETURN(l.post_attn_norm, Vector(b + "post_attention_norm.weight", dim));
        KVS_ASSIGN_OR_RETURN(l.post_ffn_norm, Vector(b + "post_ffw_norm.weight", dim));
      }
      KVS_ASSIGN_OR_RETURN(l.ffn_norm, Vector(b + std::string(spec.ffn_norm_tensor) + ".weight", dim));
      if (spec.attention_sinks) {
        KVS_ASSIGN_OR_RETURN(l.attn_sinks, Vector(b + "attn_sinks.weight", config_.n_heads));
      }
      const bool moe_layer = config_.LayerIsMoe(i);
      if (moe_layer) {
        KVS_RETURN_IF_ERROR(BindExperts(b, &l));
      } else if (spec.fused_gate_up && file_.FindTensor(b + "ffn_gate.weight") == nullptr) {
        // ffn_up rows: the gate's, then the up projection's (llama.cpp's swiglu splits it so).
        KVS_ASSIGN_OR_RETURN(const WeightView gate_up, Matrix(b + "ffn_up.weight", 2 * hidden, dim));
        l.w_gate = Rows(gate_up, 0, hidden);
        l.w_up = Rows(gate_up, hidden, hidden);
      } else {
        KVS_ASSIGN_OR_RETURN(l.w_gate, Matrix(b + "ffn_gate.weight", hidden, dim));
        KVS_ASSIGN_OR_RETURN(l.w_up, Matrix(b + "ffn_up.weight", hidden, dim));
      }
      if (!moe_layer) {
        KVS_ASSIGN_OR_RETURN(l.w_down, Matrix(b + "ffn_down.weight", dim, hidden));
      }
      struct Bias {
        const char* name;
        int64_t n;
        const float** dst;
      };
      for (const Bias& bias : {Bias{"attn_q.bias", q_dim, &l.bq}, Bias{"attn_k.bias", kv_dim, &l.bk},
                               Bias{"attn_v.bias", kv_dim, &l.bv}, Bias{"attn_output.bias", dim, &l.bo}}) {
        const bool required = spec.gpt_oss_biases || (spec.qkv_bias_required && bias.dst != &l.bo);
        if (!required && file_.FindTensor(b + bias.name) == nullptr) continue;
        KVS_ASSIGN_OR_RETURN(*bias.dst, Vector(b + bias.name, bias.n));
      }
    }
    return Status::Ok();
  }

  // Each expert's [rows, cols] matrix of a 3-D tensor ne = [cols, rows, n_experts] (or, for a
  // merged ffn_gate_up_exps, [cols, 2 rows, n_experts]: per expert the gate's rows, then the up's).
  StatusOr<std::vector<WeightView>> ExpertMatrices(const std::string& name, int64_t rows, int64_t cols,
                                                   int64_t first_row = 0, int64_t rows_per_expert = 0) const {
    if (rows_per_expert == 0) rows_per_expert = rows;
    KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(name, {cols, rows_per_expert, config_.n_experts}));
    const WeightView all{*t->type, t->data, rows_per_expert * config_.n_experts, cols};
    std::vector<WeightView> experts;
    experts.reserve(static_cast<size_t>(config_.n_experts));
    for (int e = 0; e < config_.n_experts; ++e) experts.push_back(Rows(all, e * rows_per_expert + first_row, rows));
    return experts;
  }

  // A MoE layer's router, experts and (qwen2moe) shared expert.
  Status BindExperts(const std::string& b, LayerWeights* l) {
    const int64_t dim = config_.dim, expert_hidden = config_.expert_hidden_dim;
    KVS_ASSIGN_OR_RETURN(l->router, Matrix(b + "ffn_gate_inp.weight", config_.n_experts, dim));
    if (file_.FindTensor(b + "ffn_gate_up_exps.weight") != nullptr) {
      KVS_ASSIGN_OR_RETURN(l->expert_gate,
                           ExpertMatrices(b + "ffn_gate_up_exps.weight", expert_hidden, dim, 0, 2 * expert_hidden));
      KVS_ASSIGN_OR_RETURN(l->expert_up, ExpertMatrices(b + "ffn_gate_up_exps.weight", expert_hidden, dim,
                                                        expert_hidden, 2 * expert_hidden));
    } else {
      KVS_ASSIGN_OR_RETURN(l->expert_gate, ExpertMatrices(b + "ffn_gate_exps.weight", expert_hidden, dim));
      KVS_ASSIGN_OR_RETURN(l->expert_up, ExpertMatrices(b + "ffn_up_exps.weight", expert_hidden, dim));
    }
    KVS_ASSIGN_OR_RETURN(l->expert_down, ExpertMatrices(b + "ffn_down_exps.weight", dim, expert_hidden));
    if (file_.FindTensor(b + "exp_probs_b.bias") != nullptr) {
      KVS_ASSIGN_OR_RETURN(l->expert_selection_bias, Vector(b + "exp_probs_b.bias", config_.n_experts));
    }
    if (spec_->gpt_oss_biases) {
      const int64_t n_experts = config_.n_experts;
      KVS_ASSIGN_OR_RETURN(l->router_bias, Vector(b + "ffn_gate_inp.bias", n_experts));
      KVS_ASSIGN_OR_RETURN(l->expert_gate_bias, Floats(b + "ffn_gate_exps.bias", {expert_hidden, n_experts}));
      KVS_ASSIGN_OR_RETURN(l->expert_up_bias, Floats(b + "ffn_up_exps.bias", {expert_hidden, n_experts}));
      KVS_ASSIGN_OR_RETURN(l->expert_down_bias, Floats(b + "ffn_down_exps.bias", {dim, n_experts}));
    }
    if (config_.shared_expert_hidden_dim > 0) {
      const int64_t shared = config_.shared_expert_hidden_dim;
      if (spec_->shared_expert) {  // qwen2moe's sigmoid gate; deepseek2's shared experts are ungated
        KVS_ASSIGN_OR_RETURN(l->shared_expert_gate, Vector(b + "ffn_gate_inp_shexp.weight", dim));
      }
      KVS_ASSIGN_OR_RETURN(l->shared_gate, Matrix(b + "ffn_gate_shexp.weight", shared, dim));
      KVS_ASSIGN_OR_RETURN(l->shared_up, Matrix(b + "ffn_up_shexp.weight", shared, dim));
      KVS_ASSIGN_OR_RETURN(l->shared_down, Matrix(b + "ffn_down_shexp.weight", dim, shared));
    }
    return Status::Ok();
  }

  // deepseek2's attention: the query (directly, or through the q_lora_rank bottleneck), the
  // latent and rotated key projection with its norm, the per-head absorption matrices and the
  // output. attn_k_b / attn_v_b are bound as per-head row ranges; an older file's attn_kv_b
  // ([n_heads * (nope + v_head), kv_lora_rank]) gives v_b as row ranges too, and k_b transposed
  // into an owned f32 copy (absorption multiplies by its transpose).
  Status BindLatentAttention(const std::string& b, LayerWeights* l) {
    const ModelConfig& c = config_;
    const int64_t dim = c.dim, heads = c.n_heads, rank = c.kv_lora_rank, nope = c.mla_nope_dim,
                  v_head = c.mla_v_head_dim;
    const int64_t q_dim = heads * c.QueryHeadDim();
    if (file_.FindTensor(b + "attn_q_a.weight") != nullptr) {
      if (c.q_lora_rank <= 0) {
        return DataLossError(fmt::format("{}: tensor '{}attn_q_a.weight' is present but '{}.attention.q_lora_rank' is "
                                         "{}; expected the query bottleneck's width",
                                         source_, b, ArchName(c.arch), c.q_lora_rank));
      }
      KVS_ASSIGN_OR_RETURN(l->wq_a, Matrix(b + "attn_q_a.weight", c.q_lora_rank, dim));
      KVS_ASSIGN_OR_RETURN(l->q_a_norm, Vector(b + "attn_q_a_norm.weight", c.q_lora_rank));
      KVS_ASSIGN_OR_RETURN(l->wq, Matrix(b + "attn_q_b.weight", q_dim, c.q_lora_rank));
    } else {
      KVS_ASSIGN_OR_RETURN(l->wq, Matrix(b + "attn_q.weight", q_dim, dim));
    }
    KVS_ASSIGN_OR_RETURN(l->wk, Matrix(b + "attn_kv_a_mqa.weight", rank + c.mla_rope_dim, dim));
    KVS_ASSIGN_OR_RETURN(l->kv_a_norm, Vector(b + "attn_kv_a_norm.weight", rank));
    l->k_b.clear();
    l->v_b.clear();
    if (file_.FindTensor(b + "attn_k_b.weight") != nullptr) {
      // ne = [nope, rank, heads]: head h's [rank, nope]; ne = [rank, v_head, heads]: its [v_head, rank].
      KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* kb, Tensor(b + "attn_k_b.weight", {nope, rank, heads}));
      KVS_ASSIGN_OR_RETURN(const GgufTensorInfo* vb, Tensor(b + "attn_v_b.weight", {rank, v_head, heads}));
      const WeightView k_all{*kb->type, kb->data, rank * heads, nope};
      const WeightView v_all{*vb->type, vb->data, v_head * heads, rank};
      for (int64_t h = 0; h < heads; ++h) {
        l->k_b.push_back(Rows(k_all, h * rank, rank));
        l->v_b.push_back(Rows(v_all, h * v_head, v_head));
      }
    } else if (file_.FindTensor(b + "attn_kv_b.weight") != nullptr) {
      const GgufTensorInfo* t = file_.FindTensor(b + "attn_kv_b.weight");
      if (t->ne.size() >= 1 && t->ne[0] != rank) {
        return DataLossError(fmt::format("{}: tensor '{}attn_kv_b.weight' has {} columns but the latent "
                                         "('{}.attention.kv_lora_rank') is {}",
                                         source_, b, t->ne[0], ArchName(c.arch), rank));
      }
      KVS_ASSIGN_OR_RETURN(const WeightView kv_b, Matrix(b + "attn_kv_b.weight", heads * (nope + v_head), rank));
      std::vector<float> row(static_cast<size_t>(rank));  // [rank]
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<uint8_t> owned(static_cast<size_t>(rank * nope) * sizeof(float));
        float* k_b = reinterpret_cast<float*>(owned.data());  // [rank, nope]
        for (int64_t j = 0; j < nope; ++j) {
          const WeightView r = Rows(kv_b, h * (nope + v_head) + j, 1);
          ops::DequantizeRow(r.type, r.data, row.data(), rank);
          for (int64_t i = 0; i < rank; ++i) k_b[i * nope + j] = row[static_cast<size_t>(i)];
        }
        l->k_b.push_back(WeightView{DType::kF32, ModelLoader::Own(model_, std::move(owned)), rank, nope});
        l->v_b.push_back(Rows(kv_b, h * (nope + v_head) + nope, v_head));
      }
    } else {
      return NotFoundError(fmt::format("{}: required tensors '{}attn_k_b.weight' and '{}attn_v_b.weight' (or an older "
                                       "file's '{}attn_kv_b.weight') are missing",
                                       source_, b, b, b));
    }
    KVS_ASSIGN_OR_RETURN(l->wo, Matrix(b + "attn_output.weight", dim, heads * v_head));
    return Status::Ok();
  }

  Model& model_;
  const GgufFile& file_;
  const ArchSpec* spec_ = nullptr;
  ModelConfig& config_;
  std::string source_;
};

StatusOr<std::unique_ptr<Model>> ModelLoader::FromGguf(const std::string& path, const ModelLoadOptions& options) {
  return GgufModelBuilder::Build(path, options);
}

}  // namespace kvsparse
