#include "kvsparse/logprob.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

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
  const int k = std::clamp(top_k, 0, n_vocab);
  if (k > 0) {
    std::vector<int32_t> ids(static_cast<size_t>(n_vocab));
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logit(a) > logit(b) || (logit(a) == logit(b) && a < b);
    });
    for (int i = 0; i < k; ++i) out.top.emplace_back(ids[static_cast<size_t>(i)], logprob(ids[static_cast<size_t>(i)]));
  }
  return out;
}

}  // namespace kvsparse
