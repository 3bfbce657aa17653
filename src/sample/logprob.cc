#include "kvsparse/logprob.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse {

TokenLogprob LogprobOf(const float* logits, int32_t n_vocab, int32_t token, int top_k) {
  KVS_CHECK(logits != nullptr && n_vocab > 0 && token >= 0 && token < n_vocab);
  auto logit = [&](int32_t i) { return std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i]; };
  float max = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n_vocab; ++i) max = std::max(max, logit(i));
  // log Σ exp(l - max) in double: a 150K-entry sum of floats would lose the small terms.
  double sum = 0;
  if (std::isfinite(max)) {
    for (int32_t i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logit(i)) - max);
  }
  const double log_z = std::isfinite(max) ? static_cast<double>(max) + std::log(sum) : 0.0;
  auto logprob = [&](int32_t i) {
    return std::isfinite(max) ? static_cast<float>(static_cast<double>(logit(i)) - log_z)
                              : -std::numeric_limits<float>::infinity();
  };
  TokenLogprob out;
  out.token = token;
  out.logprob = logprob(token);
  // The k best in one pass, kept sorted (k is small: at most 20 from the API), so an echo's
  // per-row call allocates k entries rather than sorting the vocabulary's ids.
  const size_t k = static_cast<size_t>(std::clamp(top_k, 0, n_vocab));
  if (k == 0) return out;
  auto before = [&](int32_t a, int32_t b) { return logit(a) > logit(b) || (logit(a) == logit(b) && a < b); };
  std::vector<int32_t> best;  // [<= k] best first
  best.reserve(k + 1);
  for (int32_t i = 0; i < n_vocab; ++i) {
    if (best.size() == k && !before(i, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), i, before), i);
    if (best.size() > k) best.pop_back();
  }
  for (int32_t id : best) out.top.emplace_back(id, logprob(id));
  return out;
}

}  // namespace kvsparse
