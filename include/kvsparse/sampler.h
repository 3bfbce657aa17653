// Next-token sampling with llama.cpp's chain: repetition penalty → top-k → top-p →
// temperature → draw from the softmax with a seeded PRNG. Deterministic for a seed.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <utility>
#include <vector>

namespace kvsparse {

struct SamplerParams {
  float temperature = 0.8f;    // <= 0: greedy argmax (lowest index on ties)
  int top_k = 40;              // <= 0: off
  float top_p = 0.95f;         // >= 1: off
  float repeat_penalty = 1.0f; // 1: off; divides positive / multiplies negative logits of recent tokens
  int repeat_last_n = 64;      // accepted tokens the penalty looks back over; 0: off, < 0: all
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);

  // logits: [n_vocab]; not modified. NaN logits count as -inf.
  int32_t Sample(const float* logits, int32_t n_vocab);
  // Records a token (prompt or generated) for the repetition penalty.
  void Accept(int32_t token);
  // Forgets the history and restarts the PRNG from the seed.
  void Reset();

  const SamplerParams& params() const { return params_; }

 private:
  double NextUniform();  // [0, 1), from the raw 64-bit stream (portable across libraries)

  SamplerParams params_;
  std::mt19937_64 rng_;
  std::deque<int32_t> history_;                   // most recent last; at most repeat_last_n when >= 0
  std::vector<float> penalized_;                  // [n_vocab] scratch
  std::vector<std::pair<float, int32_t>> candidates_;  // [n_candidates] (logit, token) scratch
  std::vector<double> weights_;                        // [n_candidates] unnormalized probabilities
};

}  // namespace kvsparse
