// Next-token sampling with llama.cpp's chain: logit bias → penalties (repetition; OpenAI's
// presence and frequency) → top-k → top-p → min-p → temperature → draw from the softmax with a
// seeded PRNG. Deterministic for a seed. Greedy decoding (temperature 0) takes the argmax after
// the bias and the penalties.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvsparse {

struct SamplerParams {
  float temperature = 0.8f;    // <= 0: greedy argmax (lowest index on ties)
  int top_k = 40;              // <= 0: off
  float top_p = 0.95f;         // >= 1: off
  float repeat_penalty = 1.0f; // 1: off; divides positive / multiplies negative logits of recent tokens
  int repeat_last_n = 64;      // accepted tokens the penalty looks back over; 0: off, < 0: all
  // OpenAI's penalties over the generated tokens (AcceptGenerated; not the prompt, as vLLM):
  // logit -= frequency_penalty * count + presence_penalty * (count > 0). 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Keep the tokens whose probability is at least min_p times the most likely one's (before
  // temperature, as llama.cpp). 0: off.
  float min_p = 0.0f;
  // Added to the logits of these tokens first (OpenAI's logit_bias; -100 all but bans one).
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
};

// The ranges sampling values must lie in, one rule for every front end: the server answers a
// value outside them with a 400 naming the field, `generate` refuses it naming the flag.
enum class SamplerValue {
  kTemperature,      // [0, 2]; 0 is greedy
  kTopK,             // >= -1; -1 and 0: off (vLLM's and llama.cpp's "off")
  kTopP,             // (0, 1]
  kMinP,             // [0, 1]
  kRepeatPenalty,    // > 0
  kRepeatLastN,      // >= -1; -1: all accepted tokens
  kPresencePenalty,  // [-2, 2]
  kFrequencyPenalty, // [-2, 2]
  kLogitBias,        // each bias in [-100, 100]
};
// The value's OpenAI / JSON name: "temperature", "top_k", ...
std::string_view SamplerValueName(SamplerValue which);
// Empty when `value` is allowed, else what it must be ("must be between 0 and 2"); NaN never is.
std::optional<std::string> SamplerValueRequirement(SamplerValue which, double value);
// The first value of `p` outside its range, with what it must be.
struct SamplerValueProblem {
  SamplerValue which;
  std::string requirement;
  double value;
};
std::optional<SamplerValueProblem> FindSamplerValueProblem(const SamplerParams& p);

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);

  // logits: [n_vocab]; not modified. NaN logits count as -inf.
  int32_t Sample(const float* logits, int32_t n_vocab);
  // Records a prompt token for the repetition penalty.
  void Accept(int32_t token);
  // Records a generated token: the repetition penalty's history and the presence and frequency
  // counts.
  void AcceptGenerated(int32_t token);
  // Forgets the history and restarts the PRNG from the seed.
  void Reset();

  const SamplerParams& params() const { return params_; }

 private:
  double NextUniform();  // [0, 1), from the raw 64-bit stream (portable across libraries)

  SamplerParams params_;
  std::mt19937_64 rng_;
  std::deque<int32_t> history_;                   // most recent last; at most repeat_last_n when >= 0
  std::unordered_map<int32_t, int32_t> generated_counts_;  // token -> times generated
  std::vector<float> penalized_;                  // [n_vocab] scratch
  std::vector<std::pair<float, int32_t>> candidates_;  // [n_candidates] (logit, token) scratch
  std::vector<double> weights_;                        // [n_candidates] unnormalized probabilities
};

}  // namespace kvsparse
