// llama2.c legacy checkpoint loader (the format of Karpathy's run.c):
//   7 x int32 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
//   (vocab_size < 0: an untied classifier follows the other weights), then f32 tensors
//   token_embedding [vocab, dim], rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim],
//   wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim], w1 [L, hidden, dim],
//   w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim], freq_cis_real/imag
//   [seq_len, head_size/2] each (unused: RoPE is recomputed), wcls [vocab, dim] if untied.
// Matrices are row-major [out, in], which is exactly WeightView's [rows, cols].
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <cstring>
#include <fmt/format.h>

#include "model/model_loader.h"
#include "model/rope_scaling.h"

namespace kvsparse {

class Llama2cModelBuilder {
 public:
  static StatusOr<std::unique_ptr<Model>> Build(const std::string& path);
};

namespace {

constexpr size_t kHeaderInts = 7;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

// An open file that closes itself.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

// Size of a regular file (a directory opens fine with fopen but reports a bogus size).
StatusOr<size_t> FileSize(std::FILE* f, const std::string& path) {
  struct stat st;
  if (::fstat(::fileno(f), &st) != 0) {
    return DataLossError(fmt::format("cannot stat '{}': {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(fmt::format("model path '{}' is not a regular file", path));
  return static_cast<size_t>(st.st_size);
}

}  // namespace

StatusOr<std::unique_ptr<Model>> Llama2cModelBuilder::Build(const std::string& path) {
  FilePtr file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) {
    return NotFoundError(fmt::format("cannot open model file '{}': {}", path, std::strerror(errno)));
  }
  KVS_ASSIGN_OR_RETURN(const size_t file_size, FileSize(file.get(), path));
  const std::string source = fmt::format("llama2.c checkpoint '{}'", path);
  int32_t header[kHeaderInts];
  if (file_size < kHeaderBytes || std::fread(header, 1, kHeaderBytes, file.get()) != kHeaderBytes) {
    return DataLossError(fmt::format("{}: file has {} bytes, too small for the {}-byte header (and it is not "
                                     "GGUF: no 'GGUF' magic)",
                                     source, file_size, kHeaderBytes));
  }
  const int32_t dim = header[0], hidden = header[1], n_layers = header[2], n_heads = header[3],
                n_kv_heads = header[4], raw_vocab = header[5], seq_len = header[6];

  std::unique_ptr<Model> model = ModelLoader::NewModel(path);
  ModelConfig& c = ModelLoader::Config(*model);
  c.arch = Arch::kLlama;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  // A negative vocab size flags an untied classifier; INT32_MIN cannot be negated and is invalid anyway.
  c.n_vocab = raw_vocab == INT32_MIN ? 0 : (raw_vocab < 0 ? -raw_vocab : raw_vocab);
  c.tied_output = raw_vocab > 0;
  c.max_context = seq_len;
  c.head_dim = n_heads > 0 ? dim / n_heads : 0;
  c.rms_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.rope_style = RopeStyle::kAdjacentPairs;
  // llama2.c has no separate head size: the heads must split dim exactly.
  Status valid = n_heads > 0 && dim % n_heads != 0
                     ? DataLossError(fmt::format("{}: dim ({}) must be a multiple of n_heads ({})", source, dim, n_heads))
                     : ValidateModelConfig(c, source);
  if (!valid.ok()) {
    return DataLossError(valid.message() + fmt::format(" (header: dim={} hidden_dim={} n_layers={} n_heads={} "
                                                       "n_kv_heads={} vocab_size={} seq_len={})",
                                                       dim, hidden, n_layers, n_heads, n_kv_heads, raw_vocab,
                                                       seq_len));
  }

  // Offsets in floats; 128-bit so that absurd headers cannot overflow before the size check.
  using Wide = unsigned __int128;
  const Wide d = static_cast<Wide>(dim), h = static_cast<Wide>(hidden), L = static_cast<Wide>(n_layers),
             V = static_cast<Wide>(c.n_vocab), S = static_cast<Wide>(seq_len);
  const Wide kv_dim = static_cast<Wide>(n_kv_heads) * static_cast<Wide>(c.head_dim);
  const Wide freq_floats = S * static_cast<Wide>(c.head_dim / 2);
  const Wide expected_floats = V * d + L * d + L * d * d + 2 * L * kv_dim * d + L * d * d + L * d +
                               3 * L * h * d + d + 2 * freq_floats + (c.tied_output ? 0 : V * d);
  const Wide expected_bytes = kHeaderBytes + expected_floats * sizeof(float);
  if (expected_bytes != file_size) {
    const bool representable = expected_bytes <= static_cast<Wide>(UINT64_MAX);
    return DataLossError(fmt::format(
        "{}: the header (dim={} hidden_dim={} n_layers={} n_heads={} n_kv_heads={} vocab_size={} seq_len={}) "
        "implies {} bytes but the file has {} bytes ({})",
        source, dim, hidden, n_layers, n_heads, n_kv_heads, raw_vocab, seq_len,
        representable ? fmt::format("{}", static_cast<uint64_t>(expected_bytes)) : std::string("more than 2^64"),
        file_size, expected_bytes > file_size ? "truncated" : "trailing data or a different format"));
  }

  // Owned copy of the weights without the header, so every tensor is float-aligned.
  std::vector<uint8_t> weights(file_size - kHeaderBytes);
  if (std::fread(weights.data(), 1, weights.size(), file.get()) != weights.size()) {
    return DataLossError(fmt::format("{}: short read of {} weight bytes", source, weights.size()));
  }
  const float* cursor = reinterpret_cast<const float*>(ModelLoader::Own(*model, std::move(weights)));
  auto take = [&cursor](int64_t n) {
    const float* p = cursor;
    cursor += n;
    return p;
  };
  auto matrix = [](const float* p, int64_t rows, int64_t cols) {
    return WeightView{DType::kF32, p, rows, cols};
  };
  const int64_t D = dim, H = hidden, KV = static_cast<int64_t>(kv_dim), NV = c.n_vocab;

  model->token_embedding = matrix(take(NV * D), NV, D);
  model->layers.resize(static_cast<size_t>(n_layers));
  for (LayerWeights& l : model->layers) l.attn_norm = take(D);
  for (LayerWeights& l : model->layers) l.wq = matrix(take(D * D), D, D);
  for (LayerWeights& l : model->layers) l.wk = matrix(take(KV * D), KV, D);
  for (LayerWeights& l : model->layers) l.wv = matrix(take(KV * D), KV, D);
  for (LayerWeights& l : model->layers) l.wo = matrix(take(D * D), D, D);
  for (LayerWeights& l : model->layers) l.ffn_norm = take(D);
  for (LayerWeights& l : model->layers) l.w_gate = matrix(take(H * D), H, D);  // w1
  for (LayerWeights& l : model->layers) l.w_down = matrix(take(D * H), D, H);  // w2
  for (LayerWeights& l : model->layers) l.w_up = matrix(take(H * D), H, D);    // w3
  model->output_norm = take(D);
  take(2 * static_cast<int64_t>(freq_floats));  // freq_cis_real, freq_cis_imag
  model->output = c.tied_output ? model->token_embedding : matrix(take(NV * D), NV, D);
  model->rope_inv_freq = RopeInvFreq(c.head_dim, c.rope_theta);
  return model;
}

StatusOr<std::unique_ptr<Model>> ModelLoader::FromLlama2c(const std::string& path) {
  return Llama2cModelBuilder::Build(path);
}

}  // namespace kvsparse
