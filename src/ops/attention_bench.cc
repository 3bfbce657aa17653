// Attention speed at the TinyLlama-1.1B shape (32 heads, 4 kv heads, head_dim 64).
// bytes_per_second counts the K and V bytes one call must read; compare it with the
// machine's read bandwidth (BM_ReadBandwidth). One decode call is one layer: a TinyLlama
// token pays 22 of them (BM_AttentionDecode22Layers measures exactly that, from DRAM).
// Multi-threaded runs report wall time (UseRealTime).
// Every kernel benchmark takes the kernel family as its first argument (isa: 0 = scalar,
// 1 = avx2, 2 = avx512; families the CPU lacks are skipped), so one run compares them side by
// side, e.g. --benchmark_filter='BM_AttentionDecode/isa:./depth:32768/storage:1/threads:1/'.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/attention_scores.h"
#include "kvsparse/dtype.h"
#include "kvsparse/isa.h"
#include "kvsparse/ops.h"
#include "ops/kv_quant.h"

namespace kvsparse {
namespace {

constexpr int kHeads = 32;
constexpr int kKvHeads = 4;
constexpr int kHeadDim = 64;
constexpr int kVGroups = 2;  // low-bit KIVI V scales per (token, head): KIVI's groups of 32 channels

// K/V for `depth` tokens of `heads` kv heads split into spans of `span_tokens` (one span =
// contiguous cache; heads 1 = one head table of a per-head layer).
struct BenchCache {
  KvStorage storage;
  std::vector<uint8_t> k, v;         // [depth, heads, kHeadDim] in storage type
  std::vector<float> k_scale, v_scale;  // [depth, heads] (int8, fp8; v_scale also int8_kivi)
  std::vector<float> k_channel_scale;   // [spans, heads, kHeadDim] (int8_kivi: one page per span)
  // int4 / int2 KIVI, f16: K per (span, head, channel), V per (token, head, group of 32 channels).
  std::vector<f16_bits> k_group_scale, k_group_min;  // [spans, heads, kHeadDim]
  std::vector<f16_bits> v_group_scale, v_group_min;  // [depth, heads, kVGroups]
  std::vector<int32_t> positions;    // [depth]
  std::vector<KvSpan> spans;

  BenchCache(KvStorage st, int64_t depth, int64_t span_tokens, int heads = kKvHeads) : storage(st) {
    const size_t elems = static_cast<size_t>(depth) * heads * kHeadDim;
    k.resize(KvRowBytes(st, elems));
    v.resize(KvRowBytes(st, elems));
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    std::uniform_int_distribution<int> code(-127, 127);
    for (size_t i = 0; i < elems; ++i) {
      const float kv[2] = {dist(rng), dist(rng)};
      switch (st) {
        case KvStorage::kF16:
          reinterpret_cast<f16_bits*>(k.data())[i] = F32ToF16(kv[0]);
          reinterpret_cast<f16_bits*>(v.data())[i] = F32ToF16(kv[1]);
          break;
        case KvStorage::kBf16:
          reinterpret_cast<bf16_bits*>(k.data())[i] = F32ToBF16(kv[0]);
          reinterpret_cast<bf16_bits*>(v.data())[i] = F32ToBF16(kv[1]);
          break;
        case KvStorage::kF32:
          reinterpret_cast<float*>(k.data())[i] = kv[0];
          reinterpret_cast<float*>(v.data())[i] = kv[1];
          break;
        case KvStorage::kInt8:
        case KvStorage::kInt8Kivi:
          reinterpret_cast<int8_t*>(k.data())[i] = static_cast<int8_t>(code(rng));
          reinterpret_cast<int8_t*>(v.data())[i] = static_cast<int8_t>(code(rng));
          break;
        case KvStorage::kFp8E4M3:
        case KvStorage::kFp8E5M2:
          k[i] = ops::EncodeFp8(st, kv[0] * ops::Fp8Max(st));
          v[i] = ops::EncodeFp8(st, kv[1] * ops::Fp8Max(st));
          break;
        case KvStorage::kInt4Kivi:
        case KvStorage::kInt2Kivi:  // random bytes are random packed codes
          if (i < k.size()) {
            k[i] = static_cast<uint8_t>(rng());
            v[i] = static_cast<uint8_t>(rng());
          }
          break;
      }
    }
    if (HasTokenScales(st)) k_scale.assign(static_cast<size_t>(depth) * heads, 1.f / 127);
    const bool low_bit = IsLowBitKivi(st);
    if (IsScaledCodeStorage(st) && !low_bit) v_scale.assign(static_cast<size_t>(depth) * heads, 1.f / 127);
    const int64_t n_spans = (depth + span_tokens - 1) / span_tokens;
    if (st == KvStorage::kInt8Kivi) k_channel_scale.assign(static_cast<size_t>(n_spans) * heads * kHeadDim, 1.f / 127);
    if (low_bit) {
      k_group_scale.assign(static_cast<size_t>(n_spans) * heads * kHeadDim, F32ToF16(1.f / 127));
      k_group_min.assign(k_group_scale.size(), F32ToF16(-0.5f));
      v_group_scale.assign(static_cast<size_t>(depth) * heads * kVGroups, F32ToF16(1.f / 127));
      v_group_min.assign(v_group_scale.size(), F32ToF16(-0.5f));
    }
    positions.resize(depth);
    for (int64_t t = 0; t < depth; ++t) positions[t] = static_cast<int32_t>(t);
    const size_t row_bytes = KvRowBytes(st, heads * kHeadDim);
    for (int64_t t0 = 0; t0 < depth; t0 += span_tokens) {
      KvSpan span;
      span.k = k.data() + t0 * row_bytes;
      span.v = v.data() + t0 * row_bytes;
      span.positions = positions.data() + t0;
      if (HasTokenScales(st)) span.k_scale = k_scale.data() + t0 * heads;
      if (!v_scale.empty()) span.v_scale = v_scale.data() + t0 * heads;
      const size_t page_channels = static_cast<size_t>(t0 / span_tokens) * heads * kHeadDim;  // this span's
      if (!k_channel_scale.empty()) span.k_channel_scale = k_channel_scale.data() + page_channels;
      if (low_bit) {
        span.k_group_scale = k_group_scale.data() + page_channels;
        span.k_group_min = k_group_min.data() + page_channels;
        span.v_group_scale = v_group_scale.data() + t0 * heads * kVGroups;
        span.v_group_min = v_group_min.data() + t0 * heads * kVGroups;
        span.v_group = kHeadDim / kVGroups;
        span.v_groups = kVGroups;
      }
      span.n = static_cast<int32_t>(std::min(span_tokens, depth - t0));
      spans.push_back(span);
    }
  }
  size_t Bytes() const {
    return k.size() + v.size() + (k_scale.size() + v_scale.size() + k_channel_scale.size()) * sizeof(float) +
           (k_group_scale.size() + k_group_min.size() + v_group_scale.size() + v_group_min.size()) * sizeof(f16_bits);
  }
};

// The benchmarks' storage argument is KvStorage's value: 0 = f32, 1 = f16, 2 = int8, 3 = int8_kivi,
// 4 = fp8_e4m3, 5 = fp8_e5m2, 6 = int4_kivi, 7 = int2_kivi.
KvStorage StorageArg(int64_t arg) { return static_cast<KvStorage>(arg); }

// Makes the benchmark's kernel family (argument `arg`) the active one; false (and the run
// skipped) when this build or CPU cannot run it.
bool UseIsa(benchmark::State& state, int64_t arg) {
  const Isa isa = static_cast<Isa>(arg);
  const Status status = SetIsa(isa);
  if (!status.ok()) {
    state.SkipWithError(status.message().c_str());
    return false;
  }
  state.SetLabel(IsaName(isa));
  return true;
}

constexpr int64_t kScalar = static_cast<int64_t>(Isa::kScalar);
constexpr int64_t kAvx2 = static_cast<int64_t>(Isa::kAvx2);
constexpr int64_t kAvx512 = static_cast<int64_t>(Isa::kAvx512);

std::vector<float> RandomQ(size_t n) {
  std::mt19937 rng(2);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> q(n);
  for (float& x : q) x = dist(rng);
  return q;
}

// Args: isa, depth, storage (StorageArg), threads, span tokens (0 = one span).
void BM_AttentionDecode(benchmark::State& state) {
  if (!UseIsa(state, state.range(0))) return;
  const int64_t depth = state.range(1);
  const KvStorage storage = StorageArg(state.range(2));
  const int threads = static_cast<int>(state.range(3));
  const int64_t span_tokens = state.range(4) > 0 ? state.range(4) : depth;
  BenchCache cache(storage, depth, span_tokens);
  AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  shape.integer_dots = true;  // as the engine runs it (int8 KV: integer dot products where the family has them)
  std::vector<float> q = RandomQ(kHeads * kHeadDim), out(kHeads * kHeadDim);
  const int32_t q_pos = static_cast<int32_t>(depth);
  for (auto _ : state) {
    ops::Attention(shape, storage, q.data(), &q_pos, 1, cache.spans.data(), static_cast<int32_t>(cache.spans.size()),
                   out.data(), threads);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(cache.Bytes()));
}

// One decode token's attention over all 22 TinyLlama layers, each with its own cache, so the
// 22 x 4 MiB (f16, depth 4096) cannot stay in the L3 between calls as in BM_AttentionDecode.
// Args: isa, depth, threads.
void BM_AttentionDecode22Layers(benchmark::State& state) {
  constexpr int kLayers = 22;
  if (!UseIsa(state, state.range(0))) return;
  const int64_t depth = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  std::vector<BenchCache> layers;
  layers.reserve(kLayers);
  for (int l = 0; l < kLayers; ++l) layers.emplace_back(KvStorage::kF16, depth, depth);
  const AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  std::vector<float> q = RandomQ(kHeads * kHeadDim), out(kHeads * kHeadDim);
  const int32_t q_pos = static_cast<int32_t>(depth);
  for (auto _ : state) {
    for (const BenchCache& cache : layers) {
      ops::Attention(shape, KvStorage::kF16, q.data(), &q_pos, 1, cache.spans.data(),
                     static_cast<int32_t>(cache.spans.size()), out.data(), threads);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kLayers *
                          static_cast<int64_t>(layers[0].Bytes()));
}

// One decode step's attention over one layer whose kv heads keep `depth` tokens each, in
// 16-token pages, over all 22 TinyLlama layers (each its own cache, as in
// BM_AttentionDecode22Layers). Modes: 0 = shared layer (one call, rows of all 4 heads);
// 1 = per-head layer, one ops::Attention call per kv head (the engine before AttentionBatch);
// 2 = per-head layer, one ops::AttentionBatch call for the 4 heads (the engine now);
// 3 = shared rows read per query head (Quest's per-query-head selection: 32 jobs {1, 1, 64}).
// Compare the modes' times within one run. Args: isa, depth, mode, threads.
void BM_AttentionDecodePerHead(benchmark::State& state) {
  constexpr int kLayers = 22;
  if (!UseIsa(state, state.range(0))) return;
  const int64_t depth = state.range(1);
  const int mode = static_cast<int>(state.range(2));
  const int threads = static_cast<int>(state.range(3));
  const int group = kHeads / kKvHeads;
  const AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  const AttentionShape head_shape{group, 1, kHeadDim, shape.scale};
  const AttentionShape query_shape{1, 1, kHeadDim, shape.scale};
  const bool shared_rows = mode == 0 || mode == 3;
  std::vector<BenchCache> caches;  // [layer] shared rows, or [layer, kv head] head tables
  caches.reserve(static_cast<size_t>(kLayers) * kKvHeads);
  for (int l = 0; l < kLayers; ++l) {
    if (shared_rows) {
      caches.emplace_back(KvStorage::kF16, depth, 16);
    } else {
      for (int h = 0; h < kKvHeads; ++h) caches.emplace_back(KvStorage::kF16, depth, 16, 1);
    }
  }
  std::vector<float> q = RandomQ(kHeads * kHeadDim), out(kHeads * kHeadDim);
  const int32_t q_pos = static_cast<int32_t>(depth);
  const int n_jobs = mode == 3 ? kHeads : kKvHeads;
  std::vector<AttentionJob> jobs(static_cast<size_t>(kLayers) * n_jobs);  // [layer, job]
  for (int l = 0; l < kLayers; ++l) {
    for (int j = 0; j < n_jobs && mode >= 1; ++j) {
      const BenchCache& cache = caches[mode == 3 ? l : l * kKvHeads + j];
      const size_t offset = static_cast<size_t>(j) * (mode == 3 ? 1 : group) * kHeadDim;
      jobs[static_cast<size_t>(l) * n_jobs + j] = AttentionJob{cache.spans.data(),
                                                               static_cast<int32_t>(cache.spans.size()),
                                                               mode == 3 ? j / group : 0, q.data() + offset,
                                                               out.data() + offset};
    }
  }
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l) {
      const AttentionJob* layer_jobs = jobs.data() + static_cast<size_t>(l) * n_jobs;
      switch (mode) {
        case 0:
          ops::Attention(shape, KvStorage::kF16, q.data(), &q_pos, 1, caches[l].spans.data(),
                         static_cast<int32_t>(caches[l].spans.size()), out.data(), threads);
          break;
        case 1:
          for (int h = 0; h < kKvHeads; ++h) {
            ops::Attention(head_shape, KvStorage::kF16, layer_jobs[h].q, &q_pos, 1, layer_jobs[h].spans,
                           layer_jobs[h].n_spans, layer_jobs[h].out, threads);
          }
          break;
        case 2: ops::AttentionBatch(head_shape, 1, KvStorage::kF16, &q_pos, 1, layer_jobs, kKvHeads, threads); break;
        default:
          ops::AttentionBatch(query_shape, kKvHeads, KvStorage::kF16, &q_pos, 1, layer_jobs, kHeads, threads);
          break;
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kLayers * kKvHeads * depth * kHeadDim * 2 * 2);
}

// Causal prefill of n queries over n tokens (positions 0..n-1). Args: isa, n, storage, threads.
void BM_AttentionPrefill(benchmark::State& state) {
  if (!UseIsa(state, state.range(0))) return;
  const int64_t n = state.range(1);
  const KvStorage storage = StorageArg(state.range(2));
  const int threads = static_cast<int>(state.range(3));
  BenchCache cache(storage, n, n);
  const AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  std::vector<float> q = RandomQ(static_cast<size_t>(n) * kHeads * kHeadDim), out(q.size());
  for (auto _ : state) {
    ops::Attention(shape, storage, q.data(), cache.positions.data(), static_cast<int32_t>(n), cache.spans.data(),
                   static_cast<int32_t>(cache.spans.size()), out.data(), threads);
    benchmark::DoNotOptimize(out.data());
  }
  // Useful multiply-adds under the causal mask: QK and PV, n(n+1)/2 pairs per head.
  const double flops = 4.0 * kHeadDim * kHeads * (static_cast<double>(n) * (n + 1) / 2);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9 * state.iterations(), benchmark::Counter::kIsRate);
}

// Gemma-style prefill: n queries over n f16 tokens (positions 0..n-1) with a sliding window
// (0: none, the causal triangle) and an attention-logit softcap (0: none). A window's cost
// follows the pairs it attends, n * window, not the triangle. Args: isa, n, window, softcap,
// threads. GFLOPS counts the pairs attended.
void BM_AttentionPrefillWindow(benchmark::State& state) {
  if (!UseIsa(state, state.range(0))) return;
  const int64_t n = state.range(1);
  AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  shape.window = static_cast<int32_t>(state.range(2));
  shape.softcap = static_cast<float>(state.range(3));
  const int threads = static_cast<int>(state.range(4));
  BenchCache cache(KvStorage::kF16, n, n);
  std::vector<float> q = RandomQ(static_cast<size_t>(n) * kHeads * kHeadDim), out(q.size());
  for (auto _ : state) {
    ops::Attention(shape, KvStorage::kF16, q.data(), cache.positions.data(), static_cast<int32_t>(n),
                   cache.spans.data(), static_cast<int32_t>(cache.spans.size()), out.data(), threads);
    benchmark::DoNotOptimize(out.data());
  }
  double pairs = 0;
  for (int64_t i = 0; i < n; ++i) pairs += shape.window > 0 ? std::min<int64_t>(i + 1, shape.window) : i + 1;
  const double flops = 4.0 * kHeadDim * kHeads * pairs;
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9 * state.iterations(), benchmark::Counter::kIsRate);
}

// Sparse prefill's kernel: a 512-query prompt chunk at the end of `depth` tokens, each kv head a
// job over the shared rows with its own key selection (as the engine runs it). keep: percent of
// each query block's 64-token key blocks selected at random (its own block always); 100 = the
// jobs without a selection, 0 = the shared-layer dense call the engine makes without sparse
// prefill. Args: isa, depth, keep, threads. GFLOPS counts the pairs actually computed.
void BM_SparsePrefillChunk(benchmark::State& state) {
  if (!UseIsa(state, state.range(0))) return;
  const int64_t depth = state.range(1);
  const int keep = static_cast<int>(state.range(2));
  const int threads = static_cast<int>(state.range(3));
  constexpr int32_t kChunk = 512;
  constexpr int kBlockTokens = 64;
  constexpr int kGroup = kHeads / kKvHeads;
  BenchCache cache(KvStorage::kF16, depth, depth);
  std::vector<int32_t> q_pos(kChunk);
  for (int32_t i = 0; i < kChunk; ++i) q_pos[i] = static_cast<int32_t>(depth - kChunk + i);
  const AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  const AttentionShape head_shape{kGroup, 1, kHeadDim, shape.scale};
  std::vector<float> q = RandomQ(static_cast<size_t>(kChunk) * kHeads * kHeadDim), out(q.size());
  // Selections: per kv head, per query block, random key blocks (ascending) plus its own.
  std::mt19937 rng(9);
  std::vector<std::vector<int64_t>> offsets(kKvHeads), ranges(kKvHeads);
  std::vector<KeySelection> selections(kKvHeads);
  double pairs = 0;
  for (int h = 0; h < kKvHeads; ++h) {
    offsets[h].push_back(0);
    for (int32_t b = 0; b < kChunk / kBlockTokens; ++b) {
      const int64_t visible_end = depth - kChunk + (b + 1) * kBlockTokens;
      const int64_t own = visible_end / kBlockTokens - 1;
      for (int64_t kb = 0; kb <= own; ++kb) {
        if (kb == own || static_cast<int>(rng() % 100) < keep) {
          ranges[h].insert(ranges[h].end(), {kb * kBlockTokens, (kb + 1) * kBlockTokens});
          pairs += kBlockTokens * static_cast<double>(kb == own ? kBlockTokens / 2 : kBlockTokens) * kGroup;
        }
      }
      offsets[h].push_back(static_cast<int64_t>(ranges[h].size() / 2));
    }
    selections[h] = KeySelection{kBlockTokens, offsets[h].data(), ranges[h].data()};
  }
  if (keep == 0 || keep == 100)
    pairs = kHeads * (kChunk * static_cast<double>(depth - kChunk) + kChunk * (kChunk + 1) / 2.0);
  std::vector<AttentionJob> jobs(kKvHeads);
  for (int h = 0; h < kKvHeads; ++h) {
    jobs[h] = AttentionJob{cache.spans.data(), static_cast<int32_t>(cache.spans.size()), h,
                           q.data() + static_cast<size_t>(h) * kChunk * kGroup * kHeadDim,
                           out.data() + static_cast<size_t>(h) * kChunk * kGroup * kHeadDim};
    if (keep > 0 && keep < 100) jobs[h].selection = &selections[h];
  }
  for (auto _ : state) {
    if (keep == 0) {
      ops::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), kChunk, cache.spans.data(),
                     static_cast<int32_t>(cache.spans.size()), out.data(), threads);
    } else {
      ops::AttentionBatch(head_shape, kKvHeads, KvStorage::kF16, q_pos.data(), kChunk, jobs.data(), kKvHeads, threads);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(4.0 * kHeadDim * pairs * 1e-9 * state.iterations(), benchmark::Counter::kIsRate);
}

// Score gathering (the second pass that sparsity policies pay for) after a decode or prefill
// call. Args: isa, queries, depth, storage, threads.
void BM_AttentionScores(benchmark::State& state) {
  if (!UseIsa(state, state.range(0))) return;
  const int32_t n_q = static_cast<int32_t>(state.range(1));
  const int64_t depth = state.range(2);
  const KvStorage storage = StorageArg(state.range(3));
  const int threads = static_cast<int>(state.range(4));
  BenchCache cache(storage, depth, depth);
  const AttentionShape shape{kHeads, kKvHeads, kHeadDim, 1.f / std::sqrt(static_cast<float>(kHeadDim))};
  std::vector<float> q = RandomQ(static_cast<size_t>(n_q) * kHeads * kHeadDim), out(q.size());
  std::vector<float> stats(static_cast<size_t>(n_q) * kHeads * 2);
  std::vector<int32_t> q_pos(n_q);
  for (int32_t i = 0; i < n_q; ++i) q_pos[i] = static_cast<int32_t>(depth - n_q + i);
  ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, cache.spans.data(),
                 static_cast<int32_t>(cache.spans.size()), out.data(), threads, stats.data());
  std::vector<float> sum_all(static_cast<size_t>(kKvHeads) * depth), sum_window(sum_all.size()), last(sum_all.size());
  const ScoreGathering gathering{GqaAggregation::kMean, static_cast<int32_t>(depth - 32)};
  for (auto _ : state) {
    ops::AttentionScores(shape, storage, q.data(), q_pos.data(), n_q, cache.spans.data(),
                         static_cast<int32_t>(cache.spans.size()), stats.data(), gathering,
                         ScoreOutputs{sum_all.data(), sum_window.data(), last.data()}, threads);
    benchmark::DoNotOptimize(sum_all.data());
  }
}

void BM_ReadBandwidth(benchmark::State& state) {
  double gbs = 0;
  for (auto _ : state) gbs = ops::MeasureReadBandwidthGBs(static_cast<int>(state.range(0)), 256ull << 20);
  state.counters["GB_per_s"] = gbs;
}

BENCHMARK(BM_ReadBandwidth)->Arg(1)->Arg(2)->Iterations(1)->Unit(benchmark::kMillisecond);
// The family varies fastest (ArgsProduct's first list), so each configuration's families run
// back to back.
BENCHMARK(BM_AttentionDecode)
    ->ArgNames({"isa", "depth", "storage", "threads", "span"})
    ->ArgsProduct({{kScalar, kAvx2, kAvx512}, {512, 4096, 32768}, {1, 0, 2, 4, 8}, {1, 2}, {0}})
    ->ArgsProduct(
        {{kScalar, kAvx2, kAvx512}, {4096}, {1, 2, 3, 4, 5, 6, 7, 8}, {2}, {16}})  // paged: one span per 16-token page
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AttentionDecode22Layers)
    ->ArgNames({"isa", "depth", "threads"})
    ->ArgsProduct({{kScalar, kAvx2, kAvx512}, {4096}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Per-head layers at 20% of 4K and of 32K (H2O's kept tokens); modes side by side.
BENCHMARK(BM_AttentionDecodePerHead)
    ->ArgNames({"isa", "depth", "mode", "threads"})
    ->ArgsProduct({{kAvx2, kAvx512}, {819, 6554}, {0, 1, 2, 3}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionScores)
    ->ArgNames({"isa", "n_q", "depth", "storage", "threads"})
    ->ArgsProduct({{kScalar, kAvx2, kAvx512}, {1, 512}, {4096}, {1, 3}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SparsePrefillChunk)
    ->ArgNames({"isa", "depth", "keep", "threads"})
    ->ArgsProduct({{kAvx2, kAvx512}, {8192}, {0, 100, 20, 10}, {2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_AttentionPrefill)
    ->ArgNames({"isa", "n", "storage", "threads"})
    ->ArgsProduct({{kScalar, kAvx2, kAvx512}, {512}, {1, 0, 2}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Gemma 2 / 3 local layers: a 4096-token prompt with a 512- or 1024-token window, with and
// without the softcap of 50, against the full causal triangle (window 0).
BENCHMARK(BM_AttentionPrefillWindow)
    ->ArgNames({"isa", "n", "window", "softcap", "threads"})
    ->ArgsProduct({{kAvx2, kAvx512}, {4096}, {0, 512, 1024}, {0, 50}, {2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvsparse
