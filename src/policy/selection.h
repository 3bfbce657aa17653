// Selection helpers shared by the policies: protected sinks and recent windows, top-k by
// score in O(n) (nth_element), and folding per-head scores into one per token.
#pragma once

#include <cstdint>
#include <vector>

#include "kvsparse/kv_policies.h"

namespace kvsparse::policy {

// The recent window (tokens) a layer keeping `target` tokens protects: "recent" if set,
// else floor(recent_ratio * target); never more than target.
int32_t RecentWindowTokens(const KvMethodParams& params, int32_t target);

// Sets *keep ([n_live]) to: the newest token (whenever target >= 1: the next step attends to
// it), the first n_sink tokens, the last n_recent tokens, and the best-scored (highest) of the
// tokens between them, `target` in all. When they do not all fit, the newest token wins, then
// the sinks, then the window. Ties keep the newer token; NaN scores rank lowest. `scratch` is reused index storage. scores: [n_live] (only the middle is read).
void KeepSinksRecentAndTop(const float* scores, int32_t n_live, int32_t target, int32_t n_sink, int32_t n_recent,
                           std::vector<int32_t>* scratch, std::vector<uint8_t>* keep);

// out[t] = mean or max over h of values[t * n_heads + h]. values: [n, n_heads]; out: [n].
void ReduceHeads(const float* values, int32_t n, int n_heads, HeadReduce reduce, float* out);

}  // namespace kvsparse::policy
