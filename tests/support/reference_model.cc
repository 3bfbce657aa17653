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
  const bool gemma = arch == "gemma2" || arch == "gemma3";
  const bool moe_arch = arch == "qwen2moe" || arch == "qwen3moe" || arch == "olmoe";
  const bool deepseek = arch == "deepseek2";
  const bool gpt_oss = arch == "gpt-oss";
  m->gpt_oss_ = gpt_oss;
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && !gemma && arch != "phi3" && !moe_arch && !deepseek &&
      !gpt_oss) {
    return UnimplementedError("reference model: architecture " + arch);
  }
  // llama.cpp's graphs: Mixtral (llama) and qwen3moe renormalize the chosen experts' weights.
  m->expert_weights_norm_ = arch == "llama" || arch == "qwen3moe";
  m->qk_norm_full_width_ = arch == "olmoe";
  // qwen2moe, qwen3moe and olmoe rotate NEOX halves too; deepseek2 adjacent pairs, as llama.
  m->neox_rope_ = arch != "llama" && arch != "deepseek2";
  m->gelu_ = gemma;
  const std::string p = arch + ".";
  KVS_ASSIGN_OR_RETURN(uint64_t dim, file->GetUInt(p + "embedding_length"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_layers, file->GetUInt(p + "block_count"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_heads, file->GetUInt(p + "attention.head_count"));
  KVS_ASSIGN_OR_RETURN(uint64_t n_kv_heads, file->GetUIntOr(p + "attention.head_count_kv", n_heads));
  KVS_ASSIGN_OR_RETURN(uint64_t context, file->GetUInt(p + "context_length"));
  KVS_ASSIGN_OR_RETURN(m->eps_, file->GetFloat(p + "attention.layer_norm_rms_epsilon"));
  KVS_ASSIGN_OR_RETURN(double theta, file->GetFloatOr(p + "rope.freq_base", 10000.0));
  KVS_ASSIGN_OR_RETURN(uint64_t n_experts, file->GetUIntOr(p + "expert_count", 0));
  KVS_ASSIGN_OR_RETURN(uint64_t n_experts_used, file->GetUIntOr(p + "expert_used_count", 0));
  m->n_experts_ = static_cast<int>(n_experts);
  m->n_experts_used_ = static_cast<int>(n_experts_used);
  m->dim_ = static_cast<int>(dim);
  m->n_layers_ = static_cast<int>(n_layers);
  m->n_heads_ = static_cast<int>(n_heads);
  m->n_kv_heads_ = static_cast<int>(n_kv_heads);
  KVS_ASSIGN_OR_RETURN(uint64_t key_length, file->GetUIntOr(p + "attention.key_length", dim / n_heads));
  m->head_dim_ = static_cast<int>(key_length);
  m->query_scale_ = 1.0 / std::sqrt(static_cast<double>(m->head_dim_));
  uint64_t n_dense_lead = 0;
  if (deepseek) {
    m->mla_ = true;
    KVS_ASSIGN_OR_RETURN(uint64_t rank, file->GetUInt(p + "attention.kv_lora_rank"));
    KVS_ASSIGN_OR_RETURN(uint64_t rope, file->GetUInt(p + "rope.dimension_count"));
    KVS_ASSIGN_OR_RETURN(uint64_t key_mla, file->GetUIntOr(p + "attention.key_length_mla", key_length));
    KVS_ASSIGN_OR_RETURN(uint64_t value_length, file->GetUIntOr(p + "attention.value_length", key_length));
    KVS_ASSIGN_OR_RETURN(uint64_t value_mla, file->GetUIntOr(p + "attention.value_length_mla", value_length));
    KVS_ASSIGN_OR_RETURN(n_dense_lead, file->GetUIntOr(p + "leading_dense_block_count", 0));
    KVS_ASSIGN_OR_RETURN(m->expert_weights_scale_, file->GetFloatOr(p + "expert_weights_scale", 1.0));
    KVS_ASSIGN_OR_RETURN(uint64_t gating, file->GetUIntOr(p + "expert_gating_func", 1));
    m->sigmoid_gating_ = gating == 2;
    if (file->Find(p + "expert_weights_norm") != nullptr) {
      KVS_ASSIGN_OR_RETURN(m->expert_weights_norm_, file->GetBool(p + "expert_weights_norm"));
    }
    m->kv_lora_rank_ = static_cast<int>(rank);
    m->mla_nope_ = static_cast<int>(key_mla - rope);
    m->mla_v_head_ = static_cast<int>(value_mla);
    m->head_dim_ = static_cast<int>(rope);  // RoPE turns only this part of each head
    m->query_scale_ = 1.0 / std::sqrt(static_cast<double>(key_mla));
  }
  if (gemma) {
    m->embedding_scale_ = std::sqrt(static_cast<double>(dim));
    KVS_ASSIGN_OR_RETURN(m->query_scale_, file->GetFloatOr(p + "attention.scale", m->query_scale_));
  }
  if (arch == "gemma2") {
    KVS_ASSIGN_OR_RETURN(m->attn_softcap_, file->GetFloatOr(p + "attn_logit_softcapping", 50.0));
    KVS_ASSIGN_OR_RETURN(m->final_softcap_, file->GetFloatOr(p + "final_logit_softcapping", 30.0));
  } else if (arch == "gemma3") {
    KVS_ASSIGN_OR_RETURN(m->final_softcap_, file->GetFloatOr(p + "final_logit_softcapping", 0.0));
  }
  // Sliding layers: gemma2 every other layer (window 4096 unless stated), gemma3 five of six.
  uint64_t window = 0, period = 1;
  if (gemma) {
    KVS_ASSIGN_OR_RETURN(window, file->GetUIntOr(p + "attention.sliding_window", arch == "gemma2" ? 4096 : 0));
    KVS_ASSIGN_OR_RETURN(period, file->GetUIntOr(p + "attention.sliding_window_pattern", arch == "gemma2" ? 2 : 6));
  } else if (gpt_oss) {  // the even layers slide
    KVS_ASSIGN_OR_RETURN(window, file->GetUInt(p + "attention.sliding_window"));
    KVS_ASSIGN_OR_RETURN(period, file->GetUIntOr(p + "attention.sliding_window_pattern", 2));
  }
  KVS_ASSIGN_OR_RETURN(double theta_sliding,
                       file->GetFloatOr(p + "rope.freq_base_swa", arch == "gemma3" ? 10000.0 : theta));

  // Pair i turns by pos * theta^(-2i/head_dim), slowed by rope_freqs[i] (or LongRoPE's factors)
  // and by the context scaling: linear divides, YaRN blends the divided and the plain speed.
  std::string scaling = "none";
  double factor = 1.0;
  if (file->Find(p + "rope.scaling.type") != nullptr) {
    scaling = std::string(*file->GetString(p + "rope.scaling.type"));
    KVS_ASSIGN_OR_RETURN(factor, file->GetFloatOr(p + "rope.scaling.factor", 1.0));
  }
  KVS_ASSIGN_OR_RETURN(uint64_t original_context, file->GetUIntOr(p + "rope.scaling.original_context_length", context));
  KVS_ASSIGN_OR_RETURN(const double attn_factor, file->GetFloatOr(p + "rope.scaling.attn_factor", 1.0));
  std::vector<double> factors(static_cast<size_t>(m->head_dim_ / 2), 1.0);
  int64_t rows, cols;
  if (file->FindTensor("rope_freqs.weight") != nullptr) {
    KVS_ASSIGN_OR_RETURN(factors, ReadTensor(*file, "rope_freqs.weight", &rows, &cols));
  } else if (file->FindTensor("rope_factors_long.weight") != nullptr) {
    // LongRoPE: the long table when the context (here the training context) exceeds the original.
    const char* table = context > original_context ? "rope_factors_long.weight" : "rope_factors_short.weight";
    KVS_ASSIGN_OR_RETURN(factors, ReadTensor(*file, table, &rows, &cols));
  }
  const int hd = m->head_dim_;
  auto global_freq = [&]() {
    std::vector<double> freq;
    // YaRN's ramp bounds: the dims turning beta_fast (32) and beta_slow (1) times over the original context.
    auto corr = [&](double turns) {
      return hd * std::log(static_cast<double>(original_context) / (turns * 2 * M_PI)) / (2 * std::log(theta));
    };
    const double low = std::max(0.0, std::floor(corr(32.0)));
    const double high = std::min(static_cast<double>(hd - 1), std::ceil(corr(1.0)));
    for (int i = 0; i < hd / 2; ++i) {
      const double plain = std::pow(theta, -2.0 * i / hd) / factors[static_cast<size_t>(i)];
      if (scaling == "linear") {
        freq.push_back(plain / factor);
      } else if (scaling == "yarn") {
        const double ramp = 1.0 - std::clamp((i - low) / std::max(0.001, high - low), 0.0, 1.0);
        freq.push_back(plain / factor * (1.0 - ramp) + plain * ramp);
      } else {
        freq.push_back(plain);
      }
    }
    return freq;
  };
  double yarn_mscale = scaling == "yarn" && factor > 1.0 ? 1.0 + 0.1 * std::log(factor) : 1.0;
  if (deepseek) {
    // DeepSeek's YaRN (its modeling code): the rotated parts keep their length when the file has
    // a log multiplier (0.1 mscale_all_dim), and the scores scale by (1 + that * ln factor)^2.
    KVS_ASSIGN_OR_RETURN(const double log_mul, file->GetFloatOr(p + "rope.scaling.yarn_log_multiplier", 0.0));
    const double ln_factor = scaling == "none" ? 0.0 : std::log(factor);
    const double rotated = log_mul != 0.0 ? 1.0 : yarn_mscale;
    const double mscale = rotated * (1.0 + log_mul * ln_factor);
    m->query_scale_ *= mscale * mscale;
    yarn_mscale = rotated;
  }

  auto matrix = [&](const std::string& name, Matrix* out) -> Status {
    KVS_ASSIGN_OR_RETURN(out->w, ReadTensor(*file, name, &out->rows, &out->cols));
    return Status::Ok();
  };
  auto vec = [&](const std::string& name, std::vector<double>* out) -> Status {
    int64_t r, c;
    KVS_ASSIGN_OR_RETURN(*out, ReadTensor(*file, name, &r, &c));
    return Status::Ok();
  };
  // Rows [first, first + n) of a fused matrix.
  auto split = [](const Matrix& fused, int64_t first, int64_t n) {
    Matrix part;
    part.rows = n;
    part.cols = fused.cols;
    part.w.assign(fused.w.begin() + first * fused.cols, fused.w.begin() + (first + n) * fused.cols);
    return part;
  };
  KVS_RETURN_IF_ERROR(matrix("token_embd.weight", &m->embedding_));
  m->n_vocab_ = static_cast<int>(m->embedding_.rows);
  KVS_RETURN_IF_ERROR(vec("output_norm.weight", &m->output_norm_));
  if (file->FindTensor("output.weight") != nullptr) {
    KVS_RETURN_IF_ERROR(matrix("output.weight", &m->output_));
  } else {
    m->output_ = m->embedding_;
  }
  const int64_t q_dim = static_cast<int64_t>(n_heads) * hd, kv_dim = static_cast<int64_t>(n_kv_heads) * hd;
  m->layers_.resize(n_layers);
  for (uint64_t l = 0; l < n_layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string b = "blk." + std::to_string(l) + ".";
    const bool sliding = window > 0 && (period == 0 || l % period < period - 1);
    L.window = sliding ? static_cast<int>(window) : 0;
    // gemma3's sliding layers: their own base, none of the file's scaling.
    if (sliding && (arch == "gemma3" || theta_sliding != theta)) {
      for (int i = 0; i < hd / 2; ++i) L.freq.push_back(std::pow(theta_sliding, -2.0 * i / hd));
      L.rope_magnitude = attn_factor;
    } else {
      L.freq = global_freq();
      L.rope_magnitude = attn_factor * yarn_mscale;
    }
    KVS_RETURN_IF_ERROR(vec(b + "attn_norm.weight", &L.attn_norm));
    KVS_RETURN_IF_ERROR(vec(b + (gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight"), &L.ffn_norm));
    if (gpt_oss) {
      KVS_RETURN_IF_ERROR(vec(b + "attn_output.bias", &L.bo));
      KVS_RETURN_IF_ERROR(vec(b + "attn_sinks.weight", &L.sinks));
      KVS_RETURN_IF_ERROR(vec(b + "ffn_gate_inp.bias", &L.router_bias));
      // [n_experts, n] tables, read as one vector and cut per expert.
      auto table = [&](const std::string& name, std::vector<std::vector<double>>* out) -> Status {
        std::vector<double> all;
        KVS_RETURN_IF_ERROR(vec(name, &all));
        const size_t n = all.size() / n_experts;
        for (uint64_t e = 0; e < n_experts; ++e) out->emplace_back(all.begin() + e * n, all.begin() + (e + 1) * n);
        return Status::Ok();
      };
      KVS_RETURN_IF_ERROR(table(b + "ffn_gate_exps.bias", &L.expert_gate_bias));
      KVS_RETURN_IF_ERROR(table(b + "ffn_up_exps.bias", &L.expert_up_bias));
      KVS_RETURN_IF_ERROR(table(b + "ffn_down_exps.bias", &L.expert_down_bias));
    }
    if (deepseek) {
      if (file->FindTensor(b + "attn_q_a.weight") != nullptr) {
        KVS_RETURN_IF_ERROR(matrix(b + "attn_q_a.weight", &L.wq_a));
        KVS_RETURN_IF_ERROR(vec(b + "attn_q_a_norm.weight", &L.q_a_norm));
        KVS_RETURN_IF_ERROR(matrix(b + "attn_q_b.weight", &L.wq));
      } else {
        KVS_RETURN_IF_ERROR(matrix(b + "attn_q.weight", &L.wq));
      }
      KVS_RETURN_IF_ERROR(matrix(b + "attn_kv_a_mqa.weight", &L.wkv_a));
      KVS_RETURN_IF_ERROR(vec(b + "attn_kv_a_norm.weight", &L.kv_a_norm));
      const int64_t rank = m->kv_lora_rank_, nope = m->mla_nope_, v_head = m->mla_v_head_;
      if (file->FindTensor(b + "attn_kv_b.weight") != nullptr) {  // [heads * (nope + v_head), rank]
        Matrix kv_b;
        KVS_RETURN_IF_ERROR(matrix(b + "attn_kv_b.weight", &kv_b));
        for (uint64_t h = 0; h < n_heads; ++h) {
          L.k_up.push_back(split(kv_b, static_cast<int64_t>(h) * (nope + v_head), nope));
          L.v_up.push_back(split(kv_b, static_cast<int64_t>(h) * (nope + v_head) + nope, v_head));
        }
      } else {  // attn_k_b: per head [rank, nope], the transpose of k_up; attn_v_b: per head [v_head, rank]
        Matrix k_b, v_b;
        KVS_RETURN_IF_ERROR(matrix(b + "attn_k_b.weight", &k_b));
        KVS_RETURN_IF_ERROR(matrix(b + "attn_v_b.weight", &v_b));
        for (uint64_t h = 0; h < n_heads; ++h) {
          Matrix up{nope, rank, std::vector<double>(static_cast<size_t>(nope * rank))};
          for (int64_t r = 0; r < rank; ++r) {
            for (int64_t c = 0; c < nope; ++c) {
              up.w[static_cast<size_t>(c * rank + r)] = k_b.w[static_cast<size_t>((h * rank + r) * nope + c)];
            }
          }
          L.k_up.push_back(std::move(up));
          L.v_up.push_back(split(v_b, static_cast<int64_t>(h) * v_head, v_head));
        }
      }
    } else if (file->FindTensor(b + "attn_qkv.weight") != nullptr) {  // phi3: Q, K, V rows in one matrix
      Matrix qkv;
      KVS_RETURN_IF_ERROR(matrix(b + "attn_qkv.weight", &qkv));
      L.wq = split(qkv, 0, q_dim);
      L.wk = split(qkv, q_dim, kv_dim);
      L.wv = split(qkv, q_dim + kv_dim, kv_dim);
    } else {
      KVS_RETURN_IF_ERROR(matrix(b + "attn_q.weight", &L.wq));
      KVS_RETURN_IF_ERROR(matrix(b + "attn_k.weight", &L.wk));
      KVS_RETURN_IF_ERROR(matrix(b + "attn_v.weight", &L.wv));
    }
    KVS_RETURN_IF_ERROR(matrix(b + "attn_output.weight", &L.wo));
    // Expert e's matrix: rows [e * rows, (e + 1) * rows) of the 3-D tensor read as 2-D.
    auto experts = [&](const std::string& name, std::vector<Matrix>* out) -> Status {
      Matrix all;
      KVS_RETURN_IF_ERROR(matrix(name, &all));
      const int64_t rows = all.rows / static_cast<int64_t>(n_experts);
      for (uint64_t e = 0; e < n_experts; ++e) out->push_back(split(all, static_cast<int64_t>(e) * rows, rows));
      return Status::Ok();
    };
    L.moe = n_experts > 0 && l >= n_dense_lead;
    if (L.moe) {
      KVS_RETURN_IF_ERROR(matrix(b + "ffn_gate_inp.weight", &L.router));
      if (file->FindTensor(b + "exp_probs_b.bias") != nullptr) {
        KVS_RETURN_IF_ERROR(vec(b + "exp_probs_b.bias", &L.selection_bias));
      }
      KVS_RETURN_IF_ERROR(experts(b + "ffn_gate_exps.weight", &L.expert_gate));
      KVS_RETURN_IF_ERROR(experts(b + "ffn_up_exps.weight", &L.expert_up));
      KVS_RETURN_IF_ERROR(experts(b + "ffn_down_exps.weight", &L.expert_down));
      if (file->FindTensor(b + "ffn_gate_shexp.weight") != nullptr) {
        if (file->FindTensor(b + "ffn_gate_inp_shexp.weight") != nullptr) {
          KVS_RETURN_IF_ERROR(vec(b + "ffn_gate_inp_shexp.weight", &L.shared_expert_gate));
        }
        KVS_RETURN_IF_ERROR(matrix(b + "ffn_gate_shexp.weight", &L.shared_gate));
        KVS_RETURN_IF_ERROR(matrix(b + "ffn_up_shexp.weight", &L.shared_up));
        KVS_RETURN_IF_ERROR(matrix(b + "ffn_down_shexp.weight", &L.shared_down));
      }
    } else if (file->FindTensor(b + "ffn_gate.weight") != nullptr) {
      KVS_RETURN_IF_ERROR(matrix(b + "ffn_gate.weight", &L.gate));
      KVS_RETURN_IF_ERROR(matrix(b + "ffn_up.weight", &L.up));
    } else {  // phi3: ffn_up holds the gate's rows, then the up projection's
      Matrix gate_up;
      KVS_RETURN_IF_ERROR(matrix(b + "ffn_up.weight", &gate_up));
      L.gate = split(gate_up, 0, gate_up.rows / 2);
      L.up = split(gate_up, gate_up.rows / 2, gate_up.rows / 2);
    }
    if (!L.moe) {
      KVS_RETURN_IF_ERROR(matrix(b + "ffn_down.weight", &L.down));
    }
    if (arch == "qwen3" || arch == "qwen3moe" || arch == "olmoe" || arch == "gemma3") {
      KVS_RETURN_IF_ERROR(vec(b + "attn_q_norm.weight", &L.q_norm));
      KVS_RETURN_IF_ERROR(vec(b + "attn_k_norm.weight", &L.k_norm));
    }
    if (gemma) {
      KVS_RETURN_IF_ERROR(vec(b + "post_attention_norm.weight", &L.post_attn_norm));
      KVS_RETURN_IF_ERROR(vec(b + "post_ffw_norm.weight", &L.post_ffn_norm));
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

void ReferenceModel::Rope(std::vector<double>& x, int n_heads, int pos, const std::vector<double>& freq,
                          double magnitude) const {
  const int half = head_dim_ / 2;
  for (int h = 0; h < n_heads; ++h) {
    double* head = &x[static_cast<size_t>(h) * head_dim_];
    for (int i = 0; i < half; ++i) {
      const double angle = pos * freq[static_cast<size_t>(i)];
      // llama rotates neighbours (2i, 2i+1); NEOX rotates (i, i + head_dim/2).
      const int a = neox_rope_ ? i : 2 * i;
      const int b = neox_rope_ ? i + half : 2 * i + 1;
      const double x0 = head[a], x1 = head[b];
      head[a] = (x0 * std::cos(angle) - x1 * std::sin(angle)) * magnitude;
      head[b] = (x0 * std::sin(angle) + x1 * std::cos(angle)) * magnitude;
    }
  }
}

std::vector<double> ReferenceModel::Ffn(const Matrix& gate_m, const Matrix& up_m, const Matrix& down_m,
                                        const std::vector<double>& h, const std::vector<double>* gate_bias,
                                        const std::vector<double>* up_bias, const std::vector<double>* down_bias) const {
  std::vector<double> gate = Apply(gate_m, h, gate_bias);
  const std::vector<double> up = Apply(up_m, h, up_bias);
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = gate[i];
    if (gpt_oss_) {  // OpenAI's reference: alpha 1.702, both parts clamped at 7, the linear one shifted by 1
      const double gc = std::min(g, 7.0), uc = std::clamp(up[i], -7.0, 7.0);
      gate[i] = gc / (1.0 + std::exp(-1.702 * gc)) * (uc + 1.0);
      continue;
    }
    const double act = gelu_ ? 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)))
                             : g / (1.0 + std::exp(-g));
    gate[i] = act * up[i];
  }
  return Apply(down_m, gate, down_bias);
}

// The n_experts_used most probable experts by softmax of the router, weighted by their
// probabilities (renormalized where the architecture does), plus the sigmoid-gated shared expert.
std::vector<double> ReferenceModel::Moe(const Layer& L, const std::vector<double>& h) const {
  const std::vector<double> logits = Apply(L.router, h, &L.router_bias);
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> prob(logits.size());
  if (gpt_oss_) {  // the logits choose; the chosen ones' softmax weighs (below)
    prob = logits;
  } else if (sigmoid_gating_) {
    for (size_t e = 0; e < logits.size(); ++e) prob[e] = 1.0 / (1.0 + std::exp(-logits[e]));
  } else {
    double total = 0;
    for (size_t e = 0; e < logits.size(); ++e) total += (prob[e] = std::exp(logits[e] - top));
    for (double& p : prob) p /= total;
  }
  // The choice is by probability, plus DeepSeek-V3's selection bias; the weights stay unbiased.
  std::vector<double> choice = prob;
  for (size_t e = 0; e < L.selection_bias.size(); ++e) choice[e] += L.selection_bias[e];
  std::vector<int> order(logits.size());
  for (size_t e = 0; e < order.size(); ++e) order[e] = static_cast<int>(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  order.resize(static_cast<size_t>(n_experts_used_));
  if (gpt_oss_) {
    const double chosen_top = prob[order[0]];
    double total = 0;
    for (int e : order) total += std::exp(prob[e] - chosen_top);
    for (int e : order) prob[e] = std::exp(prob[e] - chosen_top) / total;
  }
  double chosen_sum = 0;
  for (int e : order) chosen_sum += prob[e];
  std::vector<double> out(static_cast<size_t>(dim_), 0.0);
  for (int e : order) {
    const double weight = (expert_weights_norm_ ? prob[e] / chosen_sum : prob[e]) * expert_weights_scale_;
    const bool biased = !L.expert_gate_bias.empty();
    const std::vector<double> y = Ffn(L.expert_gate[e], L.expert_up[e], L.expert_down[e], h,
                                      biased ? &L.expert_gate_bias[e] : nullptr, biased ? &L.expert_up_bias[e] : nullptr,
                                      biased ? &L.expert_down_bias[e] : nullptr);
    for (int d = 0; d < dim_; ++d) out[d] += weight * y[d];
  }
  if (!L.shared_gate.w.empty()) {  // qwen2moe's behind a sigmoid gate, deepseek2's ungated
    double logit = 0;
    for (int d = 0; d < dim_; ++d) logit += L.shared_expert_gate.empty() ? 0.0 : L.shared_expert_gate[d] * h[d];
    const double gate = L.shared_expert_gate.empty() ? 1.0 : 1.0 / (1.0 + std::exp(-logit));
    const std::vector<double> y = Ffn(L.shared_gate, L.shared_up, L.shared_down, h);
    for (int d = 0; d < dim_; ++d) out[d] += gate * y[d];
  }
  return out;
}

std::vector<double> ReferenceModel::Forward(const std::vector<int32_t>& tokens) const {
  const size_t n = tokens.size();
  std::vector<std::vector<double>> x(n);  // [n][dim] residual stream
  for (size_t t = 0; t < n; ++t) {
    const auto first = embedding_.w.begin() + static_cast<int64_t>(tokens[t]) * dim_;
    x[t].assign(first, first + dim_);
    for (double& v : x[t]) v *= embedding_scale_;
  }
  const int group = n_heads_ / n_kv_heads_;
  for (const Layer& L : layers_) {
    if (mla_) {
      const std::vector<std::vector<double>> o = LatentAttention(L, x);
      for (size_t t = 0; t < n; ++t) {
        for (int d = 0; d < dim_; ++d) x[t][static_cast<size_t>(d)] += o[t][static_cast<size_t>(d)];
      }
    }
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (size_t t = 0; t < n && !mla_; ++t) {
      const std::vector<double> h = RmsNorm(x[t], L.attn_norm);
      q[t] = Apply(L.wq, h, &L.bq);
      k[t] = Apply(L.wk, h, &L.bk);
      v[t] = Apply(L.wv, h, &L.bv);
      if (!L.q_norm.empty() && qk_norm_full_width_) {  // olmoe: over the whole projection
        q[t] = RmsNorm(q[t], L.q_norm);
        k[t] = RmsNorm(k[t], L.k_norm);
      } else if (!L.q_norm.empty()) {  // qwen3: RMSNorm per head before RoPE
        HeadNorm(q[t], n_heads_, L.q_norm);
        HeadNorm(k[t], n_kv_heads_, L.k_norm);
      }
      Rope(q[t], n_heads_, static_cast<int>(t), L.freq, L.rope_magnitude);
      Rope(k[t], n_kv_heads_, static_cast<int>(t), L.freq, L.rope_magnitude);
    }
    for (size_t t = 0; t < n && !mla_; ++t) {
      std::vector<double> att(static_cast<size_t>(n_heads_) * head_dim_, 0.0);
      for (int h = 0; h < n_heads_; ++h) {
        const int kv_head = h / group;
        const double* qh = &q[t][static_cast<size_t>(h) * head_dim_];
        // Causal: token t sees tokens 0..t; a sliding layer only those with t - s < window.
        const size_t first = L.window > 0 && t + 1 > static_cast<size_t>(L.window) ? t + 1 - L.window : 0;
        std::vector<double> score(t + 1, 0.0);
        double max_score = -INFINITY;
        for (size_t s = first; s <= t; ++s) {
          const double* kh = &k[s][static_cast<size_t>(kv_head) * head_dim_];
          double dot = 0;
          for (int d = 0; d < head_dim_; ++d) dot += qh[d] * kh[d];
          score[s] = dot * query_scale_;
          if (attn_softcap_ > 0) score[s] = attn_softcap_ * std::tanh(score[s] / attn_softcap_);
          max_score = std::max(max_score, score[s]);
        }
        // gpt-oss's sink: one more logit in the denominator, without a value.
        if (!L.sinks.empty()) max_score = std::max(max_score, L.sinks[static_cast<size_t>(h)]);
        double total = L.sinks.empty() ? 0.0 : std::exp(L.sinks[static_cast<size_t>(h)] - max_score);
        for (size_t s = first; s <= t; ++s) total += (score[s] = std::exp(score[s] - max_score));
        for (size_t s = first; s <= t; ++s) {
          const double* vh = &v[s][static_cast<size_t>(kv_head) * head_dim_];
          for (int d = 0; d < head_dim_; ++d) att[static_cast<size_t>(h) * head_dim_ + d] += score[s] / total * vh[d];
        }
      }
      std::vector<double> o = Apply(L.wo, att, &L.bo);
      if (!L.post_attn_norm.empty()) o = RmsNorm(o, L.post_attn_norm);
      for (int d = 0; d < dim_; ++d) x[t][static_cast<size_t>(d)] += o[static_cast<size_t>(d)];
    }
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> h = RmsNorm(x[t], L.ffn_norm);
      std::vector<double> down = L.moe ? Moe(L, h) : Ffn(L.gate, L.up, L.down, h);
      if (!L.post_ffn_norm.empty()) down = RmsNorm(down, L.post_ffn_norm);
      for (int d = 0; d < dim_; ++d) x[t][static_cast<size_t>(d)] += down[static_cast<size_t>(d)];
    }
  }
  std::vector<double> logits;
  logits.reserve(n * static_cast<size_t>(n_vocab_));
  for (size_t t = 0; t < n; ++t) {
    std::vector<double> row = Apply(output_, RmsNorm(x[t], output_norm_));
    if (final_softcap_ > 0) {
      for (double& v : row) v = final_softcap_ * std::tanh(v / final_softcap_);
    }
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

std::vector<std::vector<double>> ReferenceModel::LatentAttention(const Layer& L,
                                                                const std::vector<std::vector<double>>& x) const {
  const size_t n = x.size();
  const int nope = mla_nope_, rope = head_dim_, rank = kv_lora_rank_, v_head = mla_v_head_, qh = nope + rope;
  // Per token: q [heads, nope + rope], k [heads, nope + rope] (the rotated part shared), v [heads, v_head].
  std::vector<std::vector<double>> q(n), k(n), v(n);
  for (size_t t = 0; t < n; ++t) {
    const std::vector<double> h = RmsNorm(x[t], L.attn_norm);
    q[t] = L.wq_a.w.empty() ? Apply(L.wq, h) : Apply(L.wq, RmsNorm(Apply(L.wq_a, h), L.q_a_norm));
    const std::vector<double> kv_a = Apply(L.wkv_a, h);  // [rank + rope]
    const std::vector<double> latent = RmsNorm(std::vector<double>(kv_a.begin(), kv_a.begin() + rank), L.kv_a_norm);
    std::vector<double> k_pe(kv_a.begin() + rank, kv_a.end());
    Rope(k_pe, 1, static_cast<int>(t), L.freq, L.rope_magnitude);
    k[t].resize(static_cast<size_t>(n_heads_) * qh);
    v[t].resize(static_cast<size_t>(n_heads_) * v_head);
    for (int hd = 0; hd < n_heads_; ++hd) {
      std::vector<double> q_pe(q[t].begin() + hd * qh + nope, q[t].begin() + (hd + 1) * qh);
      Rope(q_pe, 1, static_cast<int>(t), L.freq, L.rope_magnitude);
      std::copy(q_pe.begin(), q_pe.end(), q[t].begin() + hd * qh + nope);
      const std::vector<double> k_nope = Apply(L.k_up[static_cast<size_t>(hd)], latent);
      std::copy(k_nope.begin(), k_nope.end(), k[t].begin() + hd * qh);
      std::copy(k_pe.begin(), k_pe.end(), k[t].begin() + hd * qh + nope);
      const std::vector<double> vh = Apply(L.v_up[static_cast<size_t>(hd)], latent);
      std::copy(vh.begin(), vh.end(), v[t].begin() + hd * v_head);
    }
  }
  std::vector<std::vector<double>> out(n);
  for (size_t t = 0; t < n; ++t) {
    std::vector<double> att(static_cast<size_t>(n_heads_) * v_head, 0.0);
    for (int hd = 0; hd < n_heads_; ++hd) {
      std::vector<double> score(t + 1);
      double max_score = -INFINITY;
      for (size_t s = 0; s <= t; ++s) {
        double dot = 0;
        for (int d = 0; d < qh; ++d) dot += q[t][hd * qh + d] * k[s][hd * qh + d];
        score[s] = dot * query_scale_;
        max_score = std::max(max_score, score[s]);
      }
      double total = 0;
      for (size_t s = 0; s <= t; ++s) total += (score[s] = std::exp(score[s] - max_score));
      for (size_t s = 0; s <= t; ++s) {
        for (int d = 0; d < v_head; ++d) att[hd * v_head + d] += score[s] / total * v[s][hd * v_head + d];
      }
    }
    out[t] = Apply(L.wo, att);
  }
  return out;
}

double WorstRowError(const std::vector<float>& got, const std::vector<double>& want, size_t vocab) {
  double worst = 0;
  for (size_t row = 0; row * vocab < want.size(); ++row) {
    double max_diff = 0, max_ref = 1.0;
    for (size_t i = row * vocab; i < (row + 1) * vocab; ++i) {
      max_diff = std::max(max_diff, std::fabs(got[i] - want[i]));
      max_ref = std::max(max_ref, std::fabs(want[i]));
    }
    worst = std::max(worst, max_diff / max_ref);
  }
  return worst;
}

}  // namespace kvsparse::testing
