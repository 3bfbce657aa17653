// Family-independent parts of the attention kernels (attention.cc, attention_scores.cc,
// attention_scores_raw.cc): constants, scratch buffers, the token sequence over KvSpans, storage
// segments and their chunking, and the walk over a block's token rows. The block primitives
// (K packing, scores, softmax, PV), compiled once per kernel family, are in
// attention_kernels-inl.h; this header must be included before the first family region.
#pragma once
#define KVS_OPS_ATTENTION_KERNELS_H_ 1  // attention_kernels-inl.h checks that this came first

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/kv_cache.h"
#include "kvsparse/status.h"
#include "ops/kv_quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // for the families' intrinsics (GCC declares each with its own target)
#endif
// GCC 12 flags the _mm512_undefined_ps() inside several AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvsparse::ops::attn_detail {

constexpr int kBlock = 16;  // tokens per block: one 16-lane register of scores per row
constexpr int kLanes = 16;  // head_dim is padded to a multiple of this in scratch (dp)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Folds an attention sink (AttentionShape::sinks, natural-log logit) into a finished row's
// softmax state, max *m in the log2 domain and sum *l > 0: the sink becomes one more term of the
// sum, both re-based on the larger of the two maxima. Returns the factor that turns the row's
// accumulated values (relative to the old max) into its output: e^(old m - new m) / new l.
inline float FoldSink(float sink, float* m, float* l) {
  const float sink2 = sink * kLog2e;
  const float m_new = std::max(*m, sink2);
  const float rebase = std::exp2(*m - m_new);
  *l = *l * rebase + std::exp2(sink2 - m_new);
  *m = m_new;
  return rebase / *l;
}

// Heap buffer aligned for 64-byte vector loads; grows, never shrinks (reused per thread).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }
  float* Get(size_t n_floats) {
    if (n_floats > capacity_) {
      std::free(data_);
      capacity_ = static_cast<size_t>(RoundUp(static_cast<int64_t>(n_floats), 16));
      data_ = static_cast<float*>(std::aligned_alloc(64, capacity_ * sizeof(float)));
      KVS_CHECK(data_ != nullptr);
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  size_t capacity_ = 0;
};

// The spans seen as one token sequence [0, n_tokens) in ascending position order.
struct TokenSequence {
  const KvSpan* spans = nullptr;
  int32_t n_spans = 0;
  std::vector<int64_t> span_start;  // [n_spans + 1] index of each span's first token
  int64_t n_tokens = 0;

  TokenSequence(const KvSpan* s, int32_t n) : spans(s), n_spans(n), span_start(static_cast<size_t>(n) + 1) {
    for (int32_t i = 0; i < n; ++i) {
      KVS_CHECK(spans[i].n >= 0);
      span_start[i] = n_tokens;
      n_tokens += spans[i].n;
    }
    span_start[n] = n_tokens;
  }

  // Tokens with position <= pos: a prefix, because positions ascend across spans.
  int64_t VisibleCount(int32_t pos) const {
    // A decode query sees every token: one read of the last position settles it, instead of
    // one read per span (each in its own page, so a cache miss apiece).
    for (int32_t i = n_spans - 1; i >= 0; --i) {
      const KvSpan& s = spans[i];
      if (s.n == 0) continue;
      if (s.positions[s.n - 1] <= pos) return n_tokens;
      break;
    }
    int64_t count = 0;
    for (int32_t i = 0; i < n_spans; ++i) {
      const KvSpan& s = spans[i];
      if (s.n == 0) continue;
      if (s.positions[s.n - 1] <= pos) {
        count += s.n;
        continue;
      }
      count += std::upper_bound(s.positions, s.positions + s.n, pos) - s.positions;
      break;
    }
    return count;
  }

  // Tokens with position <= pos, for any pos (a sliding window's hidden prefix: the bound
  // q_pos - window may lie below every position, or below INT32_MIN). A binary search over the
  // spans, so that a decode query over a paged cache reads a few pages' positions, not all.
  int64_t CountAtMost(int64_t pos) const {
    // Invariant: every token of spans [0, lo) has position <= pos, every token of [hi, n) > pos.
    int32_t lo = 0, hi = n_spans;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo) / 2;
      int32_t s = mid;  // the first non-empty span at or after mid, below hi
      while (s < hi && spans[s].n == 0) ++s;
      if (s == hi) {  // spans [mid, hi) hold no token
        hi = mid;
        continue;
      }
      const KvSpan& span = spans[s];
      if (span.positions[span.n - 1] <= pos) {
        lo = s + 1;
      } else if (span.positions[0] > pos) {
        hi = mid;  // (spans [mid, s) are empty)
      } else {
        return span_start[s] + (std::upper_bound(span.positions, span.positions + span.n, pos) - span.positions);
      }
    }
    return span_start[lo];
  }

  // The span holding token t (t < n_tokens), skipping empty spans.
  int32_t SpanOf(int64_t t) const {
    return static_cast<int32_t>(std::upper_bound(span_start.begin(), span_start.end(), t) - span_start.begin()) - 1;
  }
};

// A run of consecutive spans sharing one storage type. Kernels walk one segment at a time; a
// uniform layer is one segment, an int8_kivi layer its quantized pages then its residual span.
// Empty spans join the segment around them.
struct KvSegment {
  int32_t first_span = 0;
  int32_t n_spans = 0;
  KvStorage storage = KvStorage::kF32;
  int64_t first_token = 0;  // index of the segment's first token among all the spans' tokens
};

// Splits spans (of a layer stored as `storage`, see SpanStorage) into segments; none when no
// span holds a token. Aborts (KVS_CHECK) when a span lacks the scales its type needs.
inline std::vector<KvSegment> KvSegments(KvStorage storage, const KvSpan* spans, int32_t n_spans) {
  std::vector<KvSegment> segments;
  int64_t tokens = 0;
  for (int32_t i = 0; i < n_spans; ++i) {
    const KvSpan& span = spans[i];
    KVS_CHECK(span.n >= 0);
    if (span.n == 0) continue;
    const KvStorage type = SpanStorage(storage, span);
    KVS_CHECK_MSG(!HasTokenScales(type) || (span.k_scale != nullptr && span.v_scale != nullptr),
                  "int8 and fp8 KV spans need k_scale and v_scale");
    KVS_CHECK_MSG(type != KvStorage::kInt8Kivi || (span.v_scale != nullptr && span.k_channel_scale != nullptr),
                  "int8_kivi KV spans need v_scale and k_channel_scale");
    KVS_CHECK_MSG(!IsLowBitKivi(type) || (span.v_group_scale != nullptr && span.v_group_min != nullptr &&
                                          span.k_group_scale != nullptr && span.k_group_min != nullptr &&
                                          span.v_group > 0),
                  "int4 / int2 KIVI KV spans need their K and V group scales and mins and v_group");
    if (segments.empty() || segments.back().storage != type) {
      if (!segments.empty()) segments.back().n_spans = i - segments.back().first_span;
      segments.push_back({segments.empty() ? 0 : i, 0, type, tokens});
    }
    tokens += span.n;
  }
  if (!segments.empty()) segments.back().n_spans = n_spans - segments.back().first_span;
  return segments;
}

// A segment (KvSegment) with what a kernel needs to walk it: its token sequence, the tokens
// each query sees, and its split into token chunks.
//
// Query i attends to the segment's tokens [first[i], visible[i]): those at or before its
// position, less (sliding window, AttentionShape::window) the ones at or before
// q_pos[i] - window. Both bounds are prefixes, since positions ascend. The chunks cover
// [min_first, max_visible), the tokens some query sees; without a window min_first is 0.
struct SegmentPlan {
  TokenSequence seq;
  KvStorage storage = KvStorage::kF32;
  int64_t first_token = 0;       // index of the segment's first token among all tokens (output column)
  std::vector<int64_t> visible;  // [n_q] end of the tokens each query attends to (a prefix)
  std::vector<int64_t> first;    // [n_q] first token each query attends to (0 without a window)
  int64_t min_first = 0;         // over the queries that see a token of the segment (0 when none does)
  int64_t max_visible = 0;       // over the same queries (0 when none)
  int64_t chunk_tokens = 0;      // multiple of kBlock
  int n_chunks = 0;
  SegmentPlan(const KvSpan* spans, int32_t n_spans, const KvSegment& segment)
      : seq(spans + segment.first_span, segment.n_spans), storage(segment.storage), first_token(segment.first_token) {}
  // Tokens some query sees: what the chunking splits.
  int64_t Extent() const { return max_visible - min_first; }
  // Token range of chunk c: [ChunkBegin(c), ChunkEnd(c)).
  int64_t ChunkBegin(int c) const { return min_first + static_cast<int64_t>(c) * chunk_tokens; }
  int64_t ChunkEnd(int c) const { return std::min(max_visible, ChunkBegin(c) + chunk_tokens); }
};

// Every segment of the spans, with each query's attended range (window: AttentionShape::window).
inline std::vector<SegmentPlan> PlanSegments(KvStorage storage, const KvSpan* spans, int32_t n_spans,
                                             const int32_t* q_pos, int32_t n_q, int32_t window) {
  std::vector<SegmentPlan> segments;
  for (const KvSegment& kv_segment : KvSegments(storage, spans, n_spans)) {
    SegmentPlan& segment = segments.emplace_back(spans, n_spans, kv_segment);
    segment.visible.resize(n_q);
    segment.first.assign(n_q, 0);
    for (int32_t i = 0; i < n_q; ++i) segment.visible[i] = segment.seq.VisibleCount(q_pos[i]);
    if (window > 0) {
      for (int32_t i = 0; i < n_q; ++i) {
        if (segment.visible[i] == 0) continue;  // sees nothing anyway
        segment.first[i] = segment.seq.CountAtMost(static_cast<int64_t>(q_pos[i]) - window);
      }
    }
    int64_t min_first = INT64_MAX;
    for (int32_t i = 0; i < n_q; ++i) {
      if (segment.first[i] >= segment.visible[i]) continue;  // sees none of the segment
      segment.max_visible = std::max(segment.max_visible, segment.visible[i]);
      min_first = std::min(min_first, segment.first[i]);
    }
    segment.min_first = segment.max_visible > 0 ? min_first : 0;
  }
  return segments;
}

// Tokens some query sees, over all segments: what the chunking shares out.
inline int64_t TotalVisible(const std::vector<SegmentPlan>& segments) {
  int64_t total = 0;
  for (const SegmentPlan& segment : segments) total += segment.Extent();
  return total;
}

// Drops the segments no query sees and splits the others into token chunks: about `wanted` in
// all, shared in proportion to the segments' visible tokens, none shorter than
// min_chunk_tokens unless its segment is. Returns each global chunk's (segment, chunk in it).
inline std::vector<std::pair<int, int>> ChunkSegments(std::vector<SegmentPlan>* segments, int wanted,
                                                      int64_t min_chunk_tokens) {
  std::erase_if(*segments, [](const SegmentPlan& segment) { return segment.Extent() <= 0; });
  const int64_t total_visible = TotalVisible(*segments);
  std::vector<std::pair<int, int>> chunk_of;
  for (int seg = 0; seg < static_cast<int>(segments->size()); ++seg) {
    SegmentPlan& segment = (*segments)[seg];
    const int64_t extent = segment.Extent();
    const int64_t share = std::max<int64_t>(1, (wanted * extent + total_visible - 1) / total_visible);
    const int64_t affordable = std::max<int64_t>(1, extent / min_chunk_tokens);
    const int64_t chunks = std::min(share, affordable);
    segment.chunk_tokens = std::max<int64_t>(kBlock, RoundUp((extent + chunks - 1) / chunks, kBlock));
    segment.n_chunks = static_cast<int>((extent + segment.chunk_tokens - 1) / segment.chunk_tokens);
    for (int c = 0; c < segment.n_chunks; ++c) chunk_of.emplace_back(seg, c);
  }
  return chunk_of;
}

// The tokens a tile of queries [q_begin, q_end) attends to in a segment, [begin, end): the
// union of its queries' ranges (empty, begin >= end, when none sees a token).
struct TileRange {
  int64_t begin = 0, end = 0;
};
inline TileRange TileTokens(const SegmentPlan& segment, int32_t q_begin, int32_t q_end) {
  TileRange range{INT64_MAX, 0};
  for (int32_t i = q_begin; i < q_end; ++i) {
    if (segment.first[i] >= segment.visible[i]) continue;
    range.begin = std::min(range.begin, segment.first[i]);
    range.end = std::max(range.end, segment.visible[i]);
  }
  if (range.end == 0) range.begin = 0;
  return range;
}

// Attention-logit softcapping (AttentionShape::softcap) on log2-domain scores: s = scale * q.k
// is softcap * tanh(s / softcap) in the natural-log domain, so a log2-domain score x = s log2(e)
// becomes log2(e) * softcap * tanh(x ln2 / softcap). The kernels cap a row's block of scores at
// once (ApplySoftcap, attention_kernels-inl.h), only when on: the scalar family with std::tanh
// (Apply), the SIMD ones with their Exp2, tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = e^(-2|y|) = 2^(-2|x| / softcap) in (0, 1].
struct Softcap {
  bool on = false;
  float in_scale = 0.f;    // ln2 / softcap
  float out_scale = 0.f;   // log2(e) * softcap
  float exp2_scale = 0.f;  // -2 / softcap: e = 2^(exp2_scale * |x|)
  explicit Softcap(float softcap)
      : on(softcap > 0.f),
        in_scale(on ? kLn2 / softcap : 0.f),
        out_scale(on ? kLog2e * softcap : 0.f),
        exp2_scale(on ? -2.f / softcap : 0.f) {}
  float Apply(float x) const { return out_scale * std::tanh(x * in_scale); }
};

// Addresses of one block's token rows (all kv heads of each token), found by walking the
// spans forward; `span` is a cursor that only advances, so a unit's walk is linear.
struct BlockRows {
  const uint8_t* k[kBlock];    // token j's K row (head 0) in storage type
  const uint8_t* v[kBlock];
  const float* k_scale[kBlock];  // [n_kv_heads] token j's scales (filled only with_scales)
  const float* v_scale[kBlock];
  const float* k_chan[kBlock];      // [n_kv_heads, head_dim] token j's span's K channel scales (int8_kivi)
  // int4 / int2 KIVI, f16 bits: token j's span's K scales and mins [n_kv_heads, head_dim], and
  // token j's V scales and mins [n_kv_heads, head_dim / v_group].
  const uint16_t* k_group_scale[kBlock];
  const uint16_t* k_group_min[kBlock];
  const uint16_t* v_group_scale[kBlock];
  const uint16_t* v_group_min[kBlock];
  int v_group = 0;
  bool one_span = false;       // all kBlock tokens lie in one span (V may be read in place)
};

// fp8 codes are widened to f16 bits in registers and converted by the f16 instruction (exact,
// subnormals included); e4m3's f16 reading is its value / 256, folded into the scales.
inline float CodeScaleFactor(KvStorage s) { return s == KvStorage::kFp8E4M3 ? 256.f : 1.f; }

// One code of a scaled-code storage type as f32, unscaled (e4m3: value / 256), exactly as the
// SIMD decoders read it.
inline float CodeToF32(KvStorage s, uint8_t code) {
  if (IsFp8Storage(s)) return F16ToF32(Fp8ToF16Bits(s, code));
  return static_cast<float>(static_cast<int8_t>(code));
}

// One-byte V codes read in place: distinct types, so that LoadV's overload picks the decoder.
enum class Fp8E4M3Code : uint8_t {};
enum class Fp8E5M2Code : uint8_t {};
// bf16 V read in place (f16_bits is the same integer type).
enum class Bf16Value : uint16_t {};

// Row j's scales: token `local` of span s (an IsScaledCodeStorage span). Null pointers stay
// null (no arithmetic on them): int8_kivi has no per-token K scales, low-bit KIVI only f16 ones.
inline void FillRowScales(const KvSpan& s, int64_t local, int j, int n_kv_heads, BlockRows* rows) {
  rows->k_scale[j] = s.k_scale != nullptr ? s.k_scale + local * n_kv_heads : nullptr;
  rows->v_scale[j] = s.v_scale != nullptr ? s.v_scale + local * n_kv_heads : nullptr;
  rows->k_chan[j] = s.k_channel_scale;
  if (s.k_group_scale != nullptr) {
    const int64_t groups = static_cast<int64_t>(n_kv_heads) * s.v_groups;  // V scales per token
    rows->v_group = s.v_group;
    rows->k_group_scale[j] = s.k_group_scale;
    rows->k_group_min[j] = s.k_group_min;
    rows->v_group_scale[j] = s.v_group_scale + local * groups;
    rows->v_group_min[j] = s.v_group_min + local * groups;
  }
}

// Row j of a block is token t (>= the span cursor's first token); advances the cursor.
inline void FillTokenRow(const TokenSequence& seq, int64_t t, int j, size_t token_bytes, int n_kv_heads,
                         bool with_scales, int32_t* span, BlockRows* rows) {
  while (t >= seq.span_start[*span + 1]) ++*span;
  const KvSpan& s = seq.spans[*span];
  const int64_t local = t - seq.span_start[*span];
  const size_t offset = static_cast<size_t>(local) * token_bytes;
  rows->k[j] = static_cast<const uint8_t*>(s.k) + offset;
  rows->v[j] = static_cast<const uint8_t*>(s.v) + offset;
  if (with_scales) FillRowScales(s, local, j, n_kv_heads, rows);
}

// with_scales: also fill k_scale / v_scale / k_chan (IsScaledCodeStorage spans); skipped
// otherwise, since this runs once per block on the decode hot path.
inline void GatherBlockRows(const TokenSequence& seq, int64_t t0, int n_block, size_t token_bytes, int n_kv_heads,
                            bool with_scales, int32_t* span, BlockRows* rows) {
  while (t0 >= seq.span_start[*span + 1]) ++*span;
  const int64_t span_end = seq.span_start[*span + 1];
  if (t0 + n_block <= span_end) {
    // The common case: the whole block lies in one span, so rows are token_bytes apart.
    const KvSpan& s = seq.spans[*span];
    const int64_t local = t0 - seq.span_start[*span];
    const uint8_t* k = static_cast<const uint8_t*>(s.k) + static_cast<size_t>(local) * token_bytes;
    const uint8_t* v = static_cast<const uint8_t*>(s.v) + static_cast<size_t>(local) * token_bytes;
    for (int j = 0; j < n_block; ++j) {
      rows->k[j] = k + static_cast<size_t>(j) * token_bytes;
      rows->v[j] = v + static_cast<size_t>(j) * token_bytes;
    }
    if (with_scales) {
      for (int j = 0; j < n_block; ++j) FillRowScales(s, local + j, j, n_kv_heads, rows);
    }
    rows->one_span = n_block == kBlock;
    return;
  }
  for (int j = 0, s_index = *span; j < n_block; ++j)
    FillTokenRow(seq, t0 + j, j, token_bytes, n_kv_heads, with_scales, &s_index, rows);
  rows->one_span = false;
}

// The rows of n ascending (not necessarily consecutive) tokens: a sparse prefill's selected
// tokens. `span` is a cursor as in GatherBlockRows.
inline void GatherTokenRows(const TokenSequence& seq, const int64_t* tokens, int n, size_t token_bytes, int n_kv_heads,
                            bool with_scales, int32_t* span, BlockRows* rows) {
  for (int j = 0; j < n; ++j) FillTokenRow(seq, tokens[j], j, token_bytes, n_kv_heads, with_scales, span, rows);
  rows->one_span = false;
}

// One kv head's row of a low-bit KIVI token (head_dim packed codes) as f32, zero-padded to dp:
// value c = min[c / group] + scale[c / group] * code, scale and min f16 bits: K per channel
// (group 1) or V per group of channels (group = v_group). codes: head_dim bytes of scratch. The
// kernels pack these rows as f32 ones.
// The scalar twin of each family's LowBitRowToF32 (attention_kernels-inl.h), and the scalar family's.
inline void DequantizeLowBitRow(int bits, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int group,
                                int head_dim, int dp, uint8_t* codes, float* dst) {
  ops::UnpackCodes(bits, packed, head_dim, codes);
  for (int g = 0; g < head_dim / group; ++g) {  // each group's pair widened once
    const float s = F16ToF32(scale[g]), m = F16ToF32(min[g]);
    for (int c = g * group; c < (g + 1) * group; ++c) dst[c] = std::fma(static_cast<float>(codes[c]), s, m);
  }
  std::fill(dst + head_dim, dst + dp, 0.f);
}

// Per-thread scratch of the low-bit KIVI path: one row's unpacked codes and a K block as f32 rows.
struct LowBitScratch {
  std::vector<uint8_t> codes;  // [head_dim]
  AlignedBuffer k_rows;        // [kBlock, dp]
};

// ---- Integer attention (int8 KV): see "Integer dots" in attention_kernels-inl.h ----

constexpr int kQueryGroup = 32;  // q dims sharing one int8 scale (llama.cpp's q8_0 block)
// Below this a query group or a block's probabilities count as zero in the integer path: their
// reciprocal steps would overflow f32 (and they cannot move a result by more than ~1e-27).
constexpr float kNegligible = 1e-30f;

// Storage the avx512 family's bf16 dot products serve (where the CPU has them): bf16, and fp8
// codes widened to bf16 exactly ("bf16 dots" in attention_kernels-inl.h).
inline bool Bf16DotsServe(KvStorage storage) { return storage == KvStorage::kBf16 || IsFp8Storage(storage); }

// Whether a family's integer path serves this storage and head size (kInt8, head_dim a multiple
// of 64: the V packing works in 64-dim chunks). Other shapes take the f32 path.
inline bool IntegerDotsServe(KvStorage storage, int head_dim) {
  return storage == KvStorage::kInt8 && head_dim % 64 == 0;
}

// A tile's pre-scaled query rows quantized once per call, in two int8 parts so that the query
// adds almost no error of its own (a single int8 query would add about as much as int8 K's own
// rounding): per row and group of kQueryGroup dims, hi = nearbyint(q * 127 / amax) with step
// amax / 127, then the remainder q - step * hi (at most step / 2) as lo with step / 254. So
// q.k = sum_g step_g (hi_g . k_g) + step_g / 254 (lo_g . k_g) up to step / 508 per dim: two
// integer dots per group on the same packed K. `sums` (each part's sum of codes) undo the
// AVX-512 family's +128 offset on K (VNNI multiplies u8 by s8).
struct QueryCodes {
  int dp = 0, n_groups = 0;
  std::vector<int8_t> hi, lo;        // [rows, dp]
  std::vector<float> steps;          // [rows, n_groups, 2] hi's step, lo's step
  std::vector<int32_t> sums;         // [rows, n_groups, 2] sum of hi codes, of lo codes
  const int8_t* Hi(int r) const { return hi.data() + static_cast<size_t>(r) * dp; }
  const int8_t* Lo(int r) const { return lo.data() + static_cast<size_t>(r) * dp; }
  const float* Steps(int r) const { return steps.data() + static_cast<size_t>(r) * n_groups * 2; }
  const int32_t* Sums(int r) const { return sums.data() + static_cast<size_t>(r) * n_groups * 2; }
};

// Round half to even of |x| <= 2^22 without a libm call (the baseline target has no rounding
// instruction): adding and subtracting 1.5 * 2^23 leaves the rounded value, exactly as nearbyint
// in the default rounding mode (the project never builds with -ffast-math, which could fold it).
inline float RoundHalfEven(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  return (x + kMagic) - kMagic;
}

// x clamped to [-127, 127], NaN (a broken model's query) to -127: a defined int8 code always.
inline float ClampCode(float x) {
  if (!(x >= -127.f)) return -127.f;
  return x > 127.f ? 127.f : x;
}

// Shared by every family and kept out of line, so it is compiled once, for the baseline target:
// inlined into a family region its multiply and subtract could fuse into an FMA there and
// quantize differently from the other families.
__attribute__((noinline)) inline void QuantizeQueryRows(const float* q_rows, int rows, int dp, QueryCodes* out) {
  out->dp = dp;
  out->n_groups = static_cast<int>((dp + kQueryGroup - 1) / kQueryGroup);
  out->hi.resize(static_cast<size_t>(rows) * dp);
  out->lo.resize(static_cast<size_t>(rows) * dp);
  out->steps.resize(static_cast<size_t>(rows) * out->n_groups * 2);
  out->sums.resize(static_cast<size_t>(rows) * out->n_groups * 2);
  for (int r = 0; r < rows; ++r) {
    const float* q = q_rows + static_cast<size_t>(r) * dp;
    int8_t* hi = out->hi.data() + static_cast<size_t>(r) * dp;
    int8_t* lo = out->lo.data() + static_cast<size_t>(r) * dp;
    for (int g = 0; g < out->n_groups; ++g) {
      const int begin = g * kQueryGroup, end = std::min(dp, begin + kQueryGroup);
      float amax = 0.f;
      for (int c = begin; c < end; ++c) amax = std::max(amax, std::fabs(q[c]));
      if (!(amax >= kNegligible)) amax = 0.f;
      const float step = amax / 127.f, lo_step = step / 254.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f, lo_inv = amax > 0.f ? 1.f / lo_step : 0.f;
      int32_t hi_sum = 0, lo_sum = 0;
      for (int c = begin; c < end; ++c) {
        hi[c] = static_cast<int8_t>(ClampCode(RoundHalfEven(q[c] * inv)));
        const float rest = q[c] - step * static_cast<float>(hi[c]);
        lo[c] = static_cast<int8_t>(ClampCode(RoundHalfEven(rest * lo_inv)));
        hi_sum += hi[c];
        lo_sum += lo[c];
      }
      const size_t at = (static_cast<size_t>(r) * out->n_groups + g) * 2;
      out->steps[at] = step;
      out->steps[at + 1] = lo_step;
      out->sums[at] = hi_sum;
      out->sums[at + 1] = lo_sum;
    }
  }
}

// Int8 codes of n rows of dim floats (ops::ScoreMatrixInt8): per row, step = max|x| / 127 (0 for
// a negligible or NaN row) and codes round(x / step) in [-127, 127], zero-padded to dp; sums (if
// not null) the codes' sum per row. Out of line for the same reason as QuantizeQueryRows.
__attribute__((noinline)) inline void QuantizeInt8Rows(const float* x, int64_t n, int dim, int dp, int8_t* codes,
                                                       float* steps, int32_t* sums) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * dim;
    int8_t* code = codes + r * dp;
    float amax = 0.f;
    for (int c = 0; c < dim; ++c) amax = std::max(amax, std::fabs(row[c]));
    if (!(amax >= kNegligible)) amax = 0.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int c = 0; c < dim; ++c) {
      code[c] = static_cast<int8_t>(ClampCode(RoundHalfEven(row[c] * inv)));
      sum += code[c];
    }
    std::fill(code + dim, code + dp, int8_t{0});
    steps[r] = amax / 127.f;
    if (sums != nullptr) sums[r] = sum;
  }
}

// One row's score from its integer group dots (dots[2g], dots[2g + 1]: group g's hi and lo
// dots), in the order every family uses (so the families' scores agree bit for bit):
// s = hi_0 * step_0, s = fma(lo_0, lo_step_0, s), then fma per part of each later group, then
// times the token's K scale.
inline float CombineGroupDots(const int32_t* dots, const float* steps, int n_groups, float k_scale) {
  float s = static_cast<float>(dots[0]) * steps[0];
  s = std::fma(static_cast<float>(dots[1]), steps[1], s);
  for (int i = 2; i < 2 * n_groups; ++i) s = std::fma(static_cast<float>(dots[i]), steps[i], s);
  return s * k_scale;
}

// Probabilities (already times each token's V scale) of one row and block as two u8 parts for
// the integer PV product, as the query is split: with step = max p / 255,
// hi = floor(p / step) and lo = nearbyint((p - step * hi) / (step / 255)), so
// p = step * hi + step / 255 * lo up to step / 510. codes: [2, kBlock] hi then lo. Returns the
// step (0 when the row has no probability in the block, or a negligible one: then every code is 0).
inline float QuantizeProbabilityCodes(const float* p, uint8_t* codes) {
  float max_p = 0.f;
  for (int j = 0; j < kBlock; ++j) max_p = std::max(max_p, p[j]);
  if (!(max_p >= kNegligible)) {
    std::fill(codes, codes + 2 * kBlock, uint8_t{0});
    return 0.f;
  }
  const float inv = 255.f / max_p, step = max_p / 255.f, lo_inv = 255.f / step;
  for (int j = 0; j < kBlock; ++j) {
    const float hi = std::min(std::floor(p[j] * inv), 255.f);
    const float rest = std::fma(-step, hi, p[j]);  // fused, as the SIMD families compute it
    codes[j] = static_cast<uint8_t>(hi);
    codes[kBlock + j] = static_cast<uint8_t>(std::clamp(std::nearbyint(rest * lo_inv), 0.f, 255.f));
  }
  return step;
}

// Copies and pre-scales one query head row into a padded scratch row (log2 domain:
// scale * log2(e), so the softmax can use exp2).
inline void LoadQueryRow(const float* src, int head_dim, int dp, float q_scale, float* dst) {
  for (int c = 0; c < head_dim; ++c) dst[c] = src[c] * q_scale;
  for (int c = head_dim; c < dp; ++c) dst[c] = 0.f;
}

// The scalar twin of the avx512 family's bf16 dots (ScoreRowsBf16): a pre-scaled query row
// (LoadQueryRow's) rounded to bf16, dotted with a bf16 K row exactly (products and sum in
// double). The kernel's f32 sums stay within a few f32 ulps of sum |q k| of it.
inline double Bf16DotTwin(const float* q_scaled, const bf16_bits* k, int head_dim) {
  double sum = 0.0;
  for (int c = 0; c < head_dim; ++c) {
    sum += static_cast<double>(BF16ToF32(F32ToBF16(q_scaled[c]))) * static_cast<double>(BF16ToF32(k[c]));
  }
  return sum;
}

}  // namespace kvsparse::ops::attn_detail
