// The built-in retrieval model (see retrieval_model.h for what it is): weights constructed
// analytically from the engine's own RoPE frequencies and RMSNorm, written with GgufWriter
// under llama.cpp's tensor names and keys.
#include "kvsparse/retrieval_model.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/ops.h"
#include "kvsparse/synth.h"
#include "model/model_loader.h"

namespace kvsparse {

namespace {

// ---- shape ----
constexpr int kHeadDim = 128;
constexpr int kDim = kHeadDim;  // one head: the loader derives head_dim = dim / n_heads
constexpr int kPairs = kHeadDim / 2;
constexpr int kHidden = 32;  // FFN weights are zero; the width only has to be valid
constexpr int kContext = 32768;
// A rope base this large leaves the slowest pairs nearly still (θ_40 = 1.8e-9 rad/token) while
// the fastest keep θ_0 = 1, θ_1 = 0.6, θ_2 = 0.37 ...: position-sharp and position-blind pairs
// in one head.
constexpr float kRopeBase = 1e14f;
constexpr float kRmsEps = 1e-5f;

// ---- vocabulary ----
constexpr int kFiller = 16, kKeys = 12, kValues = 12;
constexpr int kVocab = kFiller + kKeys + kValues;  // ids: filler, keys, values
constexpr int kFirstKey = kFiller, kFirstValue = kFiller + kKeys;

// ---- residual layout ----
constexpr int kTokSlot = 0;                 // [kVocab] one-hot of the token itself
constexpr int kConstDim = kVocab;           // 1 everywhere: the source of position-only q/k
constexpr int kPrevSlot = kConstDim + 1;    // [kVocab] one-hot of the previous token (layer 0 writes)
constexpr int kOutSlot = kPrevSlot + kVocab;  // [kVocab] the retrieved token (induction layer writes)
static_assert(kOutSlot + kVocab <= kDim, "residual layout must fit the embedding width");

// ---- scores (logits of the attention softmax, after the engine's 1/sqrt(head_dim)) ----
// Previous-token head: the 16 fastest pairs, each scoring kPrevScale * cos(...). The closest
// competitor (the query itself and t-2) trails by kPrevScale * Σ_i (1 - cos θ_i) = 0.741 *
// kPrevScale ≈ 44, and every other distance up to 140000 by more (checked numerically), so
// attention on t-1 is 1 to float precision at any depth, also through f16 or int8 KV.
constexpr int kPrevPairs = 16;
constexpr double kPrevScale = 60.0;
// Induction head: a match scores kMatchScore (non-matches exactly 0), e^-40 per competitor.
constexpr double kMatchScore = 40.0;
constexpr double kOwnTokenPenalty = 0.5;  // fraction of the code subtracted for the key's own token
// Code pairs: keys on the slowest pairs, then values, then filler (filler codes may drift a little:
// θ_24 = 5.6e-6 rad/token, i.e. 0.18 rad at 32768 tokens).
constexpr int kFirstCodePair = kPairs - kVocab;
static_assert(kFirstCodePair >= kPrevPairs, "code pairs must not overlap the previous-token pairs");
// Residual gains of the embedding's two entries and of the two slots the heads write.
constexpr double kEmbedGain = 1.0, kConstGain = 1.0, kPrevGain = 1.0, kOutGain = 1.0;
// Logit of the retrieved token (all others 0 when retrieval is clean): p(answer) ≈ 1 - 8e-8.
constexpr double kAnswerLogit = 20.0;

int CodePair(int token) {
  if (token >= kFirstKey && token < kFirstValue) return kPairs - 1 - (token - kFirstKey);
  if (token >= kFirstValue) return kPairs - 1 - kKeys - (token - kFirstValue);
  return kPairs - 1 - kKeys - kValues - token;  // filler
}

// What RMSNorm (weight 1) turns a residual entry of size `gain` into, when the row's squared
// entries sum to `sum_sq`: the engine's formula, so weights can undo it exactly.
double Normed(double gain, double sum_sq) { return gain / std::sqrt(sum_sq / kDim + kRmsEps); }

// A row-major [rows, cols] f32 matrix, converted to `type` when written.
struct Matrix {
  int64_t rows, cols;
  std::vector<float> w;  // [rows, cols]
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), w(static_cast<size_t>(r * c), 0.f) {}
  float& at(int64_t r, int64_t c) { return w[static_cast<size_t>(r * cols + c)]; }
};

void AddMatrix(GgufWriter* writer, const std::string& name, DType type, Matrix m) {
  auto data = std::make_shared<Matrix>(std::move(m));
  writer->AddTensor(name, type, {data->cols, data->rows}, [data, type](void* dst, size_t nbytes) {
    const size_t row_bytes = DTypeRowBytes(type, data->cols);
    KVS_CHECK(row_bytes * static_cast<size_t>(data->rows) == nbytes);
    for (int64_t r = 0; r < data->rows; ++r) {
      ops::QuantizeRow(type, &data->w[static_cast<size_t>(r * data->cols)],
                       static_cast<uint8_t*>(dst) + static_cast<size_t>(r) * row_bytes, data->cols);
    }
  });
}

void AddOnes(GgufWriter* writer, const std::string& name, int64_t n) {
  writer->AddTensor(name, DType::kF32, {n}, [n](void* dst, size_t nbytes) {
    KVS_CHECK(nbytes == static_cast<size_t>(n) * sizeof(float));
    float* out = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = 1.f;
  });
}

}  // namespace

TokenVocab RetrievalModelVocab() {
  TokenVocab v;
  for (int i = 0; i < kFiller; ++i) v.filler.push_back(i);
  for (int i = 0; i < kKeys; ++i) v.keys.push_back(kFirstKey + i);
  for (int i = 0; i < kValues; ++i) v.values.push_back(kFirstValue + i);
  return v;
}

Status WriteRetrievalModel(const RetrievalModelOptions& options, const std::string& out_path) {
  if (options.n_layers < 2) {
    return InvalidArgumentError(fmt::format(
        "retrieval model: n_layers must be at least 2 (a previous-token and an induction layer), found {}",
        options.n_layers));
  }
  const DType type = options.weight_type;
  if (type != DType::kF32 && type != DType::kF16) {
    return InvalidArgumentError(fmt::format("retrieval model: weight type must be f32 or f16, found {}", DTypeName(type)));
  }
  const int n_layers = options.n_layers;
  // RoPE frequencies exactly as the loader will compute them from the stored f32 base.
  const std::vector<float> inv_freq = ModelLoader::RopeInvFreq(kHeadDim, kRopeBase);
  const double score_to_qk = std::sqrt(static_cast<double>(kHeadDim));  // undoes the engine's 1/sqrt(head_dim)

  // Squared norms of the residual at each point, which fix what RMSNorm hands the projections.
  const double sq_in = kEmbedGain * kEmbedGain + kConstGain * kConstGain;  // layer 0 input
  const double sq_mid = sq_in + kPrevGain * kPrevGain;                      // after layer 0
  const double sq_out = sq_mid + kOutGain * kOutGain;                       // after the induction layer

  GgufWriter w;
  const std::string arch = "llama";
  w.SetString("general.architecture", arch);
  w.SetString("general.name", "kvsparse retrieval instrument (constructed weights, not a language model)");
  w.SetU32("general.file_type", type == DType::kF32 ? 0 : 1);
  w.SetU32(arch + ".context_length", kContext);
  w.SetU32(arch + ".embedding_length", kDim);
  w.SetU32(arch + ".block_count", static_cast<uint32_t>(n_layers));
  w.SetU32(arch + ".feed_forward_length", kHidden);
  w.SetU32(arch + ".attention.head_count", 1);
  w.SetU32(arch + ".attention.head_count_kv", 1);
  w.SetF32(arch + ".attention.layer_norm_rms_epsilon", kRmsEps);
  w.SetF32(arch + ".rope.freq_base", kRopeBase);
  w.SetU32(arch + ".rope.dimension_count", kHeadDim);
  w.SetU32(arch + ".vocab_size", kVocab);
  // Self-description for tools: which ids play which role.
  const TokenVocab vocab = RetrievalModelVocab();
  w.SetI32Array("kvsparse.retrieval.filler", vocab.filler);
  w.SetI32Array("kvsparse.retrieval.keys", vocab.keys);
  w.SetI32Array("kvsparse.retrieval.values", vocab.values);

  Matrix embd(kVocab, kDim);  // [n_vocab, dim]
  for (int t = 0; t < kVocab; ++t) {
    embd.at(t, kTokSlot + t) = static_cast<float>(kEmbedGain);
    embd.at(t, kConstDim) = static_cast<float>(kConstGain);
  }
  AddMatrix(&w, "token_embd.weight", type, std::move(embd));
  AddOnes(&w, "output_norm.weight", kDim);
  Matrix out(kVocab, kDim);  // [n_vocab, dim]: reads only the output slot
  for (int t = 0; t < kVocab; ++t) out.at(t, kOutSlot + t) = static_cast<float>(kAnswerLogit / Normed(kOutGain, sq_out));
  AddMatrix(&w, "output.weight", type, std::move(out));

  for (int l = 0; l < n_layers; ++l) {
    Matrix wq(kHeadDim, kDim), wk(kHeadDim, kDim), wv(kHeadDim, kDim), wo(kDim, kHeadDim);
    if (l == 0) {
      // Previous-token head. q_i = (s, 0), k_i = s (cos θ_i, sin θ_i): after RoPE at positions t
      // and s the pair scores s² cos((s + 1 - t) θ_i), peaking at s = t - 1.
      const double c = Normed(kConstGain, sq_in);
      const double amp = std::sqrt(kPrevScale * score_to_qk);  // per-side amplitude
      for (int i = 0; i < kPrevPairs; ++i) {
        wq.at(2 * i, kConstDim) = static_cast<float>(amp / c);
        wk.at(2 * i, kConstDim) = static_cast<float>(amp * std::cos(static_cast<double>(inv_freq[i])) / c);
        wk.at(2 * i + 1, kConstDim) = static_cast<float>(amp * std::sin(static_cast<double>(inv_freq[i])) / c);
      }
      const double tok = Normed(kEmbedGain, sq_in);
      for (int t = 0; t < kVocab; ++t) {
        wv.at(t, kTokSlot + t) = static_cast<float>(1.0 / tok);  // v = one-hot of the token
        wo.at(kPrevSlot + t, t) = static_cast<float>(kPrevGain);
      }
    } else if (l == n_layers - 1) {
      // Induction head: one pair per symbol (even dimension only), so codes of different symbols
      // never meet, whatever RoPE does inside a pair.
      const double tok = Normed(kEmbedGain, sq_mid), prev = Normed(kPrevGain, sq_mid);
      const double amp = std::sqrt(kMatchScore * score_to_qk);
      for (int t = 0; t < kVocab; ++t) {
        const int row = 2 * CodePair(t);
        wq.at(row, kTokSlot + t) = static_cast<float>(amp / tok);
        wk.at(row, kPrevSlot + t) = static_cast<float>(amp / prev);
        wk.at(row, kTokSlot + t) = static_cast<float>(-kOwnTokenPenalty * amp / tok);
        wv.at(t, kTokSlot + t) = static_cast<float>(1.0 / tok);
        wo.at(kOutSlot + t, t) = static_cast<float>(kOutGain);
      }
    }  // else: a no-op layer, every weight zero (uniform attention over zero values)
    const std::string b = fmt::format("blk.{}.", l);
    AddOnes(&w, b + "attn_norm.weight", kDim);
    AddMatrix(&w, b + "attn_q.weight", type, std::move(wq));
    AddMatrix(&w, b + "attn_k.weight", type, std::move(wk));
    AddMatrix(&w, b + "attn_v.weight", type, std::move(wv));
    AddMatrix(&w, b + "attn_output.weight", type, std::move(wo));
    AddOnes(&w, b + "ffn_norm.weight", kDim);
    AddMatrix(&w, b + "ffn_gate.weight", type, Matrix(kHidden, kDim));
    AddMatrix(&w, b + "ffn_up.weight", type, Matrix(kHidden, kDim));
    AddMatrix(&w, b + "ffn_down.weight", type, Matrix(kDim, kHidden));
  }
  return w.Write(out_path);
}

StatusOr<std::string> BuiltinRetrievalModelPath() {
  namespace fs = std::filesystem;
  const fs::path dir = ModelCacheDir();
  // The version in the name retires old files when the construction changes.
  const fs::path file = dir / "retrieval-v1.gguf";
  std::error_code ec;
  if (fs::exists(file, ec)) return file.string();
  fs::create_directories(dir, ec);
  if (ec) return InvalidArgumentError(fmt::format("cannot create cache folder {}: {}", dir.string(), ec.message()));
  // A private temp name, renamed into place: rename is atomic, so a reader never sees a
  // half-written file and concurrent writers just replace one complete file with another.
  static std::atomic<uint64_t> counter{0};
  const fs::path tmp = dir / fmt::format("{}.tmp.{}.{}", file.filename().string(), static_cast<long>(getpid()),
                                         counter.fetch_add(1));
  Status written = WriteRetrievalModel(RetrievalModelOptions{}, tmp.string());
  if (!written.ok()) {
    fs::remove(tmp, ec);
    return written;
  }
  fs::rename(tmp, file, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    return InternalError(fmt::format("cannot move the retrieval model {} into {}: {}", tmp.string(), file.string(), why));
  }
  return file.string();
}

}  // namespace kvsparse
