// The symbol classes a token-level benchmark task draws from. Token-level tasks serve
// models without a usable tokenizer (stories260K, the built-in retrieval model): a task is
// built from filler, key and value token ids and checked by token id.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsparse {

struct TokenVocab {
  std::vector<int32_t> filler;  // haystack tokens (never keys or values)
  std::vector<int32_t> keys;    // needle keys; a question is a key the model must complete
  std::vector<int32_t> values;  // what a key maps to (the expected answer)
  // Distinct filler, key and value ids, each in [0, n_vocab) of the model.
};

}  // namespace kvsparse
