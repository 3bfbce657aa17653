// Tile steps of the 32-element weight types multiplied against packed Q8_0 activations
// (packed_q8.h): Q8_0, Q4_0, Q5_0, IQ4_NL and, with a min, Q4_1 and Q5_1. Compiled once per
// kernel family. Include it inside a family region (see simd_family.h), after matmul_tile-inl.h,
// matmul_panel-inl.h and packed_q8-inl.h (<vector> and hwy/aligned_allocator.h before the region).
// A type whose B has PanelCodes also gets the panel path (PackedQ8Panel below).
//
// A weight type supplies its block arithmetic as `B` (matmul_q8_0.cc, matmul_q4_0.cc, ...):
//   using Block;                    // the GGUF weight block (32 elements, f16 scale d)
//   kOffset, kOrder                 // the packed activations' weight bias and element order
//   kHasMin (optional, default off) // value = d * q + m with unsigned q: Block has an f16 m
//   avx512: Load(b0, b1)            // a step's 64 weights as (q + kOffset) u8, in kOrder
//           DotCompact(b0, b1, xq)  // int32 lane dots of the codes q with compact-layout xq
//   avx2:   Load(b)                 // a block's 32 weights as Dot takes them
//           Dot(w, xq, init)        // int32 lane dots, starting from the packed `init`
//   scalar: Dot(b, xq)              // the block's exact integer dot of the codes q with xq[32]
// and PackedQ8Kernel<B>::Make() builds its Kernel: the step loop, decode strips, reductions and
// packing are shared.
//
// With a min, a block's dot with one Q8_0 activation block (scale d_x, codes x) is
//   d * d_x * sum q_i x_i  +  m * s,   s = d_x * sum x_i
// (ggml pairs these types with Q8_1 activations, whose f16 s is computed here exactly in f32 and
// packed per block after the token's steps). The block steps compute the first term as for any
// type (kOffset 0, so init is 0). The second is a small f32 product of the rows' mins (picked out
// of their blocks, kLanes blocks per vector) with the tokens' block sums, added to the same
// accumulators after the steps: one multiply-add per (row, token) and kLanes blocks, where folding
// it into the steps took one per 2 blocks (avx512: 0.75x of Q4_0 in prefill, registers spilled).
//
// The nibble layout shared by Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (element e < 16 is the low
// nibble of qs[e], e >= 16 the high nibble of qs[e - 16]; Q5's fifth bit of e is bit e of the
// little-endian uint32 qh) has its loads here too.
#include <concepts>

#if defined(KVS_OPS_MATMUL_PACKED_Q8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#undef KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#else
#define KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

// Whether weight type B declares a min (value = d * q + m).
template <class B>
concept WeightsWithMin = B::kHasMin;

// Q5's little-endian qh as one word (the byte assembly compiles to one load).
inline uint32_t FifthBitWord(const uint8_t* qh) {
  return qh[0] | static_cast<uint32_t>(qh[1]) << 8 | static_cast<uint32_t>(qh[2]) << 16 |
         static_cast<uint32_t>(qh[3]) << 24;
}

#if KVS_ISA_AVX512
// Two blocks' nibbles in Q8Order::kQ4NibbleHalves, which falls straight out of the nibble split:
// [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31], so int32 lanes 0-3, 8-11 are block 0 and 4-7,
// 12-15 block 1.
inline __m512i NibblesOfPair(const uint8_t* qs0, const uint8_t* qs1) {
  const __m256i packed = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0)));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), packed, 1);
  // Upper 256 bits take the high nibbles.
  return _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), _mm512_set1_epi8(0x0F));
}
// Two Q5 blocks' 5-bit codes (0..31) in natural order [b0 e0-31 | b1 e0-31]: the nibbles from the
// 128-bit lanes [qs0, qs0, qs1, qs1] (the odd ones shifted to their high nibbles), as cheap as
// Q4_0's order, and the fifth bits from the byte mask [qh0 | qh1] as it stands.
inline __m512i Q5CodesOfPair(const uint8_t* qs0, const uint8_t* qh0, const uint8_t* qs1, const uint8_t* qh1) {
  const __m512i packed = _mm512_castsi256_si512(_mm256_set_m128i(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0))));
  const __m512i doubled = _mm512_shuffle_i64x2(packed, packed, _MM_SHUFFLE(1, 1, 0, 0));
  const __m512i shifted = _mm512_mask_srli_epi16(doubled, 0xFF00FF00u, doubled, 4);
  const __mmask64 fifth_bits =
      _mm512_kunpackd(_cvtu32_mask32(FifthBitWord(qh1)), _cvtu32_mask32(FifthBitWord(qh0)));
  const __m512i sixteens = _mm512_maskz_mov_epi8(fifth_bits, _mm512_set1_epi8(16));
  // (shifted & 0x0F) | sixteens
  return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi8(0x0F), sixteens, 0xEA);
}
// The signed dot of weights fed as (q + offset) u8: dot(q + offset, x) - offset * dot(1, x).
inline __m512i UnbiasedDot(__m512i biased_w, __m512i xq, int offset) {
  const __m512i zero = _mm512_setzero_si512();
  return _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, biased_w, xq),
                          _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(static_cast<char>(offset)), xq));
}
#elif KVS_ISA_AVX2
// A block's nibbles in natural order: [e0-15 low nibbles | e16-31 high nibbles].
inline __m256i Nibbles(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}
// A Q5 block's 5-bit codes (0..31): byte e takes 16 where bit e of qh is set (each byte picks its
// qh byte, keeps its own bit, compares).
inline __m256i Q5Codes(const uint8_t* qs, const uint8_t* qh) {
  const __m256i qh_byte_of_e = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                                  0x0303030303030303);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(FifthBitWord(qh))), qh_byte_of_e);
  const __m256i all_but_own_bit = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);
  const __m256i bit_set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, all_but_own_bit), _mm256_set1_epi64x(-1));
  return _mm256_or_si256(Nibbles(qs), _mm256_and_si256(bit_set, _mm256_set1_epi8(16)));
}
// u8 x s8 lane dots from `init`; exact while each product pair fits int16 (q <= 128).
inline __m256i UnsignedDot(__m256i w, __m256i xq, __m256i init) {
  return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1)));
}
// The sign trick for signed weights: |w| times x carrying w's sign keeps maddubs' pairs in int16.
inline __m256i SignedDot(__m256i w, __m256i xq) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#else
inline int NibbleAt(const uint8_t* qs, int e) { return e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4; }
inline int Q5CodeAt(const uint8_t* qs, const uint8_t* qh, int e) {
  return NibbleAt(qs, e) | static_cast<int>((FifthBitWord(qh) >> e) & 1) << 4;
}
#endif

#if KVS_ISA_AVX512
// The 32-bit lanes of an f16 scale pair [d0 x 16 | d1 x 16] that take d1 (each holds the f16s of
// two f32 lanes), as a _mm256_blend_epi32 mask.
constexpr int ScaleBlendOf(Q8Order order) {
  int mask = 0;
  for (int i = 0; i < 8; ++i) mask |= BlockOfLane(order, 2 * i) << i;
  return mask;
}
#endif

// The block arithmetic of 32 4-bit codes in the nibble layout above that index a table of 16
// signed levels (IQ4_NL, MXFP4; value = scale * kLevels[code]), looked up by a byte shuffle.
// avx512 looks up (level + 128) as unsigned bytes for vpdpbusd with `init` = -128 * sum(x) (4
// products of at most 255 * 127 per int32 lane, no saturation); avx2's maddubs would saturate its
// int16 pairs for IQ4_NL's levels, so it takes the signed levels with the sign trick and no bias.
// The types add their scale (an f16 d, or B::Scale) and, where they pack panels, PanelCodes.
template <class BlockT, const int8_t* kLevels>
struct NibbleLevelBlocks {
  using Block = BlockT;
#if KVS_ISA_AVX512
  static constexpr int kOffset = 128;
  static constexpr Q8Order kOrder = Q8Order::kQ4NibbleHalves;
  // The levels as (level + 128) u8: flipping the sign bit of the int8 table adds 128.
  static __m512i BiasedLevels() {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevels))),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static __m512i Load(const Block& b0, const Block& b1) {
    return _mm512_shuffle_epi8(BiasedLevels(), NibblesOfPair(b0.qs, b1.qs));
  }
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return UnbiasedDot(Load(b0, b1), xq, kOffset);
  }
#elif KVS_ISA_AVX2
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static __m256i Load(const Block& b) {
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevels)));
    return _mm256_shuffle_epi8(levels, Nibbles(b.qs));
  }
  static __m256i Dot(__m256i w, __m256i xq, __m256i /*init*/) { return SignedDot(w, xq); }
#else
  static constexpr int kOffset = 0;
  static constexpr Q8Order kOrder = Q8Order::kNatural;
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < 32; ++e) dot += kLevels[NibbleAt(b.qs, e)] * xq[e];
    return dot;
  }
#endif
};

// Whether weight type B gives its blocks' scales itself (B::Scale(block), f32: MXFP4's E8M0
// exponent) rather than as an f16 field d.
template <class B>
concept WeightsWithOwnScale = requires(const typename B::Block& b) {
  { B::Scale(b) } -> std::same_as<float>;
};

#if KVS_ISA_AVX512
// The f32 lanes (as a mask) that take the second block of a step's pair.
constexpr __mmask16 SecondBlockLanesOf(Q8Order order) {
  int mask = 0;
  for (int i = 0; i < 16; ++i) mask |= BlockOfLane(order, i) << i;
  return static_cast<__mmask16>(mask);
}
#endif

template <class B>
struct PackedQ8Steps {
  using Block = typename B::Block;
  static constexpr int kBlockElems = 32;
  static constexpr bool kPairBlocks = kStepBlocks == 2;
  static constexpr bool kHasMin = WeightsWithMin<B>;
  // With a min the weights need no bias: the min terms take the place of ggml's Q8_1 sums.
  static_assert(!kHasMin || B::kOffset == 0);

  static float ScaleOf(const Block& b) {
    if constexpr (WeightsWithOwnScale<B>) {
      return B::Scale(b);
    } else {
      return F16ToF32(b.d);
    }
  }

  static const Block* RowBlocks(const TileArgs& a, int r) {
    return reinterpret_cast<const Block*>(a.w + r * a.w_row_bytes);
  }

#if KVS_ISA_AVX512
  // One step = 2 blocks = 64 weights per row; int32 lane i belongs to block BlockOfLane(i).
  static constexpr int kScaleBlend = ScaleBlendOf(B::kOrder);
  // The f32 scale of each int32 lane: [d0 | d1] per BlockOfLane, as f16 from two broadcasts and a
  // blend, then one widening convert.
  static __m512 Scales(const Block& b0, const Block& b1) {
    if constexpr (WeightsWithOwnScale<B>) {
      return _mm512_mask_blend_ps(SecondBlockLanesOf(B::kOrder), _mm512_set1_ps(B::Scale(b0)),
                                  _mm512_set1_ps(B::Scale(b1)));
    } else {
      return _mm512_cvtph_ps(_mm256_blend_epi32(_mm256_set1_epi16(static_cast<short>(b0.d)),
                                                _mm256_set1_epi16(static_cast<short>(b1.d)), kScaleBlend));
    }
  }
  // Lane i of the compact layout's scale pair [d0, d1] for int32 lane i.
  static __m512i CompactSpread() {
    constexpr auto j = [](int lane) { return BlockOfLane(B::kOrder, lane); };
    return _mm512_setr_epi32(j(0), j(1), j(2), j(3), j(4), j(5), j(6), j(7), j(8), j(9), j(10), j(11), j(12), j(13),
                             j(14), j(15));
  }
  // Where the f16 mins of 16 consecutive blocks lie in their bytes, read as 3 pairs of 64-byte
  // vectors (16 dwords each): per pair, the dword (its high half is the m) each output lane takes
  // (bit 4 picks the pair's second vector), and the output lanes it serves.
  struct MinDwords {
    int32_t index[3][16];
    uint32_t lanes[3];
  };
  static constexpr MinDwords FindMinDwords() {
    MinDwords dwords{};
    for (int k = 0; k < kLanes; ++k) {
      const int dword = static_cast<int>((k * sizeof(Block) + offsetof(Block, m)) / 4);
      dwords.index[dword / 32][k] = dword % 32;
      dwords.lanes[dword / 32] |= 1u << k;
    }
    return dwords;
  }
  static constexpr MinDwords kMinDwords = FindMinDwords();

  // The mins of blocks[0..15] as f32: the blocks' bytes in vector loads, the dwords holding the m's
  // picked out by dword permutes (single uops, unlike word permutes; a gather costs several times
  // more). kTail: only the first `count` blocks are read (masked loads, never past the row's end);
  // the others' mins come out 0.
  template <bool kTail = false>
  static __m512 Mins(const Block* blocks, int64_t count = kLanes) {
    constexpr int kBytes = kLanes * sizeof(Block);
    static_assert(kBytes <= 6 * 64 && sizeof(Block) % 4 == 0 && offsetof(Block, m) % 4 == 2);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(blocks);
    __m512i v[6];
    for (int i = 0; i < 6; ++i) {
      if (64 * i >= kBytes) {
        v[i] = _mm512_setzero_si512();
      } else if constexpr (kTail) {
        const int64_t left = count * static_cast<int64_t>(sizeof(Block)) - 64 * i;
        const uint32_t n = static_cast<uint32_t>(left <= 0 ? 0 : left >= 64 ? 64 : left);
        v[i] = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, n), bytes + 64 * i);
      } else {
        v[i] = _mm512_loadu_si512(bytes + 64 * i);
      }
    }
    __m512i dwords = _mm512_setzero_si512();
    for (int pair = 0; pair < 3; ++pair) {
      if (kMinDwords.lanes[pair] == 0) continue;
      const __m512i index = _mm512_loadu_si512(kMinDwords.index[pair]);
      dwords = _mm512_mask_blend_epi32(static_cast<__mmask16>(kMinDwords.lanes[pair]), dwords,
                                       _mm512_permutex2var_epi32(v[2 * pair], index, v[2 * pair + 1]));
    }
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dwords, 16)));
  }
  static __m512 LoadSums(const float* sums) { return _mm512_load_ps(sums); }
  static __m512 MulAdd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }

  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t s, int64_t b0, int64_t b1, AccF (&acc)[R][T]) {
    __m512i w[R];
    __m512 w_scale[R];
    for (int r = 0; r < R; ++r) {
      const Block* blocks = RowBlocks(a, r);
      if (a.w_prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + b0 * sizeof(Block)),
                     _MM_HINT_T1);
      }
      w[r] = B::Load(blocks[b0], blocks[b1]);
      w_scale[r] = Scales(blocks[b0], blocks[b1]);
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* step = a.x + t * a.x_token_bytes + s * kStepBytes;
      const __m512i xq = _mm512_load_si512(step);
      const __m512i init = _mm512_load_si512(step + kStepInitOffset);
      const __m512 x_scale = _mm512_load_ps(reinterpret_cast<const float*>(step + kStepScaleOffset));
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(init, w[r], xq);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale[r], x_scale), acc[r][t]);
      }
    }
  }

  // One weight row against one token (the decode hot loop). Kept minimal and out of line
  // (pointer-bumped, no branches in the loop): the fewer instructions per weight byte, the further
  // ahead the core's loads run, which decides how close decode gets to DRAM bandwidth.
  //  - full layout (kCompact = false): the packed `init` cancels the weight bias, the packed
  //    per-lane scales are used directly;
  //  - compact layout: B's signed dot, scales expanded per step.
  // With a min, the min terms follow in a second loop over the row (in L1 by then).
  template <bool kCompact>
  __attribute__((noinline)) static float DotRowOneToken(const Block* blocks, int64_t n_blocks, const uint8_t* x) {
    const __m512i spread = CompactSpread();
    const int64_t cols = n_blocks * kBlockElems;
    const int64_t n_steps = PackedSteps(cols);
    const float* compact_scales = CompactQ8Scales(x, cols);
    // Two accumulators: one FMA chain would cap a row at one step per FMA latency.
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    auto accumulate = [&](const Block& b0, const Block& b1, int64_t step, __m512& sum) {
      const __m512 w_scale = Scales(b0, b1);
      __m512i dot;
      __m512 x_scale;
      if constexpr (kCompact) {
        dot = B::DotCompact(b0, b1, _mm512_load_si512(x + step * kStepElems));
        const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(compact_scales + 2 * step)));
        x_scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(pair));
      } else {
        const uint8_t* packed = x + step * kStepBytes;
        dot = _mm512_dpbusd_epi32(_mm512_load_si512(packed + kStepInitOffset), B::Load(b0, b1),
                                  _mm512_load_si512(packed));
        x_scale = _mm512_load_ps(reinterpret_cast<const float*>(packed + kStepScaleOffset));
      }
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(w_scale, x_scale), sum);
    };
    const int64_t n_pairs = n_blocks / 2;
    int64_t p = 0;
    for (; p + 2 <= n_pairs; p += 2) {
      accumulate(blocks[2 * p], blocks[2 * p + 1], p, acc[0]);
      accumulate(blocks[2 * p + 2], blocks[2 * p + 3], p + 1, acc[1]);
    }
    if (p < n_pairs) accumulate(blocks[2 * p], blocks[2 * p + 1], p, acc[0]);
    if (n_pairs < n_steps) {  // odd tail: the block doubles as its own partner; its padded scale is 0
      accumulate(blocks[n_blocks - 1], blocks[n_blocks - 1], n_pairs, acc[1]);
    }
    if constexpr (kHasMin) {
      const float* sums =
          reinterpret_cast<const float*>(x + (kCompact ? CompactBlockSumsOffset(cols) : PackedBlockSumsOffset(cols)));
      int64_t b = 0;
      for (; b + kLanes <= n_blocks; b += kLanes) {
        acc[0] = _mm512_fmadd_ps(Mins(blocks + b), _mm512_load_ps(sums + b), acc[0]);
      }
      if (b < n_blocks) {
        acc[1] = _mm512_fmadd_ps(Mins<true>(blocks + b, n_blocks - b), _mm512_load_ps(sums + b), acc[1]);
      }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
  }

  // Decode: rows one after another against one token (layout chosen by DecodeUsesCompactLayout).
  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kBlockElems;
    if (DecodeUsesCompactLayout(a.cols)) {
      for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken<true>(RowBlocks(a, r), n_blocks, a.x);
    } else {
      for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken<false>(RowBlocks(a, r), n_blocks, a.x);
    }
  }
#elif KVS_ISA_AVX2
  // One step = 1 block = 32 weights per row; 8 int32 lanes.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    __m256i w[R];
    __m256 w_scale[R];
    for (int r = 0; r < R; ++r) {
      const Block& block = RowBlocks(a, r)[b];
      if (a.w_prefetch)
        _mm_prefetch(reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + b * sizeof(Block)), _MM_HINT_T1);
      w[r] = B::Load(block);
      if constexpr (WeightsWithOwnScale<B>) {
        w_scale[r] = _mm256_set1_ps(B::Scale(block));
      } else {
        w_scale[r] = _mm256_set1_ps(_cvtsh_ss(block.d));
      }
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* step = a.x + t * a.x_token_bytes + b * kStepBytes;
      const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(step));
      const __m256i init = _mm256_load_si256(reinterpret_cast<const __m256i*>(step + kStepInitOffset));
      const __m256 x_scale = _mm256_load_ps(reinterpret_cast<const float*>(step + kStepScaleOffset));
      for (int r = 0; r < R; ++r) {
        const __m256i dot = B::Dot(w[r], xq, init);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w_scale[r], x_scale), acc[r][t]);
      }
    }
  }

  // The mins of blocks[0..7] as f32 (kTail: 0 from `count` on), by word inserts: a gather is
  // slower on many AVX2 CPUs (most of all with Intel's gather-data-sampling fix), and stores to
  // an array read back as a vector would stall on store forwarding.
  template <bool kTail = false>
  static __m256 Mins(const Block* blocks, int64_t count = kLanes) {
    __m128i words = _mm_setzero_si128();
    if constexpr (kTail) {
      // Inserts at variable lanes: a shift per block, rare (the row's last few blocks).
      for (int64_t k = count - 1; k >= 0; --k) words = _mm_insert_epi16(_mm_slli_si128(words, 2), blocks[k].m, 0);
    } else {
      words = _mm_setr_epi16(static_cast<short>(blocks[0].m), static_cast<short>(blocks[1].m),
                             static_cast<short>(blocks[2].m), static_cast<short>(blocks[3].m),
                             static_cast<short>(blocks[4].m), static_cast<short>(blocks[5].m),
                             static_cast<short>(blocks[6].m), static_cast<short>(blocks[7].m));
    }
    return _mm256_cvtph_ps(words);
  }
  static __m256 LoadSums(const float* sums) { return _mm256_load_ps(sums); }
  static __m256 MulAdd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
#else
  // One step = 1 block; exact integer block dots.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    for (int t = 0; t < T; ++t) {
      const uint8_t* step = a.x + t * a.x_token_bytes + b * kStepBytes;
      const int8_t* xq = reinterpret_cast<const int8_t*>(step);
      const float x_scale = reinterpret_cast<const float*>(step + kStepScaleOffset)[0];
      for (int r = 0; r < R; ++r) {
        const Block& block = RowBlocks(a, r)[b];
        acc[r][t] += static_cast<float>(B::Dot(block, xq)) * (ScaleOf(block) * x_scale);
      }
    }
  }
#endif

  // acc[r][t] += sum over the row's blocks b of m_rb * s_tb (the min terms, see above), after the
  // block steps, which thus keep their registers.
  template <int R, int T>
  static void AddMinTerms(const TileArgs& a, AccF (&acc)[R][T]) {
    const int64_t n_blocks = a.cols / kBlockElems;
    const float* sums[T];
    for (int t = 0; t < T; ++t) {
      sums[t] = reinterpret_cast<const float*>(a.x + t * a.x_token_bytes + PackedBlockSumsOffset(a.cols));
    }
#if KVS_ISA_SCALAR
    for (int64_t b = 0; b < n_blocks; ++b) {
      for (int r = 0; r < R; ++r) {
        const float m = F16ToF32(RowBlocks(a, r)[b].m);
        for (int t = 0; t < T; ++t) acc[r][t] += m * sums[t][b];
      }
    }
#else
    // A row at a time: its mins take few registers beside the sums. The tail has a step of its
    // own, which keeps the loop free of branches (and GCC's stores of acc out of it).
    auto add_group = [&]<bool kTail>(int64_t b) {
      AccF s[T];
      for (int t = 0; t < T; ++t) s[t] = LoadSums(sums[t] + b);
      for (int r = 0; r < R; ++r) {
        const AccF mins = Mins<kTail>(RowBlocks(a, r) + b, n_blocks - b);
        for (int t = 0; t < T; ++t) acc[r][t] = MulAdd(mins, s[t], acc[r][t]);
      }
    };
    int64_t b = 0;
    for (; b + kLanes <= n_blocks; b += kLanes) add_group.template operator()<false>(b);
    if (b < n_blocks) add_group.template operator()<true>(b);
#endif
  }
};

// BlockTile (matmul_tile-inl.h) for a weight type with a min: the same block steps, then the min
// terms into the same accumulators, before they are reduced and stored.
template <class B>
struct PackedQ8MinTile : BlockTile<PackedQ8Steps<B>> {
  using Steps = PackedQ8Steps<B>;
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / Steps::kBlockElems;
    AccF acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = ZeroAcc();
    // BlockTile's block loop, odd tail included.
    if constexpr (Steps::kPairBlocks) {
      for (int64_t s = 0; s < n_blocks / 2; ++s) Steps::template Step<R, T>(a, s, 2 * s, 2 * s + 1, acc);
      if (n_blocks % 2 != 0) Steps::template Step<R, T>(a, n_blocks / 2, n_blocks - 1, n_blocks - 1, acc);
    } else {
      for (int64_t b = 0; b < n_blocks; ++b) Steps::template Step<R, T>(a, b, acc);
    }
    Steps::template AddMinTerms<R, T>(a, acc);
    StoreTile<R, T>(a, acc);
  }
};

#if KVS_ISA_AVX512
// Whether weight type B packs panels: B::PanelCodes(rows, b, quad) gives block b of 16 rows as
// 8 quad vectors of u8 codes u in PanelRow lane order (matmul_panel-inl.h), value = d * (u -
// kOffset), or d * u + m with a min.
template <class B>
concept PanelWeights = requires(const typename B::Block* const* rows, __m512i (&quad)[8]) {
  B::PanelCodes(rows, int64_t{0}, quad);
};

// The panel arithmetic (matmul_panel-inl.h) of the 32-element types: per block and group, the
// codes and the rows' d (and m with a min) as the f16 they are stored in (so a Q8_0 panel holds
// exactly the bytes of its rows, and can be kept: Kernel::packed_panels); per token and block,
// the dot's start (the packed
// steps' `init`, -kOffset * sum(x), summed over the block's lanes) and d_x, gathered once per
// call. Per row and token: sum_b d_w d_x (dot(u, x) - kOffset sum(x)) (+ m_w s_x with a min, s_x =
// d_x sum(x) from the packed block sums).
template <class B>
struct PackedQ8Panel {
  using Block = typename B::Block;
  static constexpr bool kHasMin = WeightsWithMin<B>;
  static constexpr int kBlockElems = 32;
  static constexpr int kFactors = kHasMin ? 2 : 1;  // d, then m
  static constexpr size_t kGroupBlockBytes = kPanelCodeBytes + kFactors * kPanelGroupRows * sizeof(f16_bits);
  // A block of the panel: codes of all groups, then d [group][16] f16, then m [group][16] f16.
  static constexpr size_t kBlockBytes = kPanelGroups * kGroupBlockBytes;
  static constexpr size_t kScalesOffset = kPanelGroups * kPanelCodeBytes;
  static constexpr size_t kMinsOffset = kScalesOffset + kPanelGroups * kPanelGroupRows * sizeof(f16_bits);
  static_assert(kBlockBytes % 64 == 0, "blocks keep the codes 64-byte aligned");
  // The f16 factors of `group` at offset as f32 lanes.
  static __m512 LoadFactors(const uint8_t* block, size_t offset, int group) {
    return _mm512_cvtph_ps(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(block + offset + group * kPanelGroupRows * 2)));
  }
  // Where elements 0 and 16 of a step's block j sit in its codes.
  static constexpr int kLo[2] = {PositionInStep(B::kOrder, 0, 0), PositionInStep(B::kOrder, 1, 0)};
  static constexpr int kHi = PositionInStep(B::kOrder, 0, 16) - PositionInStep(B::kOrder, 0, 0);
  static_assert(kStepBlocks == 2 && PositionInStep(B::kOrder, 1, 16) - PositionInStep(B::kOrder, 1, 0) == kHi);

  struct TokenBlocks {
    std::vector<int32_t> init;  // [n_tokens, n_blocks]
    std::vector<float> scale;   // [n_tokens, n_blocks]
  };
  static TokenBlocks& Tokens() {
    static thread_local TokenBlocks tokens;
    return tokens;
  }

  static void PrepareTokens(const TileArgs& a, int64_t n_blocks) {
    TokenBlocks& tb = Tokens();
    tb.init.resize(static_cast<size_t>(a.n_tokens) * n_blocks);
    tb.scale.resize(tb.init.size());
    for (int t = 0; t < a.n_tokens; ++t) {
      const uint8_t* token = a.x + t * a.x_token_bytes;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* step = token + (b / kStepBlocks) * kStepBytes;
        const int j = static_cast<int>(b % kStepBlocks);
        const int32_t* init = reinterpret_cast<const int32_t*>(step + kStepInitOffset);
        int32_t sum = 0;
        float scale = 0.f;
        for (int lane = 0; lane < kLanes; ++lane) {
          if (BlockOfLane(B::kOrder, lane) != j) continue;
          sum += init[lane];
          scale = reinterpret_cast<const float*>(step + kStepScaleOffset)[lane];
        }
        tb.init[t * n_blocks + b] = sum;
        tb.scale[t * n_blocks + b] = scale;
      }
    }
  }

  // Lanes of rows past n_valid repeat the first row with d = m = 0.
  static void PackGroup(const TileArgs& a, int row, int n_valid, int group, int64_t n_blocks, uint8_t* panel) {
    const Block* src[kPanelGroupRows];
    for (int j = 0; j < kPanelGroupRows; ++j) src[j] = WeightBlocks<Block>(a, row + (j < n_valid ? j : 0));
    const __mmask16 valid_lanes = PanelValidLanes(n_valid);
    for (int64_t b = 0; b < n_blocks; ++b) {
      uint8_t* block = panel + b * kBlockBytes;
      __m512i quad[8];
      B::PanelCodes(src, b, quad);
      for (int c = 0; c < 8; ++c) _mm512_store_si512(block + group * kPanelCodeBytes + 64 * c, quad[c]);
      // The rows' f16 field (d or m) of block b in lane order at `offset`, 0 on padding lanes.
      auto store_factor = [&](size_t offset, auto field) {
        f16_bits* h = reinterpret_cast<f16_bits*>(block + offset) + group * kPanelGroupRows;
        for (int k = 0; k < kPanelGroupRows; ++k) {
          h[k] = (valid_lanes >> k) & 1 ? src[PanelRow(k)][b].*field : f16_bits{0};
        }
      };
      store_factor(kScalesOffset, &Block::d);
      if constexpr (kHasMin) store_factor(kMinsOffset, &Block::m);
      // The rows' next blocks, ahead of this walk (16 row streams are more than the hardware
      // prefetcher follows).
      if (b + 8 < n_blocks) {
        for (int j = 0; j < n_valid; ++j) _mm_prefetch(reinterpret_cast<const char*>(&src[j][b + 8]), _MM_HINT_T0);
      }
    }
  }

  template <int G, int T>
  static void Sums(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, PanelPrefetch& prefetch,
                   __m512 (&acc)[G][T]) {
    const TokenBlocks& tb = Tokens();
    const uint8_t* x[T];
    const int32_t* init[T];
    const float* x_scale[T];
    const float* x_sums[T];  // with a min: d_x * sum(x) per block
    for (int t = 0; t < T; ++t) {
      x[t] = a.x + (t0 + t) * a.x_token_bytes;
      init[t] = tb.init.data() + (t0 + t) * n_blocks;
      x_scale[t] = tb.scale.data() + (t0 + t) * n_blocks;
      x_sums[t] = reinterpret_cast<const float*>(x[t] + PackedBlockSumsOffset(a.cols));
      for (int g = 0; g < G; ++g) acc[g][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
      prefetch.Step();
      const uint8_t* block = panel + b * kBlockBytes;
      const int8_t* xb[T];
      __m512i dot[G][T];
      for (int t = 0; t < T; ++t) {
        xb[t] = reinterpret_cast<const int8_t*>(x[t] + (b / kStepBlocks) * kStepBytes + kLo[b % kStepBlocks]);
        const __m512i start = _mm512_set1_epi32(init[t][b]);
        for (int g = 0; g < G; ++g) dot[g][t] = start;
      }
      PanelBlockDots<G, T>(block, kPanelCodeBytes, xb, dot, kHi);
      for (int g = 0; g < G; ++g) {
        const __m512 ws = LoadFactors(block, kScalesOffset, g);
        for (int t = 0; t < T; ++t) {
          acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][t]), _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[t][b])),
                                      acc[g][t]);
        }
      }
      if constexpr (kHasMin) {
        for (int g = 0; g < G; ++g) {
          const __m512 wm = LoadFactors(block, kMinsOffset, g);
          for (int t = 0; t < T; ++t) acc[g][t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(x_sums[t][b]), acc[g][t]);
        }
      }
    }
  }

};

// Block b's nibbles of 16 rows (Q4_0, Q4_1, IQ4_NL: element e < 16 the low nibble of qs[e], e >=
// 16 the high nibble of qs[e - 16]) as 8 quads of nibble values, PanelRow lane order.
template <class Block>
inline void PanelNibbles(const Block* const* rows, int64_t b, __m512i (&quad)[8]) {
  const uint8_t* chunk[kPanelGroupRows];
  for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = rows[j][b].qs;
  __m512i q[4];
  TransposeRowChunks(chunk, q);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    quad[c] = _mm512_and_si512(q[c], low_nibbles);
    quad[4 + c] = _mm512_and_si512(_mm512_srli_epi16(q[c], 4), low_nibbles);
  }
}

// Q5_0 / Q5_1: the nibbles plus 16 where bit e of the row's little-endian qh is set (element e),
// the bits spread to bytes per row and transposed like the nibbles' bytes.
template <class Block>
inline void PanelQ5Codes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) {
  PanelNibbles(rows, b, quad);
  alignas(64) uint8_t sixteens[kPanelGroupRows][32];  // [row][element]: 16 where the fifth bit is set
  for (int j = 0; j < kPanelGroupRows; ++j) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sixteens[j]),
                       _mm256_maskz_mov_epi8(_cvtu32_mask32(FifthBitWord(rows[j][b].qh)), _mm256_set1_epi8(16)));
  }
  for (int half = 0; half < 2; ++half) {
    const uint8_t* chunk[kPanelGroupRows];
    for (int j = 0; j < kPanelGroupRows; ++j) chunk[j] = sixteens[j] + 16 * half;
    __m512i fifth[4];
    TransposeRowChunks(chunk, fifth);
    for (int c = 0; c < 4; ++c) quad[4 * half + c] = _mm512_or_si512(quad[4 * half + c], fifth[c]);
  }
}
#endif

// The Kernel of weight type B against packed Q8 activations.
template <class B>
struct PackedQ8Kernel {
  using Steps = PackedQ8Steps<B>;
  static constexpr bool kBlockSums = Steps::kHasMin;

  static size_t PackedBytes(int64_t cols) { return PackedQ8TokenBytes(cols, kBlockSums); }
  static void Pack(const float* x, int64_t cols, uint8_t* dst) {
    PackQ8Token(x, cols, dst, B::kOffset, B::kOrder, kBlockSums);
  }
  static size_t DecodeBytes(int64_t cols) { return DecodeQ8TokenBytes(cols, kBlockSums); }
  static void PackDecode(const float* x, int64_t cols, uint8_t* dst) {
    PackQ8DecodeToken(x, cols, dst, B::kOffset, B::kOrder, kBlockSums);
  }
  static constexpr Kernel Make() {
    Kernel kernel{&PackedBytes, &Pack, nullptr};
    if constexpr (kBlockSums) {
      kernel.tile = &DispatchTile<PackedQ8MinTile<B>>;
    } else {
      kernel.tile = &DispatchTile<BlockTile<Steps>>;
    }
    if constexpr (requires(const TileArgs& a) { Steps::RunStripOneToken(a); }) {
      // The single-token strip reads the decode layout.
      kernel.decode_token_bytes = &DecodeBytes;
      kernel.pack_decode_token = &PackDecode;
    }
#if KVS_ISA_AVX512
    if constexpr (PanelWeights<B>) kernel.panel = &RunPanels<PackedQ8Panel<B>>;
    // Kept only where a panel is no larger than the rows (a byte per code: Q8_0); the others'
    // codes widen from 4-6 bits to a byte.
    if constexpr (PanelWeights<B> &&
                  PackedQ8Panel<B>::kGroupBlockBytes == kPanelGroupRows * sizeof(typename B::Block)) {
      KeepPanels<PackedQ8Panel<B>>(kernel);
    }
#endif
    return kernel;
  }
};

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_MATMUL_PACKED_Q8_INL_H_ toggle
