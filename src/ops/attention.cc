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
// GCC 12 flags the _mm512_undefined_ps() inside several AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#else
#define KVS_ATTN_AVX512 0
#endif

namespace kvsparse::ops {

namespace {

constexpr int kBlock = 16;          // tokens per block: one 16-lane register of scores per row
constexpr int kLanes = 16;          // head_dim is padded to a multiple of this in scratch
constexpr int kTileRows = 32;       // target rows (queries x group heads) per prefill unit
constexpr int64_t kMinChunkTokens = 128;  // smallest token chunk worth a separate unit
constexpr int kUnitsPerThread = 4;         // split tokens until there are this many units per thread
constexpr int64_t kPrefetchTokens = 16;   // how far ahead of the current block K/V rows are prefetched
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
  // Taylor series of 2^f = e^(f ln2) to degree 7: truncation error < 1e-8 on [-0.5, 0.5], so
  // float rounding (about 1 ulp) dominates.
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

// Into L2 only: an L1 prefetch this far ahead gets evicted by the block's own scratch traffic.
inline void Prefetch(const void* address) { _mm_prefetch(static_cast<const char*>(address), _MM_HINT_T2); }

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

inline void Prefetch(const void* address) { __builtin_prefetch(address, 0, 1); }

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
  int n_chunks = 0;           // token chunks per tile
  int64_t chunk_tokens = 0;   // multiple of kBlock
  bool direct_f32 = false;    // f32 rows with head_dim % 16 == 0 are read in place, no copy
};

// Unnormalized per-row state of one token chunk, for the split-K merge.
struct PartialState {
  float* m;    // [n_q * n_heads] running max (log2 domain)
  float* l;    // [n_q * n_heads] running sum
  float* acc;  // [n_q * n_heads, dp]
};

// Runs one (query tile, token chunk) unit over every kv head. Walking all heads of a token
// range together streams whole cache rows from memory ([n, n_kv_heads, head_dim] is
// token-major); a unit per kv head would stride through memory and waste DRAM bandwidth.
// With partial == nullptr the chunk is the whole context and normalized rows go to out.
void RunUnit(const Plan& plan, const TokenSequence& seq, const float* q, const int64_t* visible, int32_t n_q,
             int tile, int chunk, float* out, const PartialState* partial) {
  const AttentionShape& shape = plan.shape;
  const int d = shape.head_dim, dp = plan.dp, group = plan.group;
  const int q_begin = tile * plan.tile_queries;
  const int tile_queries = std::min<int>(n_q, q_begin + plan.tile_queries) - q_begin;
  // Rows are kv-head-major so each kv head's rows are contiguous:
  // row r = kv_head * head_rows + query_in_tile * group + head_in_group.
  const int head_rows = tile_queries * group;
  const int rows = head_rows * shape.n_kv_heads;
  auto row_query = [&](int r) { return q_begin + (r % head_rows) / group; };
  auto row_head = [&](int r) { return (r / head_rows) * group + r % group; };

  int64_t max_visible = 0;
  for (int i = q_begin; i < q_begin + tile_queries; ++i) max_visible = std::max(max_visible, visible[i]);
  const int64_t t_begin = static_cast<int64_t>(chunk) * plan.chunk_tokens;
  const int64_t t_end = std::min(max_visible, t_begin + plan.chunk_tokens);

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
  float* k_block = l_lanes + static_cast<size_t>(rows) * kBlock;  // [kBlock, dp] one head's K (when copied)
  float* v_block = k_block + kv_floats;                           // [kBlock, dp]
  float* m = v_block + kv_floats;                                 // [rows] running max (log2 domain)
  float* correction = m + rows;                                   // [rows]

  const float q_scale = shape.scale * kLog2e;
  for (int r = 0; r < rows; ++r) {
    const float* src = q + (static_cast<size_t>(row_query(r)) * shape.n_heads + row_head(r)) * d;
    float* dst = q_rows + static_cast<size_t>(r) * dp;
    for (int c = 0; c < d; ++c) dst[c] = src[c] * q_scale;
    for (int c = d; c < dp; ++c) dst[c] = 0.f;
    m[r] = kNegInf;
  }
  std::fill(acc, acc + q_floats, 0.f);
  std::fill(l_lanes, l_lanes + static_cast<size_t>(rows) * kBlock, 0.f);

  const size_t elem_bytes = plan.storage == KvStorage::kF16 ? sizeof(f16_bits) : sizeof(float);
  const size_t token_bytes = static_cast<size_t>(shape.n_kv_heads) * d * elem_bytes;  // one token, all heads
  const size_t head_bytes = static_cast<size_t>(d) * elem_bytes;
  const size_t span_stride = static_cast<size_t>(shape.n_kv_heads) * d;  // floats between f32 rows in a span
  int32_t block_span = t_begin < t_end ? seq.SpanOf(t_begin) : 0;
  int32_t prefetch_span = block_span;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kBlock) {
    const int n_block = static_cast<int>(std::min<int64_t>(kBlock, t_end - t0));
    // Addresses of the token rows kPrefetchTokens ahead; each kv head below prefetches its
    // part of them, which spreads the requests over the block's math.
    const uint8_t* prefetch_k[kBlock];
    const uint8_t* prefetch_v[kBlock];
    int n_prefetch = 0;
    for (int64_t t = t0 + kPrefetchTokens; t < std::min(t_end, t0 + kPrefetchTokens + kBlock); ++t) {
      while (t >= seq.span_start[prefetch_span + 1]) ++prefetch_span;
      const KvSpan& s = seq.spans[prefetch_span];
      const size_t offset = static_cast<size_t>(t - seq.span_start[prefetch_span]) * token_bytes;
      prefetch_k[n_prefetch] = static_cast<const uint8_t*>(s.k) + offset;
      prefetch_v[n_prefetch++] = static_cast<const uint8_t*>(s.v) + offset;
    }
    while (t0 >= seq.span_start[block_span + 1]) ++block_span;
    // Whole f32 blocks inside one span are read in place; the rest is converted/copied.
    const bool in_place = plan.direct_f32 && n_block == kBlock && t0 + kBlock <= seq.span_start[block_span + 1];

    for (int kv_head = 0; kv_head < shape.n_kv_heads; ++kv_head) {
      const size_t head_offset = static_cast<size_t>(kv_head) * head_bytes;
      for (int j = 0; j < n_prefetch; ++j) {
        for (size_t b = 0; b < head_bytes; b += 64) {
          Prefetch(prefetch_k[j] + head_offset + b);
          Prefetch(prefetch_v[j] + head_offset + b);
        }
      }
      const float* k_rows;
      const float* v_rows;
      size_t row_stride;
      if (in_place) {
        const KvSpan& s = seq.spans[block_span];
        const size_t offset = static_cast<size_t>(t0 - seq.span_start[block_span]) * token_bytes + head_offset;
        k_rows = reinterpret_cast<const float*>(static_cast<const uint8_t*>(s.k) + offset);
        v_rows = reinterpret_cast<const float*>(static_cast<const uint8_t*>(s.v) + offset);
        row_stride = span_stride;
      } else {
        int32_t span = block_span;
        for (int j = 0; j < n_block; ++j) {
          const int64_t t = t0 + j;
          while (t >= seq.span_start[span + 1]) ++span;
          const KvSpan& s = seq.spans[span];
          const size_t offset = static_cast<size_t>(t - seq.span_start[span]) * token_bytes + head_offset;
          LoadRowF32(plan.storage, static_cast<const uint8_t*>(s.k) + offset, d, k_block + static_cast<size_t>(j) * dp);
          LoadRowF32(plan.storage, static_cast<const uint8_t*>(s.v) + offset, d, v_block + static_cast<size_t>(j) * dp);
        }
        // Rows past the block end must be finite: their scores are masked, their p is 0.
        std::fill(k_block + static_cast<size_t>(n_block) * dp, k_block + kv_floats, 0.f);
        std::fill(v_block + static_cast<size_t>(n_block) * dp, v_block + kv_floats, 0.f);
        k_rows = k_block;
        v_rows = v_block;
        row_stride = dp;
      }

      // Scores and online softmax per row; rows whose query sees none of this block skip it.
      const int r_begin = kv_head * head_rows, r_end = r_begin + head_rows;
      for (int r = r_begin; r < r_end; ++r) {
        const int64_t valid = std::min<int64_t>(n_block, visible[row_query(r)] - t0);
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
        correction[r] =
            SoftmaxStep(scores, static_cast<int>(valid), &m[r], l_lanes + static_cast<size_t>(r) * kBlock, p_row);
      }
      // acc += p v, several rows per V load.
      int r = r_begin;
      for (; r + 8 <= r_end; r += 8) {
        AccumulateRows<8>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp,
                          dp);
      }
      for (; r + 4 <= r_end; r += 4) {
        AccumulateRows<4>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp,
                          dp);
      }
      for (; r < r_end; ++r) {
        AccumulateRows<1>(p + r * kBlock, correction + r, v_rows, row_stride, n_block, acc + static_cast<size_t>(r) * dp,
                          dp);
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    const size_t row_index = static_cast<size_t>(row_query(r)) * shape.n_heads + row_head(r);
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

  // Split the tokens (flash-decoding split-K) when query tiles alone give fewer than
  // kUnitsPerThread units per thread: decode has a single tile, so it always splits
  // once the context is long enough, and a late thread then costs little.
  const int64_t max_visible = *std::max_element(visible.begin(), visible.end());
  int n_chunks = 1;
  if (n_threads > 1 && plan.n_tiles < kUnitsPerThread * n_threads) {
    const int wanted = (kUnitsPerThread * n_threads + plan.n_tiles - 1) / plan.n_tiles;
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

  const int n_units = plan.n_tiles * n_chunks;
  const int threads = std::min(n_threads, n_units);
  // Later tiles see more tokens under the causal mask: hand them out first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int u = 0; u < n_units; ++u) {
    const int chunk = u % n_chunks;
    const int tile = plan.n_tiles - 1 - u / n_chunks;
    RunUnit(plan, seq, q, visible.data(), n_q, tile, chunk, out, n_chunks > 1 ? &partials[chunk] : nullptr);
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
