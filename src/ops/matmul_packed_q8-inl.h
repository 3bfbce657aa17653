// Tile steps of the weight types multiplied against packed Q8_0 activations (packed_q8.h): Q8_0
// and Q4_0, compiled once per kernel family. Include it inside a family region (see
// simd_family.h), after matmul_tile-inl.h and packed_q8-inl.h.
//
// A weight type supplies its block arithmetic as `B` (matmul_q8_0.cc, matmul_q4_0.cc):
//   using Block;                    // the GGUF weight block (32 elements, f16 scale d)
//   kOffset, kOrder                 // the packed activations' weight bias and element order
//   avx512: Load(b0, b1)            // a step's 64 weights as (w + kOffset) u8, in kOrder
//           DotCompact(b0, b1, xq)  // int32 lane dots of the signed weights with compact-layout xq
//   avx2:   Load(b)                 // a block's 32 weights as Dot takes them
//           Dot(w, xq, init)        // int32 lane dots, starting from the packed `init`
//   scalar: Dot(b, xq)              // the block's exact integer dot with xq[32]
// and PackedQ8Kernel<B>::Make() builds its Kernel: the step loop, decode strips, reductions and packing
// are shared.
#if defined(KVS_OPS_MATMUL_PACKED_Q8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#undef KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#else
#define KVS_OPS_MATMUL_PACKED_Q8_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

#if KVS_ISA_AVX512
// The 32-bit lanes of an f16 scale pair [d0 x 16 | d1 x 16] that take d1 (each holds the f16s of
// two f32 lanes), as a _mm256_blend_epi32 mask.
constexpr int ScaleBlendOf(Q8Order order) {
  int mask = 0;
  for (int i = 0; i < 8; ++i) mask |= BlockOfLane(order, 2 * i) << i;
  return mask;
}
#endif

template <class B>
struct PackedQ8Steps {
  using Block = typename B::Block;
  static constexpr int kBlockElems = 32;
  static constexpr bool kPairBlocks = kStepBlocks == 2;

  static const Block* RowBlocks(const TileArgs& a, int r) {
    return reinterpret_cast<const Block*>(a.w + r * a.w_row_bytes);
  }

#if KVS_ISA_AVX512
  // One step = 2 blocks = 64 weights per row; int32 lane i belongs to block BlockOfLane(i).
  static constexpr int kScaleBlend = ScaleBlendOf(B::kOrder);
  // The f32 scale of each int32 lane: [d0 | d1] per BlockOfLane, as f16 from two broadcasts and a
  // blend, then one widening convert.
  static __m512 Scales(const Block& b0, const Block& b1) {
    return _mm512_cvtph_ps(_mm256_blend_epi32(_mm256_set1_epi16(static_cast<short>(b0.d)),
                                              _mm256_set1_epi16(static_cast<short>(b1.d)), kScaleBlend));
  }
  // Lane i of the compact layout's scale pair [d0, d1] for int32 lane i.
  static __m512i CompactSpread() {
    constexpr auto j = [](int lane) { return BlockOfLane(B::kOrder, lane); };
    return _mm512_setr_epi32(j(0), j(1), j(2), j(3), j(4), j(5), j(6), j(7), j(8), j(9), j(10), j(11), j(12), j(13),
                             j(14), j(15));
  }

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
  template <bool kCompact>
  __attribute__((noinline)) static float DotRowOneToken(const Block* blocks, int64_t n_blocks, const uint8_t* x) {
    const __m512i spread = CompactSpread();
    const int64_t n_steps = PackedSteps(n_blocks * kBlockElems);
    const float* compact_scales = CompactQ8Scales(x, n_blocks * kBlockElems);
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
      w_scale[r] = _mm256_set1_ps(_cvtsh_ss(block.d));
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
        acc[r][t] += static_cast<float>(B::Dot(block, xq)) * (F16ToF32(block.d) * x_scale);
      }
    }
  }
#endif
};

// The Kernel of weight type B against packed Q8 activations.
template <class B>
struct PackedQ8Kernel {
  static size_t PackedBytes(int64_t cols) { return PackedQ8TokenBytes(cols); }
  static void Pack(const float* x, int64_t cols, uint8_t* dst) { PackQ8Token(x, cols, dst, B::kOffset, B::kOrder); }
  static void PackDecode(const float* x, int64_t cols, uint8_t* dst) {
    PackQ8DecodeToken(x, cols, dst, B::kOffset, B::kOrder);
  }
  static constexpr Kernel Make() {
    Kernel kernel{&PackedBytes, &Pack, &DispatchTile<BlockTile<PackedQ8Steps<B>>>};
    if constexpr (requires(const TileArgs& a) { PackedQ8Steps<B>::RunStripOneToken(a); }) {
      // The single-token strip reads the decode layout.
      kernel.decode_token_bytes = &DecodeQ8TokenBytes;
      kernel.pack_decode_token = &PackDecode;
    }
    return kernel;
  }
};

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_MATMUL_PACKED_Q8_INL_H_ toggle
