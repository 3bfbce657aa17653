// Sparse prefill: a prompt chunk's attention over a selection of key tokens per block of
// queries, estimated per kv head from the chunk's own queries and the cached keys. Decode is
// unchanged, and so is what the cache keeps: sparse prefill saves attention time, eviction
// (kv_policy.h) saves memory; a layer may use both.
//
// Methods (per layer, LayerKvConfig::prefill; JSON "prefill": {"method": ..., params}):
// - vertical_slash: MInference (Jiang et al., NeurIPS 2024), its "vertical and slash" pattern.
//   The last `last_q` (64) queries of the chunk attend to every key; their softmax
//   probabilities are summed per key column
//   (vertical) and per diagonal (slash: the distance from a query's newest key). The top
//   `vertical` (1000, at least 30) columns and the top `slash` (6096, at least 50) diagonals are
//   kept, the first `sink_columns` (30) columns and the `local_diagonals` (100) nearest diagonals
//   first among them (scored +inf, inside the counts, as in the reference). Each query
//   block attends to its columns one by one and to each diagonal as a `block`-wide (64) band
//   that follows the diagonal through the block, as MInference's kernel does.
//   MInference estimates once per prompt, from its last 64 queries (the question, when it comes
//   last); chunked at 512 tokens, kvsparse estimates per chunk from the chunk's own last queries
//   by default, so early chunks never see the question. `two_pass` 1 is the reference's order:
//   Engine::Forward runs the prompt once with per-chunk estimates on a fork of the sequence
//   (copy-on-write pages, cloned policies), estimates each layer's columns and diagonals from
//   that pass's last `last_q` queries against every key the layer holds at its last chunk, drops
//   the fork and prefills the prompt again with those columns and diagonals for every chunk. It
//   costs a second prefill; a prompt of one chunk runs once (its estimate already is the tail's).
// - block_sparse: MInference's block-sparse pattern. Queries and keys are mean-pooled over
//   blocks of `block` (64); the pooled products (no scaling, no softmax) rank the causal key
//   blocks of each query block; the top `top_blocks` (100)
//   are kept, and, unlike MInference, so are the blocks holding the query block's own tokens
//   (so no query is left with nothing to attend to).
// - xattention: XAttention (Xu et al., ICML 2025). Strided antidiagonal scores: with stride S
//   (`stride`, 8), query tile a and key tile b score sum_t q[aS+S-1-t] . k[bS+t], scaled by
//   1/(sqrt(head_dim) S); a softmax over each query tile's visible key tiles, summed into `block` x `block` (128) blocks; per query block the sink block and
//   the blocks of its own tokens are kept, then the others by descending score while the kept
//   share is below `threshold` (0.9) of the row (the block that crosses it is kept).
// Each query head gets its own selection, as the references choose after repeat_kv (MInference's
// minference_forward.py, XAttention's load_llama.py): a GQA group's heads attend to different
// tokens, each reading its own. `group_shared` 1 makes one selection per kv head from the mean of
// its query heads' scores instead (kvsparse's cheaper form: the group reads each selected K/V row
// once). The score products are the same either way; estimates run on f32 copies of the keys. `estimate_bits` (8 or 32) sets the precision
// of the estimating products: 8 (the default of vertical_slash and xattention, whose products
// cost as much as the sparse attention they steer) rounds queries and keys to int8 per row and
// key (ops::ScoreMatrixInt8: exact integer dots, VNNI; each score within its stated bound) on
// families with integer dots, 32 is f32 (block_sparse's default: its pooled products are cheap).
// A chunk with fewer than `min_queries` (128) queries, or whose layer holds fewer than
// `min_context` (1024) tokens, is attended densely.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/kv_types.h"
#include "kvsparse/ops.h"
#include "kvsparse/status.h"

namespace kvsparse {

enum class PrefillMethod { kDense, kVerticalSlash, kBlockSparse, kXAttention };

std::string_view PrefillMethodName(PrefillMethod method);  // "dense", "vertical_slash", ...
std::optional<PrefillMethod> PrefillMethodFromName(std::string_view name);

struct PrefillSparsity {
  PrefillMethod method = PrefillMethod::kDense;
  int block = 64;          // query block = key block, tokens (XAttention's default: 128)
  int min_queries = 128;   // smaller chunks are attended densely
  int min_context = 1024;  // so are chunks over fewer cached tokens
  // vertical_slash
  int last_q = 64;
  int vertical = 1000;
  int slash = 6096;
  int sink_columns = 30;
  int local_diagonals = 100;
  int two_pass = 0;  // 1: one estimate per prompt from its tail (Engine::Forward's two passes)
  // block_sparse
  int top_blocks = 100;
  // xattention
  int stride = 8;
  double threshold = 0.9;
  // every method: the estimating products' precision, 8 (int8, where the family has integer dots)
  // or 32 (f32)
  int estimate_bits = 8;
  // every method: 0 (default) one selection per query head, 1 one per kv head (the group's mean)
  int group_shared = 0;
};

// Selections an estimate makes for one kv head of `group` query heads: group, or 1 when shared.
inline int PrefillSelectionsPerKvHead(const PrefillSparsity& p, int group) { return p.group_shared ? 1 : group; }

// A method's paper defaults (block 128 for xattention, 64 otherwise; estimate_bits 32 for
// block_sparse, 8 otherwise).
PrefillSparsity DefaultPrefillSparsity(PrefillMethod method);

// Parameter keys of a method (block, min_queries, min_context, then the method's own).
std::vector<std::string_view> PrefillParamKeys(PrefillMethod method);
// Sets one parameter (an integer parameter needs an integral value). Errors name the key and
// the method's valid keys; ranges are checked by ValidatePrefillSparsity.
Status SetPrefillParam(std::string_view key, double value, PrefillSparsity* p);
// Ranges: block in [1, 8192], stride in [1, block] dividing it, threshold in (0, 1], last_q >= 1,
// counts >= 0, min_queries >= 1.
Status ValidatePrefillSparsity(const PrefillSparsity& p);
// "xattention:threshold=0.8:stride=16" (the paper defaults, then the parameters), as the
// --sparse-prefill flag takes it. Messages start with `flag`.
StatusOr<PrefillSparsity> ParsePrefillSparsity(std::string_view text, std::string_view flag);
// "xattention block=128 stride=8 threshold=0.9" (only the method's own parameters).
std::string PrefillSparsitySummary(const PrefillSparsity& p);

// What a Vertical-Slash estimate keeps for one selection: key columns (token indices of the keys
// estimated against, ascending) and diagonals (offsets from a query's newest visible key,
// ascending), the forced sink columns and local diagonals among them.
struct VerticalSlashPattern {
  std::vector<int64_t> columns;
  std::vector<int64_t> diagonals;
};

// One kv head's selection, owning the ranges a KeySelection points at.
struct PrefillSelection {
  int query_block = 0;
  std::vector<int64_t> range_offsets;  // [n_query_blocks + 1]
  std::vector<int64_t> ranges;         // [2 * n_ranges] (begin, end) token index pairs
  KeySelection view() const { return KeySelection{query_block, range_offsets.data(), ranges.data()}; }
};

// (query, key) pairs a selection computes among those causal attention would: the share of
// the work sparse prefill does. visible: [n_q] tokens each query sees (a prefix, in span order).
struct PrefillWork {
  int64_t selected_pairs = 0;
  int64_t causal_pairs = 0;
};
PrefillWork CountPrefillWork(const PrefillSelection& selection, const int64_t* visible, int32_t n_q);

// The estimators. Their scratch is kept between calls; one selector per thread (the engine
// estimates a layer's kv heads in parallel, one selector each, with n_threads 1).
class PrefillSelector {
 public:
  // One kv head: q [n_q, group, head_dim] its query heads' rows (rotated), visible [n_q] the
  // tokens each query sees, keys [n_tokens rounded up to config.stride (xattention), head_dim]
  // f32 (rows past n_tokens zero). head_shape: {group, 1, head_dim, scale}. out:
  // [PrefillSelectionsPerKvHead(config, group)], query head g's selection at out[g] (or the
  // group's at out[0]).
  void Select(const PrefillSparsity& config, const AttentionShape& head_shape, const float* q, const int64_t* visible,
              int32_t n_q, const float* keys, int64_t n_tokens, int n_threads, PrefillSelection* out);
  // Vertical-Slash's two halves (Select runs both): the estimate from the last `last_q` of the
  // n_q queries (arguments as Select's; out: [PrefillSelectionsPerKvHead] patterns), and one
  // selection's assembly for n_q queries from a pattern, whose columns index the keys these
  // queries see (columns past a query block's visible keys are skipped).
  void EstimateVerticalSlash(const PrefillSparsity& c, const AttentionShape& head_shape, const float* q,
                             const int64_t* visible, int32_t n_q, const float* keys, int64_t n_tokens, int n_threads,
                             VerticalSlashPattern* out);
  static void AssembleVerticalSlash(const PrefillSparsity& c, const int64_t* visible, int32_t n_q,
                                    const VerticalSlashPattern& pattern, PrefillSelection* out);

 private:
  void VerticalSlash(const PrefillSparsity& c, const AttentionShape& s, const float* q, const int64_t* visible,
                     int32_t n_q, const float* keys, int64_t n_tokens, int n_threads, PrefillSelection* out);
  void BlockSparse(const PrefillSparsity& c, const AttentionShape& s, const float* q, const int64_t* visible,
                   int32_t n_q, const float* keys, int64_t n_tokens, int n_threads, PrefillSelection* out);
  void XAttention(const PrefillSparsity& c, const AttentionShape& s, const float* q, const int64_t* visible,
                  int32_t n_q, const float* keys, int64_t n_tokens, int n_threads, PrefillSelection* out);
  // A pattern from column and diagonal sums ([horizon] each, overwritten).
  void TopPattern(const PrefillSparsity& c, int64_t horizon, float* vertical_sums, float* slash_sums,
                  VerticalSlashPattern* out);
  std::vector<float> a_, b_, c_, d_, e_;  // scratch
  std::vector<int64_t> index_;
  std::vector<VerticalSlashPattern> patterns_;  // Select's Vertical-Slash estimate
  ops::Int8Keys int8_keys_;  // estimate_bits 8: the keys packed once per estimate
};

// Every kv head's keys of the spans as f32: out [row_heads, n_rows, head_dim] with n_rows =
// n_tokens rounded up to `round_to` (the extra rows zero). storage: the layer's type.
void LoadKeyMatrices(KvStorage storage, const KvSpan* spans, int32_t n_spans, int row_heads, int head_dim, int round_to,
                     int n_threads, std::vector<float>* out, int64_t* n_rows);

// The spans' token positions, concatenated in span order (ascending): out [n_tokens].
void SpanPositions(const KvSpan* spans, int32_t n_spans, std::vector<int32_t>* out);

// Tokens each query sees: visible[i] = the spans' tokens with position <= q_pos[i].
void VisibleCounts(const KvSpan* spans, int32_t n_spans, const int32_t* q_pos, int32_t n_q,
                   std::vector<int64_t>* visible);

}  // namespace kvsparse
