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
#include "model/rope_scaling.h"

namespace kvsparse {

namespace {

// ---- shape ----
constexpr int kHeadDim = 128;
constexpr int kPairs = kHeadDim / 2;
// Heads of the multi-head shape: 4 KV heads in GQA groups of 2. The loader derives
// head_dim = dim / n_heads, so the residual is n_heads * head_dim wide (mostly unused).
constexpr int kMhaHeads = 8, kMhaKvHeads = 4;
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
static_assert(kOutSlot + kVocab <= kHeadDim, "residual layout must fit the embedding width");

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
// Local distractor head: the 16 fastest pairs unrotated, each scoring kLocalScale * cos(δ θ_i)
// at distance δ: the token itself, then e^-0.74 and e^-2.6 for the two before, then nothing.
constexpr double kLocalScale = 1.0;

int CodePair(int token) {
  if (token >= kFirstKey && token < kFirstValue) return kPairs - 1 - (token - kFirstKey);
  if (token >= kFirstValue) return kPairs - 1 - kKeys - (token - kFirstValue);
  return kPairs - 1 - kKeys - kValues - token;  // filler
}

// What RMSNorm (weight 1) turns a residual entry of size `gain` into, when the row's squared
// entries sum to `sum_sq`: the engine's formula, so weights can undo it exactly.
double Normed(double gain, double sum_sq, int dim) { return gain / std::sqrt(sum_sq / dim + kRmsEps); }

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

// What one KV head (and the query heads of its group) of a layer computes.
enum class HeadRole {
  kUniform,     // q = 0: equal attention on every cached token (distractor)
  kLocal,       // position-only, peaked on the token itself and the two before it (distractor)
  kPrevToken,   // position-only, all attention on t - 1; writes the previous-token slot when `writes`
  kInduction,   // attention on the successor of the current token's earlier occurrence; writes the output slot
};

// The role of (layer, kv_head). One-head shape: layer 0 previous-token, last layer induction,
// the rest uniform with zero output (exact no-ops). Multi-head shape: the circuit sits in KV
// head 1 of layer 0 and KV head 2 of the last layer; every other head is a distractor whose
// output is discarded, and the layers mix them differently (layer 0 and the last sharp,
// odd middle layers mostly uniform, even ones mostly local and previous-token).
HeadRole RoleOf(RetrievalShape shape, int layer, int n_layers, int kv_head, bool* writes) {
  *writes = false;
  const bool last = layer == n_layers - 1;
  if (shape == RetrievalShape::kOneHead) {
    *writes = layer == 0 || last;
    return layer == 0 ? HeadRole::kPrevToken : last ? HeadRole::kInduction : HeadRole::kUniform;
  }
  using R = HeadRole;
  if (layer == 0) {
    *writes = kv_head == 1;
    static constexpr R kFirst[kMhaKvHeads] = {R::kLocal, R::kPrevToken, R::kLocal, R::kUniform};
    return kFirst[kv_head];
  }
  if (last) {
    *writes = kv_head == 2;
    static constexpr R kLast[kMhaKvHeads] = {R::kLocal, R::kPrevToken, R::kInduction, R::kUniform};
    return kLast[kv_head];
  }
  static constexpr R kOdd[kMhaKvHeads] = {R::kUniform, R::kUniform, R::kLocal, R::kPrevToken};
  static constexpr R kEven[kMhaKvHeads] = {R::kPrevToken, R::kLocal, R::kPrevToken, R::kLocal};
  return (layer % 2 == 1 ? kOdd : kEven)[kv_head];
}

// Squared norms of the residual at each point, which fix what RMSNorm hands the projections.
struct ResidualNorms {
  double in, mid;  // layer 0's input; every later layer's input (previous-token slot filled)
};

// Fills one query head's rows of wq (at q_row), its KV head's rows of wk and wv (at kv_row) and,
// when `writes`, the query head's columns of wo (at q_row) for `role`.
void SetHead(HeadRole role, bool writes, int layer, const ResidualNorms& norms, int dim,
             const std::vector<float>& inv_freq, int64_t q_row, int64_t kv_row, Matrix* wq, Matrix* wk, Matrix* wv,
             Matrix* wo) {
  const double score_to_qk = std::sqrt(static_cast<double>(kHeadDim));  // undoes the engine's 1/sqrt(head_dim)
  const double sq = layer == 0 ? norms.in : norms.mid;
  const double tok = Normed(kEmbedGain, sq, dim);
  // v copies the token one-hot where the output is used (distractors' values stay zero).
  if (writes) {
    for (int t = 0; t < kVocab; ++t) wv->at(kv_row + t, kTokSlot + t) = static_cast<float>(1.0 / tok);
  }
  switch (role) {
    case HeadRole::kUniform:
      break;
    case HeadRole::kLocal:
    case HeadRole::kPrevToken: {
      // q_i = (a, 0), k_i = a (cos φ_i, sin φ_i): after RoPE at positions t and s the pair scores
      // a² cos((s + shift - t) θ_i) with φ_i = shift θ_i, peaking at s = t - shift.
      const bool prev = role == HeadRole::kPrevToken;
      const double c = Normed(kConstGain, sq, dim);
      const double amp = std::sqrt((prev ? kPrevScale : kLocalScale) * score_to_qk);
      const double shift = prev ? 1.0 : 0.0;
      for (int i = 0; i < kPrevPairs; ++i) {
        const double phase = shift * static_cast<double>(inv_freq[i]);
        wq->at(q_row + 2 * i, kConstDim) = static_cast<float>(amp / c);
        wk->at(kv_row + 2 * i, kConstDim) = static_cast<float>(amp * std::cos(phase) / c);
        wk->at(kv_row + 2 * i + 1, kConstDim) = static_cast<float>(amp * std::sin(phase) / c);
      }
      if (writes) {
        for (int t = 0; t < kVocab; ++t) wo->at(kPrevSlot + t, q_row + t) = static_cast<float>(kPrevGain);
      }
      break;
    }
    case HeadRole::kInduction: {
      // One pair per symbol (even dimension only), so codes of different symbols never meet,
      // whatever RoPE does inside a pair.
      const double prev = Normed(kPrevGain, sq, dim);
      const double amp = std::sqrt(kMatchScore * score_to_qk);
      for (int t = 0; t < kVocab; ++t) {
        const int row = 2 * CodePair(t);
        wq->at(q_row + row, kTokSlot + t) = static_cast<float>(amp / tok);
        wk->at(kv_row + row, kPrevSlot + t) = static_cast<float>(amp / prev);
        wk->at(kv_row + row, kTokSlot + t) = static_cast<float>(-kOwnTokenPenalty * amp / tok);
        if (writes) wo->at(kOutSlot + t, q_row + t) = static_cast<float>(kOutGain);
      }
      break;
    }
  }
}

}  // namespace

TokenVocab RetrievalModelVocab() {
  TokenVocab v;
  for (int i = 0; i < kFiller; ++i) v.filler.push_back(i);
  for (int i = 0; i < kKeys; ++i) v.keys.push_back(kFirstKey + i);
  for (int i = 0; i < kValues; ++i) v.values.push_back(kFirstValue + i);
  return v;
}

std::vector<RetrievalHead> RetrievalCircuitHeads(RetrievalShape shape, int n_layers) {
  if (shape == RetrievalShape::kOneHead) return {{0, 0}, {n_layers - 1, 0}};
  return {{0, 1}, {n_layers - 1, 2}};
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
  const bool mha = options.shape == RetrievalShape::kMultiHead;
  const int n_heads = mha ? kMhaHeads : 1, n_kv_heads = mha ? kMhaKvHeads : 1;
  const int group = n_heads / n_kv_heads;
  const int dim = n_heads * kHeadDim;
  // RoPE frequencies exactly as the loader will compute them from the stored f32 base.
  const std::vector<float> inv_freq = RopeInvFreq(kHeadDim, kRopeBase);

  ResidualNorms norms;
  norms.in = kEmbedGain * kEmbedGain + kConstGain * kConstGain;
  norms.mid = norms.in + kPrevGain * kPrevGain;
  const double sq_out = norms.mid + kOutGain * kOutGain;  // after the induction layer

  GgufWriter w;
  const std::string arch = "llama";
  w.SetString("general.architecture", arch);
  w.SetString("general.name", mha ? "kvsparse multi-head retrieval instrument (constructed weights, not a language model)"
                                  : "kvsparse retrieval instrument (constructed weights, not a language model)");
  w.SetU32("general.file_type", type == DType::kF32 ? 0 : 1);
  w.SetU32(arch + ".context_length", kContext);
  w.SetU32(arch + ".embedding_length", static_cast<uint32_t>(dim));
  w.SetU32(arch + ".block_count", static_cast<uint32_t>(n_layers));
  w.SetU32(arch + ".feed_forward_length", kHidden);
  w.SetU32(arch + ".attention.head_count", static_cast<uint32_t>(n_heads));
  w.SetU32(arch + ".attention.head_count_kv", static_cast<uint32_t>(n_kv_heads));
  w.SetF32(arch + ".attention.layer_norm_rms_epsilon", kRmsEps);
  w.SetF32(arch + ".rope.freq_base", kRopeBase);
  w.SetU32(arch + ".rope.dimension_count", kHeadDim);
  w.SetU32(arch + ".vocab_size", kVocab);
  // Self-description for tools: which ids play which role.
  const TokenVocab vocab = RetrievalModelVocab();
  w.SetI32Array("kvsparse.retrieval.filler", vocab.filler);
  w.SetI32Array("kvsparse.retrieval.keys", vocab.keys);
  w.SetI32Array("kvsparse.retrieval.values", vocab.values);

  Matrix embd(kVocab, dim);  // [n_vocab, dim]
  for (int t = 0; t < kVocab; ++t) {
    embd.at(t, kTokSlot + t) = static_cast<float>(kEmbedGain);
    embd.at(t, kConstDim) = static_cast<float>(kConstGain);
  }
  AddMatrix(&w, "token_embd.weight", type, std::move(embd));
  AddOnes(&w, "output_norm.weight", dim);
  Matrix out(kVocab, dim);  // [n_vocab, dim]: reads only the output slot
  for (int t = 0; t < kVocab; ++t) {
    out.at(t, kOutSlot + t) = static_cast<float>(kAnswerLogit / Normed(kOutGain, sq_out, dim));
  }
  AddMatrix(&w, "output.weight", type, std::move(out));

  for (int l = 0; l < n_layers; ++l) {
    // wq [n_heads * head_dim, dim], wk / wv [n_kv_heads * head_dim, dim], wo [dim, n_heads * head_dim]
    Matrix wq(n_heads * kHeadDim, dim), wk(n_kv_heads * kHeadDim, dim), wv(n_kv_heads * kHeadDim, dim),
        wo(dim, n_heads * kHeadDim);
    for (int h = 0; h < n_kv_heads; ++h) {
      bool writes = false;
      const HeadRole role = RoleOf(options.shape, l, n_layers, h, &writes);
      // Every query head of the group attends alike; only the first one's output is used.
      for (int g = 0; g < group; ++g) {
        const HeadRole query_role =
            options.lone_induction_query_head && g > 0 && role == HeadRole::kInduction ? HeadRole::kUniform : role;
        SetHead(query_role, writes && g == 0, l, norms, dim, inv_freq, static_cast<int64_t>(h * group + g) * kHeadDim,
                static_cast<int64_t>(h) * kHeadDim, &wq, &wk, &wv, &wo);
      }
    }
    const std::string b = fmt::format("blk.{}.", l);
    AddOnes(&w, b + "attn_norm.weight", dim);
    AddMatrix(&w, b + "attn_q.weight", type, std::move(wq));
    AddMatrix(&w, b + "attn_k.weight", type, std::move(wk));
    AddMatrix(&w, b + "attn_v.weight", type, std::move(wv));
    AddMatrix(&w, b + "attn_output.weight", type, std::move(wo));
    AddOnes(&w, b + "ffn_norm.weight", dim);
    AddMatrix(&w, b + "ffn_gate.weight", type, Matrix(kHidden, dim));
    AddMatrix(&w, b + "ffn_up.weight", type, Matrix(kHidden, dim));
    AddMatrix(&w, b + "ffn_down.weight", type, Matrix(dim, kHidden));
  }
  return w.Write(out_path);
}

StatusOr<std::string> BuiltinRetrievalModelPath(RetrievalShape shape) {
  namespace fs = std::filesystem;
  const fs::path dir = ModelCacheDir();
  // The version in the name retires old files when the construction changes.
  const fs::path file = dir / (shape == RetrievalShape::kMultiHead ? "retrieval-mha-v1.gguf" : "retrieval-v1.gguf");
  std::error_code ec;
  if (fs::exists(file, ec)) return file.string();
  fs::create_directories(dir, ec);
  if (ec) return InvalidArgumentError(fmt::format("cannot create cache folder {}: {}", dir.string(), ec.message()));
  // A private temp name, renamed into place: rename is atomic, so a reader never sees a
  // half-written file and concurrent writers just replace one complete file with another.
  static std::atomic<uint64_t> counter{0};
  const fs::path tmp = dir / fmt::format("{}.tmp.{}.{}", file.filename().string(), static_cast<long>(getpid()),
                                         counter.fetch_add(1));
  RetrievalModelOptions options;
  options.shape = shape;
  Status written = WriteRetrievalModel(options, tmp.string());
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
