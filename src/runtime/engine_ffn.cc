// The feed-forward half of a layer: a dense gated FFN, or a mixture of experts. A MoE step
// routes every row, groups the (row, expert) pairs by expert, and runs each chosen expert once
// over its gathered rows, so a prompt chunk reads each expert's weights once, not once per
// token, and a decode step reads only its n_experts_used experts.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvsparse/engine.h"
#include "runtime/engine_internal.h"

namespace kvsparse {

namespace engine_detail {

void RouteToExperts(const float* logits, const RouterRule& rule, float* probs, int32_t* experts, float* weights) {
  const int n_experts = rule.n_experts, n_used = rule.n_used;
  if (rule.gating == ExpertGating::kSigmoid) {
    for (int e = 0; e < n_experts; ++e) probs[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else if (rule.gating == ExpertGating::kSoftmaxChosen) {  // the logits choose; the softmax comes after
    std::copy_n(logits, n_experts, probs);
  } else {  // softmax over every expert: the weights are probabilities of the full distribution
    float max_logit = -INFINITY;
    for (int e = 0; e < n_experts; ++e) max_logit = std::max(max_logit, logits[e]);
    double total = 0;
    for (int e = 0; e < n_experts; ++e) total += std::exp(static_cast<double>(logits[e]) - max_logit);
    for (int e = 0; e < n_experts; ++e) {
      probs[e] = static_cast<float>(std::exp(static_cast<double>(logits[e]) - max_logit) / total);
    }
  }
  // Partial selection of the n_used best: by logit (the probabilities' order) or, with a
  // selection bias (DeepSeek-V3), by probability plus bias; the weights stay unbiased.
  auto score = [&](int e) { return rule.selection_bias != nullptr ? probs[e] + rule.selection_bias[e] : logits[e]; };
  for (int k = 0; k < n_used; ++k) {
    int best = -1;
    float best_score = 0;
    for (int e = 0; e < n_experts; ++e) {
      bool taken = false;
      for (int j = 0; j < k && !taken; ++j) taken = experts[j] == e;
      if (taken) continue;
      // NaN scores never win over a number; a row of NaNs still picks distinct experts.
      const float v = score(e);
      if (best < 0 || v > best_score || (std::isnan(best_score) && !std::isnan(v))) {
        best = e;
        best_score = v;
      }
    }
    experts[k] = best;
    weights[k] = probs[best];
  }
  if (rule.gating == ExpertGating::kSoftmaxChosen) {
    const float max_logit = *std::max_element(weights, weights + n_used);
    double total = 0;
    for (int k = 0; k < n_used; ++k) total += std::exp(static_cast<double>(weights[k]) - max_logit);
    for (int k = 0; k < n_used; ++k) {
      weights[k] = static_cast<float>(std::exp(static_cast<double>(weights[k]) - max_logit) / total);
    }
  }
  const bool normalize = rule.normalize;
  const float scale = rule.scale;
  if (normalize) {
    double sum = 0;
    for (int k = 0; k < n_used; ++k) sum += weights[k];
    const double divisor = std::max(sum, 6.103515625e-5);
    for (int k = 0; k < n_used; ++k) weights[k] = static_cast<float>(weights[k] / divisor);
  }
  if (scale != 1.0f) {
    for (int k = 0; k < n_used; ++k) weights[k] *= scale;
  }
}

}  // namespace engine_detail

using namespace engine_detail;  // NOLINT

// qwen2moe's shared expert output rows [n, dim] times sigmoid(gate . x) of their FFN inputs x [n, dim].
static void ScaleBySharedExpertGate(const float* gate_weights, const float* x, int32_t n, int64_t dim, float* out) {
  for (int32_t i = 0; i < n; ++i) {
    float* row = out + static_cast<size_t>(i) * dim;
    const float logit = ops::Dot(x + static_cast<size_t>(i) * dim, gate_weights, dim);
    const float gate = 1.0f / (1.0f + std::exp(-logit));
    for (int64_t j = 0; j < dim; ++j) row[j] *= gate;
  }
}

// gate[i] = act(gate[i]) * up[i] for the model's gated FFN activation.
static void GatedActivation(FfnActivation activation, float* gate, const float* up, int64_t n) {
  switch (activation) {
    case FfnActivation::kSilu: return ops::SiluMul(gate, up, n);
    case FfnActivation::kGeluTanh: return ops::GeluMul(gate, up, n);
    case FfnActivation::kSwigluClamped: return ops::SwigluClampedMul(gate, up, n);
  }
}

// Adds row `bias` [width] to each of n rows [n, width] (gpt-oss's expert biases).
static void AddRowBias(const float* bias, int64_t width, int32_t n, float* rows) {
  for (int32_t i = 0; i < n; ++i) ops::Add(rows + static_cast<size_t>(i) * width, bias, width);
}

void Engine::FeedForward(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  if (c.LayerIsMoe(layer)) return MixtureOfExperts(layer, n);
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int64_t hidden = c.hidden_dim;
  RunProducts({{&w.w_gate, s.normed.data(), n, s.gate.data()}, {&w.w_up, s.normed.data(), n, s.up.data()}},
              n_threads_);
  GatedActivation(c.ffn_activation, s.gate.data(), s.up.data(), n * hidden);
  ops::MatMul(w.w_down, s.gate.data(), n, s.proj.data(), n_threads_);
}

void Engine::MixtureOfExperts(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int n_experts = c.n_experts, n_used = c.n_experts_used;
  const size_t dim = static_cast<size_t>(c.dim);

  // Route every row.
  ops::MatMul(w.router, s.normed.data(), n, s.router_logits.data(), n_threads_);
  if (w.router_bias != nullptr) AddRowBias(w.router_bias, n_experts, n, s.router_logits.data());
  if (router_observer_) router_observer_(layer, n, s.router_logits.data());
  const RouterRule rule{n_experts, n_used, c.expert_gating, w.expert_selection_bias, c.expert_weights_norm,
                        c.expert_weights_scale};
  for (int32_t i = 0; i < n; ++i) {
    const size_t r = static_cast<size_t>(i);
    RouteToExperts(&s.router_logits[r * n_experts], rule, s.router_probs.data(), &s.chosen_expert[r * n_used],
                   &s.chosen_weight[r * n_used]);
  }
  // Group the slots (row * n_used + choice) by expert: a counting sort, stable in row order.
  std::vector<int32_t>& first = s.expert_first;
  std::fill(first.begin(), first.end(), 0);
  const int32_t n_slots = n * n_used;
  for (int32_t slot = 0; slot < n_slots; ++slot) ++first[static_cast<size_t>(s.chosen_expert[slot]) + 1];
  std::partial_sum(first.begin(), first.end(), first.begin());
  for (int32_t slot = 0; slot < n_slots; ++slot) {
    s.expert_slots[static_cast<size_t>(first[static_cast<size_t>(s.chosen_expert[slot])]++)] = slot;
  }
  // (first[e] now holds expert e's end; the starts are the previous expert's ends.)
  std::rotate(first.rbegin(), first.rbegin() + 1, first.rend());
  first[0] = 0;

  if (n <= Scratch::kGroupedExpertRows) {
    GroupedExperts(layer, n);
    return;
  }

  // The shared expert first (qwen2moe behind its sigmoid gate, deepseek2's ungated), which sets
  // s.proj; else s.proj starts at zero.
  if (w.shared_gate.data != nullptr) {
    const int64_t width = c.shared_expert_hidden_dim;
    ops::MatMul(w.shared_gate, s.normed.data(), n, s.gate.data(), n_threads_);
    ops::MatMul(w.shared_up, s.normed.data(), n, s.up.data(), n_threads_);
    ops::SiluMul(s.gate.data(), s.up.data(), n * width);
    ops::MatMul(w.shared_down, s.gate.data(), n, s.proj.data(), n_threads_);
    if (w.shared_expert_gate != nullptr) ScaleBySharedExpertGate(w.shared_expert_gate, s.normed.data(), n, c.dim, s.proj.data());
  } else {
    std::fill_n(s.proj.begin(), static_cast<size_t>(n) * dim, 0.0f);
  }

  // Each chosen expert over its gathered rows; its weighted output added back to each row.
  const int64_t width = c.expert_hidden_dim;
  for (int e = 0; e < n_experts; ++e) {
    const int32_t begin = first[static_cast<size_t>(e)], count = first[static_cast<size_t>(e) + 1] - begin;
    if (count == 0) continue;
    const int32_t* slots = &s.expert_slots[static_cast<size_t>(begin)];
    for (int32_t j = 0; j < count; ++j) {
      const size_t row = static_cast<size_t>(slots[j] / n_used);
      std::copy_n(&s.normed[row * dim], dim, &s.expert_in[static_cast<size_t>(j) * dim]);
    }
    ops::MatMul(w.expert_gate[static_cast<size_t>(e)], s.expert_in.data(), count, s.gate.data(), n_threads_);
    ops::MatMul(w.expert_up[static_cast<size_t>(e)], s.expert_in.data(), count, s.up.data(), n_threads_);
    if (w.expert_gate_bias != nullptr) {
      AddRowBias(w.expert_gate_bias + e * width, width, count, s.gate.data());
      AddRowBias(w.expert_up_bias + e * width, width, count, s.up.data());
    }
    GatedActivation(c.ffn_activation, s.gate.data(), s.up.data(), count * width);
    ops::MatMul(w.expert_down[static_cast<size_t>(e)], s.gate.data(), count, s.expert_out.data(), n_threads_);
    if (w.expert_down_bias != nullptr) AddRowBias(w.expert_down_bias + e * c.dim, c.dim, count, s.expert_out.data());
    for (int32_t j = 0; j < count; ++j) {
      const size_t row = static_cast<size_t>(slots[j] / n_used);
      const float weight = s.chosen_weight[static_cast<size_t>(slots[j])];
      float* out = &s.proj[row * dim];
      const float* y = &s.expert_out[static_cast<size_t>(j) * dim];
      for (size_t d = 0; d < dim; ++d) out[d] += weight * y[d];
    }
  }
}

// A few rows (decode): every chosen expert and the shared one in two MatMulMany calls, gate and
// up, then down, so the step pays two forks and joins for its experts, not three per expert. The
// products and sums are MixtureOfExperts' own, in the same order: the results are the same bits.
void Engine::GroupedExperts(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int n_experts = c.n_experts, n_used = c.n_experts_used;
  const size_t dim = static_cast<size_t>(c.dim);
  const size_t width = static_cast<size_t>(c.expert_hidden_dim);
  const std::vector<int32_t>& first = s.expert_first;
  const int32_t n_slots = n * n_used;
  // Slot k of the expert order: its row's FFN input at grouped_in[k].
  for (int32_t k = 0; k < n_slots; ++k) {
    const size_t row = static_cast<size_t>(s.expert_slots[static_cast<size_t>(k)] / n_used);
    std::copy_n(&s.normed[row * dim], dim, &s.grouped_in[static_cast<size_t>(k) * dim]);
  }
  std::vector<ops::MatMulJob>& jobs = s.matmul_jobs;
  jobs.clear();
  const bool shared = w.shared_gate.data != nullptr;
  if (shared) {
    jobs.push_back({&w.shared_gate, s.normed.data(), n, s.gate.data()});
    jobs.push_back({&w.shared_up, s.normed.data(), n, s.up.data()});
  }
  for (int e = 0; e < n_experts; ++e) {
    const int32_t begin = first[static_cast<size_t>(e)], count = first[static_cast<size_t>(e) + 1] - begin;
    if (count == 0) continue;
    const size_t at = static_cast<size_t>(begin);
    jobs.push_back({&w.expert_gate[static_cast<size_t>(e)], &s.grouped_in[at * dim], count, &s.grouped_gate[at * width]});
    jobs.push_back({&w.expert_up[static_cast<size_t>(e)], &s.grouped_in[at * dim], count, &s.grouped_up[at * width]});
  }
  ops::MatMulMany(jobs, n_threads_);
  // Each expert's biases on its own rows (they lie in expert order).
  auto add_expert_biases = [&](const float* table, size_t row_width, float* rows) {
    if (table == nullptr) return;
    for (int e = 0; e < n_experts; ++e) {
      const int32_t begin = first[static_cast<size_t>(e)], count = first[static_cast<size_t>(e) + 1] - begin;
      AddRowBias(table + e * row_width, static_cast<int64_t>(row_width), count, rows + begin * row_width);
    }
  };
  add_expert_biases(w.expert_gate_bias, width, s.grouped_gate.data());
  add_expert_biases(w.expert_up_bias, width, s.grouped_up.data());
  if (shared) ops::SiluMul(s.gate.data(), s.up.data(), n * c.shared_expert_hidden_dim);
  GatedActivation(c.ffn_activation, s.grouped_gate.data(), s.grouped_up.data(),
                  static_cast<int64_t>(n_slots) * c.expert_hidden_dim);
  jobs.clear();
  if (shared) jobs.push_back({&w.shared_down, s.gate.data(), n, s.proj.data()});
  for (int e = 0; e < n_experts; ++e) {
    const int32_t begin = first[static_cast<size_t>(e)], count = first[static_cast<size_t>(e) + 1] - begin;
    if (count == 0) continue;
    const size_t at = static_cast<size_t>(begin);
    jobs.push_back({&w.expert_down[static_cast<size_t>(e)], &s.grouped_gate[at * width], count,
                    &s.grouped_out[at * dim]});
  }
  ops::MatMulMany(jobs, n_threads_);
  add_expert_biases(w.expert_down_bias, dim, s.grouped_out.data());
  if (shared) {
    if (w.shared_expert_gate != nullptr) ScaleBySharedExpertGate(w.shared_expert_gate, s.normed.data(), n, c.dim, s.proj.data());
  } else {
    std::fill_n(s.proj.begin(), static_cast<size_t>(n) * dim, 0.0f);
  }
  // Added back in expert order, as MixtureOfExperts adds them.
  for (int32_t k = 0; k < n_slots; ++k) {
    const int32_t slot = s.expert_slots[static_cast<size_t>(k)];
    const float weight = s.chosen_weight[static_cast<size_t>(slot)];
    float* out = &s.proj[static_cast<size_t>(slot / n_used) * dim];
    const float* y = &s.grouped_out[static_cast<size_t>(k) * dim];
    for (size_t d = 0; d < dim; ++d) out[d] += weight * y[d];
  }
}

}  // namespace kvsparse
