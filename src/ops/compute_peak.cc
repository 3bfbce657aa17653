// Measures this machine's peak rate for the dot-product instructions the kernels use (f32 FMA;
// int8 dot products: VNNI's vpdpbusd on avx512, vpmaddubsw + vpmaddwd on avx2; bf16 dot
// products where the CPU has AVX512_BF16), as membw.cc
// measures read bandwidth: the compute half of bench-speed's floor.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "kvsparse/isa.h"
#include "kvsparse/ops.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/compute_peak.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

// kChains independent accumulators hide the instruction latency (4-5 cycles) at two issues a cycle.
constexpr int kChains = 12;

// Runs `iterations` rounds of kChains f32 multiply-adds on full vectors; returns the multiply-adds
// done (vector lanes x chains x iterations) and a value that keeps the loop alive.
int64_t F32FmaLoopImpl(int64_t iterations, float* sink) {
#if KVS_ISA_AVX512
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);  // converges: no overflow
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  *sink = _mm512_reduce_add_ps(sum);
  return iterations * kChains * 16;
#elif KVS_ISA_AVX2
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  alignas(32) float lanes[8];
  __m256 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
  _mm256_store_ps(lanes, sum);
  *sink = lanes[0];
  return iterations * kChains * 8;
#else
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = static_cast<float>(i);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  }
  float sum = 0.f;
  for (float a : acc) sum += a;
  *sink = sum;
  return iterations * kChains;
#endif
}

// The same for u8 x s8 multiply-adds into 32-bit sums (the int8 attention and the quantized
// matmuls); the accumulators wrap harmlessly.
int64_t Int8DotLoopImpl(int64_t iterations, float* sink) {
#if KVS_ISA_AVX512
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  __m512i sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  // (Not _mm512_reduce_add_epi32: GCC adds its lanes as signed ints, which these wrapped sums overflow.)
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, sum);
  uint32_t total = 0;
  for (uint32_t lane : lanes) total += lane;
  *sink = static_cast<float>(total);
  return iterations * kChains * 64;
#elif KVS_ISA_AVX2
  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) {
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    }
  }
  alignas(32) int32_t lanes[8];
  __m256i sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm256_add_epi32(sum, acc[i]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  *sink = static_cast<float>(lanes[0]);
  return iterations * kChains * 32;
#else
  int32_t acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = i;
  volatile uint32_t source[2] = {3, 5};  // not folded into a closed form
  const uint32_t a = source[0], b = source[1];
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = static_cast<int32_t>(static_cast<uint32_t>(acc[i]) * a + b);
  }
  int32_t sum = 0;
  for (int32_t x : acc) sum = static_cast<int32_t>(static_cast<uint32_t>(sum) + static_cast<uint32_t>(x));
  *sink = static_cast<float>(sum);
  return iterations * kChains;
#endif
}

// The same for bf16 pairs multiplied into f32 sums (vdpbf16ps, bf16 KV's attention): avx512 only,
// and only to be called where the CPU has AVX512_BF16; 0 multiply-adds in the other families.
#if KVS_ISA_AVX512
__attribute__((target("avx512bf16"))) int64_t Bf16DotLoopImpl(int64_t iterations, float* sink) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  // 0.5 x 2^-20 per product: the sums stay finite and normal.
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.5f));
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-20f), _mm512_set1_ps(0x1p-20f));
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  *sink = _mm512_reduce_add_ps(sum);
  return iterations * kChains * 32;
}
#else
int64_t Bf16DotLoopImpl(int64_t /*iterations*/, float* sink) {
  *sink = 0.f;
  return 0;
}
#endif

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(F32FmaLoopImpl);
HWY_EXPORT(Int8DotLoopImpl);
HWY_EXPORT(Bf16DotLoopImpl);

namespace {

// Multiply-adds per second over all threads: each runs the loop; the best of a few rounds.
template <typename Loop>
double PeakMacsPerSecond(Loop loop, int n_threads) {
  constexpr int64_t kIterations = 400000;  // ~5M instructions a thread: a few ms
  double best = 0;
  for (int round = 0; round < 4; ++round) {
    int64_t macs = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(n_threads) reduction(+ : macs)
    {
      float sink = 0.f;
      macs += loop(kIterations, &sink);
      if (sink == 1.2345f) macs += 1;  // keeps the result alive
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, static_cast<double>(macs) / s);
  }
  return best;
}

}  // namespace

ComputePeak MeasureComputePeak(int n_threads) {
  if (n_threads <= 0) n_threads = omp_get_max_threads();
  ComputePeak peak;
  peak.f32_fma_gflops = 2 * PeakMacsPerSecond(KVS_DISPATCH(F32FmaLoopImpl), n_threads) / 1e9;
  peak.int8_dot_gops = 2 * PeakMacsPerSecond(KVS_DISPATCH(Int8DotLoopImpl), n_threads) / 1e9;
  if (Bf16DotsEnabled() && ActiveIsa() == Isa::kAvx512) {
    peak.bf16_dot_gflops = 2 * PeakMacsPerSecond(KVS_DISPATCH(Bf16DotLoopImpl), n_threads) / 1e9;
  }
  return peak;
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
