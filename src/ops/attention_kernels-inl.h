// Block primitives of the attention kernels, compiled once per kernel family (see
// ops/simd_family.h): included inside the family region of attention.cc, attention_scores.cc
// and attention_scores_raw.cc, so the attention kernel and the score-gathering passes compute
// bit-identical scores within a family. The family-independent parts are in
// attention_kernels.h, which must come first (with every std header this file uses).
//
// Scratch rows are padded to dp = RoundUp(head_dim, 16) with zeros.
//
// Scores: a K block is packed so that QK needs no cross-lane reduction per dimension (each
// family's layout is described where its section starts). Scores, probabilities and the PV
// loop use "lane order": lane k of a block holds token LaneToken(k).
//
// Masks: a row attends to the tokens [first, valid) of a block (a prefix, valid, under the
// causal mask; less a prefix, first, under a sliding window: AttentionShape::window). The
// softmax steps take both bounds; first is 0 without a window.
//
// Storage types: f32, f16 and bf16 rows are converted on load; int8 and fp8 rows (value = scale * q,
// one scale per token and kv head) are dequantized on load for K. fp8 codes are widened to f16
// bits and converted by the f16 instruction (e4m3 reads value / 256: CodeScaleFactor). V is either dequantized
// into scratch or read in place, with its per-token scale folded into the probabilities.
// int8_kivi K rows carry one scale per channel for the whole span (page): packing multiplies
// by that scale vector instead of a broadcast token scale, at the same cost (the pack is
// amortized over every query row of the kv head, so folding the scales into q would not pay);
// its V is int8 per token, exactly as int8. A kernel call handles one storage type; callers
// split a kivi layer's spans into uniform segments (see KvSegments).
//
// Highway's per-target include guard: the content is compiled once per foreach_target pass.
#ifndef KVS_OPS_ATTENTION_KERNELS_H_
#error "include ops/attention_kernels.h (and the std headers) before the first family region"
#endif

#if defined(KVS_OPS_ATTENTION_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_ATTENTION_KERNELS_INL_H_
#undef KVS_OPS_ATTENTION_KERNELS_INL_H_
#else
#define KVS_OPS_ATTENTION_KERNELS_INL_H_
#endif

namespace kvsparse::ops::HWY_NAMESPACE::attn_detail {

using namespace ::kvsparse::ops::attn_detail;  // NOLINT: the family-independent parts

#if KVS_ISA_AVX512

// K layout [dp / 4 chunks][4 token groups][16 floats]: 128-bit lane L of (chunk c, group g)
// holds dims 4c..4c+3 of token 4g+L. A row's q chunk broadcast to all four lanes times that
// vector accumulates four dot products at once (one per lane); summing each lane's four
// floats (in-lane shuffles only) leaves token 4g+L's score in register lane 4L+g, so lane k
// holds token LaneToken(k).

constexpr int LaneToken(int lane) { return 4 * (lane % 4) + lane / 4; }

// 16 int8 values (or the first `mask` ones) widened to f32.
inline __m512 Int8ToF32(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline __m512 Int8ToF32(__mmask16 mask, const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, src)));
}
// 16 fp8 codes as f32 through f16 bits (ops/kv_quant.h; e4m3 reads value / 256): e4m3's sign
// extends to bits 15 and 14, and the mask keeps bit 15.
inline __m512 Fp8E4M3ToF32(__m128i codes) {
  const __m256i bits = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(bits, _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
}
inline __m512 Fp8E5M2ToF32(__m128i codes) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8)); }
// 16 bf16 values as f32 (exact: bf16 is f32's upper half).
inline __m512 Bf16ToF32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// 16 one-byte codes of a scaled-code storage type (or the first `mask` ones) as f32, unscaled.
inline __m512 CodesToF32(KvStorage storage, __mmask16 mask, const uint8_t* src) {
  const __m128i codes = _mm_maskz_loadu_epi8(mask, src);
  switch (storage) {
    case KvStorage::kFp8E4M3: return Fp8E4M3ToF32(codes);
    case KvStorage::kFp8E5M2: return Fp8E5M2ToF32(codes);
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
  }
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
    case KvStorage::kBf16: {
      const uint16_t* h = static_cast<const uint16_t*>(src);
      for (; c < head_dim; c += 16) {
        const __mmask16 m = static_cast<__mmask16>(head_dim - c >= 16 ? 0xFFFF : (1u << (head_dim - c)) - 1);
        _mm512_store_ps(dst + c, Bf16ToF32(_mm256_maskz_loadu_epi16(m, h + c)));
      }
      break;
    }
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi:  // V rows: per-token scale in both
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2: {
      const uint8_t* b = static_cast<const uint8_t*>(src);
      const __m512 s = _mm512_set1_ps(scale * CodeScaleFactor(storage));
      for (; c < head_dim; c += 16) {
        const __mmask16 m = static_cast<__mmask16>(head_dim - c >= 16 ? 0xFFFF : (1u << (head_dim - c)) - 1);
        _mm512_store_ps(dst + c, _mm512_mul_ps(CodesToF32(storage, m, b + c), s));
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
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi:  // dequantized by the caller (LowBitRowToF32)
      break;
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
        // f32 (int8: dequantized, bf16: widened to f32 first), then a 4x4 transpose of 128-bit pieces (4 dims each).
        __m512 x[4];
        for (int lane = 0; lane < 4; ++lane) {
          if (src[lane] == nullptr) {
            x[lane] = _mm512_setzero_ps();
          } else if (storage == KvStorage::kBf16) {
            x[lane] = Bf16ToF32(_mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(src[lane]) + d0));
          } else if (HasTokenScales(storage)) {
            x[lane] = _mm512_mul_ps(CodesToF32(storage, mask, src[lane] + d0),
                                    _mm512_set1_ps(scales[4 * g + lane] * CodeScaleFactor(storage)));
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

// The scores of four token groups' accumulators acc[g] (128-bit lane L: four partial sums of
// token 4g+L): each lane's four floats summed into element 4L+g, i.e. lane order.
inline ScoreVec SumLaneQuads(const __m512* acc) {
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(acc[0], acc[1], 0x44), _mm512_shuffle_ps(acc[0], acc[1], 0xEE));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_ps(acc[2], acc[3], 0x44), _mm512_shuffle_ps(acc[2], acc[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u01, u23, 0x88), _mm512_shuffle_ps(u01, u23, 0xDD));
}

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
  for (int r = 0; r < kRows; ++r) scores[r] = SumLaneQuads(acc[r]);
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

// Lanes (in lane order) holding one of the tokens first..valid-1 of the block. (The test
// lets a constant first = 0, the default path's, fold to ValidLanes.)
inline __mmask16 BlockLanes(int first, int valid) {
  if (first <= 0) return ValidLanes(valid);
  return static_cast<__mmask16>(ValidLanes(valid) & ~ValidLanes(first));
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

// Online-softmax step for one row and block over its tokens [first, valid) (first < valid):
// updates m and the lane-wise running sum l_lanes[16]; writes p[kBlock] (lane order, zeros on
// masked lanes) and returns the factor the row's accumulator must be scaled by (1 unless the
// running max grew).
inline float SoftmaxStep(ScoreVec scores, int first, int valid, float* m, float* l_lanes, float* p) {
  const __mmask16 mask = BlockLanes(first, valid);
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
// 1/sum: p[lane] = 2^(score - m) * inv_sum on the lanes of tokens [first, valid), 0 elsewhere
// (lane order).
inline void Probabilities(ScoreVec scores, int first, int valid, float m, float inv_sum, float* p) {
  const __m512 e = Exp2(_mm512_sub_ps(scores, _mm512_set1_ps(m)));
  _mm512_store_ps(p, _mm512_maskz_mul_ps(BlockLanes(first, valid), e, _mm512_set1_ps(inv_sum)));
}

inline float SumLanes(const float* l_lanes) { return _mm512_reduce_add_ps(_mm512_load_ps(l_lanes)); }

// dst[j] = the score of token j of the block, for first <= j < valid (lane order to token
// order; the lane <-> token map is its own inverse). dst[j] for other j is left alone.
inline void StoreScoresInTokenOrder(ScoreVec scores, int first, int valid, float* dst) {
  const __m512i lane_of_token = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __mmask16 tokens = static_cast<__mmask16>(((1u << valid) - 1) & ~((1u << first) - 1u));
  _mm512_mask_storeu_ps(dst, tokens, _mm512_permutexvar_ps(lane_of_token, scores));
}
inline void StoreScoresInTokenOrder(ScoreVec scores, int valid, float* dst) {
  StoreScoresInTokenOrder(scores, 0, valid, dst);
}

// Softcaps one row's block of scores (Softcap, attention_kernels.h): out_scale * tanh(x in_scale)
// as sign(x) out_scale (1 - e) / (1 + e), e = 2^(-2|x| / softcap) (Exp2's domain: <= 0).
inline void ApplySoftcap(const Softcap& cap, ScoreVec* scores) {
  const __m512 x = *scores;
  const __m512 e = Exp2(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(cap.exp2_scale)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));  // tanh(|y|)
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  const __m512i capped = _mm512_castps_si512(_mm512_mul_ps(t, _mm512_set1_ps(cap.out_scale)));
  *scores = _mm512_castsi512_ps(_mm512_or_si512(capped, sign));
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

// Loads dims c..c+15 of a V row in storage type T (float, f16 bits, unscaled int8 or fp8) as f32.
inline __m512 LoadV(const float* row, int c) { return _mm512_loadu_ps(row + c); }
inline __m512 LoadV(const f16_bits* row, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
}
inline __m512 LoadV(const int8_t* row, int c) { return Int8ToF32(row + c); }
inline __m512 LoadV(const Fp8E4M3Code* row, int c) {
  return Fp8E4M3ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m512 LoadV(const Fp8E5M2Code* row, int c) {
  return Fp8E5M2ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m512 LoadV(const Bf16Value* row, int c) {
  return Bf16ToF32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
}

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

// ---- Integer dots (int8 KV, IntegerDotsServe): VNNI's vpdpbusd multiplies u8 by s8 ----
constexpr bool kIntegerDots = true;
typedef int32_t AliasedI32 __attribute__((may_alias, aligned(1)));  // four codes read as one word

// Packs the int8 K rows of up to kBlock tokens (rows[j]: token j's head row of dp codes; rows
// past n_rows repeat row 0, their lanes are masked) as [dp / 4 quads][16 lanes][4 bytes]: lane
// k holds dims 4c..4c+3 of token LaneToken(k), offset by +128 to u8 (QueryCodes::sums undo it).
inline void PackKCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* k_codes) {
  const uint8_t* src[kBlock];
  for (int j = 0; j < kBlock; ++j) src[j] = j < n_rows ? rows[j] : rows[0];
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int d0 = 0; d0 < dp; d0 += 16) {
    __m512i x[4];  // x[i] 128-bit lane L: dims d0..d0+15 of token 4i + L
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[4 * i] + d0)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[4 * i + 1] + d0)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[4 * i + 2] + d0)), 2);
      x[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[4 * i + 3] + d0)), 3);
    }
    // 4x4 transpose of dwords within each 128-bit lane: quad j, lane L, dword i = token 4i + L,
    // which is register lane 4L + i = LaneToken's order.
    const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
    uint8_t* dst = k_codes + static_cast<size_t>(d0 / 4) * 64;
    _mm512_store_si512(dst, _mm512_xor_si512(_mm512_unpacklo_epi64(t0, t2), offset));
    _mm512_store_si512(dst + 64, _mm512_xor_si512(_mm512_unpackhi_epi64(t0, t2), offset));
    _mm512_store_si512(dst + 128, _mm512_xor_si512(_mm512_unpacklo_epi64(t1, t3), offset));
    _mm512_store_si512(dst + 192, _mm512_xor_si512(_mm512_unpackhi_epi64(t1, t3), offset));
  }
}

// QuantizeQueryRows (attention_kernels.h) 16 dims at a time: the same float operations on the
// same values (the product is kept from fusing with the subtraction), so the same codes, steps
// and sums.
inline void QuantizeQueries(const float* q_rows, int rows, int dp, QueryCodes* out) {
  static_assert(kQueryGroup == 32);
  if (dp % kQueryGroup != 0) {
    QuantizeQueryRows(q_rows, rows, dp, out);
    return;
  }
  out->dp = dp;
  out->n_groups = dp / kQueryGroup;
  out->hi.resize(static_cast<size_t>(rows) * dp);
  out->lo.resize(static_cast<size_t>(rows) * dp);
  out->steps.resize(static_cast<size_t>(rows) * out->n_groups * 2);
  out->sums.resize(static_cast<size_t>(rows) * out->n_groups * 2);
  const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
  auto code = [&](__m512 x) {  // RoundHalfEven then ClampCode (a NaN becomes -127: max returns its second operand)
    const __m512 rounded = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(rounded, low), high);
  };
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < out->n_groups; ++g) {
      const size_t at = static_cast<size_t>(r) * dp + static_cast<size_t>(g) * kQueryGroup;
      const __m512 x[2] = {_mm512_loadu_ps(q_rows + at), _mm512_loadu_ps(q_rows + at + 16)};
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1])));
      if (!(amax >= kNegligible)) amax = 0.f;
      const float step = amax / 127.f, lo_step = step / 254.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f, lo_inv = amax > 0.f ? 1.f / lo_step : 0.f;
      __m512i hi_sum = _mm512_setzero_si512(), lo_sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512 hi = code(_mm512_mul_ps(x[h], _mm512_set1_ps(inv)));
        __m512 product = _mm512_mul_ps(_mm512_set1_ps(step), hi);
        __asm__("" : "+v"(product));  // rounded on its own, as the twin's: GCC would fuse it into the subtraction
        const __m512 rest = _mm512_sub_ps(x[h], product);
        const __m512i hi_codes = _mm512_cvtps_epi32(hi);
        const __m512i lo_codes = _mm512_cvtps_epi32(code(_mm512_mul_ps(rest, _mm512_set1_ps(lo_inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out->hi.data() + at + 16 * h), _mm512_cvtepi32_epi8(hi_codes));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out->lo.data() + at + 16 * h), _mm512_cvtepi32_epi8(lo_codes));
        hi_sum = _mm512_add_epi32(hi_sum, hi_codes);
        lo_sum = _mm512_add_epi32(lo_sum, lo_codes);
      }
      const size_t s = (static_cast<size_t>(r) * out->n_groups + g) * 2;
      out->steps[s] = step;
      out->steps[s + 1] = lo_step;
      out->sums[s] = _mm512_reduce_add_epi32(hi_sum);
      out->sums[s + 1] = _mm512_reduce_add_epi32(lo_sum);
    }
  }
}

// lanes[lane] = scales[LaneToken(lane) * stride]: a whole block's per-token scales of one kv
// head (scales at its first token, stride floats apart) in lane order, in one gather.
inline void GatherLaneScales(const float* scales, int stride, float* lanes) {
  alignas(64) static constexpr auto kTokenOfLane = [] {
    std::array<int32_t, kBlock> tokens{};
    for (int lane = 0; lane < kBlock; ++lane) tokens[lane] = LaneToken(lane);
    return tokens;
  }();
  const __m512i token = _mm512_load_si512(kTokenOfLane.data());
  _mm512_store_ps(lanes, _mm512_i32gather_ps(_mm512_mullo_epi32(token, _mm512_set1_epi32(stride)), scales, 4));
}

// Scores of kRows query rows (codes rows r0..) against a packed K block, in lane order: per
// group of kQueryGroup dims two exact integer dots (the query's hi and lo parts), combined as
// CombineGroupDots does, times lane_scale (each lane's token K scale). dp % kQueryGroup == 0
// (IntegerDotsServe).
template <int kRows>
inline void ScoreRowsCodes(const QueryCodes& q, int r0, const uint8_t* k_codes, const float* lane_scale,
                           ScoreVec* scores) {
  constexpr int kGroupQuads = kQueryGroup / 4;
  __m512 s[kRows];
  for (int g = 0; g < q.n_groups; ++g) {
    const uint8_t* k = k_codes + static_cast<size_t>(g) * kGroupQuads * 64;
    __m512i hi[kRows], lo[kRows];  // two dependency chains per row
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < kGroupQuads; ++c) {
      const __m512i kc = _mm512_load_si512(k + c * 64);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const int32_t q_hi = *reinterpret_cast<const AliasedI32*>(q.Hi(r0 + r) + g * kQueryGroup + 4 * c);
        const int32_t q_lo = *reinterpret_cast<const AliasedI32*>(q.Lo(r0 + r) + g * kQueryGroup + 4 * c);
        hi[r] = _mm512_dpbusd_epi32(hi[r], kc, _mm512_set1_epi32(q_hi));
        lo[r] = _mm512_dpbusd_epi32(lo[r], kc, _mm512_set1_epi32(q_lo));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float* steps = q.Steps(r0 + r) + 2 * g;
      const int32_t* sums = q.Sums(r0 + r) + 2 * g;
      const __m512 dot_hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r], _mm512_set1_epi32(128 * sums[0])));
      const __m512 dot_lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r], _mm512_set1_epi32(128 * sums[1])));
      s[r] = g == 0 ? _mm512_mul_ps(dot_hi, _mm512_set1_ps(steps[0])) : _mm512_fmadd_ps(dot_hi, _mm512_set1_ps(steps[0]), s[r]);
      s[r] = _mm512_fmadd_ps(dot_lo, _mm512_set1_ps(steps[1]), s[r]);
    }
  }
  const __m512 k_scale = _mm512_load_ps(lane_scale);
  for (int r = 0; r < kRows; ++r) scores[r] = _mm512_mul_ps(s[r], k_scale);
}

// Packs the int8 V rows of a block (rows[j]: token j's head row of dp codes, dp % 64 == 0; rows
// past n_rows repeat row 0, their probabilities are 0) for the u8 x s8 product with the
// probability codes: [4 token groups][dp / 64 chunks][4 registers][64 bytes]. Group i holds the
// tokens of lanes 4i..4i+3 (LaneToken); register j of a chunk holds in 32-bit lane 4L + e the
// four tokens' codes of dim 64 chunk + 16L + 4j + e. Accumulators in that register order keep
// the dims of each 64-dim chunk transposed as (j, L) <-> (L, j): UnpermuteVDims restores them.
inline void PackVCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* v_codes) {
  const int chunks = dp / 64;
  for (int i = 0; i < 4; ++i) {
    const uint8_t* src[4];
    for (int x = 0; x < 4; ++x) {
      const int j = LaneToken(4 * i + x);
      src[x] = j < n_rows ? rows[j] : rows[0];
    }
    for (int c = 0; c < chunks; ++c) {
      const __m512i a = _mm512_loadu_si512(src[0] + 64 * c), b = _mm512_loadu_si512(src[1] + 64 * c);
      const __m512i cc = _mm512_loadu_si512(src[2] + 64 * c), d = _mm512_loadu_si512(src[3] + 64 * c);
      const __m512i ab_lo = _mm512_unpacklo_epi8(a, b), ab_hi = _mm512_unpackhi_epi8(a, b);
      const __m512i cd_lo = _mm512_unpacklo_epi8(cc, d), cd_hi = _mm512_unpackhi_epi8(cc, d);
      uint8_t* dst = v_codes + (static_cast<size_t>(i) * chunks + c) * 256;
      _mm512_store_si512(dst, _mm512_unpacklo_epi16(ab_lo, cd_lo));
      _mm512_store_si512(dst + 64, _mm512_unpackhi_epi16(ab_lo, cd_lo));
      _mm512_store_si512(dst + 128, _mm512_unpacklo_epi16(ab_hi, cd_hi));
      _mm512_store_si512(dst + 192, _mm512_unpackhi_epi16(ab_hi, cd_hi));
    }
  }
}

// Codes of one row's 16 (scaled) probabilities x given max(x) >= kNegligible's inv = 255 / max,
// step = max / 255 and lo_inv = 255 / step: hi (floor) then lo (nearest), kBlock bytes apart.
inline void EncodeProbabilities(__m512 x, float inv, float step, float lo_inv, uint8_t* codes) {
  const __m512 hi = _mm512_min_ps(
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(inv)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
      _mm512_set1_ps(255.f));
  const __m512 rest = _mm512_fnmadd_ps(_mm512_set1_ps(step), hi, x);
  const __m512 lo = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(lo_inv)),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                 _mm512_setzero_ps()),
                                  _mm512_set1_ps(255.f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(hi)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + kBlock), _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(lo)));
}

// QuantizeProbabilityCodes (attention_kernels.h) of p * lane_scale, 16 lanes at once: the same
// codes (hi, then lo, kBlock apart) and step.
inline float QuantizeProbabilities(const float* p, const float* lane_scale, uint8_t* codes) {
  const __m512 x = _mm512_mul_ps(_mm512_load_ps(p), _mm512_load_ps(lane_scale));
  const float max_p = _mm512_reduce_max_ps(x);
  if (!(max_p >= kNegligible)) {
    std::memset(codes, 0, 2 * kBlock);
    return 0.f;
  }
  const float inv = 255.f / max_p, step = max_p / 255.f, lo_inv = 255.f / step;
  EncodeProbabilities(x, inv, step, lo_inv, codes);
  return step;
}

// QuantizeProbabilities of rows [0, n_rows) (p rows kBlock apart, codes rows 2 kBlock apart,
// steps[r] each row's step): the same codes and steps, four rows at a time with their maxima
// reduced together and their divisions done as one vector's.
inline void QuantizeProbabilityRows(const float* p, const float* lane_scale, int n_rows, uint8_t* codes, float* steps) {
  const __m512 scale = _mm512_load_ps(lane_scale);
  int r = 0;
  for (; r + 4 <= n_rows; r += 4) {
    __m512 x[4];
    for (int i = 0; i < 4; ++i) x[i] = _mm512_mul_ps(_mm512_load_ps(p + (r + i) * kBlock), scale);
    // 128-bit block i of `c` ends up holding four partial maxima of row i, then (in-lane
    // swaps) its maximum in every lane.
    const __m512 a = _mm512_max_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
    const __m512 b = _mm512_max_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
    __m512 c = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    c = _mm512_max_ps(c, _mm512_permute_ps(c, 0x4E));
    c = _mm512_max_ps(c, _mm512_permute_ps(c, 0xB1));
    const __m512i first_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    const __m128 max_p = _mm512_castps512_ps128(_mm512_permutexvar_ps(first_lanes, c));
    const __m128 c255 = _mm_set1_ps(255.f);
    const __m128 step = _mm_div_ps(max_p, c255);
    alignas(16) float maxima[4], inv[4], steps4[4], lo_inv[4];
    _mm_store_ps(maxima, max_p);
    _mm_store_ps(inv, _mm_div_ps(c255, max_p));
    _mm_store_ps(steps4, step);
    _mm_store_ps(lo_inv, _mm_div_ps(c255, step));
    for (int i = 0; i < 4; ++i) {
      uint8_t* row_codes = codes + static_cast<size_t>(r + i) * 2 * kBlock;
      if (!(maxima[i] >= kNegligible)) {
        std::memset(row_codes, 0, 2 * kBlock);
        steps[r + i] = 0.f;
        continue;
      }
      EncodeProbabilities(x[i], inv[i], steps4[i], lo_inv[i], row_codes);
      steps[r + i] = steps4[i];
    }
  }
  for (; r < n_rows; ++r) {
    steps[r] = QuantizeProbabilities(p + r * kBlock, lane_scale, codes + static_cast<size_t>(r) * 2 * kBlock);
  }
}

// acc[r] = acc[r] * correction[r] + step[r] * (hi[r] . v) + step[r] / 255 * (lo[r] . v) for kRows
// rows (p codes rows 2 kBlock apart, hi then lo, lane order; acc rows dp apart in PackVCodes' dim
// order).
template <int kRows>
inline void AccumulateRowsCodes(const uint8_t* p_codes, const float* step, const float* correction,
                                const uint8_t* v_codes, float* acc, int dp) {
  const int chunks = dp / 64;
  for (int c = 0; c < chunks; ++c) {
    __m512i a_hi[kRows][4], a_lo[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < 4; ++j) a_hi[r][j] = a_lo[r][j] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const uint8_t* v = v_codes + (static_cast<size_t>(i) * chunks + c) * 256;
      const __m512i v0 = _mm512_load_si512(v), v1 = _mm512_load_si512(v + 64);
      const __m512i v2 = _mm512_load_si512(v + 128), v3 = _mm512_load_si512(v + 192);
      for (int r = 0; r < kRows; ++r) {
        const __m512i ph = _mm512_set1_epi32(*reinterpret_cast<const AliasedI32*>(p_codes + r * 2 * kBlock + 4 * i));
        const __m512i pl = _mm512_set1_epi32(*reinterpret_cast<const AliasedI32*>(p_codes + r * 2 * kBlock + kBlock + 4 * i));
        a_hi[r][0] = _mm512_dpbusd_epi32(a_hi[r][0], ph, v0);
        a_hi[r][1] = _mm512_dpbusd_epi32(a_hi[r][1], ph, v1);
        a_hi[r][2] = _mm512_dpbusd_epi32(a_hi[r][2], ph, v2);
        a_hi[r][3] = _mm512_dpbusd_epi32(a_hi[r][3], ph, v3);
        a_lo[r][0] = _mm512_dpbusd_epi32(a_lo[r][0], pl, v0);
        a_lo[r][1] = _mm512_dpbusd_epi32(a_lo[r][1], pl, v1);
        a_lo[r][2] = _mm512_dpbusd_epi32(a_lo[r][2], pl, v2);
        a_lo[r][3] = _mm512_dpbusd_epi32(a_lo[r][3], pl, v3);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 corr = _mm512_set1_ps(correction[r]), st = _mm512_set1_ps(step[r]);
      const __m512 lo_st = _mm512_set1_ps(step[r] / 255.f);
      for (int j = 0; j < 4; ++j) {
        float* dst = acc + static_cast<size_t>(r) * dp + 64 * c + 16 * j;
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a_hi[r][j]), st, _mm512_mul_ps(_mm512_load_ps(dst), corr));
        _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a_lo[r][j]), lo_st, a));
      }
    }
  }
}

// Restores natural dim order in one accumulator row of AccumulateRowsCodes (the (j, L)
// transpose of each 64-dim chunk is its own inverse).
inline void UnpermuteVDims(float* row, int dp) {
  for (int c = 0; c < dp; c += 64) {
    __m128 x[16];
    for (int k = 0; k < 16; ++k) x[k] = _mm_load_ps(row + c + 4 * k);
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 4; ++l) _mm_store_ps(row + c + 16 * l + 4 * j, x[4 * j + l]);
  }
}

// ---- bf16 dots (bf16 KV where the CPU has AVX512_BF16: Bf16DotsEnabled) ----
// vdpbf16ps multiplies pairs of bf16 into f32 sums (each product exact; the two adds rounded,
// denormals flushed), 32 multiply-adds per instruction against an FMA's 16. K layout [dp / 8
// chunks][4 token groups][16 dwords]: PackK's f32 layout with two dims per dword, the 128-bit lane
// L of (chunk c, group g) holding dims 8c..8c+7 of token 4g+L, so the scores come out in the same
// lane order and SumLaneQuads finishes them. The query rows are rounded to bf16 (nearest even)
// once per unit: their rounding adds about as much error as K's own. fp8 codes take the same
// path (Bf16DotsServe): widened to bf16, exactly (at most 4 significant bits, exponents well inside
// bf16's normal range), their per-token K scales applied to the scores and V scales to the
// probabilities. These functions carry the target attribute on top of the family's, so they are
// called (not inlined) from the kernels.
constexpr bool kBf16Dots = true;
#if defined(__clang__)  // clang takes a function's own target attribute instead of the region's
#define KVS_BF16_TARGET __attribute__((target(HWY_TARGET_STR ",avx512vnni,avx512bf16")))
#else
#define KVS_BF16_TARGET __attribute__((target("avx512bf16")))
#endif

// Dims d0..d0+31 of a K or V row (the first `mask` ones, zeros after) as 32 bf16: bf16 rows as
// stored, fp8 codes unscaled (e4m3 reads value / 256, as CodesToF32).
KVS_BF16_TARGET inline __m512i RowToBf16(KvStorage storage, const uint8_t* row, int d0, __mmask32 mask) {
  if (storage == KvStorage::kBf16) return _mm512_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(row) + d0);
  const __m256i codes = _mm256_maskz_loadu_epi8(mask, row + d0);
  const __m512 lo = CodesToF32(storage, 0xFFFF, reinterpret_cast<const uint8_t*>(&codes));
  const __m512 hi = CodesToF32(storage, 0xFFFF, reinterpret_cast<const uint8_t*>(&codes) + 16);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// out [rows, dp] = q_rows [rows, dp] rounded to bf16 (dp % 16 == 0).
KVS_BF16_TARGET inline void QueryRowsToBf16(const float* q_rows, int rows, int dp, uint16_t* out) {
  const size_t n = static_cast<size_t>(rows) * dp;
  for (size_t i = 0; i < n; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(q_rows + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(rounded));
  }
}

// Packs the K rows (bf16 or fp8 codes, RowToBf16) of up to kBlock tokens (rows[j]: token j's head
// row; tokens n_rows..kBlock-1 and dims head_dim..dp-1 become zeros) into k_packed [dp / 8][4][32] bf16.
KVS_BF16_TARGET inline void PackKBf16(KvStorage storage, const uint8_t* const* rows, int n_rows, int head_dim,
                                      int dp, uint16_t* k_packed) {
  for (int g = 0; g < 4; ++g) {
    for (int d0 = 0; d0 < dp; d0 += 32) {
      const int dims = std::min(32, head_dim - d0);  // >= 1: d0 < dp = RoundUp(head_dim, 16)
      const __mmask32 mask = dims >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << dims) - 1);
      __m512i x[4];  // x[lane]: dims d0..d0+31 of token 4g + lane, 8 per 128-bit piece
      for (int lane = 0; lane < 4; ++lane) {
        const int j = 4 * g + lane;
        x[lane] = j < n_rows ? RowToBf16(storage, rows[j], d0, mask) : _mm512_setzero_si512();
      }
      // 4x4 transpose of the 128-bit pieces, as PackK's f32 one.
      const __m512i t0 = _mm512_shuffle_i32x4(x[0], x[1], 0x44), t1 = _mm512_shuffle_i32x4(x[0], x[1], 0xEE);
      const __m512i t2 = _mm512_shuffle_i32x4(x[2], x[3], 0x44), t3 = _mm512_shuffle_i32x4(x[2], x[3], 0xEE);
      const __m512i out[4] = {_mm512_shuffle_i32x4(t0, t2, 0x88), _mm512_shuffle_i32x4(t0, t2, 0xDD),
                              _mm512_shuffle_i32x4(t1, t3, 0x88), _mm512_shuffle_i32x4(t1, t3, 0xDD)};
      const int chunks = std::min(4, (dp - d0) / 8);
      for (int c = 0; c < chunks; ++c) {
        _mm512_store_si512(k_packed + (static_cast<size_t>(d0 / 8 + c) * 4 + g) * 32, out[c]);
      }
    }
  }
}

// ScoreRows with bf16 query rows (stride dp) against a PackKBf16 block, in lane order.
template <int kRows>
KVS_BF16_TARGET inline void ScoreRowsBf16(const uint16_t* q, int dp, const uint16_t* k_packed, ScoreVec* scores) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int c = 0; c < dp / 8; ++c) {
    __m512i qc[kRows];
    for (int r = 0; r < kRows; ++r) {
      qc[r] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * dp + 8 * c)));
    }
    for (int g = 0; g < 4; ++g) {
      const __m512i k = _mm512_load_si512(k_packed + (c * 4 + g) * 32);
      for (int r = 0; r < kRows; ++r) {
        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], reinterpret_cast<__m512bh>(qc[r]), reinterpret_cast<__m512bh>(k));
      }
    }
  }
  for (int r = 0; r < kRows; ++r) scores[r] = SumLaneQuads(acc[r]);
}

// Scores of rows r and r + 1 (n_pair of them; bf16 query rows [rows, dp]) against a PackKBf16 block,
// times lane_k_scale (fp8: each lane's token K scale; null for bf16).
KVS_BF16_TARGET inline void ScoreRowPairBf16(int n_pair, const uint16_t* q_bf16, int r, int dp, const float* k_block,
                                             const float* lane_k_scale, ScoreVec* scores) {
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_block);
  if (n_pair == 2) {
    ScoreRowsBf16<2>(q_bf16 + static_cast<size_t>(r) * dp, dp, k, scores);
  } else {
    ScoreRowsBf16<1>(q_bf16 + static_cast<size_t>(r) * dp, dp, k, scores);
  }
  if (lane_k_scale != nullptr) {
    const __m512 scale = _mm512_load_ps(lane_k_scale);
    for (int i = 0; i < n_pair; ++i) scores[i] = _mm512_mul_ps(scores[i], scale);
  }
}

// p.v with bf16 dots (head_dim % 32 == 0): each row's 16 probabilities rounded to bf16 (2^-9 of
// each, about V's own rounding), token pairs (lanes 2i, 2i+1 of lane order) interleaved in V.
// Packs a block's V rows (rows[j]: token j's head row, bf16 or fp8 codes as RowToBf16 reads
// them; rows past n_rows repeat row 0, their
// probabilities are 0) as [8 pairs][dp / 32 chunks][2 registers][32 bf16]: for pair i (tokens
// a = LaneToken(2i), b = LaneToken(2i + 1)) and chunk c, dword 4L + e of register h holds dim
// 32c + 8L + 4h + e of a then of b. Accumulators in that order: UnpermuteBf16VDims restores it.
KVS_BF16_TARGET inline void PackVBf16(KvStorage storage, const uint8_t* const* rows, int n_rows, int dp,
                                      uint16_t* v_packed) {
  const int chunks = dp / 32;
  for (int i = 0; i < 8; ++i) {
    const int ta = LaneToken(2 * i), tb = LaneToken(2 * i + 1);
    const uint8_t* a = rows[ta < n_rows ? ta : 0];
    const uint8_t* b = rows[tb < n_rows ? tb : 0];
    for (int c = 0; c < chunks; ++c) {
      const __m512i va = RowToBf16(storage, a, 32 * c, ~__mmask32{0});
      const __m512i vb = RowToBf16(storage, b, 32 * c, ~__mmask32{0});
      uint16_t* dst = v_packed + (static_cast<size_t>(i) * chunks + c) * 64;
      _mm512_store_si512(dst, _mm512_unpacklo_epi16(va, vb));
      _mm512_store_si512(dst + 32, _mm512_unpackhi_epi16(va, vb));
    }
  }
}

// acc[r] = acc[r] * correction[r] + sum_pairs p[r][pair] . v[pair] for kRows rows (p_bf16 rows
// kBlock apart, lane order; acc rows dp apart in PackVBf16's dim order).
template <int kRows>
KVS_BF16_TARGET inline void AccumulateRowsBf16(const uint16_t* p_bf16, const float* correction,
                                               const uint16_t* v_packed, float* acc, int dp) {
  const int chunks = dp / 32;
  for (int c = 0; c < chunks; ++c) {
    __m512 a[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      const __m512 corr = _mm512_set1_ps(correction[r]);
      a[r][0] = _mm512_mul_ps(_mm512_load_ps(acc + r * dp + 32 * c), corr);
      a[r][1] = _mm512_mul_ps(_mm512_load_ps(acc + r * dp + 32 * c + 16), corr);
    }
    for (int i = 0; i < 8; ++i) {
      const uint16_t* v = v_packed + (static_cast<size_t>(i) * chunks + c) * 64;
      const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_load_si512(v));
      const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_load_si512(v + 32));
      for (int r = 0; r < kRows; ++r) {
        const __m512bh pair = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(*reinterpret_cast<const AliasedI32*>(p_bf16 + r * kBlock + 2 * i)));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], pair, v0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], pair, v1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_store_ps(acc + r * dp + 32 * c, a[r][0]);
      _mm512_store_ps(acc + r * dp + 32 * c + 16, a[r][1]);
    }
  }
}

// AccumulateRowsBf16 over rows [r_begin, r_end) of p (f32, rows kBlock apart), each row's
// probabilities rounded to bf16 into p_bf16 (same rows) first.
KVS_BF16_TARGET inline void AccumulateHeadBf16(const float* p, const float* correction, const uint16_t* v_packed,
                                               float* acc, int dp, int r_begin, int r_end, uint16_t* p_bf16) {
  for (int r = r_begin; r < r_end; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p_bf16 + r * kBlock),
                       reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(p + r * kBlock))));
  }
  int r = r_begin;
  for (; r + 8 <= r_end; r += 8) {
    AccumulateRowsBf16<8>(p_bf16 + r * kBlock, correction + r, v_packed, acc + static_cast<size_t>(r) * dp, dp);
  }
  for (; r + 4 <= r_end; r += 4) {
    AccumulateRowsBf16<4>(p_bf16 + r * kBlock, correction + r, v_packed, acc + static_cast<size_t>(r) * dp, dp);
  }
  for (; r < r_end; ++r) {
    AccumulateRowsBf16<1>(p_bf16 + r * kBlock, correction + r, v_packed, acc + static_cast<size_t>(r) * dp, dp);
  }
}
#undef KVS_BF16_TARGET

// Restores natural dim order in one accumulator row of AccumulateRowsBf16: per 32 dims, the
// 4-float pieces [lo0..lo3, hi0..hi3] become [lo0, hi0, lo1, hi1, ...].
inline void UnpermuteBf16VDims(float* row, int dp) {
  for (int c = 0; c < dp; c += 32) {
    __m128 x[8];
    for (int k = 0; k < 8; ++k) x[k] = _mm_load_ps(row + c + 4 * k);
    for (int l = 0; l < 4; ++l) {
      _mm_store_ps(row + c + 8 * l, x[l]);
      _mm_store_ps(row + c + 8 * l + 4, x[4 + l]);
    }
  }
}

#elif KVS_ISA_AVX2

// K layout [dp / 4 chunks][8 pairs][8 floats]: pair g = 4h + i (h = 0, 1; i = 0..3) holds dims
// 4c..4c+3 of token 8h + i in its low 128-bit lane and of token 8h + i + 4 in its high lane.
// A row's q chunk broadcast to both lanes times that vector accumulates two tokens' dot
// products at once (no transpose when packing, 8 independent FMA chains per row); two hadd
// levels per four pairs then leave the scores in token order, so lane order is token order.

constexpr int LaneToken(int lane) { return lane; }

// Token in the low lane of pair g (the high lane holds token + 4).
constexpr int PairToken(int g) { return 8 * (g / 4) + g % 4; }

// The low 8 int8 values of `codes` widened to f32.
inline __m256 Int8ToF32(__m128i codes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)); }
// The low 8 fp8 codes as f32 through f16 bits, as in the AVX-512 family.
inline __m256 Fp8E4M3ToF32(__m128i codes) {
  const __m128i bits = _mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7);
  return _mm256_cvtph_ps(_mm_and_si128(bits, _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
}
inline __m256 Fp8E5M2ToF32(__m128i codes) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(codes), 8)); }
// 8 bf16 values as f32 (exact).
inline __m256 Bf16ToF32(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
// The low 8 one-byte codes of a scaled-code storage type as f32, unscaled.
inline __m256 CodesToF32(KvStorage storage, __m128i codes) {
  switch (storage) {
    case KvStorage::kFp8E4M3: return Fp8E4M3ToF32(codes);
    case KvStorage::kFp8E5M2: return Fp8E5M2ToF32(codes);
    default: return Int8ToF32(codes);
  }
}

inline __m128i Load4Bytes(const void* src) {
  int32_t x;
  std::memcpy(&x, src, sizeof(x));
  return _mm_cvtsi32_si128(x);
}

// All-ones on lanes first..first+7 whose token is below `valid`.
inline __m256 ValidLanes(int valid, int first) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - first), lane));
}

// All-ones on lanes base..base+7 whose token lies in [first, valid). (The test lets a
// constant first = 0, the default path's, fold to ValidLanes.)
inline __m256 BlockLanes(int first, int valid, int base) {
  if (first <= base) return ValidLanes(valid, base);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i below_first = _mm256_cmpgt_epi32(_mm256_set1_epi32(first - base), lane);
  const __m256i below_valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid - base), lane);
  return _mm256_castsi256_ps(_mm256_andnot_si256(below_first, below_valid));
}

// Converts one row of head_dim storage elements to f32 (int8: times `scale`) with zero
// padding to dp.
inline void LoadRowF32(KvStorage storage, const void* src, float scale, int head_dim, float* dst) {
  int c = 0;
  switch (storage) {
    case KvStorage::kF16: {
      const f16_bits* h = static_cast<const f16_bits*>(src);
      for (; c + 8 <= head_dim; c += 8) {
        _mm256_store_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c))));
      }
      for (; c < head_dim; ++c) dst[c] = F16ToF32(h[c]);
      break;
    }
    case KvStorage::kBf16: {
      const bf16_bits* h = static_cast<const bf16_bits*>(src);
      for (; c + 8 <= head_dim; c += 8) {
        _mm256_store_ps(dst + c, Bf16ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + c))));
      }
      for (; c < head_dim; ++c) dst[c] = BF16ToF32(h[c]);
      break;
    }
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi:  // V rows: per-token scale in both
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2: {
      const uint8_t* b = static_cast<const uint8_t*>(src);
      const float full_scale = scale * CodeScaleFactor(storage);
      const __m256 s = _mm256_set1_ps(full_scale);
      for (; c + 8 <= head_dim; c += 8) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + c));
        _mm256_store_ps(dst + c, _mm256_mul_ps(CodesToF32(storage, codes), s));
      }
      for (; c < head_dim; ++c) dst[c] = CodeToF32(storage, b[c]) * full_scale;
      break;
    }
    case KvStorage::kF32: {
      const float* f = static_cast<const float*>(src);
      for (; c + 8 <= head_dim; c += 8) _mm256_store_ps(dst + c, _mm256_loadu_ps(f + c));
      for (; c < head_dim; ++c) dst[c] = f[c];
      break;
    }
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi:  // dequantized by the caller (LowBitRowToF32)
      break;
  }
  for (c = head_dim; c < RoundUp(head_dim, kLanes); ++c) dst[c] = 0.f;
}

// Packs the K rows of up to kBlock tokens (rows[j] = token j's head row in storage type,
// scales[j] its int8 scale, channel_scales[j] its int8_kivi scales [head_dim]; tokens
// n_rows..kBlock-1 become zeros) into the layout described above: k_packed [dp/4][8][8].
// Every element is the same single rounding (x, or code * scale) on the fast and the slow
// path, so a token's packed values do not depend on the block it falls in.
inline void PackK(KvStorage storage, const uint8_t* const* rows, const float* scales,
                  const float* const* channel_scales, int n_rows, int head_dim, int dp, float* k_packed) {
  const int full = head_dim / 4;  // chunks of four real dims
  for (int g = 0; g < 8; ++g) {
    const int ta = PairToken(g), tb = ta + 4;
    float* dst = k_packed + static_cast<size_t>(g) * 8;  // chunk c at dst + c * 64
    int c = 0;
    if (tb < n_rows) {
      const uint8_t* a = rows[ta];
      const uint8_t* b = rows[tb];
      switch (storage) {
        case KvStorage::kF32:
          for (; c < full; ++c) {
            const __m128 lo = _mm_loadu_ps(reinterpret_cast<const float*>(a) + 4 * c);
            const __m128 hi = _mm_loadu_ps(reinterpret_cast<const float*>(b) + 4 * c);
            _mm256_store_ps(dst + c * 64, _mm256_set_m128(hi, lo));
          }
          break;
        case KvStorage::kF16:
        case KvStorage::kBf16: {
          const bool bf16 = storage == KvStorage::kBf16;  // widened by a shift instead of vcvtph2ps
          auto widen = [bf16](__m128i h) { return bf16 ? Bf16ToF32(h) : _mm256_cvtph_ps(h); };
          for (; c + 2 <= full; c += 2) {  // 8 dims of each token: chunks c and c + 1
            const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 8 * c));
            const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 * c));
            _mm256_store_ps(dst + c * 64, widen(_mm_unpacklo_epi64(x, y)));
            _mm256_store_ps(dst + (c + 1) * 64, widen(_mm_unpackhi_epi64(x, y)));
          }
          for (; c < full; ++c) {
            const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + 8 * c));
            const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * c));
            _mm256_store_ps(dst + c * 64, widen(_mm_unpacklo_epi64(lo, hi)));
          }
          break;
        }
        case KvStorage::kInt8:
        case KvStorage::kFp8E4M3:
        case KvStorage::kFp8E5M2: {
          const float factor = CodeScaleFactor(storage);
          const __m256 s = _mm256_set_m128(_mm_set1_ps(scales[tb] * factor), _mm_set1_ps(scales[ta] * factor));
          for (; c + 4 <= full; c += 4) {  // 16 dims of each token: chunks c..c + 3
            const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 4 * c));
            const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4 * c));
            const __m128i lo = _mm_unpacklo_epi32(x, y), hi = _mm_unpackhi_epi32(x, y);
            _mm256_store_ps(dst + c * 64, _mm256_mul_ps(CodesToF32(storage, lo), s));
            _mm256_store_ps(dst + (c + 1) * 64, _mm256_mul_ps(CodesToF32(storage, _mm_unpackhi_epi64(lo, lo)), s));
            _mm256_store_ps(dst + (c + 2) * 64, _mm256_mul_ps(CodesToF32(storage, hi), s));
            _mm256_store_ps(dst + (c + 3) * 64, _mm256_mul_ps(CodesToF32(storage, _mm_unpackhi_epi64(hi, hi)), s));
          }
          for (; c < full; ++c) {
            const __m128i codes = _mm_unpacklo_epi32(Load4Bytes(a + 4 * c), Load4Bytes(b + 4 * c));
            _mm256_store_ps(dst + c * 64, _mm256_mul_ps(CodesToF32(storage, codes), s));
          }
          break;
        }
        case KvStorage::kInt8Kivi:
          for (; c < full; ++c) {
            const __m128i codes = _mm_unpacklo_epi32(Load4Bytes(a + 4 * c), Load4Bytes(b + 4 * c));
            const __m256 s = _mm256_set_m128(_mm_loadu_ps(channel_scales[tb] + 4 * c),
                                             _mm_loadu_ps(channel_scales[ta] + 4 * c));
            _mm256_store_ps(dst + c * 64, _mm256_mul_ps(Int8ToF32(codes), s));
          }
          break;
        case KvStorage::kInt4Kivi:
        case KvStorage::kInt2Kivi:  // dequantized by the caller (LowBitRowToF32)
          break;
      }
    }
    // The rest (a pair past the block end, a partial last chunk, padding): element by element.
    for (; c < dp / 4; ++c) {
      alignas(32) float x[8];
      for (int lane = 0; lane < 8; ++lane) {
        const int j = lane < 4 ? ta : tb, dim = 4 * c + lane % 4;
        float value = 0.f;
        if (j < n_rows && dim < head_dim) {
          switch (storage) {
            case KvStorage::kF32: value = reinterpret_cast<const float*>(rows[j])[dim]; break;
            case KvStorage::kF16: value = F16ToF32(reinterpret_cast<const f16_bits*>(rows[j])[dim]); break;
            case KvStorage::kBf16: value = BF16ToF32(reinterpret_cast<const bf16_bits*>(rows[j])[dim]); break;
            case KvStorage::kInt8:
            case KvStorage::kFp8E4M3:
            case KvStorage::kFp8E5M2:
              value = CodeToF32(storage, rows[j][dim]) * (scales[j] * CodeScaleFactor(storage));
              break;
            case KvStorage::kInt8Kivi:
              value = static_cast<float>(reinterpret_cast<const int8_t*>(rows[j])[dim]) * channel_scales[j][dim];
              break;
            case KvStorage::kInt4Kivi:
            case KvStorage::kInt2Kivi:  // dequantized by the caller (LowBitRowToF32)
              break;
          }
        }
        x[lane] = value;
      }
      _mm256_store_ps(dst + c * 64, _mm256_load_ps(x));
    }
  }
}

struct ScoreVec {
  __m256 lo, hi;  // tokens 0..7, 8..15
};

// Scores of kRows rows (q rows at stride dp) against 4 kQuads consecutive pairs of a packed
// block, k pointing at the first one (pair g0 of chunk 0): out[r][quad] holds tokens
// PairToken(g0 + 4 quad)..+7 in order. The accumulators live in registers only because every
// loop here is unrolled.
template <int kRows, int kQuads>
inline void ScorePairs(const float* q, int dp, const float* k, __m256 (*out)[kQuads]) {
  constexpr int kPairs = 4 * kQuads;
  __m256 acc[kRows][kPairs];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < kPairs; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int c = 0; c < dp / 4; ++c, k += 64) {
    __m256 qc[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) qc[r] = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(q + r * dp + 4 * c));
#pragma GCC unroll 8
    for (int i = 0; i < kPairs; ++i) {
      const __m256 kv = _mm256_load_ps(k + 8 * i);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) acc[r][i] = _mm256_fmadd_ps(qc[r], kv, acc[r][i]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int quad = 0; quad < kQuads; ++quad) {
      // Each lane's four floats summed: the low lanes' tokens then the high lanes', i.e. in order.
      const __m256* a = acc[r] + 4 * quad;
      out[r][quad] = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    }
  }
}

// Scores of kRows rows (q rows at stride dp, pre-scaled) against a packed K block, in token
// order: per row and token the same operations in the same order whatever kRows is. Two rows
// take a pass per half block, one row a single pass: 8 accumulators either way.
template <int kRows>
inline void ScoreRows(const float* q, int dp, const float* k_packed, ScoreVec* scores) {
  if constexpr (kRows == 1) {
    __m256 s[1][2];
    ScorePairs<1, 2>(q, dp, k_packed, s);
    scores[0] = {s[0][0], s[0][1]};
  } else {
    __m256 lo[kRows][1], hi[kRows][1];
    ScorePairs<kRows, 1>(q, dp, k_packed, lo);
    ScorePairs<kRows, 1>(q, dp, k_packed + 32, hi);
    for (int r = 0; r < kRows; ++r) scores[r] = {lo[r][0], hi[r][0]};
  }
}

inline float ReduceMax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float ReduceAdd(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 2^x for x <= 0 (or -inf); results below 2^-126 may flush to 0.
inline __m256 Exp2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  // The AVX-512 family's degree-7 Taylor series of 2^f.
  __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // 2^n from its exponent field: n = -127 gives +0.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Online-softmax step for one row and block over its tokens [first, valid) (first < valid):
// updates m and the lane-wise running sum l_lanes[16]; writes p[kBlock] (zeros on masked
// lanes) and returns the factor the row's accumulator must be scaled by (1 unless the running
// max grew).
inline float SoftmaxStep(const ScoreVec& scores, int first, int valid, float* m, float* l_lanes, float* p) {
  const __m256 mask_lo = BlockLanes(first, valid, 0), mask_hi = BlockLanes(first, valid, 8);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 m_vec = _mm256_set1_ps(*m);
  float correction = 1.f;
  const __m256 s_lo = _mm256_blendv_ps(neg_inf, scores.lo, mask_lo);
  const __m256 s_hi = _mm256_blendv_ps(neg_inf, scores.hi, mask_hi);
  // Once the running max has settled most blocks stay below it: one compare then
  // replaces the horizontal max reduction.
  const __m256 above = _mm256_or_ps(_mm256_cmp_ps(s_lo, m_vec, _CMP_GT_OQ), _mm256_cmp_ps(s_hi, m_vec, _CMP_GT_OQ));
  if (_mm256_movemask_ps(above) != 0) {
    const float block_max = ReduceMax(_mm256_max_ps(s_lo, s_hi));
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
    m_vec = _mm256_set1_ps(block_max);
  }
  const __m256 e_lo = _mm256_and_ps(mask_lo, Exp2(_mm256_sub_ps(scores.lo, m_vec)));
  const __m256 e_hi = _mm256_and_ps(mask_hi, Exp2(_mm256_sub_ps(scores.hi, m_vec)));
  _mm256_store_ps(p, e_lo);
  _mm256_store_ps(p + 8, e_hi);
  const __m256 c = _mm256_set1_ps(correction);
  _mm256_store_ps(l_lanes, _mm256_fmadd_ps(_mm256_load_ps(l_lanes), c, e_lo));
  _mm256_store_ps(l_lanes + 8, _mm256_fmadd_ps(_mm256_load_ps(l_lanes + 8), c, e_hi));
  return correction;
}

// Final probabilities of one row and block given its softmax max m (log2 domain) and
// 1/sum: p[lane] = 2^(score - m) * inv_sum on the lanes of tokens [first, valid), 0 elsewhere.
inline void Probabilities(const ScoreVec& scores, int first, int valid, float m, float inv_sum, float* p) {
  const __m256 m_vec = _mm256_set1_ps(m), inv = _mm256_set1_ps(inv_sum);
  _mm256_store_ps(p, _mm256_and_ps(BlockLanes(first, valid, 0),
                                   _mm256_mul_ps(Exp2(_mm256_sub_ps(scores.lo, m_vec)), inv)));
  _mm256_store_ps(p + 8, _mm256_and_ps(BlockLanes(first, valid, 8),
                                       _mm256_mul_ps(Exp2(_mm256_sub_ps(scores.hi, m_vec)), inv)));
}

inline float SumLanes(const float* l_lanes) {
  return ReduceAdd(_mm256_add_ps(_mm256_load_ps(l_lanes), _mm256_load_ps(l_lanes + 8)));
}

// dst[j] = the score of token j of the block, for first <= j < valid (others left alone).
inline void StoreScoresInTokenOrder(const ScoreVec& scores, int first, int valid, float* dst) {
  _mm256_maskstore_ps(dst, _mm256_castps_si256(BlockLanes(first, valid, 0)), scores.lo);
  _mm256_maskstore_ps(dst + 8, _mm256_castps_si256(BlockLanes(first, valid, 8)), scores.hi);
}
inline void StoreScoresInTokenOrder(const ScoreVec& scores, int valid, float* dst) {
  StoreScoresInTokenOrder(scores, 0, valid, dst);
}

// Softcaps one row's block of scores (Softcap, attention_kernels.h), as the AVX-512 family does.
inline __m256 Softcapped(const Softcap& cap, __m256 x) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256 e = Exp2(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), _mm256_set1_ps(cap.exp2_scale)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));  // tanh(|y|)
  return _mm256_or_ps(_mm256_mul_ps(t, _mm256_set1_ps(cap.out_scale)), _mm256_and_ps(x, sign_bit));
}
inline void ApplySoftcap(const Softcap& cap, ScoreVec* scores) {
  scores->lo = Softcapped(cap, scores->lo);
  scores->hi = Softcapped(cap, scores->hi);
}

// p[r][lane] *= scale[lane] for rows [r_begin, r_end) (p rows kBlock apart, 32-byte aligned).
inline void ScaleProbabilities(float* p, const float* scale, int r_begin, int r_end) {
  const __m256 lo = _mm256_loadu_ps(scale), hi = _mm256_loadu_ps(scale + 8);
  for (int r = r_begin; r < r_end; ++r) {
    float* row = p + static_cast<size_t>(r) * kBlock;
    _mm256_store_ps(row, _mm256_mul_ps(_mm256_load_ps(row), lo));
    _mm256_store_ps(row + 8, _mm256_mul_ps(_mm256_load_ps(row + 8), hi));
  }
}

// Into L2 only, as in the AVX-512 family.
inline void Prefetch(const void* address) { _mm_prefetch(static_cast<const char*>(address), _MM_HINT_T2); }

// Loads dims c..c+7 of a V row in storage type T (float, f16 bits, unscaled int8 or fp8) as f32.
inline __m256 LoadV(const float* row, int c) { return _mm256_loadu_ps(row + c); }
inline __m256 LoadV(const f16_bits* row, int c) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m256 LoadV(const int8_t* row, int c) {
  return Int8ToF32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m256 LoadV(const Fp8E4M3Code* row, int c) {
  return Fp8E4M3ToF32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m256 LoadV(const Fp8E5M2Code* row, int c) {
  return Fp8E5M2ToF32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
}
inline __m256 LoadV(const Bf16Value* row, int c) {
  return Bf16ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
}

// acc[r] = acc[r] * correction[r] + sum_lanes p[r][lane] * v_lane, for kRows rows at once so
// each V load (and conversion) serves kRows rows. V row t is at v + t * v_stride (elements of
// T, dp of them readable) and must be finite for all kBlock tokens (p is 0 past the valid
// ones); acc rows have stride dp (a multiple of 16), p rows kBlock.
template <int kRows, typename T>
inline void AccumulateRows(const float* p, const float* correction, const T* v, size_t v_stride, float* acc, int dp) {
  constexpr int kVecs = kRows >= 8 ? 1 : 2;  // 8-dim vectors per row and pass: keep 8 FMA chains in flight
  for (int c = 0; c < dp; c += 8 * kVecs) {
    __m256 a[kRows][kVecs];
    for (int r = 0; r < kRows; ++r) {
      const __m256 scale = _mm256_set1_ps(correction[r]);
      for (int x = 0; x < kVecs; ++x) a[r][x] = _mm256_mul_ps(_mm256_load_ps(acc + r * dp + c + 8 * x), scale);
    }
#pragma GCC unroll 16
    for (int lane = 0; lane < kBlock; ++lane) {
      __m256 v_row[kVecs];
      for (int x = 0; x < kVecs; ++x) v_row[x] = LoadV(v + lane * v_stride, c + 8 * x);
      for (int r = 0; r < kRows; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r * kBlock + lane]);
        for (int x = 0; x < kVecs; ++x) a[r][x] = _mm256_fmadd_ps(pr, v_row[x], a[r][x]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int x = 0; x < kVecs; ++x) _mm256_store_ps(acc + r * dp + c + 8 * x, a[r][x]);
  }
}

// Integer dots: not in this family yet (int8 KV takes the f32 path). The primitives are
// declared for the callers' discarded `if constexpr (kIntegerDots)` branches.
constexpr bool kIntegerDots = false;
inline void QuantizeQueries(const float* q_rows, int rows, int dp, QueryCodes* out) {
  QuantizeQueryRows(q_rows, rows, dp, out);
}
inline void PackKCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* k_codes);
template <int kRows>
void ScoreRowsCodes(const QueryCodes& q, int r0, const uint8_t* k_codes, const float* lane_scale, ScoreVec* scores);
inline void PackVCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* v_codes);
inline float QuantizeProbabilities(const float* p, const float* lane_scale, uint8_t* codes);
inline void QuantizeProbabilityRows(const float* p, const float* lane_scale, int n_rows, uint8_t* codes, float* steps);
inline void GatherLaneScales(const float* scales, int stride, float* lanes);
template <int kRows>
void AccumulateRowsCodes(const uint8_t* p_codes, const float* step, const float* correction, const uint8_t* v_codes,
                         float* acc, int dp);
inline void UnpermuteVDims(float* row, int dp);

#else  // portable scalar path with the same structure; K stays in plain rows, lane = token

constexpr int LaneToken(int lane) { return lane; }

inline void LoadRowF32(KvStorage storage, const void* src, float scale, int head_dim, float* dst) {
  switch (storage) {
    case KvStorage::kF16: {
      const f16_bits* h = static_cast<const f16_bits*>(src);
      for (int c = 0; c < head_dim; ++c) dst[c] = F16ToF32(h[c]);
      break;
    }
    case KvStorage::kBf16: {
      const bf16_bits* h = static_cast<const bf16_bits*>(src);
      for (int c = 0; c < head_dim; ++c) dst[c] = BF16ToF32(h[c]);
      break;
    }
    case KvStorage::kInt8:
    case KvStorage::kInt8Kivi:  // V rows: per-token scale in both
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2: {
      const uint8_t* b = static_cast<const uint8_t*>(src);
      const float full_scale = scale * CodeScaleFactor(storage);
      for (int c = 0; c < head_dim; ++c) dst[c] = full_scale * CodeToF32(storage, b[c]);
      break;
    }
    case KvStorage::kF32:
      std::memcpy(dst, src, head_dim * sizeof(float));
      break;
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi:  // dequantized by the caller (LowBitRowToF32)
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
      LoadRowF32(storage, rows[j], HasTokenScales(storage) ? scales[j] : 1.f, head_dim, dst);
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

inline float SoftmaxStep(const ScoreVec& scores, int first, int valid, float* m, float* l_lanes, float* p) {
  float block_max = kNegInf;
  for (int j = first; j < valid; ++j) block_max = std::max(block_max, scores.s[j]);
  float correction = 1.f;
  if (block_max > *m) {
    correction = *m == kNegInf ? 0.f : std::exp2(*m - block_max);
    *m = block_max;
  }
  for (int j = 0; j < kBlock; ++j) {
    p[j] = j >= first && j < valid ? std::exp2(scores.s[j] - *m) : 0.f;
    l_lanes[j] = l_lanes[j] * correction + p[j];
  }
  return correction;
}

inline void Probabilities(const ScoreVec& scores, int first, int valid, float m, float inv_sum, float* p) {
  for (int j = 0; j < kBlock; ++j) p[j] = j >= first && j < valid ? std::exp2(scores.s[j] - m) * inv_sum : 0.f;
}

inline float SumLanes(const float* l_lanes) {
  float sum = 0.f;
  for (int j = 0; j < kBlock; ++j) sum += l_lanes[j];
  return sum;
}

inline void StoreScoresInTokenOrder(const ScoreVec& scores, int first, int valid, float* dst) {
  std::copy(scores.s + first, scores.s + valid, dst + first);
}
inline void StoreScoresInTokenOrder(const ScoreVec& scores, int valid, float* dst) {
  StoreScoresInTokenOrder(scores, 0, valid, dst);
}

inline void ApplySoftcap(const Softcap& cap, ScoreVec* scores) {
  for (int j = 0; j < kBlock; ++j) scores->s[j] = cap.Apply(scores->s[j]);
}

inline void ScaleProbabilities(float* p, const float* scale, int r_begin, int r_end) {
  for (int r = r_begin; r < r_end; ++r)
    for (int j = 0; j < kBlock; ++j) p[static_cast<size_t>(r) * kBlock + j] *= scale[j];
}

inline void Prefetch(const void* address) { __builtin_prefetch(address, 0, 1); }

inline float LoadV(const float* row, int c) { return row[c]; }
inline float LoadV(const f16_bits* row, int c) { return F16ToF32(row[c]); }
inline float LoadV(const int8_t* row, int c) { return static_cast<float>(row[c]); }
inline float LoadV(const Fp8E4M3Code* row, int c) {
  return CodeToF32(KvStorage::kFp8E4M3, static_cast<uint8_t>(row[c]));
}
inline float LoadV(const Fp8E5M2Code* row, int c) {
  return CodeToF32(KvStorage::kFp8E5M2, static_cast<uint8_t>(row[c]));
}
inline float LoadV(const Bf16Value* row, int c) { return BF16ToF32(static_cast<bf16_bits>(row[c])); }

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

// Integer dots, the scalar twins of the AVX-512 family's (same codes, same integer sums, same
// float operations in the same order): K and V stay plain [kBlock, dp] code rows.
constexpr bool kIntegerDots = true;

inline void QuantizeQueries(const float* q_rows, int rows, int dp, QueryCodes* out) {
  QuantizeQueryRows(q_rows, rows, dp, out);
}

inline void PackKCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* k_codes) {
  for (int j = 0; j < kBlock; ++j) std::memcpy(k_codes + static_cast<size_t>(j) * dp, rows[j < n_rows ? j : 0], dp);
}

template <int kRows>
inline void ScoreRowsCodes(const QueryCodes& q, int r0, const uint8_t* k_codes, const float* lane_scale,
                           ScoreVec* scores) {
  int32_t dots[128];  // [n_groups, 2] (head_dim <= 2048)
  KVS_CHECK(q.n_groups <= 64);
  for (int r = 0; r < kRows; ++r) {
    const int8_t* hi = q.Hi(r0 + r);
    const int8_t* lo = q.Lo(r0 + r);
    for (int j = 0; j < kBlock; ++j) {
      const int8_t* k = reinterpret_cast<const int8_t*>(k_codes) + static_cast<size_t>(j) * q.dp;
      for (int g = 0; g < q.n_groups; ++g) {
        int32_t dot_hi = 0, dot_lo = 0;
        for (int c = g * kQueryGroup; c < std::min(q.dp, (g + 1) * kQueryGroup); ++c) {
          dot_hi += int32_t{hi[c]} * k[c];
          dot_lo += int32_t{lo[c]} * k[c];
        }
        dots[2 * g] = dot_hi;
        dots[2 * g + 1] = dot_lo;
      }
      scores[r].s[j] = CombineGroupDots(dots, q.Steps(r0 + r), q.n_groups, lane_scale[j]);
    }
  }
}

inline void PackVCodes(const uint8_t* const* rows, int n_rows, int dp, uint8_t* v_codes) {
  PackKCodes(rows, n_rows, dp, v_codes);
}

inline float QuantizeProbabilities(const float* p, const float* lane_scale, uint8_t* codes) {
  float scaled[kBlock];
  for (int j = 0; j < kBlock; ++j) scaled[j] = p[j] * lane_scale[j];
  return QuantizeProbabilityCodes(scaled, codes);
}

inline void GatherLaneScales(const float* scales, int stride, float* lanes) {
  for (int lane = 0; lane < kBlock; ++lane) lanes[lane] = scales[static_cast<size_t>(lane) * stride];
}

inline void QuantizeProbabilityRows(const float* p, const float* lane_scale, int n_rows, uint8_t* codes, float* steps) {
  for (int r = 0; r < n_rows; ++r) {
    steps[r] = QuantizeProbabilities(p + r * kBlock, lane_scale, codes + static_cast<size_t>(r) * 2 * kBlock);
  }
}

template <int kRows>
inline void AccumulateRowsCodes(const uint8_t* p_codes, const float* step, const float* correction,
                                const uint8_t* v_codes, float* acc, int dp) {
  for (int r = 0; r < kRows; ++r) {
    float* a = acc + static_cast<size_t>(r) * dp;
    const uint8_t* hi = p_codes + r * 2 * kBlock;
    const uint8_t* lo = hi + kBlock;
    for (int c = 0; c < dp; ++c) {
      int32_t dot_hi = 0, dot_lo = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int32_t v = reinterpret_cast<const int8_t*>(v_codes)[static_cast<size_t>(j) * dp + c];
        dot_hi += int32_t{hi[j]} * v;
        dot_lo += int32_t{lo[j]} * v;
      }
      const float with_hi = std::fma(static_cast<float>(dot_hi), step[r], a[c] * correction[r]);
      a[c] = std::fma(static_cast<float>(dot_lo), step[r] / 255.f, with_hi);
    }
  }
}

inline void UnpermuteVDims(float*, int) {}

#endif

#if !KVS_ISA_AVX512
// bf16 dots: only in the avx512 family (bf16 and fp8 KV take the f32 path in the others).
// Declared for the callers' discarded `if constexpr (kBf16Dots)` branches.
constexpr bool kBf16Dots = false;
inline void QueryRowsToBf16(const float* q_rows, int rows, int dp, uint16_t* out);
inline void PackKBf16(KvStorage storage, const uint8_t* const* rows, int n_rows, int head_dim, int dp,
                      uint16_t* k_packed);
inline void ScoreRowPairBf16(int n_pair, const uint16_t* q_bf16, int r, int dp, const float* k_block,
                             const float* lane_k_scale, ScoreVec* scores);
inline void PackVBf16(KvStorage storage, const uint8_t* const* rows, int n_rows, int dp, uint16_t* v_packed);
inline void AccumulateHeadBf16(const float* p, const float* correction, const uint16_t* v_packed, float* acc, int dp,
                               int r_begin, int r_end, uint16_t* p_bf16);
inline void UnpermuteBf16VDims(float* row, int dp);
#endif

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
// 16 codes of a packed int4 (8 bytes) or int2 (4 bytes) row, one per byte in channel order
// (codes are packed low bits first: ops/kv_quant.h).
inline __m128i UnpackSixteenCodes(int bits, const uint8_t* packed) {
  if (bits == 4) {  // byte i -> 16-bit lane i = (low nibble, high nibble) as two bytes
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed)));
    return _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0x0F)), _mm_slli_epi16(_mm_srli_epi16(bytes, 4), 8));
  }
  int32_t word;  // bits == 2: byte i -> 32-bit lane i = its four 2-bit codes as four bytes
  std::memcpy(&word, packed, sizeof(word));
  const __m128i bytes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
  const __m128i three = _mm_set1_epi32(3);
  __m128i codes = _mm_and_si128(bytes, three);
  codes = _mm_or_si128(codes, _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(bytes, 2), three), 8));
  codes = _mm_or_si128(codes, _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(bytes, 4), three), 16));
  return _mm_or_si128(codes, _mm_slli_epi32(_mm_srli_epi32(bytes, 6), 24));
}
#endif

// One kv head's low-bit KIVI row as f32, zero-padded to dp: DequantizeLowBitRow (its scalar
// twin, which the scalar family runs) 16 codes at a time. Both fuse the multiply-add and widen
// the f16 scales exactly, so the rows are bit-identical. group: 1 (K, a scale per channel) or V's
// channels per scale.
inline void LowBitRowToF32(int bits, const uint8_t* packed, const uint16_t* scale, const uint16_t* min, int group,
                           int head_dim, int dp, uint8_t* codes, float* dst) {
#if KVS_ISA_SCALAR
  DequantizeLowBitRow(bits, packed, scale, min, group, head_dim, dp, codes, dst);
#else
  // 16 consecutive channels share one scale (group a multiple of 16) or have one each (group 1);
  // other groups take the twin. F16C widens the f16 scales in registers (_cvtsh_ss: exact, as
  // F16ToF32), not through a call per value.
  if (group != 1 && group % 16 != 0) {
    DequantizeLowBitRow(bits, packed, scale, min, group, head_dim, dp, codes, dst);
    return;
  }
  int c = 0;
  for (; c + 16 <= head_dim; c += 16) {
    const __m128i codes16 = UnpackSixteenCodes(bits, packed + c * bits / 8);
#if KVS_ISA_AVX512
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes16));
    const __m512 s = group == 1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + c)))
                                : _mm512_set1_ps(_cvtsh_ss(scale[c / group]));
    const __m512 m = group == 1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(min + c)))
                                : _mm512_set1_ps(_cvtsh_ss(min[c / group]));
    _mm512_storeu_ps(dst + c, _mm512_fmadd_ps(x, s, m));
#else
    for (int half = 0; half < 2; ++half) {
      const int ch = c + 8 * half;
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half ? _mm_srli_si128(codes16, 8) : codes16));
      const __m256 s = group == 1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + ch)))
                                  : _mm256_set1_ps(_cvtsh_ss(scale[ch / group]));
      const __m256 m = group == 1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(min + ch)))
                                  : _mm256_set1_ps(_cvtsh_ss(min[ch / group]));
      _mm256_storeu_ps(dst + ch, _mm256_fmadd_ps(x, s, m));
    }
#endif
  }
  const int mask = (1 << bits) - 1;
  for (; c < head_dim; ++c) {  // the last head_dim % 16 values, as the twin computes them
    const int code = (packed[c * bits / 8] >> (c * bits % 8)) & mask;
    dst[c] = std::fma(static_cast<float>(code), _cvtsh_ss(scale[c / group]), _cvtsh_ss(min[c / group]));
  }
  std::fill(dst + head_dim, dst + dp, 0.f);
#endif
}

// One kv head's K rows of a low-bit KIVI block dequantized into scratch, k_head[j] repointed at
// token j's f32 row, so that PackK(kF32, ...) packs the block.
inline void DequantizeLowBitKBlock(int bits, const BlockRows& block, int stored_head, int n_block, int head_dim, int dp,
                                   LowBitScratch* scratch, const uint8_t** k_head) {
  scratch->codes.resize(head_dim);
  float* k_rows = scratch->k_rows.Get(static_cast<size_t>(kBlock) * dp);
  const size_t channel = static_cast<size_t>(stored_head) * head_dim;
  for (int j = 0; j < n_block; ++j) {
    float* row = k_rows + static_cast<size_t>(j) * dp;
    LowBitRowToF32(bits, k_head[j], block.k_group_scale[j] + channel, block.k_group_min[j] + channel, /*group=*/1,
                   head_dim, dp, scratch->codes.data(), row);
    k_head[j] = reinterpret_cast<const uint8_t*>(row);
  }
}

// Per-token scales of a block (token j: scale[j] * factor, j < n_block) in lane order, 0 on lanes
// past the block: what scores (K) or probabilities (V) are multiplied by when the codes enter the
// dots unscaled (the integer path, fp8 codes in place or through bf16; factor: CodeScaleFactor).
inline void ScalesInLaneOrder(const float* scale, int n_block, float* lanes, float factor = 1.f) {
  for (int lane = 0; lane < kBlock; ++lane) {
    lanes[lane] = LaneToken(lane) < n_block ? scale[LaneToken(lane)] * factor : 0.f;
  }
}

// Scores of rows r and r + 1 (n_pair of them) against the packed K block: with `q_bf16` (bf16
// dots) from the rows' bf16 queries and k_block's bf16 pairs, times lane_k_scale unless it is null
// (fp8 codes; null for bf16); with `codes` (the integer path) from the rows' query codes and
// k_block's codes times lane_k_scale; else from the pre-scaled f32 rows q_rows [rows, dp] and
// k_block's floats.
inline void ScoreRowPair(int n_pair, const uint16_t* q_bf16, const QueryCodes* codes, const float* q_rows, int r,
                         int dp, const float* k_block, const float* lane_k_scale, ScoreVec* scores) {
  if (q_bf16 != nullptr) {
    if constexpr (kBf16Dots) ScoreRowPairBf16(n_pair, q_bf16, r, dp, k_block, lane_k_scale, scores);
  } else if (codes != nullptr) {
    if constexpr (kIntegerDots) {
      const uint8_t* k_codes = reinterpret_cast<const uint8_t*>(k_block);
      if (n_pair == 2) {
        ScoreRowsCodes<2>(*codes, r, k_codes, lane_k_scale, scores);
      } else {
        ScoreRowsCodes<1>(*codes, r, k_codes, lane_k_scale, scores);
      }
    }
  } else if (n_pair == 2) {
    ScoreRows<2>(q_rows + static_cast<size_t>(r) * dp, dp, k_block, scores);
  } else {
    ScoreRows<1>(q_rows + static_cast<size_t>(r) * dp, dp, k_block, scores);
  }
}

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

}  // namespace kvsparse::ops::HWY_NAMESPACE::attn_detail

#endif  // KVS_OPS_ATTENTION_KERNELS_INL_H_
