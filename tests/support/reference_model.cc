#include "support/reference_model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kvsparse/gguf.h"
#include "kvsparse/ops.h"

namespace kvsparse::testing {

namespace {

// Dequantizes a whole GGUF tensor (any supported type) to doubles, row by row.
StatusOr<std::vector<double>> ReadTensor(const GgufFile& file, const std::string& name, int64_t* rows,
                                         int64_t* cols) {
  const GgufTensorInfo* t = file.FindTensor(name);
  if (t == nullptr) return NotFoundError("reference model: tensor '" + name + "' is missing");
  if (!t->type) return UnimplementedError("reference model: tensor '" + name + "' has an unsupported type");
  *cols = t->ne[0];
  *rows = t->NumElements() / *cols;
  const size_t row_bytes = DTypeRowBytes(*t->type, *cols);
  std::vector<float> row(static_cast<size_t>(*cols));
  std::vector<double> out;
  out.reserve(static_cast<size_t>(*rows * *cols));
  for (int64_t r = 0; r < *rows; ++r) {
    ref::DequantizeRow(*t->type, static_cast<const uint8_t*>(t->data) + r * row_bytes, row.data(), *cols);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<ReferenceModel>> ReferenceModel::Load(const std::string& gguf_path) {
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(gguf_path));
  std::unique_ptr<ReferenceModel> m(new ReferenceModel());
  KVS_ASSIGN_OR_RETURN(std::string_view arch_view, file->GetString("general.architecture"));
  const std::string arch(arch_view);
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3") {
    return UnimplementedError("reference model: architecture " + arch);
  }
  m->neox_rope_ = arch != "llama";
  const std::string p = arch + ".";
  KVS_ASSIGN_OR_RETURN(uint64_t dim, file->GetUInt(p + "embedding_length"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_layers, file->GetUInt(p + "block_count"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_heads, file->GetUInt(p + "attention.head_count"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_kv_heads, file->GetUIntOr(p + "attention.head_count_kv", n_heads));
  KVS_ASSIGN_OR_RETURN(m->eps_, file->GetFloat(p + "attention.layer_norm_rms_epsilon"));
  KVS_ASSIGN_OR_RETURN(double theta, file->GetFloatOr(p + "rope.freq_base", 10000.0));
  m->dim_ = static_cast<int>(dim);
  m->n_layers_ = static_cast<int>(n_layers);
  m->n_heads_ = static_cast<int>(n_heads);
  m->n_kv_heads_ = static_cast<int>(n_kv_heads);
  KVS_ASSIGN_OR_RETURN(uint64_t key_length, file->GetUIntOr(p + "attention.key_length", dim / n_heads));
  m->head_dim_ = static_cast<int>(key_length);

  // Pair i turns by pos * theta^(-2i/head_dim), slowed by rope_freqs[i] and a linear factor when given.
  double linear = 1.0;
  if (file->Find(p + "rope.scaling.type") != nullptr && *file->GetString(p + "rope.scaling.type") == "linear") {
    linear = *file->GetFloat(p + "rope.scaling.factor");
  }
  std::vector<double> factors(static_cast<size_t>(m->head_dim_ / 2), 1.0);
  if (file->FindTensor("rope_freqs.weight") != nullptr) {
    int64_t rows, cols;
    KVS_ASSIGN_OR_RETURN(factors, ReadTensor(*file, "rope_freqs.weight", &rows, &cols));
  }
  for (int i = 0; i < m->head_dim_ / 2; ++i) {
    m->freq_.push_back(std::pow(theta, -2.0 * i / m->head_dim_) / factors[static_cast<size_t>(i)] / linear);
  }

  auto matrix = [&](const std::string& name, Matrix* out) -> Status {
    KVS_ASSIGN_OR_RETURN(out->w, ReadTensor(*file, name, &out->rows, &out->cols));
    return Status::Ok();
  };
  auto vec = [&](const std::string& name, std::vector<double>* out) -> Status {
    int64_t rows, cols;
    KVS_ASSIGN_OR_RETURN(*out, ReadTensor(*file, name, &rows, &cols));
    return Status::Ok();
  };
  KVS_RETURN_IF_ERROR(matrix("token_embd.weight", &m->embedding_));
  m->n_vocab_ = static_cast<int>(m->embedding_.rows);
  KVS_RETURN_IF_ERROR(vec("output_norm.weight", &m->output_norm_));
  if (file->FindTensor("output.weight") != nullptr) {
    KVS_RETURN_IF_ERROR(matrix("output.weight", &m->output_));
  } else {
    m->output_ = m->embedding_;
  }
  m->layers_.resize(n_layers);
  for (uint64_t l = 0; l < n_layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string b = "blk." + std::to_string(l) + ".";
    KVS_RETURN_IF_ERROR(vec(b + "attn_norm.weight", &L.attn_norm));
    KVS_RETURN_IF_ERROR(vec(b + "ffn_norm.weight", &L.ffn_norm));
    KVS_RETURN_IF_ERROR(matrix(b + "attn_q.weight", &L.wq));
    KVS_RETURN_IF_ERROR(matrix(b + "attn_k.weight", &L.wk));
    KVS_RETURN_IF_ERROR(matrix(b + "attn_v.weight", &L.wv));
    KVS_RETURN_IF_ERROR(matrix(b + "attn_output.weight", &L.wo));
    KVS_RETURN_IF_ERROR(matrix(b + "ffn_gate.weight", &L.gate));
    KVS_RETURN_IF_ERROR(matrix(b + "ffn_up.weight", &L.up));
    KVS_RETURN_IF_ERROR(matrix(b + "ffn_down.weight", &L.down));
    if (arch == "qwen3") {
      KVS_RETURN_IF_ERROR(vec(b + "attn_q_norm.weight", &L.q_norm));
      KVS_RETURN_IF_ERROR(vec(b + "attn_k_norm.weight", &L.k_norm));
    }
    if (file->FindTensor(b + "attn_q.bias") != nullptr) {
      KVS_RETURN_IF_ERROR(vec(b + "attn_q.bias", &L.bq));
      KVS_RETURN_IF_ERROR(vec(b + "attn_k.bias", &L.bk));
      KVS_RETURN_IF_ERROR(vec(b + "attn_v.bias", &L.bv));
    }
  }
  return m;
}

std::vector<double> ReferenceModel::Apply(const Matrix& m, const std::vector<double>& x,
                                          const std::vector<double>* bias) {
  std::vector<double> y(static_cast<size_t>(m.rows));
  for (int64_t r = 0; r < m.rows; ++r) {
    double sum = (bias != nullptr && !bias->empty()) ? (*bias)[static_cast<size_t>(r)] : 0.0;
    for (int64_t c = 0; c < m.cols; ++c) sum += m.w[static_cast<size_t>(r * m.cols + c)] * x[static_cast<size_t>(c)];
    y[static_cast<size_t>(r)] = sum;
  }
  return y;
}

std::vector<double> ReferenceModel::RmsNorm(const std::vector<double>& x, const std::vector<double>& weight) const {
  double sum_sq = 0;
  for (double v : x) sum_sq += v * v;
  const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(x.size()) + eps_);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv_rms * weight[i];
  return out;
}

void ReferenceModel::HeadNorm(std::vector<double>& x, int n_heads, const std::vector<double>& weight) const {
  for (int h = 0; h < n_heads; ++h) {
    const auto first = x.begin() + static_cast<int64_t>(h) * head_dim_;
    const std::vector<double> normed = RmsNorm(std::vector<double>(first, first + head_dim_), weight);
    std::copy(normed.begin(), normed.end(), first);
  }
}

void ReferenceModel::Rope(std::vector<double>& x, int n_heads, int pos) const {
  const int half = head_dim_ / 2;
  for (int h = 0; h < n_heads; ++h) {
    double* head = &x[static_cast<size_t>(h) * head_dim_];
    for (int i = 0; i < half; ++i) {
      const double angle = pos * freq_[static_cast<size_t>(i)];
      // llama rotates neighbours (2i, 2i+1); NEOX rotates (i, i + head_dim/2).
      const int a = neox_rope_ ? i : 2 * i;
      const int b = neox_rope_ ? i + half : 2 * i + 1;
      const double x0 = head[a], x1 = head[b];
      head[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
      head[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
    }
  }
}

std::vector<double> ReferenceModel::Forward(const std::vector<int32_t>& tokens) const {
  const size_t n = tokens.size();
  std::vector<std::vector<double>> x(n);  // [n][dim] residual stream
  for (size_t t = 0; t < n; ++t) {
    const auto first = embedding_.w.begin() + static_cast<int64_t>(tokens[t]) * dim_;
    x[t].assign(first, first + dim_);
  }
  const int group = n_heads_ / n_kv_heads_;
  for (const Layer& L : layers_) {
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> h = RmsNorm(x[t], L.attn_norm);
      q[t] = Apply(L.wq, h, &L.bq);
      k[t] = Apply(L.wk, h, &L.bk);
      v[t] = Apply(L.wv, h, &L.bv);
      if (!L.q_norm.empty()) {  // qwen3: RMSNorm per head before RoPE
        HeadNorm(q[t], n_heads_, L.q_norm);
        HeadNorm(k[t], n_kv_heads_, L.k_norm);
      }
      Rope(q[t], n_heads_, static_cast<int>(t));
      Rope(k[t], n_kv_heads_, static_cast<int>(t));
    }
    for (size_t t = 0; t < n; ++t) {
      std::vector<double> att(static_cast<size_t>(n_heads_) * head_dim_, 0.0);
      for (int h = 0; h < n_heads_; ++h) {
        const int kv_head = h / group;
        const double* qh = &q[t][static_cast<size_t>(h) * head_dim_];
        // Causal: token t sees tokens 0..t.
        std::vector<double> score(t + 1);
        double max_score = -INFINITY;
        for (size_t s = 0; s <= t; ++s) {
          const double* kh = &k[s][static_cast<size_t>(kv_head) * head_dim_];
          double dot = 0;
          for (int d = 0; d < head_dim_; ++d) dot += qh[d] * kh[d];
          score[s] = dot / std::sqrt(static_cast<double>(head_dim_));
          max_score = std::max(max_score, score[s]);
        }
        double total = 0;
        for (double& sc : score) total += (sc = std::exp(sc - max_score));
        for (size_t s = 0; s <= t; ++s) {
          const double* vh = &v[s][static_cast<size_t>(kv_head) * head_dim_];
          for (int d = 0; d < head_dim_; ++d) att[static_cast<size_t>(h) * head_dim_ + d] += score[s] / total * vh[d];
        }
      }
      const std::vector<double> o = Apply(L.wo, att);
      for (int d = 0; d < dim_; ++d) x[t][static_cast<size_t>(d)] += o[static_cast<size_t>(d)];
    }
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> h = RmsNorm(x[t], L.ffn_norm);
      std::vector<double> gate = Apply(L.gate, h);
      const std::vector<double> up = Apply(L.up, h);
      for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
      const std::vector<double> down = Apply(L.down, gate);
      for (int d = 0; d < dim_; ++d) x[t][static_cast<size_t>(d)] += down[static_cast<size_t>(d)];
    }
  }
  std::vector<double> logits;
  logits.reserve(n * static_cast<size_t>(n_vocab_));
  for (size_t t = 0; t < n; ++t) {
    const std::vector<double> row = Apply(output_, RmsNorm(x[t], output_norm_));
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

}  // namespace kvsparse::testing
