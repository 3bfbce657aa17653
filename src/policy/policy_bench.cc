// Cost of the policy bookkeeping per decode step (observe) and per eviction (select +
// compact) at realistic live counts, to confirm it stays O(n) and allocation-free.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kvsparse/kv_policies.h"

namespace kvsparse {
namespace {

constexpr int kHeads = 8;

// One decode step: append a token, observe a [heads, n] row, evict 16 tokens every 16 steps.
void RunPolicy(benchmark::State& state, KvMethod method) {
  const int32_t budget = static_cast<int32_t>(state.range(0));
  const int interval = 16;
  LayerKvConfig config;
  config.method = method;
  config.budget = KvBudget::Tokens(budget);
  config.params = DefaultMethodParams(method);
  config.params.decode_evict = true;
  auto policy = std::move(CreatePolicy(config, 0, 1, 1)).value();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  std::vector<float> row(static_cast<size_t>(kHeads) * (budget + interval));
  for (float& v : row) v = uniform(rng) / budget;
  std::vector<uint8_t> keep;
  std::vector<int32_t> positions(budget + interval);
  int32_t n_live = 0, n_seen = 0;
  policy->OnAppend(budget);
  n_live = n_seen = budget;
  for (auto _ : state) {
    policy->OnAppend(1);
    ++n_live, ++n_seen;
    AttentionObservation obs;
    obs.n_queries = 1;
    obs.n_tokens = n_live;
    obs.n_kv_heads = kHeads;
    obs.sum_all = obs.sum_window = obs.last = row.data();
    policy->Observe(obs);
    const int32_t target = policy->EvictionTarget(n_live, n_seen, EvictionPoint::kDecodeStep, interval);
    if (target < n_live) {
      SelectionContext ctx;
      ctx.n_live = n_live;
      ctx.target = target;
      ctx.positions = positions.data();
      policy->SelectKeep(ctx, &keep);
      policy->OnEvict(keep);
      n_live = target;
    }
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_H2O(benchmark::State& state) { RunPolicy(state, KvMethod::kH2O); }
void BM_Tova(benchmark::State& state) { RunPolicy(state, KvMethod::kTova); }
void BM_Scissorhands(benchmark::State& state) { RunPolicy(state, KvMethod::kScissorhands); }
void BM_SnapKv(benchmark::State& state) { RunPolicy(state, KvMethod::kSnapKv); }
void BM_Random(benchmark::State& state) { RunPolicy(state, KvMethod::kRandom); }

BENCHMARK(BM_H2O)->Arg(256)->Arg(4096);
BENCHMARK(BM_Tova)->Arg(256)->Arg(4096);
BENCHMARK(BM_Scissorhands)->Arg(256)->Arg(4096);
BENCHMARK(BM_SnapKv)->Arg(256)->Arg(4096);
BENCHMARK(BM_Random)->Arg(256)->Arg(4096);

}  // namespace
}  // namespace kvsparse
