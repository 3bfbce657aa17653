// Activations packed for Q8_0/Q4_0 weight kernels. Each token's f32 row is quantized to ggml
// Q8_0 blocks (d = amax/127, q = round(x/d)) and stored in "steps" of kStepElems elements
// (kStepElems / 32 Q8_0 blocks), laid out for direct vector loads:
//   int8_t  q[kStepElems];      // quantized values (in the weight kernel's element order)
//   int32_t init[kLanes];       // -offset * (sum of the 4 q's feeding each int32 lane)
//   float   scale[kLanes];      // the Q8_0 block scale d of each lane's block
// `init` pre-cancels the bias of unsigned weight bytes in u8 x s8 dot products: a kernel that
// feeds (w + offset) as unsigned bytes starts its accumulator at `init`. Tokens are padded to a
// whole step with zero blocks (q = 0, init = 0, scale = 0), so kernels never branch on tails.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/simd_isa.h"

namespace kvsparse::matmul {

inline constexpr int kStepElems = 4 * simd::kLanes;
inline constexpr int kStepBlocks = kStepElems / 32;
inline constexpr size_t kStepBytes = kStepElems + 2 * sizeof(int32_t) * simd::kLanes;

inline int64_t PackedSteps(int64_t cols) { return (cols + kStepElems - 1) / kStepElems; }
inline size_t PackedQ8TokenBytes(int64_t cols) { return static_cast<size_t>(PackedSteps(cols)) * kStepBytes; }

// Where element e (0..31) of block j (0..kStepBlocks-1) of a step lives in the step's q array.
enum class Q8Order {
  kNatural,        // block j element e at j*32 + e
  kQ4NibbleHalves  // 512-bit Q4_0 kernels: [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31]
};

// Packs one token: x [cols] -> dst (PackedQ8TokenBytes(cols) bytes, 64-byte aligned).
// `offset` is the unsigned bias the weight kernel adds to its weight bytes (0 if none).
void PackQ8Token(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order);

// Compact single-token layout for decode (1.125 bytes per element instead of 3): decode streams
// every weight row past the same activations, which must stay in L1 next to the weight stream
// even for long rows (the 3-byte layout of a 5632-wide row alone is half of a 32 KiB L1).
//   int8_t q[PackedSteps(cols) * kStepElems];   // same element order and zero padding as above
//   float  d[PackedSteps(cols) * kStepBlocks];  // per-block scale (0 for padding blocks)
inline size_t CompactQ8TokenBytes(int64_t cols) {
  return static_cast<size_t>(PackedSteps(cols)) * (kStepElems + kStepBlocks * sizeof(float));
}
inline const float* CompactQ8Scales(const uint8_t* packed, int64_t cols) {
  return reinterpret_cast<const float*>(packed + PackedSteps(cols) * kStepElems);
}
void PackQ8TokenCompact(const float* x, int64_t cols, uint8_t* dst, Q8Order order);

// Decode keeps the full layout (no per-step scale/bias work in the kernel) while a token fits
// comfortably in L1 beside the weight stream, and switches to the compact one beyond that.
inline constexpr size_t kDecodeFullLayoutMaxBytes = 8 * 1024;
inline bool DecodeUsesCompactLayout(int64_t cols) { return PackedQ8TokenBytes(cols) > kDecodeFullLayoutMaxBytes; }
inline size_t DecodeQ8TokenBytes(int64_t cols) {
  return DecodeUsesCompactLayout(cols) ? CompactQ8TokenBytes(cols) : PackedQ8TokenBytes(cols);
}
inline void PackQ8DecodeToken(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order) {
  if (DecodeUsesCompactLayout(cols)) {
    PackQ8TokenCompact(x, cols, dst, order);
  } else {
    PackQ8Token(x, cols, dst, offset, order);
  }
}

}  // namespace kvsparse::matmul
