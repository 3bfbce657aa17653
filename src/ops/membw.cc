// Measures sustained multi-threaded read bandwidth: the ceiling for decode-time matvec.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kvsparse/ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvsparse::ops {

namespace {

// Sums 64-bit words of [begin, end); the result is returned so the loads are not elided.
uint64_t SumRange(const uint64_t* begin, const uint64_t* end) {
#if defined(__AVX2__)
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  __m256i acc2 = _mm256_setzero_si256(), acc3 = _mm256_setzero_si256();
  const uint64_t* p = begin;
  for (; p + 16 <= end; p += 16) {
    acc0 = _mm256_add_epi64(acc0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
    acc1 = _mm256_add_epi64(acc1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 4)));
    acc2 = _mm256_add_epi64(acc2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8)));
    acc3 = _mm256_add_epi64(acc3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 12)));
  }
  __m256i acc = _mm256_add_epi64(_mm256_add_epi64(acc0, acc1), _mm256_add_epi64(acc2, acc3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; p < end; ++p) sum += *p;
  return sum;
#else
  uint64_t sum = 0;
  for (const uint64_t* p = begin; p < end; ++p) sum += *p;
  return sum;
#endif
}

}  // namespace

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
      total += SumRange(data + begin, data + end);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    best_seconds = std::min(best_seconds, seconds);
  }
  (void)sink;
  return static_cast<double>(words * sizeof(uint64_t)) / best_seconds / 1e9;
}

}  // namespace kvsparse::ops
