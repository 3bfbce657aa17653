// Fast score gathering: a QK-only second pass over K that turns each score into its final
// softmax probability with the row's (max, sum) from ops::Attention, folds the query heads
// of each KV head and sums over queries, block by block. Nothing of size n_q x n_tokens is
// ever stored.
//
// Work is split into units of (kv head, token chunk); a unit owns its output columns, so
// units never write the same element; inside a unit, queries go in cache-sized tiles. Scores
// come from the same block primitives as the attention kernel (attention_kernels-inl.h), so
// within a kernel family they match its scores bit for bit. Spans of different storage types
// (int8_kivi pages and their full-precision residual) are walked as separate segments; a row's
// softmax statistics are global, so segments need no merge. Sliding windows and softcapping
// (AttentionShape) mask and cap the scores exactly as the attention kernel does, with the same
// primitives, so the probabilities are those it attended with. Compiled once per kernel family
// (ops/simd_family.h); ops::AttentionScores runs the active family's AttentionScoresImpl.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "kvsparse/attention_scores.h"
#include "kvsparse/isa.h"
#include "ops/attention_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/attention_scores.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/attention_kernels-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

namespace {

using namespace attn_detail;  // NOLINT: the kernel's own primitives (this family's and the shared ones)

constexpr int64_t kMinChunkTokens = 64;  // smallest token chunk worth a separate unit
constexpr int kUnitsPerThread = 4;
constexpr int64_t kMinParallelWork = int64_t{1} << 20;  // multiply-adds below which threads cost more than they save
constexpr int kTileRows = 64;  // query rows (queries x group) whose q stays cached while K streams

struct ScorePlan {
  AttentionShape shape;
  ScoreGathering gathering;
  ScoreOutputs outputs;
  int group = 0;
  int dp = 0;
  int64_t n_tokens = 0;       // output row length
  const float* q = nullptr;
  const int32_t* q_pos = nullptr;
  int32_t n_q = 0;
  const float* row_max_sum = nullptr;
  int32_t first_window = 0;   // the first query inside the window (window_rows row 0)
};

// One (kv head, token chunk) unit. Queries are processed in tiles of about kTileRows rows so
// that a tile's pre-scaled q rows stay in L1/L2 while the chunk's K blocks stream past; the
// unit adds each tile's contribution into its own output columns. kMasked: the shape has a
// sliding window or a softcap (the default path is its own instantiation, as in attention.cc).
template <bool kMasked>
void RunScoreUnit(const ScorePlan& plan, const SegmentPlan& segment, int kv_head, int64_t t_begin, int64_t t_end) {
  const TokenSequence& seq = segment.seq;
  const int64_t* visible = segment.visible.data();
  const int64_t* first = segment.first.data();
  const AttentionShape& shape = plan.shape;
  const bool windowed = kMasked && shape.window > 0;
  const Softcap softcap(kMasked ? shape.softcap : 0.f);
  const bool capped = kMasked && softcap.on;
  const int d = shape.head_dim, dp = plan.dp, group = plan.group;
  const int tile_queries = std::max(1, kTileRows / group);
  const int max_rows = tile_queries * group;

  static thread_local AlignedBuffer buffer;
  const size_t q_floats = static_cast<size_t>(max_rows) * dp;
  const size_t p_floats = static_cast<size_t>(max_rows) * kBlock;
  float* const scratch = buffer.Get(q_floats + p_floats + static_cast<size_t>(kBlock) * dp + 2 * max_rows);
  float* q_rows = scratch;                  // [rows, dp] pre-scaled queries (as in ops::Attention)
  float* p = q_rows + q_floats;             // [rows, kBlock] this block's probabilities, lane order
  float* k_block = p + p_floats;            // [dp / 4, 4, 16] packed K
  float* row_max = k_block + static_cast<size_t>(kBlock) * dp;  // [rows] softmax max, log2 domain
  float* row_inv_sum = row_max + max_rows;  // [rows] 1 / softmax sum (0: row sees nothing)

  const bool int8 = IsScaledCodeStorage(segment.storage);
  const bool kivi = IsKiviStorage(segment.storage);
  const bool low_bit = IsLowBitKivi(segment.storage);  // packed codes with zero points: f32 scratch rows
  const size_t token_bytes = KvRowBytes(segment.storage, static_cast<size_t>(shape.n_kv_heads) * d);
  const size_t head_offset = KvRowBytes(segment.storage, static_cast<size_t>(kv_head) * d);
  static thread_local LowBitScratch low_bit_scratch;
  const bool max_fold = plan.gathering.aggregation == GqaAggregation::kMax;
  const float fold_scale = max_fold ? 1.f : 1.f / static_cast<float>(group);
  const ScoreOutputs& out = plan.outputs;
  const size_t out_row = static_cast<size_t>(kv_head) * plan.n_tokens + segment.first_token;
  const float q_scale = shape.scale * kLog2e;
  // Integer dots as ops::Attention computes them (AttentionShape::integer_dots), so the scores
  // match its statistics.
  const bool integer = kIntegerDots && shape.integer_dots && IntegerDotsServe(segment.storage, d);
  static thread_local QueryCodes query_codes;
  const bool bf16_dots = kBf16Dots && shape.integer_dots && Bf16DotsServe(segment.storage) && Bf16DotsEnabled();
  static thread_local std::vector<uint16_t> q_bf16;  // [rows, dp]

  for (int32_t q_begin = 0; q_begin < plan.n_q; q_begin += tile_queries) {
    const int32_t q_end = std::min(plan.n_q, q_begin + tile_queries);
    // Rows: the tile's queries' heads of this kv head, row r = (i - q_begin) * group + head_in_group.
    const int rows = (q_end - q_begin) * group;
    const TileRange tile_tokens = TileTokens(segment, q_begin, q_end);
    const int64_t tile_begin = std::max(t_begin, tile_tokens.begin);
    const int64_t tile_end = std::min(t_end, tile_tokens.end);
    if (tile_end <= tile_begin) continue;  // causal mask (or window): the tile sees none of the chunk
    for (int r = 0; r < rows; ++r) {
      const int32_t i = q_begin + r / group;
      const size_t row_index = static_cast<size_t>(i) * shape.n_heads + kv_head * group + r % group;
      LoadQueryRow(plan.q + row_index * d, d, dp, q_scale, q_rows + static_cast<size_t>(r) * dp);
      row_max[r] = plan.row_max_sum[2 * row_index] * kLog2e;
      const float sum = plan.row_max_sum[2 * row_index + 1];
      row_inv_sum[r] = sum > 0.f ? 1.f / sum : 0.f;
    }
    if (integer) QuantizeQueries(q_rows, rows, dp, &query_codes);
    if (bf16_dots) {
      if constexpr (kBf16Dots) {
        q_bf16.resize(static_cast<size_t>(rows) * dp);
        QueryRowsToBf16(q_rows, rows, dp, q_bf16.data());
      }
    }
    const bool has_last = q_end == plan.n_q;

    int32_t block_span = seq.SpanOf(tile_begin);
    for (int64_t t0 = tile_begin; t0 < tile_end; t0 += kBlock) {
      const int n_block = static_cast<int>(std::min<int64_t>(kBlock, t_end - t0));
      BlockRows block;
      GatherBlockRows(seq, t0, n_block, token_bytes, shape.n_kv_heads, int8, &block_span, &block);
      const uint8_t* k_head[kBlock];
      float k_scale[kBlock];
      const float* k_chan[kBlock];
      for (int j = 0; j < n_block; ++j) {
        k_head[j] = block.k[j] + head_offset;
        if (kivi) {
          // int8_kivi's channel scales (low-bit KIVI reads its own in DequantizeLowBitKBlock)
          if (!low_bit) k_chan[j] = block.k_chan[j] + static_cast<size_t>(kv_head) * d;
        } else if (int8) {
          k_scale[j] = block.k_scale[j][kv_head];
        }
      }
      alignas(64) float lane_k_scale[kBlock];  // integer, fp8 bf16 dots: token K scale per lane (0 past)
      if (integer) {
        if constexpr (kIntegerDots) {
          ScalesInLaneOrder(k_scale, n_block, lane_k_scale);
          PackKCodes(k_head, n_block, dp, reinterpret_cast<uint8_t*>(k_block));
        }
      } else if (bf16_dots) {
        if constexpr (kBf16Dots) {
          // fp8: the token K scales apply to the scores
          if (int8) ScalesInLaneOrder(k_scale, n_block, lane_k_scale, CodeScaleFactor(segment.storage));
          PackKBf16(segment.storage, k_head, n_block, d, dp, reinterpret_cast<uint16_t*>(k_block));
        }
      } else if (low_bit) {
        DequantizeLowBitKBlock(KvStorageBits(segment.storage), block, kv_head, n_block, d, dp, &low_bit_scratch,
                               k_head);
        PackK(KvStorage::kF32, k_head, k_scale, k_chan, n_block, d, dp, k_block);
      } else {
        PackK(segment.storage, k_head, k_scale, k_chan, n_block, d, dp, k_block);
      }

      // Probabilities of every row, two rows at a time so they share the K loads.
      // Row r sees the block's tokens [first_of(r), valid_of(r)).
      auto valid_of = [&](int r) {
        return static_cast<int>(std::clamp<int64_t>(visible[q_begin + r / group] - t0, 0, n_block));
      };
      auto first_of = [&](int r) {
        return windowed ? static_cast<int>(std::clamp<int64_t>(first[q_begin + r / group] - t0, 0, n_block)) : 0;
      };
      for (int r = 0; r < rows; r += 2) {
        const int n_pair = std::min(2, rows - r);
        const int valid0 = valid_of(r), valid1 = n_pair == 2 ? valid_of(r + 1) : 0;
        const int first0 = first_of(r), first1 = n_pair == 2 ? first_of(r + 1) : 0;
        float* p_row = p + static_cast<size_t>(r) * kBlock;
        if (valid0 <= first0 && valid1 <= first1) {  // causal mask or window: neither row sees this block
          std::fill(p_row, p_row + n_pair * kBlock, 0.f);
          continue;
        }
        ScoreVec scores[2];
        ScoreRowPair(n_pair, bf16_dots ? q_bf16.data() : nullptr, integer ? &query_codes : nullptr, q_rows, r, dp,
                     k_block, int8 ? lane_k_scale : nullptr, scores);
        if (capped) {
          for (int i = 0; i < n_pair; ++i) ApplySoftcap(softcap, &scores[i]);
        }
        if (n_pair == 2) Probabilities(scores[1], first1, valid1, row_max[r + 1], row_inv_sum[r + 1], p_row + kBlock);
        Probabilities(scores[0], first0, valid0, row_max[r], row_inv_sum[r], p_row);
      }

      // Fold each query's heads, then sum over the tile's queries (lane order throughout).
      float sum_all[kBlock] = {}, sum_window[kBlock] = {}, last[kBlock] = {};
      for (int32_t i = q_begin; i < q_end; ++i) {
        if (visible[i] <= t0 || (windowed && first[i] >= t0 + n_block)) continue;  // sees none of the block
        float folded[kBlock] = {};
        for (int g = 0; g < group; ++g) {
          const float* p_row = p + (static_cast<size_t>(i - q_begin) * group + g) * kBlock;
          for (int lane = 0; lane < kBlock; ++lane) {
            folded[lane] = max_fold ? std::max(folded[lane], p_row[lane]) : folded[lane] + p_row[lane];
          }
        }
        for (int lane = 0; lane < kBlock; ++lane) folded[lane] *= fold_scale;
        for (int lane = 0; lane < kBlock; ++lane) sum_all[lane] += folded[lane];
        if (plan.q_pos[i] >= plan.gathering.window_start) {
          for (int lane = 0; lane < kBlock; ++lane) sum_window[lane] += folded[lane];
          if (out.window_rows != nullptr) {
            float* row = out.window_rows +
                         (static_cast<size_t>(i - plan.first_window) * plan.shape.n_kv_heads + kv_head) *
                             plan.n_tokens +
                         segment.first_token + t0;
            for (int lane = 0; lane < kBlock; ++lane) {
              const int j = LaneToken(lane);
              if (j < n_block) row[j] = folded[lane];
            }
          }
        }
        if (i == plan.n_q - 1) std::copy(folded, folded + kBlock, last);
      }
      for (int lane = 0; lane < kBlock; ++lane) {
        const int j = LaneToken(lane);
        if (j >= n_block) continue;
        const size_t at = out_row + static_cast<size_t>(t0 + j);
        if (out.sum_all != nullptr) out.sum_all[at] += sum_all[lane];
        if (out.sum_window != nullptr) out.sum_window[at] += sum_window[lane];
        if (out.last != nullptr && has_last) out.last[at] = last[lane];
      }
    }
  }
}

}  // namespace

void AttentionScoresImpl(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos,
                         int32_t n_q, const KvSpan* spans, int32_t n_spans, const float* row_max_sum,
                         const ScoreGathering& gathering, const ScoreOutputs& outputs, int n_threads) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0);
  KVS_CHECK_MSG(shape.n_heads % shape.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  KVS_CHECK(n_q >= 0 && n_spans >= 0);
  KVS_CHECK_MSG(n_q == 0 || row_max_sum != nullptr, "AttentionScores needs the row_max_sum of ops::Attention");
  if (n_threads <= 0) n_threads = omp_get_max_threads();

  int64_t n_tokens = 0;
  for (int32_t i = 0; i < n_spans; ++i) n_tokens += spans[i].n;
  // Tokens no query sees, and every token when there are no queries, stay 0.
  const size_t n_out = static_cast<size_t>(shape.n_kv_heads) * n_tokens;
  for (float* o : {outputs.sum_all, outputs.sum_window, outputs.last}) {
    if (o != nullptr) std::fill(o, o + n_out, 0.f);
  }
  int32_t first_window = n_q;  // queries [first_window, n_q) are the window's (positions ascend)
  while (first_window > 0 && q_pos[first_window - 1] >= gathering.window_start) --first_window;
  if (outputs.window_rows != nullptr) {
    std::fill(outputs.window_rows, outputs.window_rows + static_cast<size_t>(n_q - first_window) * n_out, 0.f);
  }
  std::vector<SegmentPlan> segments =
      PlanSegments(storage, spans, n_spans, q_pos, n_q, shape.window);  // checks the scales
  const int64_t total_visible = TotalVisible(segments);
  if (total_visible == 0) return;

  ScorePlan plan;
  plan.shape = shape;
  plan.gathering = gathering;
  plan.outputs = outputs;
  plan.group = shape.n_heads / shape.n_kv_heads;
  plan.dp = static_cast<int>(RoundUp(shape.head_dim, kLanes));
  plan.n_tokens = n_tokens;
  plan.q = q;
  plan.q_pos = q_pos;
  plan.n_q = n_q;
  plan.row_max_sum = row_max_sum;
  plan.first_window = first_window;

  // Enough (kv head, chunk) units to keep every thread busy, but chunks of at least
  // kMinChunkTokens; segments share the chunks in proportion to their tokens.
  const int64_t work = static_cast<int64_t>(n_q) * shape.n_heads * total_visible * shape.head_dim;
  if (work < kMinParallelWork) n_threads = 1;
  int wanted = 1;
  if (n_threads > 1) wanted = (kUnitsPerThread * n_threads + shape.n_kv_heads - 1) / shape.n_kv_heads;
  // Global chunk -> (segment, chunk within it); segments no query sees are dropped.
  const std::vector<std::pair<int, int>> chunk_of = ChunkSegments(&segments, wanted, kMinChunkTokens);
  const int n_chunks = static_cast<int>(chunk_of.size());

  const int n_units = shape.n_kv_heads * n_chunks;
  const int threads = std::min(n_threads, n_units);
  const bool masked = shape.window > 0 || shape.softcap > 0.f;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int u = 0; u < n_units; ++u) {
    const int kv_head = u % shape.n_kv_heads;
    const auto [seg, chunk] = chunk_of[u / shape.n_kv_heads];
    const SegmentPlan& segment = segments[seg];
    if (masked) {
      RunScoreUnit<true>(plan, segment, kv_head, segment.ChunkBegin(chunk), segment.ChunkEnd(chunk));
    } else {
      RunScoreUnit<false>(plan, segment, kv_head, segment.ChunkBegin(chunk), segment.ChunkEnd(chunk));
    }
  }
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(AttentionScoresImpl);

void AttentionScores(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos,
                     int32_t n_q, const KvSpan* spans, int32_t n_spans, const float* row_max_sum,
                     const ScoreGathering& gathering, const ScoreOutputs& outputs, int n_threads) {
  KVS_DISPATCH(AttentionScoresImpl)(shape, storage, q, q_pos, n_q, spans, n_spans, row_max_sum, gathering, outputs,
                                    n_threads);
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
