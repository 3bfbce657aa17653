// The built-in retrieval model: a llama-architecture GGUF whose weights are set by hand, not
// trained, so that token-level retrieval and copy tasks are solved (close to 100%) with the
// full KV cache at any depth up to at least 32768 tokens. It is a measuring instrument for
// KV sparsity, not a language model: it knows no language, only in-context lookup.
//
// How it works (one head per layer, head_dim 128, dim 128, FFNs zero, norms 1):
//   residual = [token one-hot | constant | previous-token one-hot | output one-hot | unused]
//   - layer 0, previous-token head: q and k read only the constant dimension, so they depend
//     on position alone; k is pre-rotated by one RoPE step, so after RoPE the score of query t
//     against key s is A0 * Σ_i cos((s - t + 1) θ_i) over the 16 fastest pairs, maximal exactly
//     at s = t - 1. V copies the token one-hot into the previous-token slot.
//   - last layer, induction head: q = code(current token), k = code(previous-token slot) -
//     ½ code(own token); each symbol's code is one RoPE pair among the 40 slowest (rope base
//     1e14), so different symbols score exactly 0 at any distance and a match scores ~S1
//     (the phase drifts by < 0.01 rad for keys and values even at 131072 tokens). V copies the
//     attended token into the output slot, which is all the classifier reads. The −½ own-token
//     term makes a sequence's first token (which attends to itself in layer 0) a weaker match
//     than the true successor.
//   - layers 1 .. n_layers-2 are exact no-ops (all weights zero): KV that no answer depends on.
// So the answer to "... key value ... key" is `value`, and the tokens an answer needs are:
// in layer 0 the token just before each query (and, while the prompt is processed, the key
// before its value); in the last layer the value token that follows the key (or, when copying,
// the token after the current token's earlier occurrence). A sparse cache answers correctly
// exactly when it keeps (or selects) those.
#pragma once

#include <string>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "kvsparse/token_vocab.h"

namespace kvsparse {

// The one-head model above, or the multi-head variant (`synth --shape retrieval-mha`) that
// head-level methods need: 8 query heads in 4 GQA groups (head_dim 128, dim 1024), with the
// same circuit in two heads (layer 0 KV head 1: previous-token; last layer KV head 2:
// induction) and distractor heads everywhere else whose output is discarded (wo = 0): local
// heads (the token and the two before it), previous-token heads and uniform heads (q = 0).
// Layer 0 and the last layer are mostly sharp, odd middle layers mostly uniform, even ones
// local and previous-token. So the answer needs the circuit heads' tokens only: a per-head
// or per-layer method that spends its budget there can keep a needle that a uniform split
// cannot. What it is not: distractor heads here need nothing, so their budget is pure waste;
// in a trained model every head contributes something.
enum class RetrievalShape { kOneHead, kMultiHead };

// A (layer, KV head) of the model.
struct RetrievalHead {
  int layer = 0;
  int kv_head = 0;
};

struct RetrievalModelOptions {
  RetrievalShape shape = RetrievalShape::kOneHead;
  // >= 2. Layer 0 is the previous-token head, the last layer the induction head, the ones
  // between are exact no-ops (they give per-layer KV configs layers that need nothing).
  int n_layers = 4;
  // Weight matrices: f32 or f16 (both score 100% on the tests); norms are always f32.
  DType weight_type = DType::kF32;
  // kMultiHead: the induction head's second query head attends uniformly instead (its output is
  // unused either way, so the model answers alike): a probe's group mean of the induction score
  // halves, its group max does not.
  bool lone_induction_query_head = false;
};

// Writes the model (GGUF v3, general.architecture "llama", context_length 32768, no tokenizer:
// tasks are token ids). InvalidArgument for n_layers < 2 or another weight type.
Status WriteRetrievalModel(const RetrievalModelOptions& options, const std::string& out_path);

// The heads that carry the retrieval circuit (previous-token, then induction), the ones a
// retrieval-head probe must find.
std::vector<RetrievalHead> RetrievalCircuitHeads(RetrievalShape shape, int n_layers);

// Token ids of the model: 16 filler (0-15), 12 keys (16-27), 12 values (28-39); n_vocab 40.
// A key may be paired with any value. Needle / copy tasks work when the tokens to retrieve occur
// once before the question: keys and values do; filler repeats, so a filler "question" returns
// the haystack's average successor of that filler symbol.
TokenVocab RetrievalModelVocab();

// The default model (RetrievalModelOptions{}), written once into the cache folder
// ($KVSPARSE_CACHE, else ~/.cache/kvsparse, else the temp folder) and reused; concurrent
// callers are safe (each writes a private temp file and renames it into place).
StatusOr<std::string> BuiltinRetrievalModelPath(RetrievalShape shape = RetrievalShape::kOneHead);

}  // namespace kvsparse
