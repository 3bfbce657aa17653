// The tile driver shared by every weight type's kernel, compiled once per kernel family: include it
// inside a family region (see simd_family.h), after matmul_kernels.h.
//  - DispatchTile<K> maps a runtime tile shape (n_rows x n_tokens, each 1..4) onto
//    `K::template Run<R, T>(args)`, so tile loops are fully unrolled with accumulators in registers;
//    for TileArgs::row_strip it runs K::RunStripOneToken (if K has one) or Run<1, T> row by row.
//  - BlockTile<K> is the Run<R, T> of the block-quantized weight types: it zeroes the R x T
//    accumulators, feeds the tile's weight blocks to K's step and stores the sums. A weight type
//    only supplies the arithmetic of one step.
// No include guard of the usual kind: Highway's per-target toggle re-enters it once per family.
#if defined(KVS_OPS_MATMUL_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_MATMUL_TILE_INL_H_
#undef KVS_OPS_MATMUL_TILE_INL_H_
#else
#define KVS_OPS_MATMUL_TILE_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

// This family's kernel per weight type (matmul_<type>.cc).
const Kernel& KernelQ8_0();
const Kernel& KernelQ4_0();
const Kernel& KernelQ4_K();
const Kernel& KernelQ4_1();
const Kernel& KernelQ5_0();
const Kernel& KernelQ5_1();
const Kernel& KernelQ2_K();
const Kernel& KernelQ3_K();
const Kernel& KernelQ5_K();
const Kernel& KernelQ6_K();
const Kernel& KernelIQ4_NL();
const Kernel& KernelMXFP4();
const Kernel& KernelIQ4_XS();
const Kernel& KernelF32();
const Kernel& KernelF16();
const Kernel& KernelBF16();

// One f32 accumulator of the family: a vector register (summed at the end), or a float.
#if KVS_ISA_AVX512
using AccF = __m512;
inline AccF ZeroAcc() { return _mm512_setzero_ps(); }
inline float ReduceAdd(__m512 v) { return _mm512_reduce_add_ps(v); }
inline void AddScalar(AccF& acc, float v) { acc = _mm512_add_ps(acc, _mm512_zextps128_ps512(_mm_set_ss(v))); }
#elif KVS_ISA_AVX2
using AccF = __m256;
inline AccF ZeroAcc() { return _mm256_setzero_ps(); }
inline void AddScalar(AccF& acc, float v) { acc = _mm256_add_ps(acc, _mm256_zextps128_ps256(_mm_set_ss(v))); }
inline float ReduceAdd(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#else
using AccF = float;
inline AccF ZeroAcc() { return 0.f; }
inline float ReduceAdd(float v) { return v; }
inline void AddScalar(AccF& acc, float v) { acc += v; }
#endif

// Row r of the tile as weight blocks, and token t's packed activations as Q8_K blocks.
template <class Block>
inline const Block* WeightBlocks(const TileArgs& a, int r) {
  return reinterpret_cast<const Block*>(a.w + r * a.w_row_bytes);
}
inline const BlockQ8_K* Q8KTokenBlocks(const TileArgs& a, int t) {
  return reinterpret_cast<const BlockQ8_K*>(a.x + t * a.x_token_bytes);
}

#if KVS_ISA_AVX512 || KVS_ISA_AVX2
// Pulls block b of the next row tile's row r into L2 while this tile computes: 4 interleaved row
// streams defeat the hardware prefetcher (see MatMul). Every cache line the block touches.
template <class Block>
inline void PrefetchWeightBlock(const TileArgs& a, int r, int64_t b) {
  if (!a.w_prefetch) return;
  const char* pf = reinterpret_cast<const char*>(a.w_prefetch + r * a.w_row_bytes + b * sizeof(Block));
  for (size_t off = 0; off < sizeof(Block); off += 64) _mm_prefetch(pf + off, _MM_HINT_T1);
  _mm_prefetch(pf + sizeof(Block) - 1, _MM_HINT_T1);
}
#endif

// y[t * y_stride + r] = (or +=, for later K chunks) the sum of acc[r][t]. One branch per tile:
// the plain stores of a row's sums then merge into one vector store.
template <int R, int T>
inline void StoreTile(const TileArgs& a, const AccF (&acc)[R][T]) {
  if (a.accumulate) {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) a.y[t * a.y_stride + r] += ReduceAdd(acc[r][t]);
    return;
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) a.y[t * a.y_stride + r] = ReduceAdd(acc[r][t]);
}

// K supplies:
//   kBlockElems                        elements per weight block
//   kPairBlocks                        whether one step consumes two blocks
//   Step<R, T>(a, s, b0, b1, acc)      step s = blocks b0, b1 (kPairBlocks), or
//   Step<R, T>(a, b, acc)              block b
// and optionally RunStripOneToken(a) (the decode loop), which DispatchTile picks up.
template <class K>
struct BlockTile : K {
  template <int R, int T>
  static void Run(const TileArgs& a) {
    const int64_t n_blocks = a.cols / K::kBlockElems;
    AccF acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = ZeroAcc();
    if constexpr (K::kPairBlocks) {
      // Block indices computed straight from s keep the load addresses off any dependency chain,
      // which matters for how far ahead the core can stream weights.
      for (int64_t s = 0; s < n_blocks / 2; ++s) K::template Step<R, T>(a, s, 2 * s, 2 * s + 1, acc);
      if (n_blocks % 2 != 0) {
        // Odd tail: the last block doubles as its own partner; the padded activations (scale 0)
        // cancel the duplicate.
        K::template Step<R, T>(a, n_blocks / 2, n_blocks - 1, n_blocks - 1, acc);
      }
    } else {
      for (int64_t b = 0; b < n_blocks; ++b) K::template Step<R, T>(a, b, acc);
    }
    StoreTile<R, T>(a, acc);
  }
};

template <class K, int R>
void DispatchTokens(const TileArgs& a) {
  switch (a.n_tokens) {
    case 1: return K::template Run<R, 1>(a);
    case 2: return K::template Run<R, 2>(a);
    case 3: return K::template Run<R, 3>(a);
    case 4: return K::template Run<R, 4>(a);
  }
  KVS_CHECK_MSG(false, "tile token count out of range");
}

// A strip of any number of rows, computed one row at a time (each row fully, left to right), so
// the weights are read as one sequential stream -- the decode (few tokens) path.
template <class K, int T>
void RunStrip(const TileArgs& a) {
  TileArgs row = a;
  row.n_rows = 1;
  row.w_prefetch = nullptr;
  for (int r = 0; r < a.n_rows; ++r) {
    row.w = a.w + r * a.w_row_bytes;
    row.y = a.y + r;
    K::template Run<1, T>(row);
  }
}

template <class K>
void DispatchTile(const TileArgs& a) {
  static_assert(kMaxTileRows == 4 && kMaxTileTokens == 4);
  if (a.row_strip) {
    // Kernels may provide a dedicated single-token strip (the decode hot loop).
    if constexpr (requires { K::RunStripOneToken(a); }) {
      if (a.n_tokens == 1) return K::RunStripOneToken(a);
    }
    switch (a.n_tokens) {
      case 1: return RunStrip<K, 1>(a);
      case 2: return RunStrip<K, 2>(a);
      case 3: return RunStrip<K, 3>(a);
      case 4: return RunStrip<K, 4>(a);
    }
    KVS_CHECK_MSG(false, "strip token count out of range");
  }
  switch (a.n_rows) {
    case 1: return DispatchTokens<K, 1>(a);
    case 2: return DispatchTokens<K, 2>(a);
    case 3: return DispatchTokens<K, 3>(a);
    case 4: return DispatchTokens<K, 4>(a);
  }
  KVS_CHECK_MSG(false, "tile row count out of range");
}

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_MATMUL_TILE_INL_H_ toggle
