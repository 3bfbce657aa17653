// Shared pieces of the sparse prefill estimators (prefill_*.cc): score products over the f32
// key matrix and the assembly of each query block's token ranges.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kvsparse/sparse_prefill.h"

namespace kvsparse::prefill_detail {

// The keys of an estimate as int8 codes (into int8_keys) when config.estimate_bits is 8 and the
// family has integer dots; null (f32 products) otherwise.
const ops::Int8Keys* PrepareEstimateKeys(const PrefillSparsity& config, const float* keys, int64_t n_keys, int dim,
                                         int n_threads, ops::Int8Keys* int8_keys);
// scores [n_rows, n_keys] = rows [n_rows, dim] . keys [n_keys, dim]^T on n_threads: ops::ScoreMatrix,
// or ops::ScoreMatrixInt8 over int8_keys (PrepareEstimateKeys of the same keys) when not null.
void ScoreProducts(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, int n_threads,
                   std::vector<float>* scores, const ops::Int8Keys* int8_keys = nullptr);

// Builds a PrefillSelection block by block: Add() the (begin, end) token ranges of the current
// query block in any order, overlapping or not; EndBlock() sorts (unless they came in ascending
// order), merges and clips them to [0, limit) and starts the next block.
class RangeAssembler {
 public:
  RangeAssembler(int query_block, PrefillSelection* out);
  void Add(int64_t begin, int64_t end) {
    if (begin >= end) return;
    if (!pending_.empty() && std::pair(begin, end) < pending_.back()) ascending_ = false;
    pending_.emplace_back(begin, end);
  }
  void EndBlock(int64_t limit);

 private:
  PrefillSelection* out_;
  std::vector<std::pair<int64_t, int64_t>> pending_;
  bool ascending_ = true;  // pending_ arrived sorted: EndBlock skips the sort
};

// The key tokens a query block [first, last] sees of its own: from the newest token its first
// query sees to the newest its last query sees (a chunk's own tokens, before any eviction).
inline std::pair<int64_t, int64_t> OwnTokens(const int64_t* visible, int32_t first, int32_t last) {
  return {visible[first] > 0 ? visible[first] - 1 : 0, visible[last]};
}

}  // namespace kvsparse::prefill_detail
