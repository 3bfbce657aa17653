// Tile steps of the super-block weight types against Q8_K activations (Q2_K, Q3_K, Q5_K, Q6_K,
// IQ4_XS), compiled once per kernel family. Include it inside a family region (see
// simd_family.h), after matmul_tile-inl.h and quantize-inl.h; kquant_blocks.h must be included
// before the region.
//
// Per super-block, with the weight read as integers (KBlockInts: value = d sc_g q - dmin m_g):
//   dot = d_x * (d * sum_g sc_g * sum_{i in g} q_i x_i - dmin * sum_g m_g * bsum_g)
// where the integer sums are exact and bsum_g (sum of the group's 16 activation codes) comes with
// the Q8_K block -- ggml's vec_dot_qN_K_q8_K arithmetic. KQuantScalarSteps<B> is the scalar
// family's step, the exact twin the SIMD families' steps are checked against through the tests.
// KQuantAvx512Steps<U> / KQuantAvx2Steps<U> are those steps, shared by the types that present
// their blocks as unsigned codes (see KScales); each type supplies U in its matmul_<type>.cc.
#if defined(KVS_OPS_MATMUL_KQUANT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_MATMUL_KQUANT_INL_H_
#undef KVS_OPS_MATMUL_KQUANT_INL_H_
#else
#define KVS_OPS_MATMUL_KQUANT_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

// B supplies `using Block` and `static void Unpack(const Block&, quant::KBlockInts*)`.
template <class B>
struct KQuantScalarSteps {
  using Block = typename B::Block;
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;


  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    for (int r = 0; r < R; ++r) {
      quant::KBlockInts w;
      B::Unpack(WeightBlocks<Block>(a, r)[b], &w);
      for (int t = 0; t < T; ++t) {
        const BlockQ8_K& xb = Q8KTokenBlocks(a, t)[b];
        int32_t scaled = 0, mins = 0;
        for (int g = 0; g < kQK_K / 16; ++g) {
          int32_t dot = 0;
          for (int e = 0; e < 16; ++e) dot += w.q[16 * g + e] * xb.qs[16 * g + e];
          scaled += w.scale[g] * dot;
          mins += w.min[g] * xb.bsums[g];
        }
        const float sum = w.d * static_cast<float>(scaled) - w.dmin * static_cast<float>(mins);
        AddScalar(acc[r][t], xb.d * sum);
      }
    }
  }
};

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
// The SIMD families read a super-block as unsigned codes u (0..63) with per-group int16 scales:
//   value_i = d * sc_g * u_i - dmin * m_g
// so that maddubs (u8 x s8 pair sums) cannot saturate: |u| * 128 * 2 < 32768. Types with signed
// codes q = u - off (Q6_K: off 32, Q3_K: off 4) and no min of their own use m_g = off * sc_g and
// dmin = d: sum_i sc_g (u_i - off) x_i = sum_i sc_g u_i x_i - off * sc_g * bsum_g, all exact int32.
struct KScales {
  __m256i scales16;  // [16] int16 sc_g
  __m256i mins16;    // [16] int16 m_g
  float d;
  float dmin;
};

// AddBlockDot: acc += x_d * (d * isum - dmin * sum_g m_g bsum_g), where isum = sum_g sc_g
// sum_{i in g} u_i x_i spread over the lanes. kMinsAreCodeOffset (dmin == d): the subtraction is
// done exactly in int32 first.
#if KVS_ISA_AVX512
template <bool kMinsAreCodeOffset>
inline __m512 AddBlockDot(__m512 acc, __m512i isum, const KScales& s, const BlockQ8_K& xb) {
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
  const __m256i min_sum = _mm256_madd_epi16(bsums, s.mins16);  // [8] int32
  if constexpr (kMinsAreCodeOffset) {
    isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(min_sum));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(s.d * xb.d), acc);
  } else {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(s.d * xb.d), acc);
    return _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(min_sum)), _mm512_set1_ps(-s.dmin * xb.d), acc);
  }
}

// Moves bits left by kBits (right for negative kBits) within each 16-bit lane. Callers mask the
// result to bits that came from the same byte, so this acts as a per-byte shift.
template <int kBits>
inline __m512i ShiftBits16(__m512i v) {
  if constexpr (kBits > 0) return _mm512_slli_epi16(v, kBits);
  else if constexpr (kBits < 0) return _mm512_srli_epi16(v, -kBits);
  else return v;
}

// A 64-element chunk c (elements 64c..64c+63) spans groups 4c..4c+3, one per 128-bit lane: int16
// lane m of its scale vector holds sc_{4c + m/8}. scales16 sits in the low 256 bits.
inline __m512i ChunkScales(__m512i scales16, int c) {
  constexpr long long kOnes = 0x0001000100010001LL;
  const long long g = 4LL * c;
  const __m512i pick = _mm512_set_epi64((g + 3) * kOnes, (g + 3) * kOnes, (g + 2) * kOnes, (g + 2) * kOnes,
                                        (g + 1) * kOnes, (g + 1) * kOnes, g * kOnes, g * kOnes);
  return _mm512_permutexvar_epi16(pick, scales16);
}

// Steps of a super-block type U for the avx512 family. U supplies
//   using Block; static constexpr bool kMinsAreCodeOffset;
//   static KScales Scales(const Block&);
//   template <int H> static void Codes(const Block&, __m512i* codes);  // codes[2]: chunks 2H, 2H+1
// Per chunk: maddubs gives int16 pair sums, vpdpwssd scales them by sc_g and accumulates int32.
template <class U>
struct KQuantAvx512Steps {
  using Block = typename U::Block;
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;
  static constexpr int kChunks = kQK_K / 64;


  // One weight row against one token: the decode hot loop, lean and out of line.
  __attribute__((noinline)) static float DotRowOneToken(const Block* blocks, int64_t n_blocks, const BlockQ8_K* x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      const Block& block = blocks[b];
      const BlockQ8_K& xb = x[b];
      const KScales s = U::Scales(block);
      const __m512i scales16 = _mm512_castsi256_si512(s.scales16);
      __m512i codes[kChunks];  // [4][64] uint8
      U::template Codes<0>(block, codes);
      U::template Codes<1>(block, codes + 2);
      __m512i isum = _mm512_setzero_si512();
      for (int c = 0; c < kChunks; ++c) {
        const __m512i xq = _mm512_loadu_si512(xb.qs + 64 * c);
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(codes[c], xq), ChunkScales(scales16, c));
      }
      acc = AddBlockDot<U::kMinsAreCodeOffset>(acc, isum, s, xb);
    }
    return _mm512_reduce_add_ps(acc);
  }

  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<Block>(a, r), n_blocks, x);
  }

  // Prefill: row by row, each half-block's codes and chunk scales are unpacked into registers and
  // used by all T tokens at once, so nothing unpacked goes through memory.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    for (int r = 0; r < R; ++r) {
      const Block& block = WeightBlocks<Block>(a, r)[b];
      PrefetchWeightBlock<Block>(a, r, b);
      const KScales s = U::Scales(block);
      __m512i isum[T];
      for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
      HalfStep<0, T>(a, b, block, s, isum);
      HalfStep<1, T>(a, b, block, s, isum);
      for (int t = 0; t < T; ++t)
        acc[r][t] = AddBlockDot<U::kMinsAreCodeOffset>(acc[r][t], isum[t], s, Q8KTokenBlocks(a, t)[b]);
    }
  }

  // Chunks 2H, 2H+1 of one row's block against T tokens.
  template <int H, int T>
  static inline void HalfStep(const TileArgs& a, int64_t b, const Block& block, const KScales& s, __m512i (&isum)[T]) {
    __m512i codes[2];  // [2][64] uint8
    U::template Codes<H>(block, codes);
    const __m512i scales16 = _mm512_castsi256_si512(s.scales16);
    for (int k = 0; k < 2; ++k) {
      const int c = 2 * H + k;
      const __m512i scales = ChunkScales(scales16, c);
      for (int t = 0; t < T; ++t) {
        const __m512i xq = _mm512_loadu_si512(Q8KTokenBlocks(a, t)[b].qs + 64 * c);
        isum[t] = _mm512_dpwssd_epi32(isum[t], _mm512_maddubs_epi16(codes[k], xq), scales);
      }
    }
  }
};
#else   // KVS_ISA_AVX2
template <bool kMinsAreCodeOffset>
inline __m256 AddBlockDot(__m256 acc, __m256i isum, const KScales& s, const BlockQ8_K& xb) {
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums));
  const __m256i min_sum = _mm256_madd_epi16(bsums, s.mins16);  // [8] int32
  if constexpr (kMinsAreCodeOffset) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, min_sum)), _mm256_set1_ps(s.d * xb.d), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s.d * xb.d), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sum), _mm256_set1_ps(-s.dmin * xb.d), acc);
  }
}

// Moves bits left by kBits (right for negative kBits) within each 16-bit lane (see the avx512 twin).
template <int kBits>
inline __m256i ShiftBits16(__m256i v) {
  if constexpr (kBits > 0) return _mm256_slli_epi16(v, kBits);
  else if constexpr (kBits < 0) return _mm256_srli_epi16(v, -kBits);
  else return v;
}

// A 32-element chunk c spans groups 2c (low 128 bits) and 2c+1 (high 128 bits): int16 lanes 0-7
// of its scale vector hold sc_{2c}, lanes 8-15 sc_{2c+1}. `half` holds sc_{8(c/4)..8(c/4)+7} in
// both 128-bit lanes.
inline __m256i ChunkScales(__m256i half, int c) {
  const int lo = 2 * (2 * c % 8), hi = lo + 2;  // byte offsets of sc_{2c}, sc_{2c+1} within `half`
  const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi | (hi + 1) << 8)),
                                        _mm_set1_epi16(static_cast<short>(lo | (lo + 1) << 8)));
  return _mm256_shuffle_epi8(half, pick);
}

// Steps of a super-block type U for the avx2 family. U supplies
//   using Block; static constexpr bool kMinsAreCodeOffset;
//   static KScales Scales(const Block&);
//   template <int H> static void Codes(const Block&, __m256i* codes);  // codes[4]: chunks 4H..4H+3
// Per chunk: maddubs gives int16 pair sums, madd scales them by sc_g into int32.
template <class U>
struct KQuantAvx2Steps {
  using Block = typename U::Block;
  static constexpr int kBlockElems = kQK_K;
  static constexpr bool kPairBlocks = false;
  static constexpr int kChunks = kQK_K / 32;


  // sum + v as one running register. GCC rebalances chains of integer vector adds into trees, whose
  // partial sums (products computed far ahead) spill here; the empty asm hides the sum from that.
  static inline __m256i AddInOrder(__m256i sum, __m256i v) {
    sum = _mm256_add_epi32(sum, v);
    asm("" : "+x"(sum));
    return sum;
  }

  // Chunk c's int32 sums: sc * (u . x) over its 32 elements.
  static inline __m256i ChunkDot(__m256i codes, __m256i scales, const int8_t* x) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xq), scales);
  }

  // One weight row against one token: the decode hot loop, lean and out of line. Half-blocks keep
  // the live codes within the 16 registers.
  __attribute__((noinline)) static float DotRowOneToken(const Block* blocks, int64_t n_blocks, const BlockQ8_K* x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      const Block& block = blocks[b];
      const BlockQ8_K& xb = x[b];
      const KScales s = U::Scales(block);
      const __m256i half0 = _mm256_permute2x128_si256(s.scales16, s.scales16, 0x00);
      const __m256i half1 = _mm256_permute2x128_si256(s.scales16, s.scales16, 0x11);
      __m256i codes[4];  // [4][32] uint8
      U::template Codes<0>(block, codes);
      __m256i isum = _mm256_add_epi32(ChunkDot(codes[0], ChunkScales(half0, 0), xb.qs),
                                      ChunkDot(codes[1], ChunkScales(half0, 1), xb.qs + 32));
      __m256i isum2 = _mm256_add_epi32(ChunkDot(codes[2], ChunkScales(half0, 2), xb.qs + 64),
                                       ChunkDot(codes[3], ChunkScales(half0, 3), xb.qs + 96));
      U::template Codes<1>(block, codes);
      isum = _mm256_add_epi32(isum, _mm256_add_epi32(ChunkDot(codes[0], ChunkScales(half1, 0), xb.qs + 128),
                                                     ChunkDot(codes[1], ChunkScales(half1, 1), xb.qs + 160)));
      isum2 = _mm256_add_epi32(isum2, _mm256_add_epi32(ChunkDot(codes[2], ChunkScales(half1, 2), xb.qs + 192),
                                                       ChunkDot(codes[3], ChunkScales(half1, 3), xb.qs + 224)));
      acc = AddBlockDot<U::kMinsAreCodeOffset>(acc, _mm256_add_epi32(isum, isum2), s, xb);
    }
    return ReduceAdd(acc);
  }

  static void RunStripOneToken(const TileArgs& a) {
    const int64_t n_blocks = a.cols / kQK_K;
    const BlockQ8_K* x = reinterpret_cast<const BlockQ8_K*>(a.x);
    for (int r = 0; r < a.n_rows; ++r) a.y[r] = DotRowOneToken(WeightBlocks<Block>(a, r), n_blocks, x);
  }

  // Prefill: row by row, each half-block's codes and chunk scales are unpacked into registers and
  // used by all T tokens at once, so nothing unpacked goes through memory (16 registers: 4 codes,
  // a scale, T sums). Activations are re-read from L1 per row.
  template <int R, int T>
  static inline void Step(const TileArgs& a, int64_t b, AccF (&acc)[R][T]) {
    for (int r = 0; r < R; ++r) {
      const Block& block = WeightBlocks<Block>(a, r)[b];
      PrefetchWeightBlock<Block>(a, r, b);
      const KScales s = U::Scales(block);
      __m256i isum[T];
      for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
      HalfStep<0, T>(a, b, block, s, isum);
      HalfStep<1, T>(a, b, block, s, isum);
      for (int t = 0; t < T; ++t)
        acc[r][t] = AddBlockDot<U::kMinsAreCodeOffset>(acc[r][t], isum[t], s, Q8KTokenBlocks(a, t)[b]);
    }
  }

  // Chunks 4H..4H+3 of one row's block against T tokens.
  template <int H, int T>
  static inline void HalfStep(const TileArgs& a, int64_t b, const Block& block, const KScales& s, __m256i (&isum)[T]) {
    __m256i codes[4];  // [4][32] uint8
    U::template Codes<H>(block, codes);
    const __m256i half = _mm256_permute2x128_si256(s.scales16, s.scales16, H == 0 ? 0x00 : 0x11);
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * H + k;
      const __m256i scales = ChunkScales(half, c);
      for (int t = 0; t < T; ++t) {
        isum[t] = AddInOrder(isum[t], ChunkDot(codes[k], scales, Q8KTokenBlocks(a, t)[b].qs + 32 * c));
      }
    }
  }
};
#endif
#endif  // KVS_ISA_AVX512 || KVS_ISA_AVX2

// Q8_K blocks of one token, padded to 64 bytes.
inline size_t Q8KPackedBytes(int64_t cols) {
  return (static_cast<size_t>(cols / kQK_K) * sizeof(BlockQ8_K) + 63) / 64 * 64;
}
inline void PackQ8KToken(const float* x, int64_t cols, uint8_t* dst) {
  quant::HWY_NAMESPACE::QuantizeRowQ8_K(x, reinterpret_cast<BlockQ8_K*>(dst), cols);
}

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_MATMUL_KQUANT_INL_H_ toggle
