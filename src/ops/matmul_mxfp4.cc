// MXFP4 weights (gpt-oss's experts) x Q8_0 activations (packed_q8.h): value = 2^(e - 128) *
// kMxfp4Values[nibble], IQ4_NL's arithmetic (NibbleLevelBlocks) with 16 signed levels (|level| <=
// 12); only the scale differs: an E8M0 exponent, the exact f32 power of two (Mxfp4Scale, a table)
// instead of an f16 d. No kept panels: their scales are f16, which holds 2^(e - 128) only for e in
// [104, 143].
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_mxfp4.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
#include "ops/matmul_panel-inl.h"
#include "ops/packed_q8-inl.h"
#include "ops/matmul_packed_q8-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {
namespace {

struct MXFP4Blocks : NibbleLevelBlocks<BlockMXFP4, kMxfp4Values> {
  static float Scale(const Block& b) { return Mxfp4Scale(b.e); }
};

constexpr Kernel kKernel = PackedQ8Kernel<MXFP4Blocks>::Make();

}  // namespace

const Kernel& KernelMXFP4() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
