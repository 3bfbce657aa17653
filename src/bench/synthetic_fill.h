// Synthetic KV depth for the speed benchmarks: random K/V appended straight into a cache, as a
// prefill would store them, without running the model (decode speed and memory do not depend
// on the cached values).
#pragma once

#include <cstdint>

#include "kvsparse/kv_cache.h"
#include "kvsparse/status.h"

namespace kvsparse {

class SparseKvController;

// Appends `n_tokens` tokens of random K/V (positions 0 .. n_tokens-1) to every layer of
// sequence `seq` in chunks of `chunk`. With a controller each chunk is announced to the
// policies (OnAppend) and every layer is trimmed after it (AfterAttention with kPrefillChunk,
// kPromptEnd for the last chunk), as a chunked prefill would; policies that read attention
// get no observations. The K/V values are the same for every call (a fixed seed).
Status SyntheticFill(KvCache& cache, SparseKvController* controller, int seq, int32_t n_tokens, int chunk);

}  // namespace kvsparse
