// Activations packed for the weight kernels of the 32-element block types (Q8_0, Q4_0, Q5_0,
// IQ4_NL, Q4_1, Q5_1). Each token's f32 row is quantized to ggml Q8_0 blocks (d = amax/127,
// q = round(x/d)) and stored in "steps" of kStepElems elements (kStepElems / 32 Q8_0 blocks), laid
// out for direct vector loads:
//   int8_t  q[kStepElems];      // quantized values (in the weight kernel's element order)
//   int32_t init[kLanes];       // -offset * (sum of the 4 q's feeding each int32 lane)
//   float   scale[kLanes];      // the Q8_0 block scale d of each lane's block
// `init` pre-cancels the bias of unsigned weight bytes in u8 x s8 dot products: a kernel that
// feeds (w + offset) as unsigned bytes starts its accumulator at `init`. Tokens are padded to a
// whole step with zero blocks (q = 0, init = 0, scale = 0), so kernels never branch on tails.
// Weight types with a min (value = d_w * q_w + m) also multiply each block's d * sum(q) (ggml's
// Q8_1 s, here f32 and exact: an 11-bit d times a 9-bit sum); their tokens end in those block sums.
// kLanes (so the step size) depends on the kernel family: packed_q8-inl.h holds the layout.
#pragma once

#include <cstddef>

namespace kvsparse::matmul {

// Where element e (0..31) of block j (0..kStepBlocks-1) of a step lives in the step's q array.
enum class Q8Order {
  kNatural,        // block j element e at j*32 + e
  kQ4NibbleHalves  // 512-bit Q4_0 kernels: [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31]
};

// Decode keeps the full layout (no per-step scale/bias work in the kernel) while a token fits
// comfortably in L1 beside the weight stream, and switches to the compact one beyond that.
inline constexpr size_t kDecodeFullLayoutMaxBytes = 8 * 1024;

}  // namespace kvsparse::matmul
