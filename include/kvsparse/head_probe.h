// Retrieval-head probe (RazorAttention's data-free head score; H. Tang et al., "RazorAttention:
// Efficient KV Cache Compression Through Retrieval Heads", ICLR 2025, arXiv:2407.15891) and
// the step that turns head scores into the `razor` method's per-layer sets of full heads.
//
// The probe feeds the model a random token sequence R (distinct tokens, `tokens` long) twice,
// R R, and watches each KV head's attention (averaged over its query heads) while the second
// copy is read one token at a time: the query R[j] at position n + j should, in a retrieval
// head, attend to the token that followed R[j]'s earlier occurrence (position j + 1: an
// induction head) or to that occurrence itself (position j: an echo head). A head's scores are
// those attention shares averaged over the queries and the trials; score = induction + echo.
// Heads that attend locally, to sinks or uniformly score near 0 (uniform: about 2 / (n + j)).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct HeadProbeOptions {
  int tokens = 128;    // length of the random sequence R (at most the vocabulary; the prompt is 2x)
  int trials = 2;      // random sequences averaged
  uint64_t seed = 1;
  int n_threads = 1;
};

struct HeadScore {
  int layer = 0;
  int kv_head = 0;
  double induction = 0;  // mean attention on the earlier occurrence's successor
  double echo = 0;       // mean attention on the earlier occurrence itself
  double score() const { return induction + echo; }
};

// Every (layer, KV head) of the model, best score first (ties: lower layer, then lower head).
StatusOr<std::vector<HeadScore>> ProbeRetrievalHeads(const Model& model, const HeadProbeOptions& options);

// The heads file `kvsparse probe-heads -o FILE` writes and razor's "heads" reads:
//   {"n_layers": L, "n_kv_heads": H, "heads": [{"layer": l, "kv_head": h, "score": s,
//    "induction": i, "echo": e}, ...]}   (any order; "induction"/"echo" optional)
// so scores from elsewhere (e.g. DuoAttention's published head patterns) can be written by hand.
std::string HeadScoresToJson(const std::vector<HeadScore>& heads, int n_layers, int n_kv_heads);
// Reads and checks a heads file against the model's shape; messages name the file and entry.
StatusOr<std::vector<HeadScore>> LoadHeadScores(const std::string& path, int n_layers, int n_kv_heads);

// For every razor layer of `config` not yet resolved: reads its "heads" file (or, when it names
// none, probes `model` once with default options) and marks the best `retrieval_heads` heads of
// the whole model as full (a count, or a share of n_layers x n_kv_heads rounded to nearest, at
// least 1 when the share is > 0). Heads are ranked over every layer, so a layer may get none.
// No-op when the config has no razor layer.
Status ResolveRetrievalHeads(const Model& model, int n_threads, KvSparsityConfig* config);

}  // namespace kvsparse
