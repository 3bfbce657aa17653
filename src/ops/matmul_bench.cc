// MatMul speed on TinyLlama-1.1B shapes (dim 2048, hidden 5632, 4 kv heads of 64, vocab 32000).
//  - BM_ReadBandwidth: the machine's streaming-read limit (1 GiB buffer).
//  - BM_MatVec*: n_tokens = 1 over a working set far larger than L3, so weights come from DRAM;
//    compare its GB/s counter with BM_ReadBandwidth.
//  - BM_Gemm*: n_tokens = 512 (prefill); the GOP/s counter counts 2 ops per multiply-add.
//  - BM_TinyLlamaDecode / BM_TinyLlamaPrefillLayer: all of a layer's matmuls in sequence.
// Run with --benchmark_min_time=... as needed; threads default to 2 (KVS_BENCH_THREADS overrides).
// The kernels are the best family this CPU runs (KVSPARSE_ISA=scalar|avx2|avx512 lowers it); the
// context header names it.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/isa.h"
#include "kvsparse/ops.h"

namespace kvsparse {
namespace {

const bool kFamilyInContext = [] {
  benchmark::AddCustomContext("kernel_family", IsaName(ActiveIsa()));
  return true;
}();

int BenchThreads() {
  const char* env = std::getenv("KVS_BENCH_THREADS");
  return env ? std::atoi(env) : 2;
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

// Random but valid weight bytes: int8/nibble payloads are arbitrary, f16 scales are set to a
// small finite value so results stay finite. (Quantizing real floats would take far longer.)
Buffer RandomWeights(DType type, int64_t rows, int64_t cols, uint32_t seed) {
  const size_t bytes = DTypeRowBytes(type, cols) * rows;
  Buffer buf(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  std::mt19937_64 rng(seed);
  uint64_t* words = reinterpret_cast<uint64_t*>(buf.get());
  for (size_t i = 0; i < bytes / 8; ++i) words[i] = rng();
  const f16_bits small = F32ToF16(0.01f);
  uint8_t* p = buf.get();
  switch (type) {
    case DType::kQ8_0:
      for (size_t i = 0; i < bytes / sizeof(BlockQ8_0); ++i) reinterpret_cast<BlockQ8_0*>(p)[i].d = small;
      break;
    case DType::kQ4_0:
      for (size_t i = 0; i < bytes / sizeof(BlockQ4_0); ++i) reinterpret_cast<BlockQ4_0*>(p)[i].d = small;
      break;
    case DType::kQ4_K:
      for (size_t i = 0; i < bytes / sizeof(BlockQ4_K); ++i) {
        reinterpret_cast<BlockQ4_K*>(p)[i].d = small;
        reinterpret_cast<BlockQ4_K*>(p)[i].dmin = small;
      }
      break;
    case DType::kF16:
      for (size_t i = 0; i < bytes / 2; ++i) reinterpret_cast<f16_bits*>(p)[i] = F32ToF16((i % 17) * 0.01f - 0.08f);
      break;
    case DType::kBF16:
      for (size_t i = 0; i < bytes / 2; ++i) reinterpret_cast<bf16_bits*>(p)[i] = F32ToBF16((i % 17) * 0.01f - 0.08f);
      break;
    case DType::kF32:
      for (size_t i = 0; i < bytes / 4; ++i) reinterpret_cast<float*>(p)[i] = (i % 17) * 0.01f - 0.08f;
      break;
    default: {
      // Other block types: quantize a pattern row by row (slower, but only once per benchmark).
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c) row[c] = static_cast<float>((c * 7 + seed) % 23) * 0.01f - 0.11f;
      for (int64_t r = 0; r < rows; ++r) ref::QuantizeRow(type, row.data(), p + r * DTypeRowBytes(type, cols), cols);
      break;
    }
  }
  return buf;
}

std::vector<float> RandomActivations(int64_t n) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

void BM_ReadBandwidth(benchmark::State& state) {
  double gbs = 0.0;
  for (auto _ : state) gbs = ops::MeasureReadBandwidthGBs(BenchThreads(), 1ull << 30);
  state.counters["GB/s"] = gbs;
}
BENCHMARK(BM_ReadBandwidth)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

// w with kept panels (ops::PackPanels, what a loaded model's Q8_0 matrices get on avx512) in
// `holder`, or w itself where the active family keeps none.
WeightView KeepPanels(const WeightView& w, Buffer* holder) {
  const size_t bytes = ops::PanelBytes(w);
  if (bytes == 0) return w;
  holder->reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  return ops::PackPanels(w, holder->get(), BenchThreads());
}

// Matrix-vector over enough distinct copies of the matrix (>= 512 MiB) that weights stream from DRAM.
void BM_MatVec(benchmark::State& state, DType type, bool kept = false) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const size_t matrix_bytes = DTypeRowBytes(type, cols) * rows;
  const int copies = static_cast<int>(std::max<size_t>(2, (512ull << 20) / matrix_bytes));
  std::vector<Buffer> weights, panels(copies);
  std::vector<WeightView> views;
  for (int i = 0; i < copies; ++i) {
    weights.push_back(RandomWeights(type, rows, cols, i));
    const WeightView w{type, weights.back().get(), rows, cols};
    views.push_back(kept ? KeepPanels(w, &panels[i]) : w);
  }
  const std::vector<float> x = RandomActivations(cols);
  std::vector<float> y(rows);
  int next = 0;
  for (auto _ : state) {
    ops::MatMul(views[next], x.data(), 1, y.data(), BenchThreads());
    benchmark::DoNotOptimize(y.data());
    next = (next + 1) % copies;
  }
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(matrix_bytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

void BM_Gemm(benchmark::State& state, DType type, bool kept = false) {
  const int64_t rows = state.range(0), cols = state.range(1), n_tokens = state.range(2);
  const Buffer w = RandomWeights(type, rows, cols, 1);
  Buffer panels;
  const WeightView view =
      kept ? KeepPanels(WeightView{type, w.get(), rows, cols}, &panels) : WeightView{type, w.get(), rows, cols};
  const std::vector<float> x = RandomActivations(cols * n_tokens);
  std::vector<float> y(rows * n_tokens);
  for (auto _ : state) {
    ops::MatMul(view, x.data(), n_tokens, y.data(), BenchThreads());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GOP/s"] =
      benchmark::Counter(2.0 * rows * cols * n_tokens * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

#define KVS_MATVEC(name, ...)                     \
  BENCHMARK_CAPTURE(BM_MatVec, name, __VA_ARGS__) \
      ->Args({2048, 2048})                        \
      ->Args({5632, 2048})                 \
      ->Args({2048, 5632})                 \
      ->Unit(benchmark::kMicrosecond)      \
      ->UseRealTime()
KVS_MATVEC(q8_0, DType::kQ8_0);
KVS_MATVEC(q8_0_kept, DType::kQ8_0, true);
KVS_MATVEC(q4_0, DType::kQ4_0);
KVS_MATVEC(q4_K, DType::kQ4_K);
KVS_MATVEC(q4_1, DType::kQ4_1);
KVS_MATVEC(q5_0, DType::kQ5_0);
KVS_MATVEC(q5_1, DType::kQ5_1);
KVS_MATVEC(q2_K, DType::kQ2_K);
KVS_MATVEC(q3_K, DType::kQ3_K);
KVS_MATVEC(q5_K, DType::kQ5_K);
KVS_MATVEC(q6_K, DType::kQ6_K);
KVS_MATVEC(iq4_nl, DType::kIQ4_NL);
KVS_MATVEC(iq4_xs, DType::kIQ4_XS);
KVS_MATVEC(mxfp4, DType::kMXFP4);
KVS_MATVEC(f16, DType::kF16);
KVS_MATVEC(bf16, DType::kBF16);
KVS_MATVEC(f32, DType::kF32);

#define KVS_GEMM_Q8_0(name, ...)                           \
  BENCHMARK_CAPTURE(BM_Gemm, name, DType::kQ8_0, __VA_ARGS__) \
      ->Args({2048, 2048, 512})                               \
      ->Args({5632, 2048, 512})                               \
      ->Args({2048, 5632, 512})                               \
      ->Args({2048, 2048, 64})                                \
      ->Args({2048, 2048, 16})                                \
      ->Args({2048, 2048, 8})                                 \
      ->Args({2048, 2048, 4})                                 \
      ->Args({2048, 2048, 2})                                 \
      ->Args({4, 2048, 512}) /* mostly activation packing */  \
      ->Unit(benchmark::kMillisecond)                         \
      ->UseRealTime()
KVS_GEMM_Q8_0(q8_0, false);
KVS_GEMM_Q8_0(q8_0_kept, true);  // panels packed once (a loaded model's Q8_0 matrices on avx512)
#define KVS_GEMM(name, type)             \
  BENCHMARK_CAPTURE(BM_Gemm, name, type) \
      ->Args({2048, 2048, 512})          \
      ->Args({4, 2048, 512})             \
      ->Unit(benchmark::kMillisecond)    \
      ->UseRealTime()
KVS_GEMM(q4_0, DType::kQ4_0);
KVS_GEMM(q4_K, DType::kQ4_K);
KVS_GEMM(q4_1, DType::kQ4_1);
KVS_GEMM(q5_0, DType::kQ5_0);
KVS_GEMM(q5_1, DType::kQ5_1);
KVS_GEMM(q2_K, DType::kQ2_K);
KVS_GEMM(q3_K, DType::kQ3_K);
KVS_GEMM(q5_K, DType::kQ5_K);
KVS_GEMM(q6_K, DType::kQ6_K);
KVS_GEMM(iq4_nl, DType::kIQ4_NL);
KVS_GEMM(iq4_xs, DType::kIQ4_XS);
KVS_GEMM(f16, DType::kF16);
KVS_GEMM(bf16, DType::kBF16);
KVS_GEMM(f32, DType::kF32);

// One TinyLlama layer's weights: wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down).
struct LayerShapes {
  int64_t rows, cols;
};
constexpr LayerShapes kLayer[] = {{2048, 2048}, {256, 2048},  {256, 2048}, {2048, 2048},
                                  {5632, 2048}, {5632, 2048}, {2048, 5632}};
constexpr int kLayers = 22;

// Whole-model decode (22 layers + 32000x2048 output), every matrix distinct: tokens/s.
void BM_TinyLlamaDecode(benchmark::State& state) {
  const DType type = DType::kQ8_0;
  std::vector<Buffer> weights;
  std::vector<WeightView> views;
  size_t total_bytes = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (const LayerShapes& s : kLayer) {
      weights.push_back(RandomWeights(type, s.rows, s.cols, l * 16 + views.size()));
      views.push_back(WeightView{type, weights.back().get(), s.rows, s.cols});
      total_bytes += DTypeRowBytes(type, s.cols) * s.rows;
    }
  }
  weights.push_back(RandomWeights(type, 32000, 2048, 999));
  views.push_back(WeightView{type, weights.back().get(), 32000, 2048});
  total_bytes += DTypeRowBytes(type, 2048) * 32000;
  const std::vector<float> x = RandomActivations(5632);
  std::vector<float> y(32000);
  for (auto _ : state) {
    for (const WeightView& w : views) ops::MatMul(w, x.data(), 1, y.data(), BenchThreads());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(total_bytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TinyLlamaDecode)->Unit(benchmark::kMillisecond)->UseRealTime();

// One layer's matmuls for a 512-token prefill; tok/s is scaled to all 22 layers (matmuls only).
void BM_TinyLlamaPrefillLayer(benchmark::State& state) {
  const DType type = DType::kQ8_0;
  const int64_t n_tokens = 512;
  std::vector<Buffer> weights;
  std::vector<WeightView> views;
  double macs = 0;
  for (const LayerShapes& s : kLayer) {
    weights.push_back(RandomWeights(type, s.rows, s.cols, views.size()));
    views.push_back(WeightView{type, weights.back().get(), s.rows, s.cols});
    macs += static_cast<double>(s.rows) * s.cols * n_tokens;
  }
  const std::vector<float> x = RandomActivations(5632 * n_tokens);
  std::vector<float> y(5632 * n_tokens);
  for (auto _ : state) {
    for (const WeightView& w : views) ops::MatMul(w, x.data(), n_tokens, y.data(), BenchThreads());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["model_tok/s"] =
      benchmark::Counter(static_cast<double>(n_tokens) * state.iterations() / kLayers, benchmark::Counter::kIsRate);
  state.counters["GOP/s"] = benchmark::Counter(2.0 * macs * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TinyLlamaPrefillLayer)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace kvsparse
