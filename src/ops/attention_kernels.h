// Block primitives shared by the attention kernel (attention.cc) and the attention-score
// gathering pass (attention_scores.cc), so that both compute bit-identical scores.
//
// Scratch rows are padded to dp = RoundUp(head_dim, 16) with zeros.
//
// Scores: a K block is packed so that QK needs no cross-lane reduction. In the packed
// layout [dp / 4 chunks][4 token groups][16 floats], 128-bit lane L of (chunk c, group g)
// holds dims 4c..4c+3 of token 4g+L. A row's q chunk broadcast to all four lanes times
// that vector accumulates four dot products at once (one per lane); summing each lane's
// four floats (in-lane shuffles only) leaves token 4g+L's score in register lane 4L+g.
// Scores, probabilities and the PV loop therefore use "lane order": lane k holds token
// LaneToken(k).
//
// Storage types: f32 and f16 rows are converted on load; int8 rows (value = scale * q,
// one scale per token and kv head) are dequantized on load for K. V is either dequantized
// into scratch or read in place, with its per-token scale folded into the probabilities.
// int8_kivi K rows carry one scale per channel for the whole span (page): packing multiplies
// by that scale vector instead of a broadcast token scale, at the same cost (the pack is
// amortized over every query row of the kv head, so folding the scales into q would not pay);
// its V is int8 per token, exactly as int8. A kernel call handles one storage type; callers
// split a kivi layer's spans into uniform segments (see KvSegments).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kvsparse/kv_cache.h"
#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVS_ATTN_AVX512 1
#include <immintrin.h>
// GCC 12 flags the _mm512_undefined_ps() inside several AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#else
#define KVS_ATTN_AVX512 0
#endif

namespace kvsparse::ops::attn_detail {

constexpr int kBlock = 16;  // tokens per block: one 16-lane register of scores per row
constexpr int kLanes = 16;  // head_dim is padded to a multiple of this in scratch
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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
    KVS_CHECK_MSG(type != KvStorage::kInt8 || (span.k_scale != nullptr && span.v_scale != nullptr),
                  "int8 KV spans need k_scale and v_scale");
    KVS_CHECK_MSG(type != KvStorage::kInt8Kivi || span.v_scale != nullptr, "int8_kivi KV spans need v_scale");
    if (segments.empty() || segments.back().storage != type) {
      if (!segments.empty()) segments.back().n_spans = i - segments.back().first_span;
      segments.push_back({segments.empty() ? 0 : i, 0, type, tokens});
    }
    tokens += span.n;
  }
  if (!segments.empty()) segments.back().n_spans = n_spans - segments.back().first_span;
  return segments;
}

// Addresses of one block's token rows (all kv heads of each token), found by walking the
// spans forward; `span` is a cursor that only advances, so a unit's walk is linear.
struct BlockRows {
  const uint8_t* k[kBlock];    // token j's K row (head 0) in storage type
  const uint8_t* v[kBlock];
  const float* k_scale[kBlock];  // [n_kv_heads] token j's scales (filled only with_scales)
  const float* v_scale[kBlock];
  const float* k_chan[kBlock];   // [n_kv_heads, head_dim] token j's span's K channel scales (int8_kivi)
  bool one_span = false;       // all kBlock tokens lie in one span (V may be read in place)
};

inline bool IsInt8Storage(KvStorage s) { return s == KvStorage::kInt8 || s == KvStorage::kInt8Kivi; }

// with_scales: also fill k_scale / v_scale / k_chan (int8 and int8_kivi spans); skipped
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
      // int8_kivi spans have no per-token K scales (and no arithmetic on a null pointer).
      for (int j = 0; j < n_block; ++j) {
        rows->k_scale[j] = s.k_scale != nullptr ? s.k_scale + (local + j) * n_kv_heads : nullptr;
        rows->v_scale[j] = s.v_scale + (local + j) * n_kv_heads;
        rows->k_chan[j] = s.k_channel_scale;
      }
    }
    rows->one_span = n_block == kBlock;
    return;
  }
  for (int j = 0, s_index = *span; j < n_block; ++j) {
    while (t0 + j >= seq.span_start[s_index + 1]) ++s_index;
    const KvSpan& s = seq.spans[s_index];
    const int64_t local = t0 + j - seq.span_start[s_index];
    const size_t offset = static_cast<size_t>(local) * token_bytes;
    rows->k[j] = static_cast<const uint8_t*>(s.k) + offset;
    rows->v[j] = static_cast<const uint8_t*>(s.v) + offset;
    if (with_scales) {
      rows->k_scale[j] = s.k_scale != nullptr ? s.k_scale + local * n_kv_heads : nullptr;
      rows->v_scale[j] = s.v_scale + local * n_kv_heads;
      rows->k_chan[j] = s.k_channel_scale;
    }
  }
  rows->one_span = false;
}

#if KVS_ATTN_AVX512

constexpr int LaneToken(int lane) { return 4 * (lane % 4) + lane / 4; }

// 16 int8 values (or the first `mask` ones) widened to f32.
inline __m512 Int8ToF32(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline __m512 Int8ToF32(__mmask16 mask, const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, src)));
}

// Converts one row of head_dim storage elements to f32 (int8: times `scale`) with zero
// padding to dp.
inline void LoadRowF32(KvStorage storage, const void* src, float scale, int head_dim, float* dst) {
  int c = 0;
  switch (storage) {
    case KvStorage::kF16: {
      const uint16_t* h = static_cast<const uint16_t*>(src);
      for (; c + 16 <= head_dim; c += 16) {
        _mm512_store_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + c))));
      }
      if (c < head_dim) {
        const __mmask16 m = static_cast<__mmask16>((1u << (head_dim - c)) - 1);
        _mm512_store_ps(dst + c, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + c)));
      }
      break;
    }
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi: {  // V rows: per-token scale in both
      const int8_t* b = static_cast<const int8_t*>(src);
      const __m512 s = _mm512_set1_ps(scale);
      for (; c + 16 <= head_dim; c += 16) _mm512_store_ps(dst + c, _mm512_mul_ps(Int8ToF32(b + c), s));
      if (c < head_dim) {
        const __mmask16 m = static_cast<__mmask16>((1u << (head_dim - c)) - 1);
        _mm512_store_ps(dst + c, _mm512_mul_ps(Int8ToF32(m, b + c), s));
      }
      break;
    }
    case KvStorage::kF32: {
      const float* f = static_cast<const float*>(src);
      for (; c + 16 <= head_dim; c += 16) _mm512_store_ps(dst + c, _mm512_loadu_ps(f + c));
      if (c < head_dim) {
        const __mmask16 m = static_cast<__mmask16>((1u << (head_dim - c)) - 1);
        _mm512_store_ps(dst + c, _mm512_maskz_loadu_ps(m, f + c));
      }
      break;
    }
  }
}

// Packs the K rows of up to kBlock tokens (rows[j] = token j's head row in storage type,
// scales[j] its int8 scale, channel_scales[j] its int8_kivi scales [head_dim]; tokens
// n_rows..kBlock-1 become zeros) into the layout described above: k_packed [dp/4][4][16].
inline void PackK(KvStorage storage, const uint8_t* const* rows, const float* scales,
                  const float* const* channel_scales, int n_rows, int head_dim, int dp, float* k_packed) {
  for (int g = 0; g < 4; ++g) {
    const uint8_t* src[4];
    for (int lane = 0; lane < 4; ++lane) src[lane] = 4 * g + lane < n_rows ? rows[4 * g + lane] : nullptr;
    for (int d0 = 0; d0 < dp; d0 += 16) {
      const int dims = std::min(16, head_dim - d0);
      const __mmask16 mask = static_cast<__mmask16>(dims >= 16 ? 0xFFFF : (1u << dims) - 1);
      float* dst = k_packed + (static_cast<size_t>(d0 / 4) * 4 + g) * 16;  // chunk d0/4, group g
      __m512 out[4];  // out[c]: dims d0+4c..d0+4c+3 of the group's four tokens
      if (storage == KvStorage::kF16) {
        // 4x4 transpose of 64-bit pieces (4 f16 dims each), then widen to f32.
        __m256i x[4];
        for (int lane = 0; lane < 4; ++lane) {
          x[lane] = src[lane] == nullptr ? _mm256_setzero_si256()
                                         : _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(src[lane]) + d0);
        }
        const __m256i t0 = _mm256_unpacklo_epi64(x[0], x[1]), t1 = _mm256_unpackhi_epi64(x[0], x[1]);
        const __m256i t2 = _mm256_unpacklo_epi64(x[2], x[3]), t3 = _mm256_unpackhi_epi64(x[2], x[3]);
        out[0] = _mm512_cvtph_ps(_mm256_permute2x128_si256(t0, t2, 0x20));
        out[1] = _mm512_cvtph_ps(_mm256_permute2x128_si256(t1, t3, 0x20));
        out[2] = _mm512_cvtph_ps(_mm256_permute2x128_si256(t0, t2, 0x31));
        out[3] = _mm512_cvtph_ps(_mm256_permute2x128_si256(t1, t3, 0x31));
      } else {
        // f32 (int8: dequantized to f32 first), then a 4x4 transpose of 128-bit pieces (4 dims each).
        __m512 x[4];
        for (int lane = 0; lane < 4; ++lane) {
          if (src[lane] == nullptr) {
            x[lane] = _mm512_setzero_ps();
          } else if (storage == KvStorage::kInt8) {
            x[lane] = _mm512_mul_ps(Int8ToF32(mask, reinterpret_cast<const int8_t*>(src[lane]) + d0),
                                    _mm512_set1_ps(scales[4 * g + lane]));
          } else if (storage == KvStorage::kInt8Kivi) {
            x[lane] = _mm512_mul_ps(Int8ToF32(mask, reinterpret_cast<const int8_t*>(src[lane]) + d0),
                                    _mm512_maskz_loadu_ps(mask, channel_scales[4 * g + lane] + d0));
          } else {
            x[lane] = _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(src[lane]) + d0);
          }
        }
        const __m512 t0 = _mm512_shuffle_f32x4(x[0], x[1], 0x44), t1 = _mm512_shuffle_f32x4(x[0], x[1], 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(x[2], x[3], 0x44), t3 = _mm512_shuffle_f32x4(x[2], x[3], 0xEE);
        out[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
        out[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
        out[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
        out[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
      }
      for (int c = 0; c < 4; ++c) _mm512_store_ps(dst + c * 64, out[c]);
    }
  }
}

using ScoreVec = __m512;  // one row's kBlock scores in lane order

// Scores of kRows rows (q rows at stride dp, pre-scaled) against a packed K block, in lane order.
template <int kRows>
inline void ScoreRows(const float* q, int dp, const float* k_packed, ScoreVec* scores) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int c = 0; c < dp / 4; ++c) {
    __m512 qc[kRows];
    for (int r = 0; r < kRows; ++r) qc[r] = _mm512_broadcast_f32x4(_mm_load_ps(q + r * dp + 4 * c));
    for (int g = 0; g < 4; ++g) {
      const __m512 k = _mm512_load_ps(k_packed + (c * 4 + g) * 16);
      for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(qc[r], k, acc[r][g]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    // Sum each 128-bit lane's four floats of acc[g] into element 4L+g.
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(acc[r][0], acc[r][1], 0x44),
                                     _mm512_shuffle_ps(acc[r][0], acc[r][1], 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_ps(acc[r][2], acc[r][3], 0x44),
                                     _mm512_shuffle_ps(acc[r][2], acc[r][3], 0xEE));
    scores[r] = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x88), _mm512_shuffle_ps(u01, u23, 0xDD));
  }
}

// Lanes (in lane order) holding one of the first `valid` tokens of the block.
inline __mmask16 ValidLanes(int valid) {
  static constexpr auto kMasks = [] {
    std::array<uint16_t, kBlock + 1> masks{};
    for (int v = 0; v <= kBlock; ++v)
      for (int lane = 0; lane < kBlock; ++lane)
        if (LaneToken(lane) < v) masks[v] |= static_cast<uint16_t>(1u << lane);
    return masks;
  }();
  return kMasks[valid];
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
// l_lanes[16]; writes p[kBlock] (lane order, zeros on masked lanes) and returns the factor
// the row's accumulator must be scaled by (1 unless the running max grew).
inline float SoftmaxStep(ScoreVec scores, int valid, float* m, float* l_lanes, float* p) {
  const __mmask16 mask = ValidLanes(valid);
  __m512 m_vec = _mm512_set1_ps(*m);
  float correction = 1.f;
  // Once the running max has settled most blocks stay below it: one compare then
  // replaces the horizontal max reduction.
  if (_mm512_mask_cmp_ps_mask(mask, scores, m_vec, _CMP_GT_OQ) != 0) {
    const float block_max = _mm512_mask_reduce_max_ps(mask, scores);
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
    m_vec = _mm512_set1_ps(block_max);
  }
  const __m512 e = _mm512_maskz_mov_ps(mask, Exp2(_mm512_sub_ps(scores, m_vec)));
  _mm512_store_ps(p, e);
  _mm512_store_ps(l_lanes, _mm512_fmadd_ps(_mm512_load_ps(l_lanes), _mm512_set1_ps(correction), e));
  return correction;
}

// Final probabilities of one row and block given its softmax max m (log2 domain) and
// 1/sum: p[lane] = 2^(score - m) * inv_sum on valid lanes, 0 elsewhere (lane order).
inline void Probabilities(ScoreVec scores, int valid, float m, float inv_sum, float* p) {
  const __m512 e = Exp2(_mm512_sub_ps(scores, _mm512_set1_ps(m)));
  _mm512_store_ps(p, _mm512_maskz_mul_ps(ValidLanes(valid), e, _mm512_set1_ps(inv_sum)));
}

inline float SumLanes(const float* l_lanes) { return _mm512_reduce_add_ps(_mm512_load_ps(l_lanes)); }

// dst[j] = the score of token j of the block, for j < valid (lane order to token order; the
// lane <-> token map is its own inverse).
inline void StoreScoresInTokenOrder(ScoreVec scores, int valid, float* dst) {
  const __m512i lane_of_token = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << valid) - 1), _mm512_permutexvar_ps(lane_of_token, scores));
}

// p[r][lane] *= scale[lane] for rows [r_begin, r_end) (p rows kBlock apart, 64-byte aligned).
inline void ScaleProbabilities(float* p, const float* scale, int r_begin, int r_end) {
  const __m512 s = _mm512_loadu_ps(scale);
  for (int r = r_begin; r < r_end; ++r) {
    float* row = p + static_cast<size_t>(r) * kBlock;
    _mm512_store_ps(row, _mm512_mul_ps(_mm512_load_ps(row), s));
  }
}

// Into L2 only: an L1 prefetch this far ahead gets evicted by the block's own scratch traffic.
inline void Prefetch(const void* address) { _mm_prefetch(static_cast<const char*>(address), _MM_HINT_T2); }

// Loads dims c..c+15 of a V row in storage type T (float, f16 bits or unscaled int8) as f32.
inline __m512 LoadV(const float* row, int c) { return _mm512_loadu_ps(row + c); }
inline __m512 LoadV(const f16_bits* row, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
}
inline __m512 LoadV(const int8_t* row, int c) { return Int8ToF32(row + c); }

// acc[r] = acc[r] * correction[r] + sum_lanes p[r][lane] * v_(LaneToken(lane)), for kRows rows
// at once so each V load (and conversion) serves kRows rows. V row t is at v + t * v_stride
// (elements of T, dp of them readable) and must be finite for all kBlock tokens (p is 0 past
// the valid ones); acc rows have stride dp, p rows kBlock.
template <int kRows, typename T>
inline void AccumulateRows(const float* p, const float* correction, const T* v, size_t v_stride, float* acc, int dp) {
  for (int c = 0; c < dp; c += 16) {
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) {
      a[r] = _mm512_mul_ps(_mm512_load_ps(acc + r * dp + c), _mm512_set1_ps(correction[r]));
    }
#pragma GCC unroll 16
    for (int lane = 0; lane < kBlock; ++lane) {
      const __m512 v_row = LoadV(v + LaneToken(lane) * v_stride, c);
      for (int r = 0; r < kRows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kBlock + lane]), v_row, a[r]);
    }
    for (int r = 0; r < kRows; ++r) _mm512_store_ps(acc + r * dp + c, a[r]);
  }
}

#else  // portable scalar path with the same structure; K stays in plain rows, lane = token

constexpr int LaneToken(int lane) { return lane; }

inline void LoadRowF32(KvStorage storage, const void* src, float scale, int head_dim, float* dst) {
  switch (storage) {
    case KvStorage::kF16: {
      const f16_bits* h = static_cast<const f16_bits*>(src);
      for (int c = 0; c < head_dim; ++c) dst[c] = F16ToF32(h[c]);
      break;
    }
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi: {  // V rows: per-token scale in both
      const int8_t* b = static_cast<const int8_t*>(src);
      for (int c = 0; c < head_dim; ++c) dst[c] = scale * static_cast<float>(b[c]);
      break;
    }
    case KvStorage::kF32:
      std::memcpy(dst, src, head_dim * sizeof(float));
      break;
  }
  for (int c = head_dim; c < RoundUp(head_dim, kLanes); ++c) dst[c] = 0.f;
}

// k_packed here is simply [kBlock, dp] rows.
inline void PackK(KvStorage storage, const uint8_t* const* rows, const float* scales,
                  const float* const* channel_scales, int n_rows, int head_dim, int dp, float* k_packed) {
  for (int j = 0; j < kBlock; ++j) {
    float* dst = k_packed + static_cast<size_t>(j) * dp;
    if (j < n_rows && storage == KvStorage::kInt8Kivi) {
      const int8_t* b = reinterpret_cast<const int8_t*>(rows[j]);
      for (int c = 0; c < head_dim; ++c) dst[c] = static_cast<float>(b[c]) * channel_scales[j][c];
      std::fill(dst + head_dim, dst + dp, 0.f);
    } else if (j < n_rows) {
      LoadRowF32(storage, rows[j], storage == KvStorage::kInt8 ? scales[j] : 1.f, head_dim, dst);
    } else {
      std::fill(k_packed + static_cast<size_t>(j) * dp, k_packed + static_cast<size_t>(j + 1) * dp, 0.f);
    }
  }
}

struct ScoreVec {
  float s[kBlock];
};

template <int kRows>
inline void ScoreRows(const float* q, int dp, const float* k_packed, ScoreVec* scores) {
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kBlock; ++j) {
      float s = 0.f;
      for (int c = 0; c < dp; ++c) s += q[r * dp + c] * k_packed[j * dp + c];
      scores[r].s[j] = s;
    }
  }
}

inline float SoftmaxStep(const ScoreVec& scores, int valid, float* m, float* l_lanes, float* p) {
  float block_max = kNegInf;
  for (int j = 0; j < valid; ++j) block_max = std::max(block_max, scores.s[j]);
  float correction = 1.f;
  if (block_max > *m) {
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
  }
  for (int j = 0; j < kBlock; ++j) {
    p[j] = j < valid ? std::exp2(scores.s[j] - *m) : 0.f;
    l_lanes[j] = l_lanes[j] * correction + p[j];
  }
  return correction;
}

inline void Probabilities(const ScoreVec& scores, int valid, float m, float inv_sum, float* p) {
  for (int j = 0; j < kBlock; ++j) p[j] = j < valid ? std::exp2(scores.s[j] - m) * inv_sum : 0.f;
}

inline float SumLanes(const float* l_lanes) {
  float sum = 0.f;
  for (int j = 0; j < kBlock; ++j) sum += l_lanes[j];
  return sum;
}

inline void StoreScoresInTokenOrder(const ScoreVec& scores, int valid, float* dst) {
  std::copy(scores.s, scores.s + valid, dst);
}

inline void ScaleProbabilities(float* p, const float* scale, int r_begin, int r_end) {
  for (int r = r_begin; r < r_end; ++r)
    for (int j = 0; j < kBlock; ++j) p[static_cast<size_t>(r) * kBlock + j] *= scale[j];
}

inline void Prefetch(const void* address) { __builtin_prefetch(address, 0, 1); }

inline float LoadV(const float* row, int c) { return row[c]; }
inline float LoadV(const f16_bits* row, int c) { return F16ToF32(row[c]); }
inline float LoadV(const int8_t* row, int c) { return static_cast<float>(row[c]); }

template <int kRows, typename T>
inline void AccumulateRows(const float* p, const float* correction, const T* v, size_t v_stride, float* acc, int dp) {
  for (int r = 0; r < kRows; ++r) {
    float* a = acc + r * dp;
    for (int c = 0; c < dp; ++c) a[c] *= correction[r];
    for (int j = 0; j < kBlock; ++j) {
      const float pj = p[r * kBlock + j];
      for (int c = 0; c < dp; ++c) a[c] += pj * LoadV(v + j * v_stride, c);
    }
  }
}

#endif

// AccumulateRows over rows [r_begin, r_end), in groups that share each V load.
template <typename T>
void AccumulateHead(const float* p, const float* correction, const T* v, size_t v_stride, float* acc, int dp,
                    int r_begin, int r_end) {
  int r = r_begin;
  for (; r + 8 <= r_end; r += 8) {
    AccumulateRows<8>(p + r * kBlock, correction + r, v, v_stride, acc + static_cast<size_t>(r) * dp, dp);
  }
  for (; r + 4 <= r_end; r += 4) {
    AccumulateRows<4>(p + r * kBlock, correction + r, v, v_stride, acc + static_cast<size_t>(r) * dp, dp);
  }
  for (; r < r_end; ++r) {
    AccumulateRows<1>(p + r * kBlock, correction + r, v, v_stride, acc + static_cast<size_t>(r) * dp, dp);
  }
}

// Copies and pre-scales one query head row into a padded scratch row (log2 domain:
// scale * log2(e), so the softmax can use exp2).
inline void LoadQueryRow(const float* src, int head_dim, int dp, float q_scale, float* dst) {
  for (int c = 0; c < head_dim; ++c) dst[c] = src[c] * q_scale;
  for (int c = head_dim; c < dp; ++c) dst[c] = 0.f;
}

}  // namespace kvsparse::ops::attn_detail
