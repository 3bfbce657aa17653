// Measures sustained multi-threaded read bandwidth: the ceiling for decode-time matvec.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kvsparse/ops.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/membw.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
namespace kvsparse::ops::HWY_NAMESPACE {

// Sums 64-bit words of [begin, end); the result is returned so the loads are not elided.
// The range is walked as kStreams interleaved sub-ranges with software prefetch, because one
// sequential stream per core leaves DRAM bandwidth unused (too few misses in flight) — the
// matmul kernels stream several weight rows at once, and the limit must be measured the same way.
uint64_t SumRangeImpl(const uint64_t* begin, const uint64_t* end) {
  constexpr int kStreams = 4;
  constexpr int64_t kStep = 16;  // words per stream per iteration (two cache lines)
  const int64_t n = end - begin;
  const int64_t per_stream = n / kStreams / kStep * kStep;
  uint64_t sum = 0;
#if !KVS_ISA_SCALAR  // 256-bit loads: as many misses in flight as the matmul kernels
  __m256i acc[kStreams][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_si256();
  for (int64_t i = 0; i < per_stream; i += kStep) {
    for (int s = 0; s < kStreams; ++s) {
      const uint64_t* p = begin + s * per_stream + i;
      _mm_prefetch(reinterpret_cast<const char*>(p + 256), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + 264), _MM_HINT_T0);
      acc[s][0] = _mm256_add_epi64(acc[s][0], _mm256_add_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)),
                                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 4))));
      acc[s][1] = _mm256_add_epi64(acc[s][1], _mm256_add_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8)),
                                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 12))));
    }
  }
  alignas(32) uint64_t lanes[4];
  for (auto& a : acc) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a[0], a[1]));
    sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
#else
  for (int64_t i = 0; i < per_stream; ++i)
    for (int s = 0; s < kStreams; ++s) sum += begin[s * per_stream + i];
#endif
  for (const uint64_t* p = begin + kStreams * per_stream; p < end; ++p) sum += *p;
  return sum;
}

}  // namespace kvsparse::ops::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse::ops {

HWY_EXPORT(SumRangeImpl);

double MeasureReadBandwidthGBs(int n_threads, size_t bytes) {
  if (n_threads <= 0) n_threads = omp_get_max_threads();
  const size_t words = std::max<size_t>(bytes / sizeof(uint64_t), 1024) / 64 * 64;
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<uint64_t, FreeDeleter> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(64, words * sizeof(uint64_t))));
  if (!buffer) return 0.0;
  uint64_t* data = buffer.get();
  // First touch from the same threads/static split as the reads (NUMA-friendly, commits pages).
#pragma omp parallel for num_threads(n_threads) schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(words); ++i) data[i] = static_cast<uint64_t>(i);

  double best_seconds = 1e30;
  volatile uint64_t sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t total = 0;
#pragma omp parallel num_threads(n_threads) reduction(+ : total)
    {
      const int64_t n = omp_get_num_threads();
      const int64_t id = omp_get_thread_num();
      // Chunks are multiples of 8 words so every thread's slice stays 64-byte aligned.
      const int64_t chunk = (static_cast<int64_t>(words) / n + 7) / 8 * 8;
      const int64_t begin = std::min<int64_t>(id * chunk, words);
      const int64_t end = std::min<int64_t>(begin + chunk, words);
      total += KVS_DISPATCH(SumRangeImpl)(data + begin, data + end);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    best_seconds = std::min(best_seconds, seconds);
  }
  (void)sink;
  return static_cast<double>(words * sizeof(uint64_t)) / best_seconds / 1e9;
}

}  // namespace kvsparse::ops
#endif  // HWY_ONCE
