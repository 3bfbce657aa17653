// Retrieval-head probe (RazorAttention's data-free head score; H. Tang et al., "RazorAttention:
// Efficient KV Cache Compression Through Retrieval Heads", ICLR 2025, arXiv:2407.15891) and
// the step that turns head scores into the `razor` method's per-layer sets of full heads.
//
// The probe feeds the model a random token sequence R (distinct tokens, `tokens` long, 2500 as
// in the reference's razor_attention.py) `repeats` times (4), R R R R, and reads every copy after
// the first one token at a time. The query R[j] of copy c should, in a retrieval head, attend to
// R[j]'s earlier occurrences (positions c'n + j, c' < c: an echo head) or to the tokens that
// followed them (c'n + j + 1: an induction head). Per query head, a score is that attention summed
// over the earlier occurrences, averaged over the queries and the trials; a KV head takes the
// max over its group's query heads (the reference's _max_every_group), echo and induction apart.
// Heads that attend locally, to sinks or uniformly score near 0. The sequence is cut to fit the
// vocabulary and max_context / repeats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct HeadProbeOptions {
  int tokens = 2500;   // length of the random sequence R (at most the vocabulary and max_context / repeats)
  int repeats = 4;     // copies of R in the prompt (>= 2)
  int trials = 1;      // random sequences averaged
  uint64_t seed = 1;
  int n_threads = 1;
};

struct HeadScore {
  int layer = 0;
  int kv_head = 0;
  double induction = 0;  // mean attention on the earlier occurrences' successors (max over the group)
  double echo = 0;       // mean attention on the earlier occurrences themselves (max over the group)
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
// none, probes `model` once with default options) and marks as full the best `echo_heads` heads
// of the whole model by echo score together with the best `induction_heads` by induction score
// (the reference's lists), or with `retrieval_heads` set the best that many by echo + induction.
// Counts: an integer, or a share of n_layers x n_kv_heads rounded half to even as the reference
// (Python's round(): a model of fewer than 50 KV heads gets no echo head at 1%), retrieval_heads'
// to nearest and at least 1 when > 0. Heads are ranked over every layer, so a layer may get none.
// A heads file without the echo / induction split ranks by its score.
// No-op when the config has no razor layer.
Status ResolveRetrievalHeads(const Model& model, int n_threads, KvSparsityConfig* config);

}  // namespace kvsparse
