// Q5_0 weights x Q8_0 activations (packed_q8.h): value = d * (q5 - 16), Q4_0 plus a fifth bit per
// weight. The 5-bit codes are used as unsigned bytes and the packed activations' `init` holds
// -16 * sum(x) per lane, as for Q4_0. Compiled once per kernel family; the tile loops are shared
// (matmul_packed_q8-inl.h), this file holds the block arithmetic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"
#include "ops/packed_q8.h"

#include <hwy/aligned_allocator.h>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul_q5_0.cc"
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

constexpr int kQ5Offset = 16;

struct Q5_0Blocks {
  using Block = BlockQ5_0;
  static constexpr int kOffset = kQ5Offset;
  // avx512 too: its pair of fifth-bit words is then the byte mask as it stands.
  static constexpr Q8Order kOrder = Q8Order::kNatural;

#if KVS_ISA_AVX512
  static __m512i Load(const Block& b0, const Block& b1) { return Q5CodesOfPair(b0.qs, b0.qh, b1.qs, b1.qh); }
  static void PanelCodes(const Block* const* rows, int64_t b, __m512i (&quad)[8]) { PanelQ5Codes(rows, b, quad); }
  static __m512i DotCompact(const Block& b0, const Block& b1, __m512i xq) {
    return UnbiasedDot(Load(b0, b1), xq, kQ5Offset);
  }
#elif KVS_ISA_AVX2
  static __m256i Load(const Block& b) { return Q5Codes(b.qs, b.qh); }
  // 5-bit x int8 pairs stay inside int16 (2 * 31 * 127).
  static __m256i Dot(__m256i w, __m256i xq, __m256i init) { return UnsignedDot(w, xq, init); }
#else
  static int32_t Dot(const Block& b, const int8_t* xq) {
    int32_t dot = 0;
    for (int e = 0; e < kQK5_0; ++e) dot += (Q5CodeAt(b.qs, b.qh, e) - kQ5Offset) * xq[e];
    return dot;
  }
#endif
};

constexpr Kernel kKernel = PackedQ8Kernel<Q5_0Blocks>::Make();

}  // namespace

const Kernel& KernelQ5_0() { return kKernel; }

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"
