// Fast attention over KV spans: flash-decoding style online softmax.
//
// Work is split into units of (query tile, token chunk). A unit owns one "row" per
// (query, query head) pair of its tile and walks its token chunk in blocks of kBlock
// tokens; for each kv head, the block's K and V rows are read once and used by all
// tile_queries * group rows of that head, so GQA heads share every load. Per row it keeps
// a running max m, running sum l and an unnormalized accumulator acc[head_dim].
// Scores live in the log2 domain (q is pre-scaled by scale*log2(e)) so the softmax
// uses exp2. When the tokens are split into several chunks (decode: one query tile for
// all threads), the partial (m, l, acc) of each chunk are merged at the end.
// Spans of different storage types (an int8_kivi layer's quantized pages and its
// full-precision residual) form segments, each chunked on its own; a segment's chunks are
// merged like any other, so mixed storage costs no extra pass.
// Optionally (decode steps with an observing policy) every row's scores are also stored in
// token order (raw_scores), so the policy's score gathering needs no second pass over K.
// Sliding windows (AttentionShape::window): each query attends to a range of tokens
// [first, visible) rather than a prefix; chunks cover only the tokens some query sees, a unit
// walks only its tile's range (and skips blocks no row of the tile sees), and a block masks
// the leading lanes below each row's first token. Softcapping (AttentionShape::softcap) caps
// each block's scores before the softmax step.
// The block primitives (K packing, scores, softmax step, PV) are in attention_kernels-inl.h;
// this file is compiled once per kernel family (ops/simd_family.h) and ops::Attention runs the
// active family's AttentionImpl.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/dtype.h"
#include "kvsparse/isa.h"
#include "ops/attention_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/attention.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/attention_kernels-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

namespace {

using namespace attn_detail;  // NOLINT: the kernel's own primitives (this family's and the shared ones)

constexpr int kTileRows = 32;       // target rows per kv head (tile queries x group) in a prefill unit
constexpr int64_t kMinChunkTokens = 128;  // smallest token chunk worth a separate unit
constexpr int kUnitsPerThread = 4;         // split tokens until there are this many units per thread
constexpr int64_t kPrefetchTokens = 32;   // how far ahead of the current block K/V rows are prefetched

struct Plan {
  AttentionShape shape;
  int group = 0;
  int dp = 0;                 // head_dim padded to kLanes
  int tile_queries = 0;       // queries per unit
  int n_tiles = 0;
  bool v_in_place = false;    // head_dim % 16 == 0: whole V blocks are read in place, no copy
  int64_t n_tokens = 0;       // all tokens of the spans: the length of a raw_scores row
  int row_heads = 0;          // kv heads per stored token row (>= shape.n_kv_heads)
  int first_kv_head = 0;      // the row's head that is this call's kv head 0
  const KeySelection* selection = nullptr;  // sparse prefill: only these tokens (tiles lie inside a query block)
};

// Unnormalized per-row state of one token chunk, for the split-K merge.
struct PartialState {
  float* m;    // [n_q * n_heads] running max (log2 domain)
  float* l;    // [n_q * n_heads] running sum
  float* acc;  // [n_q * n_heads, dp]
};

// Where a unit's finished rows go: normalized outputs (and optionally each row's softmax
// max and sum), or, when the tokens are split into chunks, the chunk's partial state.
struct UnitOutput {
  float* out = nullptr;                  // [n_q, n_heads, head_dim]
  float* row_max_sum = nullptr;          // [n_q, n_heads, 2] or null
  const PartialState* partial = nullptr;
  float* raw_scores = nullptr;           // [n_q, n_heads, n_tokens] or null: written by every unit
  const float* sinks = nullptr;          // [n_heads] or null: folded in where a row is finished
};

// Runs one (query tile, token chunk) unit over every kv head. Walking all heads of a token
// range together streams whole cache rows from memory ([n, n_kv_heads, head_dim] is
// token-major); a unit per kv head would stride through memory and waste DRAM bandwidth.
// With partial == nullptr the chunk is the whole context and normalized rows go to out.
// kMasked: the shape has a sliding window or a softcap. The default path (neither) is its own
// instantiation, so the window's per-row bounds and the cap cost it nothing.
template <bool kMasked>
void RunUnit(const Plan& plan, const SegmentPlan& segment, const float* q, int32_t n_q, int tile, int chunk,
             const UnitOutput& output) {
  const TokenSequence& seq = segment.seq;
  const int64_t* visible = segment.visible.data();
  const int64_t* first = segment.first.data();
  const KvStorage storage = segment.storage;
  const AttentionShape& shape = plan.shape;
  const bool windowed = kMasked && shape.window > 0;
  const Softcap softcap(kMasked ? shape.softcap : 0.f);
  const bool capped = kMasked && softcap.on;
  const int d = shape.head_dim, dp = plan.dp, group = plan.group;
  const int q_begin = tile * plan.tile_queries;
  const int tile_queries = std::min<int>(n_q, q_begin + plan.tile_queries) - q_begin;
  // Rows are kv-head-major so each kv head's rows are contiguous:
  // row r = kv_head * head_rows + query_in_tile * group + head_in_group.
  const int head_rows = tile_queries * group;
  const int rows = head_rows * shape.n_kv_heads;
  auto row_query = [&](int r) { return q_begin + (r % head_rows) / group; };
  auto row_head = [&](int r) { return (r / head_rows) * group + r % group; };

  // The chunk's tokens that some query of the tile sees (all of them before its last query's
  // position, without a window).
  const TileRange tile_tokens = TileTokens(segment, q_begin, q_begin + tile_queries);
  const int64_t t_begin = std::max(segment.ChunkBegin(chunk), tile_tokens.begin);
  const int64_t t_end = std::min(tile_tokens.end, segment.ChunkEnd(chunk));
  // Sparse prefill: the tile's selected tokens of [t_begin, t_end), as segment-local indices.
  // The walk below takes them kBlock at a time, so unselected tokens cost nothing.
  static thread_local std::vector<int64_t> selected;
  selected.clear();
  if (plan.selection != nullptr) {
    const KeySelection& sel = *plan.selection;
    const int block = q_begin / sel.query_block;
    for (int64_t r = sel.range_offsets[block]; r < sel.range_offsets[block + 1]; ++r) {
      const int64_t begin = std::max(t_begin, sel.ranges[2 * r] - segment.first_token);
      const int64_t end = std::min(t_end, sel.ranges[2 * r + 1] - segment.first_token);
      for (int64_t t = begin; t < end; ++t) selected.push_back(t);
    }
  }
  const bool sparse = plan.selection != nullptr;
  const int64_t n_walk = sparse ? static_cast<int64_t>(selected.size()) : std::max<int64_t>(0, t_end - t_begin);

  // Per-thread scratch, reused across calls.
  static thread_local AlignedBuffer buffer;
  const size_t q_floats = static_cast<size_t>(rows) * dp;
  const size_t kv_floats = static_cast<size_t>(kBlock) * dp;
  float* const scratch = buffer.Get(2 * q_floats + static_cast<size_t>(rows) * (2 * kBlock + 2) + 2 * kv_floats);
  // Every region but the last two is a multiple of 16 floats long, so vector rows stay 64-byte aligned.
  float* q_rows = scratch;                                        // [rows, dp] pre-scaled queries
  float* acc = q_rows + q_floats;                                 // [rows, dp]
  float* p = acc + q_floats;                                      // [rows, kBlock] this block's probabilities
  float* l_lanes = p + static_cast<size_t>(rows) * kBlock;        // [rows, kBlock] running sums, lane-wise
  float* k_block = l_lanes + static_cast<size_t>(rows) * kBlock;  // [dp / 4, 4, 16] one head's packed K
  float* v_block = k_block + kv_floats;                           // [kBlock, dp] one head's V (when copied)
  float* m = v_block + kv_floats;                                 // [rows] running max (log2 domain)
  float* correction = m + rows;                                   // [rows]

  static thread_local std::vector<int64_t> row_visible;  // [rows] tokens the row's query attends to
  static thread_local std::vector<int64_t> row_first;    // [rows] the first of them (window)
  row_visible.resize(rows);
  row_first.resize(rows);
  const float q_scale = shape.scale * kLog2e;
  for (int r = 0; r < rows; ++r) {
    row_visible[r] = visible[row_query(r)];
    row_first[r] = windowed ? first[row_query(r)] : 0;
    const float* src = q + (static_cast<size_t>(row_query(r)) * shape.n_heads + row_head(r)) * d;
    LoadQueryRow(src, d, dp, q_scale, q_rows + static_cast<size_t>(r) * dp);
    m[r] = kNegInf;
  }
  std::fill(acc, acc + q_floats, 0.f);
  std::fill(l_lanes, l_lanes + static_cast<size_t>(rows) * kBlock, 0.f);
  // Integer dots (int8 KV on families that have them): q quantized once per unit; K and V
  // blocks packed as codes into the k_block / v_block scratch (bytes, 4x smaller than floats).
  const bool integer = kIntegerDots && shape.integer_dots && IntegerDotsServe(storage, d);
  static thread_local QueryCodes query_codes;
  static thread_local std::vector<uint8_t> p_codes;  // [rows, 2, kBlock] hi and lo parts, lane order
  static thread_local std::vector<float> p_step;     // [rows]
  if (integer) {
    QuantizeQueries(q_rows, rows, dp, &query_codes);
    p_codes.resize(static_cast<size_t>(rows) * 2 * kBlock);
    p_step.resize(rows);
  }
  // bf16 dots (bf16 and fp8 KV where the CPU has AVX512_BF16): q rounded to bf16 once per unit, K
  // blocks packed as bf16 pairs into k_block (half its floats); with head_dim % 32 == 0 V as token
  // pairs into v_block and the probabilities rounded to bf16 per block (else p.v stays f32).
  const bool bf16_dots = kBf16Dots && shape.integer_dots && Bf16DotsServe(storage) && Bf16DotsEnabled();
  const bool bf16_pv = bf16_dots && d % 32 == 0;
  static thread_local std::vector<uint16_t> q_bf16;  // [rows, dp]
  static thread_local AlignedBuffer p_bf16_buffer;
  uint16_t* p_bf16 = nullptr;  // [rows, kBlock] this block's probabilities as bf16, lane order
  if (bf16_dots) {
    if constexpr (kBf16Dots) {
      q_bf16.resize(q_floats);
      QueryRowsToBf16(q_rows, rows, dp, q_bf16.data());
      p_bf16 = reinterpret_cast<uint16_t*>(p_bf16_buffer.Get(static_cast<size_t>(rows) * kBlock / 2));
    }
  }

  const bool int8 = IsScaledCodeStorage(storage);  // int8, fp8 or KIVI: scaled codes
  const bool kivi = IsKiviStorage(storage);
  const bool low_bit = IsLowBitKivi(storage);  // packed codes with zero points: dequantized into scratch rows
  const int bits = KvStorageBits(storage);
  const size_t token_bytes =
      KvRowBytes(storage, static_cast<size_t>(plan.row_heads) * d);  // one token row, all its heads
  const size_t head_bytes = KvRowBytes(storage, d);
  static thread_local LowBitScratch low_bit_scratch;
  if (low_bit) low_bit_scratch.codes.resize(d);  // (V rows use it too)
  const size_t span_stride = static_cast<size_t>(plan.row_heads) * d;  // elements between rows in a span
  // Prefetches of one block are spread over a head's row pairs (see below).
  const int prefetch_per_pair = (kBlock + (head_rows + 1) / 2 - 1) / ((head_rows + 1) / 2);
  int32_t block_span = n_walk > 0 ? seq.SpanOf(sparse ? selected[0] : t_begin) : 0;
  int32_t prefetch_span = block_span;
  for (int64_t w0 = 0; w0 < n_walk; w0 += kBlock) {
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, n_walk - w0));
    // The block's tokens: t0 .. t0 + n_block - 1, or (sparse) block_tokens[0 .. n_block - 1].
    const int64_t* block_tokens = sparse ? selected.data() + w0 : nullptr;
    const int64_t t0 = sparse ? block_tokens[0] : t_begin + w0;
    const int64_t t_last = sparse ? block_tokens[n_block - 1] : t0 + n_block - 1;
    const bool consecutive = !sparse || t_last - t0 == n_block - 1;
    if (windowed) {
      // Queries far apart in one tile (or a sparse walk) may leave blocks that no row sees
      // between their windows: skip them whole.
      bool seen = false;
      for (int i = q_begin; i < q_begin + tile_queries && !seen; ++i) seen = first[i] <= t_last && visible[i] > t0;
      if (!seen) continue;
    }
    // Addresses of the token rows kPrefetchTokens ahead; each kv head below prefetches its
    // part of them, which spreads the requests over the block's math. (A sparse walk's next
    // tokens are not consecutive: it does not prefetch.)
    const uint8_t* prefetch_k[kBlock];
    const uint8_t* prefetch_v[kBlock];
    int n_prefetch = 0;
    for (int64_t t = t0 + kPrefetchTokens; !sparse && t < std::min(t_end, t0 + kPrefetchTokens + kBlock); ++t) {
      while (t >= seq.span_start[prefetch_span + 1]) ++prefetch_span;
      const KvSpan& s = seq.spans[prefetch_span];
      const size_t offset = static_cast<size_t>(t - seq.span_start[prefetch_span]) * token_bytes;
      prefetch_k[n_prefetch] = static_cast<const uint8_t*>(s.k) + offset;
      prefetch_v[n_prefetch++] = static_cast<const uint8_t*>(s.v) + offset;
      // Per-token scales ([n, row_heads] floats beside the codes): one line per 64 bytes of them.
      if (s.k_scale != nullptr || s.v_scale != nullptr) {
        const size_t scale_index = static_cast<size_t>(t - seq.span_start[prefetch_span]) * plan.row_heads;
        if ((scale_index * sizeof(float)) % 64 < static_cast<size_t>(plan.row_heads) * sizeof(float) ||
            t == t0 + kPrefetchTokens) {
          if (s.k_scale != nullptr) Prefetch(s.k_scale + scale_index);
          if (s.v_scale != nullptr) Prefetch(s.v_scale + scale_index);
        }
      }
    }
    BlockRows block;  // this block's token rows (head 0) in storage type
    if (consecutive) {
      GatherBlockRows(seq, t0, n_block, token_bytes, plan.row_heads, int8, &block_span, &block);
    } else {
      GatherTokenRows(seq, block_tokens, n_block, token_bytes, plan.row_heads, int8, &block_span, &block);
    }
    const bool v_in_place = plan.v_in_place && block.one_span && !low_bit;

    for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
      const int stored_head = plan.first_kv_head + kv_head;  // its place in the stored rows
      const size_t head_offset = static_cast<size_t>(stored_head) * head_bytes;
      const uint8_t* k_head[kBlock];
      float k_scale[kBlock];         // int8 and fp8: token j's K scale for this head
      const float* k_chan[kBlock];   // KIVI only: token j's K channel scales for this head [d]
      float v_scale[kBlock];         // int8, fp8 and KIVI: token j's V scale for this head
      for (int j = 0; j < n_block; ++j) k_head[j] = block.k[j] + head_offset;
      // The integer path's whole blocks in one span read their scales straight into lane order.
      const bool lane_scales_direct = integer && block.one_span;
      if (int8 && !low_bit && !lane_scales_direct) {  // (low-bit KIVI reads its f16 scales below)
        for (int j = 0; j < n_block; ++j) {
          if (kivi) {
            k_chan[j] = block.k_chan[j] + static_cast<size_t>(stored_head) * d;
          } else {
            k_scale[j] = block.k_scale[j][stored_head];
          }
          v_scale[j] = block.v_scale[j][stored_head];
        }
      }
      alignas(64) float lane_k_scale[kBlock];  // integer, fp8 bf16 dots: token K scale per lane (0 past)
      alignas(64) float lane_v_scale[kBlock];  // integer, fp8 bf16 dots: token V scale per lane (0 past)
      if (integer) {
        if constexpr (kIntegerDots) {
          if (lane_scales_direct) {
            GatherLaneScales(block.k_scale[0] + stored_head, plan.row_heads, lane_k_scale);
            GatherLaneScales(block.v_scale[0] + stored_head, plan.row_heads, lane_v_scale);
          } else {
            ScalesInLaneOrder(k_scale, n_block, lane_k_scale);
            ScalesInLaneOrder(v_scale, n_block, lane_v_scale);
          }
          PackKCodes(k_head, n_block, dp, reinterpret_cast<uint8_t*>(k_block));
        }
      } else if (bf16_dots) {
        if constexpr (kBf16Dots) {
          if (int8) {  // fp8: the token scales apply to the scores and (below) the probabilities
            ScalesInLaneOrder(k_scale, n_block, lane_k_scale, CodeScaleFactor(storage));
            ScalesInLaneOrder(v_scale, n_block, lane_v_scale, CodeScaleFactor(storage));
          }
          PackKBf16(storage, k_head, n_block, d, dp, reinterpret_cast<uint16_t*>(k_block));
        }
      } else if (low_bit) {
        DequantizeLowBitKBlock(bits, block, stored_head, n_block, d, dp, &low_bit_scratch, k_head);
        PackK(KvStorage::kF32, k_head, k_scale, k_chan, n_block, d, dp, k_block);
      } else {
        PackK(storage, k_head, k_scale, k_chan, n_block, d, dp, k_block);
      }
      // V is read in place (converted on the fly) when it needs no padding and the block is
      // whole and inside one span; otherwise it is converted into zero-padded scratch rows.
      const void* v_rows = v_block;
      size_t v_stride = dp;  // elements
      KvStorage v_type = KvStorage::kF32;
      if (integer) {
        if constexpr (kIntegerDots) {
          const uint8_t* v_head[kBlock];
          for (int j = 0; j < n_block; ++j) v_head[j] = block.v[j] + head_offset;
          PackVCodes(v_head, n_block, dp, reinterpret_cast<uint8_t*>(v_block));
        }
      } else if (bf16_pv) {
        if constexpr (kBf16Dots) {
          const uint8_t* v_head[kBlock];
          for (int j = 0; j < n_block; ++j) v_head[j] = block.v[j] + head_offset;
          PackVBf16(storage, v_head, n_block, dp, reinterpret_cast<uint16_t*>(v_block));
        }
      } else if (v_in_place) {
        v_rows = block.v[0] + head_offset;
        v_stride = span_stride;
        v_type = storage;
      } else {
        for (int j = 0; j < n_block; ++j) {
          float* row = v_block + static_cast<size_t>(j) * dp;
          if (low_bit) {
            const size_t groups_at = static_cast<size_t>(stored_head) * (d / block.v_group);  // head's V groups
            LowBitRowToF32(bits, block.v[j] + head_offset, block.v_group_scale[j] + groups_at,
                           block.v_group_min[j] + groups_at, block.v_group, d, dp, low_bit_scratch.codes.data(), row);
          } else {
            LoadRowF32(storage, block.v[j] + head_offset, int8 ? v_scale[j] : 1.f, d, row);
          }
        }
        // Rows past the block end must be finite: their p is 0, but 0 * NaN is not.
        std::fill(v_block + static_cast<size_t>(n_block) * dp, v_block + kv_floats, 0.f);
      }

      // Scores and online softmax, two rows at a time so they share the K loads.
      const int r_begin = kv_head * head_rows, r_end = r_begin + head_rows;
      // This head's share of the prefetches, spread over the row pairs so that the requests
      // trickle out instead of filling the miss queue at once.
      for (int r = r_begin, pair = 0; r < r_end; r += 2, ++pair) {
        for (int j = pair * prefetch_per_pair; j < std::min(n_prefetch, (pair + 1) * prefetch_per_pair); ++j) {
          for (size_t b = 0; b < head_bytes; b += 64) {
            Prefetch(prefetch_k[j] + head_offset + b);
            Prefetch(prefetch_v[j] + head_offset + b);
          }
        }
        const int n_pair = std::min(2, r_end - r);
        ScoreVec scores[2];
        ScoreRowPair(n_pair, bf16_dots ? q_bf16.data() : nullptr, integer ? &query_codes : nullptr, q_rows, r, dp,
                     k_block, int8 ? lane_k_scale : nullptr, scores);
        if (capped) {
          for (int i = 0; i < n_pair; ++i) ApplySoftcap(softcap, &scores[i]);
        }
        for (int i = 0; i < n_pair; ++i) {
          // Rows whose query sees none of this block contribute nothing. The tokens ascend, so
          // the ones a row sees are a prefix of the block, less (window) a prefix of that.
          const int64_t valid =
              consecutive ? std::min<int64_t>(n_block, row_visible[r + i] - t0)
                          : std::lower_bound(block_tokens, block_tokens + n_block, row_visible[r + i]) - block_tokens;
          int64_t lo = 0;
          if (windowed) {
            lo = consecutive ? std::max<int64_t>(0, row_first[r + i] - t0)
                             : std::lower_bound(block_tokens, block_tokens + n_block, row_first[r + i]) - block_tokens;
          }
          float* p_row = p + static_cast<size_t>(r + i) * kBlock;
          if (valid <= lo) {
            std::fill(p_row, p_row + kBlock, 0.f);
            correction[r + i] = 1.f;
            continue;
          }
          if (output.raw_scores != nullptr) {
            const size_t row_index = static_cast<size_t>(row_query(r + i)) * shape.n_heads + row_head(r + i);
            StoreScoresInTokenOrder(scores[i], static_cast<int>(lo), static_cast<int>(valid),
                                    output.raw_scores + row_index * plan.n_tokens + segment.first_token + t0);
          }
          correction[r + i] = SoftmaxStep(scores[i], static_cast<int>(lo), static_cast<int>(valid), &m[r + i],
                                          l_lanes + static_cast<size_t>(r + i) * kBlock, p_row);
        }
      }
      // acc += p v, several rows per V load.
      if (integer) {
        if constexpr (kIntegerDots) {
          // The V scales fold into the probabilities, which become u8 codes per row and block.
          QuantizeProbabilityRows(p + static_cast<size_t>(r_begin) * kBlock, lane_v_scale, r_end - r_begin,
                                  p_codes.data() + static_cast<size_t>(r_begin) * 2 * kBlock, p_step.data() + r_begin);
          const uint8_t* v_codes = reinterpret_cast<const uint8_t*>(v_block);
          int r = r_begin;
          for (; r + 2 <= r_end; r += 2) {  // (2 rows x 2 parts x 4 registers of sums: 16 of the 32 zmm)
            AccumulateRowsCodes<2>(p_codes.data() + static_cast<size_t>(r) * 2 * kBlock, p_step.data() + r, correction + r,
                                   v_codes, acc + static_cast<size_t>(r) * dp, dp);
          }
          for (; r < r_end; ++r) {
            AccumulateRowsCodes<1>(p_codes.data() + static_cast<size_t>(r) * 2 * kBlock, p_step.data() + r, correction + r,
                                   v_codes, acc + static_cast<size_t>(r) * dp, dp);
          }
        }
        continue;
      }
      if (bf16_pv) {
        if constexpr (kBf16Dots) {
          // fp8 V is unscaled: its token scales fold into the probabilities (the running sums hold
          // the unscaled ones).
          if (int8) ScaleProbabilities(p, lane_v_scale, r_begin, r_end);
          AccumulateHeadBf16(p, correction, reinterpret_cast<const uint16_t*>(v_block), acc, dp, r_begin, r_end,
                             p_bf16);
        }
        continue;
      }
      switch (v_type) {
        case KvStorage::kF32:
          AccumulateHead(p, correction, static_cast<const float*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          break;
        case KvStorage::kF16:
          AccumulateHead(p, correction, static_cast<const f16_bits*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          break;
        case KvStorage::kBf16:
          AccumulateHead(p, correction, static_cast<const Bf16Value*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          break;
        case KvStorage::kInt8:
        case KvStorage::kInt8Kivi:
        case KvStorage::kFp8E4M3:
        case KvStorage::kFp8E5M2: {
          // In-place int8 / fp8 V is unscaled: fold each token's V scale into the probabilities
          // (the running sums above already hold the unscaled ones).
          ScalesInLaneOrder(v_scale, n_block, lane_v_scale, CodeScaleFactor(v_type));
          ScaleProbabilities(p, lane_v_scale, r_begin, r_end);
          if (v_type == KvStorage::kFp8E4M3) {
            AccumulateHead(p, correction, static_cast<const Fp8E4M3Code*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          } else if (v_type == KvStorage::kFp8E5M2) {
            AccumulateHead(p, correction, static_cast<const Fp8E5M2Code*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          } else {
            AccumulateHead(p, correction, static_cast<const int8_t*>(v_rows), v_stride, acc, dp, r_begin, r_end);
          }
          break;
        }
        case KvStorage::kInt4Kivi:
        case KvStorage::kInt2Kivi:  // never in place: dequantized into v_block (kF32)
          KVS_CHECK_MSG(false, "low-bit KIVI V is read from scratch rows");
          break;
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    const size_t row_index = static_cast<size_t>(row_query(r)) * shape.n_heads + row_head(r);
    float* a = acc + static_cast<size_t>(r) * dp;
    if constexpr (kIntegerDots) {
      if (integer) UnpermuteVDims(a, dp);
    }
    if constexpr (kBf16Dots) {
      if (bf16_pv) UnpermuteBf16VDims(a, dp);
    }
    const float l = SumLanes(l_lanes + static_cast<size_t>(r) * kBlock);
    if (output.partial != nullptr) {
      output.partial->m[row_index] = m[r];
      output.partial->l[row_index] = l;
      std::copy(a, a + d, output.partial->acc + row_index * dp);
    } else {
      float* o = output.out + row_index * d;
      float row_m = m[r], row_l = l;
      float inv = l > 0.f ? 1.f / l : 0.f;  // no visible token -> zeros
      if (output.sinks != nullptr && l > 0.f) inv = FoldSink(output.sinks[row_head(r)], &row_m, &row_l);
      for (int c = 0; c < d; ++c) o[c] = a[c] * inv;
      if (output.row_max_sum != nullptr) {
        output.row_max_sum[2 * row_index] = row_m * kLn2;  // -inf when no token is visible
        output.row_max_sum[2 * row_index + 1] = row_l;
      }
    }
  }
}

// One job of a batch: its plan, segments and token chunks, and where its units and partial
// states sit among the batch's.
struct JobPlan {
  Plan plan;
  std::vector<SegmentPlan> segments;
  std::vector<std::pair<int, int>> chunk_of;  // global chunk -> (segment, chunk within it)
  int n_chunks = 0;
  int n_units = 0;  // 0: no query sees a token (outputs already written)
  int first_unit = 0;  // among the batch's units
  size_t partial_offset = 0;  // floats into the batch's partial buffer
};

// Plans one job as a lone Attention call would (so its chunks, hence its rounding, are the
// same); a job no query of which sees any token gets its outputs here and no unit.
void PlanJob(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos, int32_t n_q,
             const AttentionJob& job, int n_threads, JobPlan* jp) {
  KVS_CHECK(job.n_spans >= 0 && (job.n_spans == 0 || job.spans != nullptr));
  KVS_CHECK_MSG(job.first_kv_head >= 0 && job.first_kv_head + shape.n_kv_heads <= row_heads,
                "AttentionBatch: a job's kv heads lie outside the span rows");
  int64_t n_tokens = 0;
  for (int32_t i = 0; i < job.n_spans; ++i) n_tokens += job.spans[i].n;
  jp->segments = PlanSegments(storage, job.spans, job.n_spans, q_pos, n_q, shape.window);
  if (job.raw_scores != nullptr) {
    // The units write the tokens each row sees; the rest of each segment is -inf.
    for (const SegmentPlan& segment : jp->segments) {
      for (int32_t i = 0; i < n_q; ++i) {
        const int64_t first = std::min(segment.first[i], segment.visible[i]);
        for (int h = 0; h < shape.n_heads; ++h) {
          float* row = job.raw_scores + (static_cast<size_t>(i) * shape.n_heads + h) * n_tokens + segment.first_token;
          std::fill(row, row + first, kNegInf);
          std::fill(row + segment.visible[i], row + segment.seq.n_tokens, kNegInf);
        }
      }
    }
  }
  jp->n_chunks = 0;
  jp->n_units = 0;
  const size_t n_rows_total = static_cast<size_t>(n_q) * shape.n_heads;
  if (TotalVisible(jp->segments) == 0) {  // no query sees any token
    std::fill(job.out, job.out + n_rows_total * shape.head_dim, 0.f);
    if (job.row_max_sum != nullptr) {
      for (size_t row = 0; row < n_rows_total; ++row) {
        job.row_max_sum[2 * row] = kNegInf;
        job.row_max_sum[2 * row + 1] = 0.f;
      }
    }
    return;
  }

  Plan& plan = jp->plan;
  plan.shape = shape;
  plan.group = shape.n_heads / shape.n_kv_heads;
  plan.dp = static_cast<int>(RoundUp(shape.head_dim, kLanes));
  plan.tile_queries = std::clamp(kTileRows / plan.group, 1, static_cast<int>(n_q));
  plan.n_tiles = (n_q + plan.tile_queries - 1) / plan.tile_queries;
  plan.v_in_place = shape.head_dim % kLanes == 0;
  plan.n_tokens = n_tokens;
  plan.row_heads = row_heads;
  plan.first_kv_head = job.first_kv_head;
  plan.selection = job.selection;
  if (job.selection != nullptr) {
    const KeySelection& sel = *job.selection;
    KVS_CHECK_MSG(sel.query_block > 0 && sel.range_offsets != nullptr && sel.range_offsets[0] == 0,
                  "AttentionBatch: a malformed key selection");
    KVS_CHECK_MSG(job.raw_scores == nullptr, "AttentionBatch: a key selection cannot keep raw scores");
    // A tile must lie inside one query block: the largest tile size that divides the block.
    while (sel.query_block % plan.tile_queries != 0) --plan.tile_queries;
    plan.n_tiles = (n_q + plan.tile_queries - 1) / plan.tile_queries;
  }

  // Split the tokens (flash-decoding split-K) when query tiles alone give fewer than
  // kUnitsPerThread units per thread: decode has a single tile, so it always splits
  // once the context is long enough, and a late thread then costs little. Segments share
  // the wanted chunks in proportion to their tokens.
  int wanted = 1;
  // (A sparse walk is not split: its tiles attend to different tokens.)
  if (n_threads > 1 && plan.n_tiles < kUnitsPerThread * n_threads && job.selection == nullptr) {
    wanted = (kUnitsPerThread * n_threads + plan.n_tiles - 1) / plan.n_tiles;
  }
  // Segments no query sees are dropped (they cost nothing).
  jp->chunk_of = ChunkSegments(&jp->segments, wanted, kMinChunkTokens);
  jp->n_chunks = static_cast<int>(jp->chunk_of.size());
  jp->n_units = plan.n_tiles * jp->n_chunks;
}

// Scales each chunk's state by 2^(m_c - M), sums, normalizes.
void MergeChunks(const JobPlan& jp, const PartialState* partials, int32_t n_q, const AttentionJob& job) {
  const Plan& plan = jp.plan;
  const size_t n_rows_total = static_cast<size_t>(n_q) * plan.shape.n_heads;
  const int d = plan.shape.head_dim;
  for (size_t row = 0; row < n_rows_total; ++row) {
    float m_max = kNegInf;
    for (int c = 0; c < jp.n_chunks; ++c) m_max = std::max(m_max, partials[c].m[row]);
    float* o = job.out + row * d;
    std::fill(o, o + d, 0.f);
    if (job.row_max_sum != nullptr) {
      job.row_max_sum[2 * row] = m_max * kLn2;
      job.row_max_sum[2 * row + 1] = 0.f;
    }
    if (m_max == kNegInf) continue;  // no chunk saw a token
    float l_total = 0.f;
    for (int c = 0; c < jp.n_chunks; ++c) {
      if (partials[c].m[row] == kNegInf) continue;
      const float w = std::exp2(partials[c].m[row] - m_max);
      l_total += partials[c].l[row] * w;
      const float* a = partials[c].acc + row * plan.dp;
      for (int e = 0; e < d; ++e) o[e] += a[e] * w;
    }
    float inv = 1.f / l_total;
    if (job.sinks != nullptr) {
      inv = FoldSink(job.sinks[row % plan.shape.n_heads], &m_max, &l_total);
      if (job.row_max_sum != nullptr) job.row_max_sum[2 * row] = m_max * kLn2;
    }
    if (job.row_max_sum != nullptr) job.row_max_sum[2 * row + 1] = l_total;
    for (int e = 0; e < d; ++e) o[e] *= inv;
  }
}

}  // namespace

void AttentionBatchImpl(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos,
                        int32_t n_q, const AttentionJob* jobs, int32_t n_jobs, int n_threads) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0);
  KVS_CHECK_MSG(shape.n_heads % shape.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  KVS_CHECK(n_q >= 0 && n_jobs >= 0);
  KVS_CHECK_MSG(shape.sinks == nullptr, "AttentionBatch: attention sinks go in each job (AttentionJob::sinks)");
  if (n_q == 0 || n_jobs == 0) return;
  if (n_threads <= 0) n_threads = omp_get_max_threads();

  // Kept per calling thread: decode steps run this a few times per layer, and their plans'
  // buffers keep their capacity.
  static thread_local std::vector<JobPlan> plans;
  static thread_local std::vector<PartialState> partials;  // [Σ jobs' chunks] (jobs with more than one)
  static thread_local std::vector<int> unit_start;         // [n_jobs + 1] first unit of each job
  if (plans.size() < static_cast<size_t>(n_jobs)) plans.resize(n_jobs);
  unit_start.resize(static_cast<size_t>(n_jobs) + 1);
  size_t partial_floats = 0;
  int n_units = 0;
  for (int32_t j = 0; j < n_jobs; ++j) {
    JobPlan& jp = plans[j];
    PlanJob(shape, row_heads, storage, jobs[j].q_pos != nullptr ? jobs[j].q_pos : q_pos, n_q, jobs[j], n_threads, &jp);
    jp.first_unit = n_units;
    unit_start[j] = n_units;
    n_units += jp.n_units;
    jp.partial_offset = partial_floats;
    if (jp.n_chunks > 1) {
      partial_floats += static_cast<size_t>(n_q) * shape.n_heads * (2 + jp.plan.dp) * jp.n_chunks;
    }
  }
  unit_start[n_jobs] = n_units;
  if (n_units == 0) return;

  static thread_local AlignedBuffer partial_buffer;
  float* const partial_base = partial_floats > 0 ? partial_buffer.Get(partial_floats) : nullptr;
  partials.clear();
  static thread_local std::vector<size_t> first_partial;  // [n_jobs] each job's first entry in partials
  first_partial.resize(n_jobs);
  const size_t n_rows_total = static_cast<size_t>(n_q) * shape.n_heads;
  for (int32_t j = 0; j < n_jobs; ++j) {
    const JobPlan& jp = plans[j];
    first_partial[j] = partials.size();
    if (jp.n_chunks <= 1) continue;
    const size_t per_chunk = n_rows_total * (2 + jp.plan.dp);
    for (int c = 0; c < jp.n_chunks; ++c) {
      float* b = partial_base + jp.partial_offset + per_chunk * c;
      partials.push_back({b, b + n_rows_total, b + 2 * n_rows_total});
    }
  }

  const int threads = std::min(n_threads, n_units);
  const bool masked = shape.window > 0 || shape.softcap > 0.f;
  const JobPlan* const plan_of = plans.data();
  const PartialState* const partial_of = partials.data();
  const int* const starts = unit_start.data();
  const size_t* const partial_first = first_partial.data();
  // One loop over every job's units. Within a job, later tiles see more tokens under the
  // causal mask: hand them out first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int u = 0; u < n_units; ++u) {
    const int j = static_cast<int>(std::upper_bound(starts, starts + n_jobs + 1, u) - starts) - 1;
    const JobPlan& jp = plan_of[j];
    const int local = u - jp.first_unit;
    const int chunk = local % jp.n_chunks;
    const int tile = jp.plan.n_tiles - 1 - local / jp.n_chunks;
    const AttentionJob& job = jobs[j];
    UnitOutput output{job.out, job.row_max_sum, jp.n_chunks > 1 ? &partial_of[partial_first[j] + chunk] : nullptr,
                      job.raw_scores, job.sinks};
    const SegmentPlan& segment = jp.segments[jp.chunk_of[chunk].first];
    if (masked) {
      RunUnit<true>(jp.plan, segment, job.q, n_q, tile, jp.chunk_of[chunk].second, output);
    } else {
      RunUnit<false>(jp.plan, segment, job.q, n_q, tile, jp.chunk_of[chunk].second, output);
    }
  }

  for (int32_t j = 0; j < n_jobs; ++j) {
    if (plans[j].n_chunks > 1) MergeChunks(plans[j], partials.data() + first_partial[j], n_q, jobs[j]);
  }
}

void AttentionImpl(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
                   const KvSpan* spans, int32_t n_spans, float* out, int n_threads, float* row_max_sum,
                   float* raw_scores) {
  KVS_CHECK(n_spans >= 0);
  AttentionJob job;
  job.spans = spans;
  job.n_spans = n_spans;
  job.q = q;
  job.out = out;
  job.row_max_sum = row_max_sum;
  job.raw_scores = raw_scores;
  job.sinks = shape.sinks;
  AttentionShape job_shape = shape;
  job_shape.sinks = nullptr;
  AttentionBatchImpl(job_shape, shape.n_kv_heads, storage, q_pos, n_q, &job, 1, n_threads);
}

bool UsesIntegerDotsImpl(KvStorage storage, int head_dim) {
  return attn_detail::kIntegerDots && attn_detail::IntegerDotsServe(storage, head_dim);
}
bool UsesBf16DotsImpl(KvStorage storage) {
  return attn_detail::kBf16Dots && attn_detail::Bf16DotsServe(storage) && Bf16DotsEnabled();
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(AttentionImpl);
HWY_EXPORT(AttentionBatchImpl);
HWY_EXPORT(UsesIntegerDotsImpl);
HWY_EXPORT(UsesBf16DotsImpl);

bool UsesIntegerDots(KvStorage storage, int head_dim) { return KVS_DISPATCH(UsesIntegerDotsImpl)(storage, head_dim); }
bool UsesBf16Dots(KvStorage storage) { return KVS_DISPATCH(UsesBf16DotsImpl)(storage); }

void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, int n_threads, float* row_max_sum,
               float* raw_scores) {
  KVS_DISPATCH(AttentionImpl)(shape, storage, q, q_pos, n_q, spans, n_spans, out, n_threads, row_max_sum, raw_scores);
}

void AttentionBatch(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos, int32_t n_q,
                    const AttentionJob* jobs, int32_t n_jobs, int n_threads) {
  KVS_DISPATCH(AttentionBatchImpl)(shape, row_heads, storage, q_pos, n_q, jobs, n_jobs, n_threads);
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
