// IQ4_NL weights x Q8_0 activations (packed_q8.h): value = d * kIq4NlValues[nibble], Q4_0's
// nibble layout with 16 non-linear int8 levels looked up by a byte shuffle (NibbleLevelBlocks in
// matmul_packed_q8-inl.h: avx2's maddubs would saturate on pairs of 2 * 241 * 127, so it takes the
// sign trick); the f16 d and the panel codes are IQ4_NL's own. Compiled once per kernel family.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_iq4_nl.cc"
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

struct IQ4_NLBlocks : NibbleLevelBlocks<BlockIQ4_NL, kIq4NlValues> {
#if KVS_ISA_AVX512
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) {
    PanelNibbles(rows, b, quad);
    const __m512i levels = BiasedLevels();
    for (int c = 0; c < 8; ++c) quad[c] = _mm512_shuffle_epi8(levels, quad[c]);
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<IQ4_NLBlocks>::Make();

}  // namespace

const Kernel& KernelIQ4_NL() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
