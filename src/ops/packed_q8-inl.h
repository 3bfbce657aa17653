// The packed Q8 activation layout of one kernel family (see packed_q8.h): include it inside a
// family region (see simd_family.h), after packed_q8.h. The packers live in packed_q8.cc.
#if defined(KVS_OPS_PACKED_Q8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_PACKED_Q8_INL_H_
#undef KVS_OPS_PACKED_Q8_INL_H_
#else
#define KVS_OPS_PACKED_Q8_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

// int32 lanes per integer vector (and f32 lanes per float vector); the scalar family keeps the
// 8-lane (one block per step) layout.
inline constexpr int kLanes = KVS_ISA_AVX512 ? 16 : 8;
inline constexpr int kStepElems = 4 * kLanes;
inline constexpr int kStepBlocks = kStepElems / 32;
inline constexpr size_t kStepBytes = kStepElems + 2 * sizeof(int32_t) * kLanes;
// Byte offsets of a step's init[] and scale[] arrays.
inline constexpr size_t kStepInitOffset = kStepElems;
inline constexpr size_t kStepScaleOffset = kStepElems + sizeof(int32_t) * kLanes;

inline int64_t PackedSteps(int64_t cols) { return (cols + kStepElems - 1) / kStepElems; }
inline size_t PackedStepsBytes(int64_t cols) { return static_cast<size_t>(PackedSteps(cols)) * kStepBytes; }

// Position in the step's q array of element e (0..31) of the step's block j.
constexpr int PositionInStep(Q8Order order, int j, int e) {
  if (order == Q8Order::kQ4NibbleHalves && kStepBlocks == 2) return (e < 16 ? 0 : 32) + j * 16 + (e & 15);
  return j * 32 + e;
}
// The step's block that int32 lane `lane` (its 4 positions) belongs to.
constexpr int BlockOfLane(Q8Order order, int lane) {
  for (int j = 0; j < kStepBlocks; ++j) {
    for (int half = 0; half < 32; half += 16) {
      const int start = PositionInStep(order, j, half);
      if (start <= 4 * lane && 4 * lane < start + 16) return j;
    }
  }
  return 0;
}

// Compact single-token layout for decode (1.125 bytes per element instead of 3): decode streams
// every weight row past the same activations, which must stay in L1 next to the weight stream
// even for long rows (the 3-byte layout of a 5632-wide row alone is half of a 32 KiB L1).
//   int8_t q[PackedSteps(cols) * kStepElems];   // same element order and zero padding as above
//   float  d[PackedSteps(cols) * kStepBlocks];  // per-block scale (0 for padding blocks)
inline size_t CompactStepsBytes(int64_t cols) {
  return static_cast<size_t>(PackedSteps(cols)) * (kStepElems + kStepBlocks * sizeof(float));
}
inline const float* CompactQ8Scales(const uint8_t* packed, int64_t cols) {
  return reinterpret_cast<const float*>(packed + PackedSteps(cols) * kStepElems);
}

// With `block_sums` (weight types with a min), a token in either layout ends in
//   float block_sum[BlockSumCount(cols)];  // d * sum(q) per Q8_0 block, zero padded, 64-byte aligned
// a whole number of vectors, so the min terms run over kLanes blocks at a time.
inline int64_t BlockSumCount(int64_t cols) { return (cols / 32 + kLanes - 1) / kLanes * kLanes; }
inline size_t RoundUp64(size_t bytes) { return (bytes + 63) / 64 * 64; }
inline size_t WithBlockSums(size_t steps_bytes, int64_t cols, bool block_sums) {
  return block_sums ? RoundUp64(steps_bytes) + static_cast<size_t>(BlockSumCount(cols)) * sizeof(float) : steps_bytes;
}
inline size_t PackedQ8TokenBytes(int64_t cols, bool block_sums) {
  return WithBlockSums(PackedStepsBytes(cols), cols, block_sums);
}
inline size_t CompactQ8TokenBytes(int64_t cols, bool block_sums) {
  return WithBlockSums(CompactStepsBytes(cols), cols, block_sums);
}
inline size_t PackedBlockSumsOffset(int64_t cols) { return RoundUp64(PackedStepsBytes(cols)); }
inline size_t CompactBlockSumsOffset(int64_t cols) { return RoundUp64(CompactStepsBytes(cols)); }

// Packs one token: x [cols] -> dst (PackedQ8TokenBytes(cols, block_sums) bytes, 64-byte aligned).
// `offset` is the unsigned bias the weight kernel adds to its weight bytes (0 if none).
void PackQ8Token(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order, bool block_sums);
// The compact layout (CompactQ8TokenBytes(cols, block_sums) bytes).
void PackQ8TokenCompact(const float* x, int64_t cols, uint8_t* dst, Q8Order order, bool block_sums);

inline bool DecodeUsesCompactLayout(int64_t cols) { return PackedStepsBytes(cols) > kDecodeFullLayoutMaxBytes; }
inline size_t DecodeQ8TokenBytes(int64_t cols, bool block_sums) {
  return DecodeUsesCompactLayout(cols) ? CompactQ8TokenBytes(cols, block_sums) : PackedQ8TokenBytes(cols, block_sums);
}
inline void PackQ8DecodeToken(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order,
                              bool block_sums) {
  if (DecodeUsesCompactLayout(cols)) {
    PackQ8TokenCompact(x, cols, dst, order, block_sums);
  } else {
    PackQ8Token(x, cols, dst, offset, order, block_sums);
  }
}

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_PACKED_Q8_INL_H_ toggle
