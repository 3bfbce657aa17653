// The token streams of the label-free `fidelity` task of `kvsparse bench`. The stream is
// teacher-forced through the full cache and through each method; KL and perplexity mean
// something only when the stream is text the model could have written, so by default it is
// sampled from the model itself, or it is the user's text or token ids.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/model.h"
#include "kvsparse/status.h"
#include "kvsparse/tokenizer.h"

namespace kvsparse {

enum class FidelityStreamKind {
  kSampled,  // drawn from the model at temperature 1 with a dense cache, from BOS (default)
  kText,     // --fidelity-text FILE, encoded by the model's tokenizer
  kTokens,   // --fidelity-tokens FILE: whitespace-separated token ids
};

struct FidelityStreamSource {
  FidelityStreamKind kind = FidelityStreamKind::kSampled;
  std::string path;   // kText / kTokens
  uint64_t seed = 1;  // kSampled: the bench seed
  // "sampled(seed=1)", "text:FILE", "tokens:FILE": the row's `stream` field, part of its key.
  std::string Label() const;
};

// Token ids separated by whitespace (spaces, tabs, newlines); '#' starts a comment that runs to
// the end of its line. `file` names the source in errors,
// which give file:line, the token's index in the stream, the text found and the vocabulary size.
StatusOr<std::vector<int32_t>> ParseFidelityTokens(std::string_view text, const std::string& file, int32_t n_vocab);

// BOS, then length - 1 tokens each drawn from the model's next-token distribution at
// temperature 1 (no top-k / top-p / penalty), decoded one at a time with a dense f32 cache.
// Deterministic for (model, bos, length, seed) on one kernel family (isa.h).
StatusOr<std::vector<int32_t>> SampleFidelityStream(const Model& model, int32_t bos, int32_t length, uint64_t seed,
                                                    int n_threads);

// The first token of a sampled stream: the tokenizer's BOS (else its EOS, which starts documents
// in BOS-less vocabularies); 1, llama's BOS, for models without a tokenizer (llama2.c files).
StatusOr<int32_t> FidelityStartToken(const Model& model, const Tokenizer* tokenizer);

// The streams of one configuration of `length` tokens: `samples` sampled streams (seeds derived
// from source.seed, the length and the sample index, so every method sees the same ones), or one
// stream, the first `length` tokens of the file. Errors name the flag and the file.
StatusOr<std::vector<std::vector<int32_t>>> MakeFidelityStreams(const FidelityStreamSource& source, const Model& model,
                                                                const Tokenizer* tokenizer, int32_t length,
                                                                int samples, int n_threads);

// Streams already made in one run, by length: the configurations of a length share them
// instead of sampling them again.
using FidelityStreamCache = std::map<int32_t, std::vector<std::vector<int32_t>>>;

// FNV-1a of the streams' ids as 16 hex digits: the row's `stream_hash`, equal across rows (and
// shards) exactly when they measured the same tokens.
std::string FidelityStreamHash(const std::vector<std::vector<int32_t>>& streams);

}  // namespace kvsparse
