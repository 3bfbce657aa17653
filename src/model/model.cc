// Model: format detection, shared validation and size accounting.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>

#include "kvsparse/model.h"
#include "model/arch.h"
#include "model/model_loader.h"

namespace kvsparse {

std::string_view ArchName(Arch a) { return ArchSpecOf(a).gguf_name; }

float ModelConfig::AttentionLogitScale(int layer) const {
  const float base = attention_scale > 0.f ? attention_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  const float magnitude = rope_attn_factor * (sliding_rope_unscaled && IsSliding(layer) ? 1.0f : rope_mscale);
  return base * magnitude * magnitude;
}

int ModelConfig::MaxFfnWidth() const {
  return std::max({hidden_dim, IsMoe() ? expert_hidden_dim : 0, shared_expert_hidden_dim});
}

int ModelConfig::NumSlidingLayers() const {
  int n = 0;
  for (uint8_t sliding : sliding_layers) n += sliding != 0 ? 1 : 0;
  return n;
}

double ModelConfig::DenseKvBytes(int64_t n_tokens, double bytes_per_value) const {
  const double per_token = static_cast<double>(KvValuesPerToken()) * bytes_per_value;  // K and V (or MLA's latent) of one layer
  double bytes = 0;
  for (int layer = 0; layer < n_layers; ++layer) {
    const int64_t held = IsSliding(layer) ? std::min<int64_t>(n_tokens, sliding_window) : n_tokens;
    bytes += per_token * static_cast<double>(held);
  }
  return bytes;
}

void Model::SetContextLength(int32_t n_ctx) {
  if (rope_inv_freq_long.empty()) return;
  rope_inv_freq = n_ctx > long_rope_original_context ? rope_inv_freq_long : rope_inv_freq_short;
}

bool IsSupportedWeightType(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1:
    case DType::kQ2_K:
    case DType::kQ3_K:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kIQ4_NL:
    case DType::kIQ4_XS:
    case DType::kMXFP4:
      return true;
    case DType::kQ8_K:  // activation-side only
      return false;
  }
  return false;
}

std::string_view SupportedWeightTypeNames() {
  return "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4";
}

Model::~Model() = default;

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& path, const ModelLoadOptions& options) {
  // Checked before opening: fopen succeeds on a directory and blocks on a FIFO.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return InvalidArgumentError(fmt::format("model path '{}' is not a regular file", path));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return NotFoundError(fmt::format("cannot open model file '{}': {}", path, std::strerror(errno)));
  }
  char magic[4] = {0, 0, 0, 0};
  const size_t got = std::fread(magic, 1, sizeof(magic), f);
  std::fclose(f);
  if (got == sizeof(magic) && std::memcmp(magic, "GGUF", 4) == 0) return LoadGguf(path, options);
  // llama2.c checkpoints have no magic; the loader validates the header and file size instead.
  return LoadLlama2c(path);
}

StatusOr<std::unique_ptr<Model>> Model::LoadGguf(const std::string& path, const ModelLoadOptions& options) {
  return ModelLoader::FromGguf(path, options);
}

StatusOr<std::unique_ptr<Model>> Model::LoadLlama2c(const std::string& path) {
  return ModelLoader::FromLlama2c(path);
}

namespace {
int64_t Elements(const WeightView& w) { return w.rows * w.cols; }
size_t Bytes(const WeightView& w) { return static_cast<size_t>(w.rows) * DTypeRowBytes(w.type, w.cols); }
// Calls f(matrix, is_routed_expert) for each MoE matrix of a layer: the router, the shared
// expert's, and every expert's (none in a dense layer).
// Calls f(matrix) for each attention and dense FFN matrix of a layer (MLA's included).
template <typename F>
void ForEachDenseMatrix(const LayerWeights& l, F f) {
  for (const WeightView* w : {&l.wq_a, &l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
    if (w->data != nullptr) f(*w);
  }
  for (const std::vector<WeightView>* heads : {&l.k_b, &l.v_b}) {
    for (const WeightView& w : *heads) f(w);
  }
}
// Floats of a layer's norms, biases and gate vectors.
int64_t LayerVectorFloats(const ModelConfig& c, const LayerWeights& l) {
  int64_t n = (c.post_norms ? 4 : 2) * static_cast<int64_t>(c.dim);  // attn_norm, ffn_norm (+ post-norms)
  if (c.qk_norm) n += c.qk_norm_full_width ? l.wq.rows + l.wk.rows : 2 * static_cast<int64_t>(c.head_dim);
  if (l.shared_expert_gate != nullptr) n += c.dim;
  if (l.expert_selection_bias != nullptr) n += c.n_experts;
  if (l.q_a_norm != nullptr) n += c.q_lora_rank;
  if (l.kv_a_norm != nullptr) n += c.kv_lora_rank;
  if (l.bq != nullptr) n += l.wq.rows;
  if (l.bk != nullptr) n += l.wk.rows;
  if (l.bv != nullptr) n += l.wv.rows;
  return n;
}
template <typename F>
void ForEachMoeMatrix(const LayerWeights& l, F f) {
  for (const WeightView* w : {&l.router, &l.shared_gate, &l.shared_up, &l.shared_down}) {
    if (w->data != nullptr) f(*w, false);
  }
  for (const std::vector<WeightView>* experts : {&l.expert_gate, &l.expert_up, &l.expert_down}) {
    for (const WeightView& w : *experts) f(w, true);
  }
}
}  // namespace

int64_t Model::ParameterCount() const {
  const ModelConfig& c = config_;
  int64_t total = Elements(token_embedding) + c.dim;  // + output_norm
  if (!c.tied_output) total += Elements(output);
  for (const LayerWeights& l : layers) {
    total += LayerVectorFloats(c, l);
    ForEachDenseMatrix(l, [&](const WeightView& w) { total += Elements(w); });
    ForEachMoeMatrix(l, [&](const WeightView& w, bool) { total += Elements(w); });
  }
  return total;
}

size_t Model::WeightBytes() const {
  const ModelConfig& c = config_;
  const size_t norm_bytes = sizeof(float) * static_cast<size_t>(c.dim);
  size_t total = Bytes(token_embedding) + norm_bytes;
  if (!c.tied_output) total += Bytes(output);
  for (const LayerWeights& l : layers) {
    total += sizeof(float) * static_cast<size_t>(LayerVectorFloats(c, l));
    ForEachDenseMatrix(l, [&](const WeightView& w) { total += Bytes(w); });
    ForEachMoeMatrix(l, [&](const WeightView& w, bool) { total += Bytes(w); });
  }
  return total;
}

size_t Model::ActiveWeightBytesPerToken() const {
  const ModelConfig& c = config_;
  // The embedding table is read whole only when the output projection is tied to it.
  const size_t embedding_row = DTypeRowBytes(token_embedding.type, token_embedding.cols);
  size_t routed = 0;
  for (const LayerWeights& l : layers) ForEachMoeMatrix(l, [&](const WeightView& w, bool expert) { routed += expert ? Bytes(w) : 0; });
  size_t total = WeightBytes() - routed;
  if (!c.tied_output) total -= Bytes(token_embedding) - embedding_row;
  if (c.IsMoe()) total += routed / static_cast<size_t>(c.n_experts) * static_cast<size_t>(c.n_experts_used);
  return total;
}

int64_t Model::ActiveParameterCount() const {
  const ModelConfig& c = config_;
  if (!c.IsMoe()) return ParameterCount();
  int64_t routed = 0;
  for (const LayerWeights& l : layers) ForEachMoeMatrix(l, [&](const WeightView& w, bool expert) { routed += expert ? Elements(w) : 0; });
  return ParameterCount() - routed + routed / c.n_experts * c.n_experts_used;
}

std::string Model::Summary() const {
  std::string s = fmt::format("{} {:.2f}B {}", ArchName(config_.arch), ParameterCount() / 1e9,
                              DTypeName(layers.empty() ? DType::kF32 : layers[0].wq.type));
  if (config_.IsMoe()) s += fmt::format(", {} of {} experts", config_.n_experts_used, config_.n_experts);
  if (kept_panel_bytes_ > 0) s += fmt::format(", kept panels {:.0f} MiB", kept_panel_bytes_ / 1048576.0);
  return s;
}

Status ValidateModelConfig(const ModelConfig& c, const std::string& source) {
  struct Field {
    const char* name;
    int value;
  };
  for (const Field& f : {Field{"n_vocab", c.n_vocab}, Field{"dim", c.dim}, Field{"hidden_dim", c.hidden_dim},
                         Field{"n_layers", c.n_layers}, Field{"n_heads", c.n_heads},
                         Field{"n_kv_heads", c.n_kv_heads},
                         Field{"context_length", c.max_context}}) {
    if (f.value <= 0) {
      return DataLossError(fmt::format("{}: {} must be positive, found {}", source, f.name, f.value));
    }
  }
  // Real head sizes are 64..256; the bound keeps hostile key_length values from sizing buffers.
  constexpr int kMaxHeadDim = 1024;
  if (c.head_dim <= 0 || c.head_dim > kMaxHeadDim) {
    return DataLossError(fmt::format("{}: head_dim must be in [1, {}], found {} (attention.key_length, or "
                                     "embedding_length / head_count = {} / {})",
                                     source, kMaxHeadDim, c.head_dim, c.dim, c.n_heads));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return DataLossError(fmt::format("{}: n_heads ({}) must be a multiple of n_kv_heads ({})", source, c.n_heads,
                                     c.n_kv_heads));
  }
  if (c.head_dim % 2 != 0) {
    return DataLossError(fmt::format("{}: head_dim ({}) must be even for RoPE", source, c.head_dim));
  }
  if (!(c.rms_eps > 0.f) || !std::isfinite(c.rms_eps)) {
    return DataLossError(fmt::format("{}: RMSNorm epsilon must be positive and finite, found {}", source, c.rms_eps));
  }
  if (!(c.rope_theta > 0.f) || !std::isfinite(c.rope_theta)) {
    return DataLossError(fmt::format("{}: RoPE theta must be positive and finite, found {}", source, c.rope_theta));
  }
  return Status::Ok();
}

}  // namespace kvsparse
