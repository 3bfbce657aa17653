// Fast attention over KV spans: flash-decoding style online softmax.
//
// Work is split into units of (query tile, kv head, token chunk). A unit owns
// R = tile_queries * group "rows" (one per (query, query head) pair of that kv head)
// and walks its token chunk in blocks of kBlock tokens: each block's K and V rows are
// read once and used by all R rows, so GQA heads share every load. Per row it keeps
// a running max m, running sum l and an unnormalized accumulator acc[head_dim].
// Scores live in the log2 domain (q is pre-scaled by scale*log2(e)) so the softmax
// uses exp2. When a kv head's tokens are split into several chunks (decode with few
// kv heads or many threads), the partial (m, l, acc) of each chunk are merged at the end.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVS_ATTN_AVX512 1
#include <immintrin.h>
#else
#define KVS_ATTN_AVX512 0
#endif

namespace kvsparse::ops {

namespace {

constexpr int kBlock = 16;          // tokens per block: one 16-lane register of scores per row
constexpr int kLanes = 16;          // head_dim is padded to a multiple of this in scratch
constexpr int kTileRows = 32;       // target rows (queries x group heads) per prefill unit
constexpr int64_t kMinChunkTokens = 512;  // smallest token chunk worth a separate unit
constexpr int64_t kPrefetchTokens = 32;   // how far ahead of the current block K/V rows are prefetched
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Heap buffer aligned for 64-byte vector loads; grows, never shrinks (reused per thread).
class AlignedBuffer {
 public:
  ~AlignedBuffer() { std::free(data_); }
  float* Get(size_t n_floats) {
    if (n_floats > capacity_) {
      std::free(data_);
      capacity_ = RoundUp(static_cast<int64_t>(n_floats), 16);
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

  TokenSequence(const KvSpan* s, int32_t n) : spans(s), n_spans(n), span_start(n + 1) {
    for (int32_t i = 0; i < n; ++i) {
      KVS_CHECK(spans[i].n >= 0);
      span_start[i] = n_tokens;
      n_tokens += spans[i].n;
    }
    span_start[n] = n_tokens;
  }

  // Tokens with position <= pos: a prefix, because positions ascend across spans.
  int64_t VisibleCount(int32_t pos) const {
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

  // The span holding token t (t < n_tokens), skipping empty spans.
  int32_t SpanOf(int64_t t) const {
    return static_cast<int32_t>(std::upper_bound(span_start.begin(), span_start.end(), t) - span_start.begin()) - 1;
  }
};

// ---------------------------------------------------------------------------
// Block primitives. Scratch rows are padded to dp = RoundUp(head_dim, 16) with zeros.

#if KVS_ATTN_AVX512

// Converts/copies one row of head_dim storage elements to f32 with zero padding to dp.
inline void LoadRowF32(KvStorage storage, const void* src, int head_dim, float* dst) {
  int c = 0;
  if (storage == KvStorage::kF16) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (; c + 16 <= head_dim; c += 16) {
      _mm512_store_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + c))));
    }
    if (c < head_dim) {
      const __mmask16 m = static_cast<__mmask16>((1u << (head_dim - c)) - 1);
      _mm512_store_ps(dst + c, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + c)));
    }
  } else {
    const float* f = static_cast<const float*>(src);
    for (; c + 16 <= head_dim; c += 16) _mm512_store_ps(dst + c, _mm512_loadu_ps(f + c));
    if (c < head_dim) {
      const __mmask16 m = static_cast<__mmask16>((1u << (head_dim - c)) - 1);
      _mm512_store_ps(dst + c, _mm512_maskz_loadu_ps(m, f + c));
    }
  }
}

// Lane k of the result = horizontal sum of part[k]. A transpose-and-add tree:
// 45 shuffles/adds for 16 sums instead of 16 separate reductions.
inline __m512 HorizontalSums16(const __m512 (&part)[16]) {
  // The tree leaves sum(in[kOrder[k]]) in lane k; kOrder is its own inverse, so feeding
  // in[i] = part[kOrder[i]] puts sum(part[k]) in lane k.
  constexpr int kOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 s[8];
  for (int i = 0; i < 8; ++i) {  // 512 -> 256: halves of two vectors side by side
    const __m512 x = part[kOrder[i]], y = part[kOrder[i + 8]];
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  __m512 w[4];
  for (int i = 0; i < 4; ++i) {  // 256 -> 128
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[i], s[i + 4], 0x88), _mm512_shuffle_f32x4(s[i], s[i + 4], 0xDD));
  }
  __m512 z[2];
  for (int i = 0; i < 2; ++i) {  // 128 -> 64 within 128-bit lanes
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44), _mm512_shuffle_ps(w[i], w[i + 2], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

// Scores of one row against kBlock K rows (row j at k + j * k_stride): lane j = q . k_j
// (log2 domain, q pre-scaled).
inline __m512 ScoreBlock(const float* q_row, const float* k, size_t k_stride, int dp) {
  __m512 part[16];
  for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
  for (int c = 0; c < dp; c += 16) {
    const __m512 qc = _mm512_load_ps(q_row + c);
    for (int j = 0; j < 16; ++j) part[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + j * k_stride + c), part[j]);
  }
  return HorizontalSums16(part);
}

// 2^x for x <= 0 (or -inf); results below 2^-127 are not needed exactly.
inline __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  // Taylor series of 2^f = e^(f ln2) to degree 7: relative error < 1e-8 on [-0.5, 0.5].
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Online-softmax step for one row and block: updates m and the lane-wise running sum
// l_lanes[16]; writes p[kBlock] (zeros on masked lanes) and returns the factor the row's
// accumulator must be scaled by (1 unless the running max grew).
inline float SoftmaxStep(__m512 scores, int valid, float* m, float* l_lanes, float* p) {
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const float block_max = _mm512_mask_reduce_max_ps(mask, scores);
  float correction = 1.f;
  if (block_max > *m) {
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
  }
  const __m512 e = _mm512_maskz_mov_ps(mask, Exp2(_mm512_sub_ps(scores, _mm512_set1_ps(*m))));
  _mm512_store_ps(p, e);
  _mm512_store_ps(l_lanes, _mm512_fmadd_ps(_mm512_load_ps(l_lanes), _mm512_set1_ps(correction), e));
  return correction;
}

inline float SumLanes(const float* l_lanes) { return _mm512_reduce_add_ps(_mm512_load_ps(l_lanes)); }

inline void Prefetch(const void* address) { _mm_prefetch(static_cast<const char*>(address), _MM_HINT_T0); }

// acc[r] = acc[r] * correction[r] + sum_j p[r][j] * v_j (row j at v + j * v_stride), for kRows rows at once,
// so each V chunk load serves kRows rows. acc rows have stride dp, p rows stride kBlock.
template <int kRows>
inline void AccumulateRows(const float* p, const float* correction, const float* v, size_t v_stride, int n_valid,
                           float* acc, int dp) {
  for (int c = 0; c < dp; c += 16) {
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) {
      a[r] = _mm512_mul_ps(_mm512_load_ps(acc + r * dp + c), _mm512_set1_ps(correction[r]));
    }
    for (int j = 0; j < n_valid; ++j) {
      const __m512 vj = _mm512_loadu_ps(v + j * v_stride + c);
      for (int r = 0; r < kRows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kBlock + j]), vj, a[r]);
    }
    for (int r = 0; r < kRows; ++r) _mm512_store_ps(acc + r * dp + c, a[r]);
  }
}

#else  // portable scalar path with the same structure

inline void LoadRowF32(KvStorage storage, const void* src, int head_dim, float* dst) {
  if (storage == KvStorage::kF16) {
    const f16_bits* h = static_cast<const f16_bits*>(src);
    for (int c = 0; c < head_dim; ++c) dst[c] = F16ToF32(h[c]);
  } else {
    std::memcpy(dst, src, head_dim * sizeof(float));
  }
  for (int c = head_dim; c < RoundUp(head_dim, kLanes); ++c) dst[c] = 0.f;
}

inline void ScoreBlock(const float* q_row, const float* k, size_t k_stride, int dp, float* scores) {
  for (int j = 0; j < kBlock; ++j) {
    float s = 0.f;
    for (int c = 0; c < dp; ++c) s += q_row[c] * k[j * k_stride + c];
    scores[j] = s;
  }
}

inline float SoftmaxStep(const float* scores, int valid, float* m, float* l_lanes, float* p) {
  float block_max = kNegInf;
  for (int j = 0; j < valid; ++j) block_max = std::max(block_max, scores[j]);
  float correction = 1.f;
  if (block_max > *m) {
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
  }
  for (int j = 0; j < kBlock; ++j) {
    p[j] = j < valid ? std::exp2(scores[j] - *m) : 0.f;
    l_lanes[j] = l_lanes[j] * correction + p[j];
  }
  return correction;
}

inline float SumLanes(const float* l_lanes) {
  float sum = 0.f;
  for (int j = 0; j < kBlock; ++j) sum += l_lanes[j];
  return sum;
}

inline void Prefetch(const void* address) { __builtin_prefetch(address); }

template <int kRows>
inline void AccumulateRows(const float* p, const float* correction, const float* v, size_t v_stride, int n_valid,
                           float* acc, int dp) {
  for (int r = 0; r < kRows; ++r) {
    float* a = acc + r * dp;
    for (int c = 0; c < dp; ++c) a[c] *= correction[r];
    for (int j = 0; j < n_valid; ++j) {
      const float pj = p[r * kBlock + j];
      for (int c = 0; c < dp; ++c) a[c] += pj * v[j * v_stride + c];
    }
  }
}

#endif

// ---------------------------------------------------------------------------

struct Plan {
  AttentionShape shape;
  KvStorage storage;
  int group = 0;
  int dp = 0;                 // head_dim padded to kLanes
  int tile_queries = 0;       // queries per unit
  int n_tiles = 0;
  int n_chunks = 0;           // token chunks per (tile, kv head)
  int64_t chunk_tokens = 0;   // multiple of kBlock
  bool direct_f32 = false;    // f32 rows with head_dim % 16 == 0 are read in place, no copy
};

// Output of one unit for its rows: the unnormalized state, or (single chunk) the final rows.
struct PartialState {
  float* m;    // [n_q * n_heads] per chunk
  float* l;    // [n_q * n_heads]
  float* acc;  // [n_q * n_heads, dp]
};

// Runs one (tile, kv head, chunk) unit. With partial == nullptr the chunk is the whole
// context and the normalized result goes straight to out.
void RunUnit(const Plan& plan, const TokenSequence& seq, const float* q, const int64_t* visible, int32_t n_q,
             int tile, int kv_head, int chunk, float* out, const PartialState* partial) {
  const AttentionShape& shape = plan.shape;
  const int d = shape.head_dim, dp = plan.dp, group = plan.group;
  const int q_begin = tile * plan.tile_queries;
  const int q_end = std::min<int>(n_q, q_begin + plan.tile_queries);
  const int rows = (q_end - q_begin) * group;  // row r: query q_begin + r / group, head kv_head*group + r % group

  int64_t max_visible = 0;
  for (int i = q_begin; i < q_end; ++i) max_visible = std::max(max_visible, visible[i]);
  const int64_t t_begin = static_cast<int64_t>(chunk) * plan.chunk_tokens;
  const int64_t t_end = std::min(max_visible, t_begin + plan.chunk_tokens);

  // Per-thread scratch: q rows, accumulators, block probabilities, and (when converting) K/V blocks.
  static thread_local AlignedBuffer buffer;
  const size_t q_floats = static_cast<size_t>(rows) * dp;
  const size_t kv_floats = static_cast<size_t>(kBlock) * dp;
  float* const scratch = buffer.Get(2 * q_floats + static_cast<size_t>(rows) * (2 * kBlock + 2) + 2 * kv_floats);
  // Every region but the last three is a multiple of 16 floats long, so all vector rows stay 64-byte aligned.
  float* q_rows = scratch;                                // [rows, dp] pre-scaled queries
  float* acc = q_rows + q_floats;                         // [rows, dp]
  float* p = acc + q_floats;                              // [rows, kBlock]
  float* l_lanes = p + static_cast<size_t>(rows) * kBlock;  // [rows, kBlock] running sums, lane-wise
  float* k_block = l_lanes + static_cast<size_t>(rows) * kBlock;  // [kBlock, dp] (when not read in place)
  float* v_block = k_block + kv_floats;                   // [kBlock, dp]
  float* m = v_block + kv_floats;                               // [rows] running max (log2 domain)
  float* correction = m + rows;                           // [rows]

  const float q_scale = shape.scale * kLog2e;
  for (int r = 0; r < rows; ++r) {
    const int i = q_begin + r / group;
    const int h = kv_head * group + r % group;
    const float* src = q + (static_cast<size_t>(i) * shape.n_heads + h) * d;
    for (int c = 0; c < d; ++c) q_rows[static_cast<size_t>(r) * dp + c] = src[c] * q_scale;
    for (int c = d; c < dp; ++c) q_rows[static_cast<size_t>(r) * dp + c] = 0.f;
    m[r] = kNegInf;
  }
  std::fill(acc, acc + q_floats, 0.f);
  std::fill(l_lanes, l_lanes + static_cast<size_t>(rows) * kBlock, 0.f);

  const size_t elem_bytes = plan.storage == KvStorage::kF16 ? sizeof(f16_bits) : sizeof(float);
  const size_t token_stride = static_cast<size_t>(shape.n_kv_heads) * d * elem_bytes;
  const size_t head_offset = static_cast<size_t>(kv_head) * d * elem_bytes;
  const size_t row_bytes = static_cast<size_t>(d) * elem_bytes;
  const size_t span_stride = static_cast<size_t>(shape.n_kv_heads) * d;  // floats between f32 rows in a span
  int32_t span = t_begin < t_end ? seq.SpanOf(t_begin) : 0;
  int32_t prefetch_span = span;
  int64_t prefetch_next = t_begin;  // first token not yet prefetched
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kBlock) {
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, t_end - t0));
    // Request the rows kPrefetchTokens ahead so DRAM latency hides behind this block's math.
    for (const int64_t until = std::min(t_end, t0 + kBlock + kPrefetchTokens); prefetch_next < until; ++prefetch_next) {
      while (prefetch_next >= seq.span_start[prefetch_span + 1]) ++prefetch_span;
      const KvSpan& s = seq.spans[prefetch_span];
      const size_t offset = static_cast<size_t>(prefetch_next - seq.span_start[prefetch_span]) * token_stride + head_offset;
      for (size_t b = 0; b < row_bytes; b += 64) {
        Prefetch(static_cast<const uint8_t*>(s.k) + offset + b);
        Prefetch(static_cast<const uint8_t*>(s.v) + offset + b);
      }
    }
    // The block's K/V rows: read in place when they are f32, full and inside one span;
    // otherwise converted/copied into zero-padded scratch rows.
    while (t0 >= seq.span_start[span + 1]) ++span;
    const float* k_rows;
    const float* v_rows;
    size_t row_stride;
    if (plan.direct_f32 && n_block == kBlock && t0 + kBlock <= seq.span_start[span + 1]) {
      const KvSpan& s = seq.spans[span];
      const size_t offset = static_cast<size_t>(t0 - seq.span_start[span]) * token_stride + head_offset;
      k_rows = reinterpret_cast<const float*>(static_cast<const uint8_t*>(s.k) + offset);
      v_rows = reinterpret_cast<const float*>(static_cast<const uint8_t*>(s.v) + offset);
      row_stride = span_stride;
    } else {
      for (int j = 0; j < n_block; ++j) {
        const int64_t t = t0 + j;
        while (t >= seq.span_start[span + 1]) ++span;
        const KvSpan& s = seq.spans[span];
        const size_t offset = static_cast<size_t>(t - seq.span_start[span]) * token_stride + head_offset;
        LoadRowF32(plan.storage, static_cast<const uint8_t*>(s.k) + offset, d, k_block + static_cast<size_t>(j) * dp);
        LoadRowF32(plan.storage, static_cast<const uint8_t*>(s.v) + offset, d, v_block + static_cast<size_t>(j) * dp);
      }
      // Rows past the block end must be finite: their scores are masked, their p is 0.
      std::fill(k_block + static_cast<size_t>(n_block) * dp, k_block + static_cast<size_t>(kBlock) * dp, 0.f);
      std::fill(v_block + static_cast<size_t>(n_block) * dp, v_block + static_cast<size_t>(kBlock) * dp, 0.f);
      k_rows = k_block;
      v_rows = v_block;
      row_stride = dp;
    }

    // Scores and online softmax per row; rows whose query sees none of this block skip it.
    for (int r = 0; r < rows; ++r) {
      const int64_t valid = std::min<int64_t>(n_block, visible[q_begin + r / group] - t0);
      float* p_row = p + static_cast<size_t>(r) * kBlock;
      if (valid <= 0) {
        std::fill(p_row, p_row + kBlock, 0.f);
        correction[r] = 1.f;
        continue;
      }
#if KVS_ATTN_AVX512
      const __m512 scores = ScoreBlock(q_rows + static_cast<size_t>(r) * dp, k_rows, row_stride, dp);
#else
      float scores[kBlock];
      ScoreBlock(q_rows + static_cast<size_t>(r) * dp, k_rows, row_stride, dp, scores);
#endif
      correction[r] = SoftmaxStep(scores, static_cast<int>(valid), &m[r], l_lanes + static_cast<size_t>(r) * kBlock, p_row);
    }
    // acc += p v, several rows per V load.
    int r = 0;
    for (; r + 8 <= rows; r += 8) {
      AccumulateRows<8>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp, dp);
    }
    for (; r + 4 <= rows; r += 4) {
      AccumulateRows<4>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp, dp);
    }
    for (; r < rows; ++r) {
      AccumulateRows<1>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp, dp);
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int i = q_begin + r / group;
    const int h = kv_head * group + r % group;
    const size_t row_index = static_cast<size_t>(i) * shape.n_heads + h;
    const float* a = acc + static_cast<size_t>(r) * dp;
    const float l = SumLanes(l_lanes + static_cast<size_t>(r) * kBlock);
    if (partial != nullptr) {
      partial->m[row_index] = m[r];
      partial->l[row_index] = l;
      std::copy(a, a + d, partial->acc + row_index * dp);
    } else {
      float* o = out + row_index * d;
      const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible token -> zeros
      for (int c = 0; c < d; ++c) o[c] = a[c] * inv;
    }
  }
}

}  // namespace

void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, int n_threads) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0);
  KVS_CHECK_MSG(shape.n_heads % shape.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  KVS_CHECK(n_q >= 0 && n_spans >= 0);
  if (n_q == 0) return;
  if (n_threads <= 0) n_threads = omp_get_max_threads();

  const TokenSequence seq(spans, n_spans);
  std::vector<int64_t> visible(n_q);  // [n_q] tokens each query attends to (a prefix)
  for (int32_t i = 0; i < n_q; ++i) visible[i] = seq.VisibleCount(q_pos[i]);

  Plan plan;
  plan.shape = shape;
  plan.storage = storage;
  plan.group = shape.n_heads / shape.n_kv_heads;
  plan.dp = static_cast<int>(RoundUp(shape.head_dim, kLanes));
  plan.tile_queries = std::clamp(kTileRows / plan.group, 1, static_cast<int>(n_q));
  plan.n_tiles = (n_q + plan.tile_queries - 1) / plan.tile_queries;
  plan.direct_f32 = storage == KvStorage::kF32 && shape.head_dim % kLanes == 0;

  // Split each kv head's tokens when tiles x kv heads alone cannot keep the threads busy.
  const int64_t max_visible = *std::max_element(visible.begin(), visible.end());
  const int base_units = plan.n_tiles * shape.n_kv_heads;
  int n_chunks = 1;
  if (n_threads > 1 && base_units < 2 * n_threads) {
    const int wanted = (2 * n_threads + base_units - 1) / base_units;
    const int64_t affordable = std::max<int64_t>(1, max_visible / kMinChunkTokens);
    n_chunks = static_cast<int>(std::min<int64_t>(wanted, affordable));
  }
  plan.n_chunks = n_chunks;
  plan.chunk_tokens = std::max<int64_t>(kBlock, RoundUp((max_visible + n_chunks - 1) / n_chunks, kBlock));

  const size_t n_rows_total = static_cast<size_t>(n_q) * shape.n_heads;
  static thread_local AlignedBuffer partial_buffer;
  std::vector<PartialState> partials;
  if (n_chunks > 1) {
    const size_t per_chunk = n_rows_total * (2 + plan.dp);
    float* base = partial_buffer.Get(per_chunk * n_chunks);
    for (int c = 0; c < n_chunks; ++c) {
      float* b = base + per_chunk * c;
      partials.push_back({b, b + n_rows_total, b + 2 * n_rows_total});
    }
  }

  const int n_units = plan.n_tiles * shape.n_kv_heads * n_chunks;
  const int threads = std::min(n_threads, n_units);
  // Later tiles see more tokens under the causal mask: hand them out first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int u = 0; u < n_units; ++u) {
    const int chunk = u % n_chunks;
    const int kv_head = (u / n_chunks) % shape.n_kv_heads;
    const int tile = plan.n_tiles - 1 - u / (n_chunks * shape.n_kv_heads);
    RunUnit(plan, seq, q, visible.data(), n_q, tile, kv_head, chunk, out,
            n_chunks > 1 ? &partials[chunk] : nullptr);
  }

  if (n_chunks > 1) {
    // Merge chunk states: scale each by 2^(m_c - M), sum, normalize.
    const int d = shape.head_dim;
    for (size_t row = 0; row < n_rows_total; ++row) {
      float m_max = kNegInf;
      for (int c = 0; c < n_chunks; ++c) m_max = std::max(m_max, partials[c].m[row]);
      float* o = out + row * d;
      std::fill(o, o + d, 0.f);
      if (m_max == kNegInf) continue;  // no chunk saw a token
      float l_total = 0.f;
      for (int c = 0; c < n_chunks; ++c) {
        if (partials[c].m[row] == kNegInf) continue;
        const float w = std::exp2(partials[c].m[row] - m_max);
        l_total += partials[c].l[row] * w;
        const float* a = partials[c].acc + row * plan.dp;
        for (int e = 0; e < d; ++e) o[e] += a[e] * w;
      }
      const float inv = 1.f / l_total;
      for (int e = 0; e < d; ++e) o[e] *= inv;
    }
  }
}

}  // namespace kvsparse::ops
