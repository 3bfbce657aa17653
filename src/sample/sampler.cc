#include "kvsparse/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <unordered_set>

#include "kvsparse/status.h"

namespace kvsparse {
namespace {

// Higher logit first; the lower token id wins ties so results never depend on sort stability.
bool Before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// 2, 0.5, -100: the shortest form that reads back the same.
std::string FormatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

std::string_view SamplerValueName(SamplerValue which) {
  switch (which) {
    case SamplerValue::kTemperature: return "temperature";
    case SamplerValue::kTopK: return "top_k";
    case SamplerValue::kTopP: return "top_p";
    case SamplerValue::kMinP: return "min_p";
    case SamplerValue::kRepeatPenalty: return "repeat_penalty";
    case SamplerValue::kRepeatLastN: return "repeat_last_n";
    case SamplerValue::kPresencePenalty: return "presence_penalty";
    case SamplerValue::kFrequencyPenalty: return "frequency_penalty";
    case SamplerValue::kLogitBias: return "logit_bias";
  }
  return "?";
}

std::optional<std::string> SamplerValueRequirement(SamplerValue which, double v) {
  auto between = [v](double lo, double hi) -> std::optional<std::string> {
    if (v >= lo && v <= hi) return std::nullopt;  // false for NaN
    return "must be between " + FormatNumber(lo) + " and " + FormatNumber(hi);
  };
  switch (which) {
    case SamplerValue::kTemperature: return between(0.0, 2.0);
    case SamplerValue::kTopK:
      if (v >= -1.0 && v == std::floor(v)) return std::nullopt;
      return std::string("must be an integer of at least -1 (-1 and 0: off)");
    case SamplerValue::kTopP:
      if (v > 0.0 && v <= 1.0) return std::nullopt;
      return std::string("must be greater than 0 and at most 1");
    case SamplerValue::kMinP: return between(0.0, 1.0);
    case SamplerValue::kRepeatPenalty:
      if (v > 0.0 && std::isfinite(v)) return std::nullopt;
      return std::string("must be greater than 0");
    case SamplerValue::kRepeatLastN:
      if (v >= -1.0 && v == std::floor(v)) return std::nullopt;
      return std::string("must be an integer of at least -1 (-1: all tokens, 0: off)");
    case SamplerValue::kPresencePenalty:
    case SamplerValue::kFrequencyPenalty: return between(-2.0, 2.0);
    case SamplerValue::kLogitBias: return between(-100.0, 100.0);
  }
  return std::nullopt;
}

std::optional<SamplerValueProblem> FindSamplerValueProblem(const SamplerParams& p) {
  const std::pair<SamplerValue, double> values[] = {
      {SamplerValue::kTemperature, p.temperature},          {SamplerValue::kTopK, p.top_k},
      {SamplerValue::kTopP, p.top_p},                       {SamplerValue::kMinP, p.min_p},
      {SamplerValue::kRepeatPenalty, p.repeat_penalty},     {SamplerValue::kRepeatLastN, p.repeat_last_n},
      {SamplerValue::kPresencePenalty, p.presence_penalty}, {SamplerValue::kFrequencyPenalty, p.frequency_penalty}};
  for (const auto& [which, value] : values) {
    if (auto requirement = SamplerValueRequirement(which, value)) return SamplerValueProblem{which, *requirement, value};
  }
  for (const auto& [token, bias] : p.logit_bias) {
    if (auto requirement = SamplerValueRequirement(SamplerValue::kLogitBias, bias)) {
      return SamplerValueProblem{SamplerValue::kLogitBias, *requirement, bias};
    }
  }
  return std::nullopt;
}

Sampler::Sampler(const SamplerParams& p) : params_(p), rng_(p.seed) {}

void Sampler::Reset() {
  history_.clear();
  generated_counts_.clear();
  rng_.seed(params_.seed);
}

void Sampler::Accept(int32_t token) {
  if (params_.repeat_last_n == 0) return;
  history_.push_back(token);
  if (params_.repeat_last_n > 0) {
    while (history_.size() > static_cast<size_t>(params_.repeat_last_n)) history_.pop_front();
  }
}

void Sampler::AcceptGenerated(int32_t token) {
  Accept(token);
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) ++generated_counts_[token];
}

double Sampler::NextUniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::Sample(const float* logits, int32_t n_vocab) {
  KVS_CHECK(logits != nullptr && n_vocab > 0);
  penalized_.resize(n_vocab);
  for (int32_t i = 0; i < n_vocab; ++i) {
    penalized_[i] = std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i];
  }

  for (const auto& [token, bias] : params_.logit_bias) {
    if (token >= 0 && token < n_vocab) penalized_[token] += bias;
  }
  // Repetition penalty: once per distinct recent token, pushing its logit towards "less likely".
  if (params_.repeat_penalty != 1.0f && params_.repeat_penalty > 0.0f && !history_.empty()) {
    std::unordered_set<int32_t> seen;
    for (int32_t token : history_) {
      if (token < 0 || token >= n_vocab || !seen.insert(token).second) continue;
      float& logit = penalized_[token];
      logit = logit <= 0.0f ? logit * params_.repeat_penalty : logit / params_.repeat_penalty;
    }
  }

  for (const auto& [token, count] : generated_counts_) {
    if (token < 0 || token >= n_vocab) continue;
    penalized_[token] -= params_.frequency_penalty * static_cast<float>(count) + params_.presence_penalty;
  }

  if (params_.temperature <= 0.0f) {
    // max_element returns the first maximum: the lowest index on ties.
    return static_cast<int32_t>(std::max_element(penalized_.begin(), penalized_.end()) - penalized_.begin());
  }

  candidates_.resize(n_vocab);
  for (int32_t i = 0; i < n_vocab; ++i) candidates_[i] = {penalized_[i], i};

  // Top-k: keep the k best, sorted best first. Without top-k or top-p the order is
  // irrelevant, so the O(n log n) sort over the whole vocab is skipped.
  size_t kept = static_cast<size_t>(n_vocab);
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < kept) kept = static_cast<size_t>(params_.top_k);
  if (kept < candidates_.size() || params_.top_p < 1.0f) {
    std::partial_sort(candidates_.begin(), candidates_.begin() + kept, candidates_.end(), Before);
    candidates_.resize(kept);
  } else {
    std::iter_swap(candidates_.begin(), std::min_element(candidates_.begin(), candidates_.end(), Before));
  }

  const float max_logit = candidates_[0].first;
  if (!std::isfinite(max_logit)) return candidates_[0].second;  // every logit is -inf (or +inf wins outright)

  // Top-p on the untempered distribution: the smallest prefix reaching probability p.
  if (params_.top_p < 1.0f && kept > 1) {
    double total = 0;
    for (const auto& c : candidates_) total += std::exp(static_cast<double>(c.first - max_logit));
    double cumulative = 0;
    size_t prefix = kept;
    for (size_t i = 0; i < kept; ++i) {
      cumulative += std::exp(static_cast<double>(candidates_[i].first - max_logit)) / total;
      if (cumulative >= params_.top_p) {
        prefix = i + 1;
        break;
      }
    }
    candidates_.resize(std::max<size_t>(prefix, 1));
  }

  // Min-p: p >= min_p * p_max, i.e. logit >= max + log(min_p); the best always stays.
  if (params_.min_p > 0.0f && candidates_.size() > 1) {
    const float floor = max_logit + std::log(params_.min_p);  // <= max_logit: the best is never below it
    std::erase_if(candidates_, [floor](const std::pair<float, int32_t>& c) { return c.first < floor; });
  }

  // Temperature, then draw by inverting the CDF.
  std::vector<double>& weights = weights_;
  weights.resize(candidates_.size());
  double total = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    weights[i] = std::exp(static_cast<double>(candidates_[i].first - max_logit) / params_.temperature);
    total += weights[i];
  }
  const double target = NextUniform() * total;
  double cumulative = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    cumulative += weights[i];
    if (target < cumulative) return candidates_[i].second;
  }
  return candidates_.back().second;  // rounding left target at the very top
}

}  // namespace kvsparse
