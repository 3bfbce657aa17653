// Log-probabilities of tokens under the model, for the API's `logprobs` and `echo`: the
// log-softmax of the raw logits (before the sampler's bias, penalties and temperature, as vLLM
// reports them by default) and the most likely alternatives.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace kvsparse {

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.f;  // NaN: none (a prompt's first token, which nothing predicts)
  std::vector<std::pair<int32_t, float>> top;  // [top_k] (token, logprob), most likely first, lower id on ties
};

// logits: [n_vocab] (NaN counts as -inf). top_k alternatives (0: none, capped at n_vocab).
TokenLogprob LogprobOf(const float* logits, int32_t n_vocab, int32_t token, int top_k);

}  // namespace kvsparse
