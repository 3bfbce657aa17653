// The batched runtime and the continuous-batching scheduler on the real stories260K model
// (token level): batching never changes what a request generates, pages come back when
// requests end or are cancelled, and running out of pages queues or preempts instead of failing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/logprob.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/synth.h"
#include "kvsparse/sparse_kv_controller.h"
#include "support/random_data.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

using std::chrono::milliseconds;

struct Runtime {
  std::unique_ptr<Model> model;
  SparseKvSetup kv;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Scheduler> scheduler;
};

// budget_bytes 0: room for 16 dense requests of 256 tokens.
Runtime MakeRuntimeFromConfig(const std::string& path, KvSparsityConfig config, size_t budget_bytes,
                              SchedulerOptions options = {}) {
  Runtime r;
  auto model = Model::Load(path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  r.model = std::move(*model);
  const ModelConfig& c = r.model->config();
  // One page layout for every runtime, so a request alone (int8_kivi: 32-token pages and a
  // 128-token residual by default) matches one on a server started with f16 layers, whose
  // cache a per-request KIVI type shares.
  config.page_size = kDefaultPageSize;
  config.kivi_residual = 0;
  const KvGeometry geometry{c.n_layers, c.n_kv_heads, c.head_dim};
  if (budget_bytes == 0) {
    auto probe = CreateServingKv(geometry, config, size_t{1} << 30);
    EXPECT_TRUE(probe.ok()) << probe.status().ToString();
    budget_bytes = 16 * probe->controller->SequenceReserveBytes(256, 0);
  }
  auto kv = CreateServingKv(geometry, config, budget_bytes);
  EXPECT_TRUE(kv.ok()) << kv.status().ToString();
  r.kv = std::move(*kv);
  r.engine = std::make_unique<Engine>(*r.model, r.kv.cache.get(), 1, r.kv.controller.get());
  options.max_context = 256;
  r.scheduler = std::make_unique<Scheduler>(r.engine.get(), r.kv.controller.get(), options);
  return r;
}

// per_head -1: the method's default granularity; 0 / 1: every layer shared / per KV head.
Runtime MakeRuntime(const std::string& path, const std::string& method, const std::string& budget,
                    const std::string& kv_type, size_t budget_bytes, SchedulerOptions options = {},
                    int per_head = -1) {
  auto model = Model::Load(path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  auto config = KvSparsityConfigFromFlags(method, budget, kv_type, (*model)->config().n_layers);
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (per_head >= 0) {
    for (LayerKvConfig& layer : config->layers) layer.per_head = per_head != 0;
  }
  return MakeRuntimeFromConfig(path, *config, budget_bytes, options);
}

GenerationRequest Greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  GenerationRequest g;
  g.prompt = std::move(prompt);
  g.max_tokens = max_tokens;
  g.sampling.temperature = 0;
  return g;
}

// Prompts of different lengths (1 .. 90 tokens) over the 512-token vocabulary.
std::vector<int32_t> Prompt(int i) {
  std::vector<int32_t> p{1};
  const int n = 1 + (i * 37) % 90;
  for (int j = 1; j < n; ++j) p.push_back(static_cast<int32_t>(3 + (i * 131 + j * 17) % 500));
  return p;
}

std::vector<int32_t> Drain(RequestHandle& h) {
  std::vector<int32_t> out;
  while (h.WaitNext(&out, milliseconds(10))) {
  }
  return out;
}

// Runs every request to the end with Step on this thread.
void StepUntilDone(Scheduler& s, const std::vector<std::shared_ptr<RequestHandle>>& handles) {
  for (int guard = 0; guard < 100000; ++guard) {
    if (std::all_of(handles.begin(), handles.end(), [](const auto& h) { return h->finished(); })) return;
    s.Step();
  }
  FAIL() << "requests did not finish";
}

std::vector<int32_t> RunAlone(const std::string& path, const std::string& method, const std::string& budget,
                              const std::vector<int32_t>& prompt, int32_t max_tokens,
                              const std::string& kv_type = "f16", int per_head = -1) {
  Runtime r = MakeRuntime(path, method, budget, kv_type, 0, {}, per_head);
  auto h = r.scheduler->Submit(Greedy(prompt, max_tokens));
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  StepUntilDone(*r.scheduler, {*h});
  return Drain(**h);
}

class BatchedEqualsAlone : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

// A request's greedy tokens are the same whether it runs alone or with 15 others (chunked
// prompts of other requests interleaved with its decode steps).
TEST_P(BatchedEqualsAlone, SixteenRequests) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  const auto [method, budget] = GetParam();
  constexpr int kRequests = 16;
  constexpr int32_t kMaxTokens = 24;
  SchedulerOptions options;
  options.max_running = kRequests;
  options.step_tokens = 64;  // forces prompts to interleave with decode steps
  Runtime r = MakeRuntime(path, method, budget, "f16", 0, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < kRequests; ++i) {
    auto h = r.scheduler->Submit(Greedy(Prompt(i), kMaxTokens));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles.push_back(*h);
  }
  StepUntilDone(*r.scheduler, handles);
  for (int i = 0; i < kRequests; i += 5) {  // a sample of them alone (each costs a model load)
    const std::vector<int32_t> alone = RunAlone(path, method, budget, Prompt(i), kMaxTokens);
    EXPECT_EQ(Drain(*handles[i]), alone) << "request " << i;
    EXPECT_EQ(handles[i]->finish_reason(), FinishReason::kLength);
  }
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0) << "every page comes back when the requests end";
  r.kv.cache->CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Methods, BatchedEqualsAlone,
                         ::testing::Values(std::make_pair("full", ""), std::make_pair("h2o", "0.5"),
                                           std::make_pair("snapkv", "48"), std::make_pair("streaming_llm", "40"),
                                           std::make_pair("quest", "32")),
                         [](const auto& info) { return std::string(info.param.first); });

// One ForwardBatch over several sequences gives each the logits it gets alone.
TEST(EngineBatch, ForwardBatchMatchesSeparateForwards) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime batched = MakeRuntime(path, "full", "", "f16", 0);
  Runtime alone = MakeRuntime(path, "full", "", "f16", 0);
  const int vocab = batched.model->config().n_vocab;
  std::vector<int> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(*batched.kv.controller->AcquireSequence());
    ASSERT_EQ(*alone.kv.controller->AcquireSequence(), seqs.back());
  }
  const std::vector<int32_t> p0 = Prompt(3), p1 = Prompt(7), p2{1, 42};
  std::vector<float> l0(vocab), l1(static_cast<size_t>(p1.size()) * vocab), l2(vocab);
  std::vector<BatchSequence> batch(3);
  batch[0] = {seqs[0], p0.data(), static_cast<int32_t>(p0.size()), 0, EvictionPoint::kPromptEnd, l0.data(), false};
  batch[1] = {seqs[1], p1.data(), static_cast<int32_t>(p1.size()), 0, EvictionPoint::kPromptEnd, l1.data(), true};
  batch[2] = {seqs[2], p2.data(), 2, 0, EvictionPoint::kPromptEnd, l2.data(), false};
  ASSERT_TRUE(batched.engine->ForwardBatch(batch).ok());
  std::vector<float> r0(vocab), r1(l1.size()), r2(vocab);
  ASSERT_TRUE(alone.engine->Forward(seqs[0], p0.data(), static_cast<int32_t>(p0.size()), 0, r0.data()).ok());
  ASSERT_TRUE(alone.engine->Forward(seqs[1], p1.data(), static_cast<int32_t>(p1.size()), 0, r1.data(), true).ok());
  ASSERT_TRUE(alone.engine->Forward(seqs[2], p2.data(), 2, 0, r2.data()).ok());
  auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    float worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    return worst;
  };
  EXPECT_LT(close(l0, r0), 1e-4f);
  EXPECT_LT(close(l1, r1), 1e-4f);
  EXPECT_LT(close(l2, r2), 1e-4f);

  // Then a decode row of each: their attention runs as one batched call (Engine::AttendDecodeBatch).
  const int32_t next[3] = {5, 9, 17};
  const int32_t pos[3] = {static_cast<int32_t>(p0.size()), static_cast<int32_t>(p1.size()), 2};
  std::vector<std::vector<float>> got(3, std::vector<float>(vocab)), want(3, std::vector<float>(vocab));
  for (int i = 0; i < 3; ++i) {
    batch[i] = {seqs[i], &next[i], 1, pos[i], EvictionPoint::kDecodeStep, got[i].data(), false};
  }
  ASSERT_TRUE(batched.engine->ForwardBatch(batch).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(alone.engine->Forward(seqs[i], &next[i], 1, pos[i], want[i].data()).ok());
    EXPECT_LT(close(got[i], want[i]), 1e-4f) << "decode row of sequence " << i;
  }
}

// A step that cannot get its pages fails before anything is stored, and one with a bad entry
// (duplicate sequence, token out of range) leaves the cache as it was.
TEST(EngineBatch, StepsAreAllOrNothing) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime r = MakeRuntime(path, "full", "", "f16", 0);
  SparseKvController& kv = *r.kv.controller;
  const int a = *kv.AcquireSequence(), b = *kv.AcquireSequence();
  const std::vector<int32_t> p = Prompt(5);
  std::vector<float> logits(r.model->config().n_vocab);
  ASSERT_TRUE(r.engine->Forward(a, p.data(), static_cast<int32_t>(p.size()), 0, logits.data()).ok());
  const int64_t pages = r.kv.cache->pages_in_use();
  const int32_t bad[2] = {3, 100000};
  std::vector<BatchSequence> batch(2);
  batch[0] = {b, p.data(), static_cast<int32_t>(p.size()), 0, EvictionPoint::kPromptEnd, logits.data(), false};
  batch[1] = {a, bad, 2, static_cast<int32_t>(p.size()), EvictionPoint::kPromptEnd, nullptr, false};
  EXPECT_EQ(r.engine->ForwardBatch(batch).code(), StatusCode::kOutOfRange);
  batch[1] = {b, p.data(), 1, 0, EvictionPoint::kDecodeStep, nullptr, false};
  EXPECT_EQ(r.engine->ForwardBatch(batch).code(), StatusCode::kInvalidArgument);
  batch[1] = {a, p.data(), 1, 3, EvictionPoint::kDecodeStep, nullptr, false};  // position already stored
  EXPECT_EQ(r.engine->ForwardBatch(batch).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.kv.cache->pages_in_use(), pages);
  EXPECT_EQ(r.kv.cache->NumTokens(b, 0), 0);
  EXPECT_EQ(kv.SeenTokens(b), 0);

  // A budget that holds the short prompt but not the long one beside it: the step fails whole.
  const std::vector<int32_t> longer = Prompt(2);  // 75 tokens
  ASSERT_GT(longer.size(), 64u);
  Runtime small = MakeRuntime(path, "full", "", "f16",
                              r.kv.controller->SequenceReserveBytes(static_cast<int32_t>(p.size()), 0));
  const int x = *small.kv.controller->AcquireSequence(), y = *small.kv.controller->AcquireSequence();
  batch[0] = {x, p.data(), static_cast<int32_t>(p.size()), 0, EvictionPoint::kPromptEnd, nullptr, false};
  batch[1] = {y, longer.data(), static_cast<int32_t>(longer.size()), 0, EvictionPoint::kPromptEnd, logits.data(),
              false};
  EXPECT_EQ(small.engine->ForwardBatch(batch).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(small.kv.cache->pages_in_use(), 0);
  EXPECT_EQ(small.kv.controller->SeenTokens(x), 0);
}

// Fork shares pages and clones the policies: both copies then continue exactly as the original.
// For cumulative the fork's layers share one copy of the ranking (LinkSequencePolicies).
class EngineBatchFork : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(EngineBatchFork, ForkedSequenceContinuesLikeTheOriginal) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime r = MakeRuntime(path, GetParam().first, GetParam().second, "f16", 0);
  SparseKvController& kv = *r.kv.controller;
  const int vocab = r.model->config().n_vocab;
  const int src = *kv.AcquireSequence(), dst = *kv.AcquireSequence();
  const std::vector<int32_t> p = Prompt(11);
  std::vector<float> ls(vocab), ld(vocab);
  ASSERT_TRUE(r.engine->Forward(src, p.data(), static_cast<int32_t>(p.size()), 0, ls.data()).ok());
  const int64_t pages = r.kv.cache->pages_in_use();
  ASSERT_TRUE(kv.Fork(src, dst).ok());
  EXPECT_EQ(r.kv.cache->pages_in_use(), pages) << "a fork copies no page";
  int32_t pos = static_cast<int32_t>(p.size());
  for (int step = 0; step < 30; ++step, ++pos) {
    const int32_t token = static_cast<int32_t>(std::max_element(ls.begin(), ls.end()) - ls.begin());
    std::vector<BatchSequence> batch(2);
    batch[0] = {src, &token, 1, pos, EvictionPoint::kDecodeStep, ls.data(), false};
    batch[1] = {dst, &token, 1, pos, EvictionPoint::kDecodeStep, ld.data(), false};
    ASSERT_TRUE(r.engine->ForwardBatch(batch).ok());
    ASSERT_EQ(ls, ld) << "step " << step;
  }
  r.kv.cache->CheckInvariants();
  // RemoveRange through the controller: the policies follow the pages.
  ASSERT_TRUE(kv.RemoveRange(dst, pos - 8, -1).ok());
  EXPECT_EQ(kv.SeenTokens(dst), pos - 8);
  r.kv.cache->CheckInvariants();
  ASSERT_TRUE(kv.ReleaseSequence(src).ok());
  ASSERT_TRUE(kv.ReleaseSequence(dst).ok());
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
  EXPECT_EQ(*kv.AcquireSequence(), src) << "released ids are reused";
}

INSTANTIATE_TEST_SUITE_P(Methods, EngineBatchFork,
                         ::testing::Values(std::pair<const char*, const char*>{"h2o", "24"},
                                           std::pair<const char*, const char*>{"cumulative", "0.3"}),
                         [](const auto& info) { return std::string(info.param.first); });

// Admission reserves each request's pages under its sparsity budget: a long request at a 20%
// budget reserves about a fifth of what a dense one does, and int8 pages less again.
TEST(Scheduler, SparseRequestsReserveLess) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime dense = MakeRuntime(path, "full", "", "f16", 0);
  Runtime sparse = MakeRuntime(path, "h2o", "0.2", "f16", 0);
  Runtime sparse_int8 = MakeRuntime(path, "h2o", "0.2", "int8", 0);
  const size_t d = dense.scheduler->ReserveBytes(4000, 96);
  const size_t s = sparse.scheduler->ReserveBytes(4000, 96);
  const size_t s8 = sparse_int8.scheduler->ReserveBytes(4000, 96);
  EXPECT_LT(s * 4, d) << "dense " << d << " bytes, h2o 20% " << s << " bytes";
  EXPECT_LT(s8, s) << "int8 " << s8 << " bytes, f16 " << s << " bytes";
}

// A sparse request reserves its budget, not its budget plus a prompt chunk: the chunk a step
// runs sits on top only until its eviction, so one chunk's pages beside all reservations is
// enough. Six requests fit where reserving a chunk each would admit fewer, and none is ever
// preempted (every step fits its pages).
TEST(Scheduler, SparseAdmissionReservesOneChunkForAll) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.max_running = 6;
  options.step_tokens = 32;  // prompts of 70-90 tokens run in chunks, each trimmed to the budget
  Runtime probe = MakeRuntime(path, "h2o", "24", "f16", 0, options);
  size_t reserve = 0;
  for (int i = 0; i < 6; ++i) {
    reserve = std::max(reserve, probe.scheduler->ReserveBytes(static_cast<int32_t>(Prompt(i).size()), 30));
  }
  const size_t chunk = probe.scheduler->ChunkReserveBytes(static_cast<int32_t>(Prompt(0).size()));
  ASSERT_GT(chunk, 0u);
  const size_t budget = 6 * reserve + chunk;
  ASSERT_LT(budget / (reserve + chunk), 6u) << "a chunk per request would admit fewer";
  Runtime r = MakeRuntime(path, "h2o", "24", "f16", budget, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 6; ++i) {
    auto h = r.scheduler->Submit(Greedy(Prompt(i), 30));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles.push_back(*h);
  }
  int most_running = 0;
  for (int guard = 0; guard < 10000; ++guard) {
    if (std::all_of(handles.begin(), handles.end(), [](const auto& h) { return h->finished(); })) break;
    r.scheduler->Step();
    most_running = std::max(most_running, r.scheduler->Stats().running);
    EXPECT_LE(r.kv.cache->budget().used_bytes(), budget);
  }
  EXPECT_EQ(most_running, 6);
  EXPECT_EQ(r.scheduler->Stats().preemptions, 0);
  for (const SparseKvLayerStats& l : r.kv.controller->layer_stats()) EXPECT_EQ(l.deferred_evictions, 0);
  for (auto& h : handles) EXPECT_EQ(h->finish_reason(), FinishReason::kLength);
  r.kv.cache->CheckInvariants();
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
}

// Cancelled, timed-out and finished requests all give their pages back; a full queue refuses.
TEST(Scheduler, CancellationTimeoutAndQueueLimit) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.max_running = 2;
  options.max_queue = 3;
  Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
  Scheduler& s = *r.scheduler;
  auto a = *s.Submit(Greedy(Prompt(1), 150));
  auto b = *s.Submit(Greedy(Prompt(2), 150));
  GenerationRequest timed = Greedy(Prompt(3), 150);
  timed.deadline = std::chrono::steady_clock::now() - milliseconds(1);
  auto c = *s.Submit(std::move(timed));
  auto refused = s.Submit(Greedy(Prompt(4), 10));
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Stats().rejected, 1);
  for (int i = 0; i < 5; ++i) s.Step();
  EXPECT_TRUE(c->finished());
  EXPECT_EQ(c->finish_reason(), FinishReason::kTimeout);
  EXPECT_GT(r.kv.cache->pages_in_use(), 0);
  a->Cancel();
  b->Cancel();
  s.Step();
  EXPECT_EQ(a->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(b->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
  EXPECT_EQ(s.Stats().running, 0);
  // Requests that can never run are refused at once, with the reason.
  EXPECT_EQ(s.Submit(Greedy({}, 4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Submit(Greedy({1, 9999}, 4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Submit(Greedy(Prompt(1), 1000)).status().code(), StatusCode::kInvalidArgument);
}

// More requests than the pages hold: they queue and all finish, with the tokens they get alone.
TEST(Scheduler, ExhaustionQueuesInsteadOfFailing) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime probe = MakeRuntime(path, "full", "", "f16", 0);
  SchedulerOptions options;
  options.max_running = 8;
  const size_t two = 2 * probe.scheduler->ReserveBytes(91, 20);
  Runtime r = MakeRuntime(path, "full", "", "f16", two, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 6; ++i) handles.push_back(*r.scheduler->Submit(Greedy(Prompt(i), 20)));
  int most_running = 0, most_waiting = 0;
  for (int guard = 0; guard < 10000; ++guard) {
    if (std::all_of(handles.begin(), handles.end(), [](const auto& h) { return h->finished(); })) break;
    r.scheduler->Step();
    most_running = std::max(most_running, r.scheduler->Stats().running);
    most_waiting = std::max(most_waiting, r.scheduler->Stats().waiting);
  }
  EXPECT_LT(most_running, 6) << "the pages hold fewer than six at once";
  EXPECT_GT(most_waiting, 0);
  EXPECT_EQ(r.scheduler->Stats().preemptions, 0) << "reservations cover every admitted request";
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(handles[i]->finish_reason(), FinishReason::kLength) << i;
    EXPECT_EQ(Drain(*handles[i]), RunAlone(path, "full", "", Prompt(i), 20)) << i;
  }
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
}

// With overcommitted admission a step can lack pages: the newest request is preempted and
// later recomputed from its prompt and its tokens so far, and still produces its own tokens.
TEST(Scheduler, PreemptionRecomputesWithoutChangingTokens) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime probe = MakeRuntime(path, "full", "", "f16", 0);
  SchedulerOptions options;
  options.max_running = 4;
  options.overcommit = 4;  // all four start; pages for two
  const size_t budget = probe.scheduler->ReserveBytes(91, 40) * 2;
  Runtime r = MakeRuntime(path, "full", "", "f16", budget, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 4; ++i) {
    auto h = r.scheduler->Submit(Greedy(Prompt(i + 2), 40));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles.push_back(*h);
  }
  StepUntilDone(*r.scheduler, handles);
  EXPECT_GT(r.scheduler->Stats().preemptions, 0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Drain(*handles[i]), RunAlone(path, "full", "", Prompt(i + 2), 40)) << i;
  }
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
}

// echo: every prompt token's log-probability (the first NaN), also when the prompt runs in
// several chunks over several steps, equal to a plain forward pass's; max_tokens 0 generates
// nothing. logprobs on a sparse request: each greedy token comes with its own log-probability,
// the best of its alternatives.
TEST(Scheduler, EchoAndLogprobsComeFromTheModelsLogits) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.step_tokens = 32;  // a 75-token prompt runs in three steps
  Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
  GenerationRequest echo = Greedy(Prompt(2), 0);
  echo.echo = true;
  echo.logprobs = 2;
  const std::vector<int32_t> prompt = echo.prompt;
  ASSERT_EQ(prompt.size(), 75u);
  auto h = r.scheduler->Submit(echo);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  StepUntilDone(*r.scheduler, {*h});
  EXPECT_EQ((*h)->finish_reason(), FinishReason::kLength);
  EXPECT_TRUE(Drain(**h).empty());
  const std::vector<TokenLogprob> scored = (*h)->prompt_logprobs();
  ASSERT_EQ(scored.size(), prompt.size());
  EXPECT_TRUE(std::isnan(scored[0].logprob));

  const ModelConfig& c = r.model->config();
  ContiguousKvCache cache(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF16, 1,
                          static_cast<int32_t>(prompt.size()));
  Engine engine(*r.model, &cache, 1);
  std::vector<float> logits(prompt.size() * static_cast<size_t>(c.n_vocab));
  ASSERT_TRUE(engine.Forward(0, prompt.data(), static_cast<int32_t>(prompt.size()), 0, logits.data(), true).ok());
  for (size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_EQ(scored[i].token, prompt[i]);
    const TokenLogprob want = LogprobOf(logits.data() + (i - 1) * c.n_vocab, c.n_vocab, prompt[i], 2);
    EXPECT_NEAR(scored[i].logprob, want.logprob, 1e-3) << i;
    ASSERT_EQ(scored[i].top.size(), 2u);
    EXPECT_EQ(scored[i].top[0].first, want.top[0].first) << i;
  }

  Runtime sparse = MakeRuntime(path, "h2o", "24", "int8", 0);
  GenerationRequest g = Greedy(Prompt(5), 12);
  g.logprobs = 1;
  auto generated = sparse.scheduler->Submit(g);
  ASSERT_TRUE(generated.ok()) << generated.status().ToString();
  StepUntilDone(*sparse.scheduler, {*generated});
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  while ((*generated)->WaitNext(&tokens, milliseconds(10), &logprobs)) {
  }
  ASSERT_EQ(logprobs.size(), tokens.size());
  ASSERT_FALSE(tokens.empty());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(logprobs[i].token, tokens[i]);
    ASSERT_EQ(logprobs[i].top.size(), 1u);
    EXPECT_EQ(logprobs[i].top[0].first, tokens[i]) << "greedy takes the best";
    EXPECT_LE(logprobs[i].logprob, 0.f);
  }
  EXPECT_TRUE((*generated)->prompt_logprobs().empty());
}

// A worker thread serves requests submitted from other threads.
TEST(Scheduler, WorkerThreadServesConcurrentSubmitters) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.max_running = 4;
  Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
  r.scheduler->Start();
  std::vector<std::thread> clients;
  std::vector<std::vector<int32_t>> got(8);
  for (int i = 0; i < 8; ++i) {
    clients.emplace_back([&, i] {
      auto h = r.scheduler->Submit(Greedy(Prompt(i), 12));
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      got[i] = Drain(**h);
    });
  }
  for (auto& t : clients) t.join();
  r.scheduler->Stop(/*drain=*/true, milliseconds(2000));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i].size(), 12u) << i;
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
  EXPECT_EQ(r.scheduler->Submit(Greedy(Prompt(1), 2)).status().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvsparse

namespace kvsparse {
namespace {

// A request may bring its own method, budget and page storage (the server's "kvsparse"
// extension field): it runs as a server configured that way would run it and reserves what its
// budget and storage need.
TEST(Scheduler, PerRequestMethodAndBudget) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  Runtime r = MakeRuntime(path, "full", "", "f16", 0);
  const KvSparsityConfig& base = r.kv.controller->config();
  auto layers = KvLayersWithOverride(base, "h2o", "40");
  ASSERT_TRUE(layers.ok()) << layers.status().ToString();
  GenerationRequest g = Greedy(Prompt(2), 30);
  g.kv_layers = std::make_shared<const std::vector<LayerKvConfig>>(*layers);
  EXPECT_LT(r.scheduler->ReserveBytes(static_cast<int32_t>(g.prompt.size()), 30, g.kv_layers.get()),
            r.scheduler->ReserveBytes(static_cast<int32_t>(g.prompt.size()), 30));
  auto h = r.scheduler->Submit(g);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto plain = r.scheduler->Submit(Greedy(Prompt(2), 30));
  ASSERT_TRUE(plain.ok());
  StepUntilDone(*r.scheduler, {*h, *plain});
  // The server's layers are shared (its method, full, is): the override runs H2O on them.
  EXPECT_EQ(Drain(**h), RunAlone(path, "h2o", "40", Prompt(2), 30, "f16", /*per_head=*/0));
  EXPECT_EQ(Drain(**plain), RunAlone(path, "full", "", Prompt(2), 30));
  EXPECT_GT(r.scheduler->Stats().evicted_tokens, 0);

  // Bad overrides name the field.
  auto unknown = KvLayersWithOverride(base, "h3o", "0.2");
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("kv_method"), std::string::npos) << unknown.status().message();
  auto no_budget = KvLayersWithOverride(base, "h2o", "");
  EXPECT_NE(no_budget.status().message().find("kv_budget"), std::string::npos) << no_budget.status().message();
  auto bad_budget = KvLayersWithOverride(base, "h2o", "1.5");
  EXPECT_EQ(bad_budget.status().code(), StatusCode::kInvalidArgument);
  auto bad_type = KvLayersWithOverride(base, "", "", "int3");
  EXPECT_EQ(bad_type.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_type.status().message().find("kv_type"), std::string::npos) << bad_type.status().message();
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
}

// A request's kv_type stores its pages in that type beside requests on the server's: its
// tokens are those of a server started with that type, it reserves and holds fewer bytes, and
// its pages go back to the pool.
TEST(Scheduler, PerRequestKvType) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.max_running = 4;
  Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
  const KvSparsityConfig& base = r.kv.controller->config();
  struct Case {
    const char* method;
    const char* budget;
    const char* kv_type;
  };
  const Case cases[] = {{"", "", "int8"}, {"h2o", "40", "int8"}, {"", "", "int8_kivi"}, {"", "", "f32"}};
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 4; ++i) {
    const Case& c = cases[i];
    auto layers = KvLayersWithOverride(base, c.method, c.budget, c.kv_type);
    ASSERT_TRUE(layers.ok()) << layers.status().ToString();
    GenerationRequest g = Greedy(Prompt(i), 24);
    g.kv_layers = std::make_shared<const std::vector<LayerKvConfig>>(*layers);
    if (std::string(c.kv_type) == "int8") {
      EXPECT_LT(r.scheduler->ReserveBytes(static_cast<int32_t>(g.prompt.size()), 24, g.kv_layers.get()),
                r.scheduler->ReserveBytes(static_cast<int32_t>(g.prompt.size()), 24));
    }
    auto h = r.scheduler->Submit(g);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handles.push_back(*h);
  }
  auto plain = r.scheduler->Submit(Greedy(Prompt(4), 24));
  ASSERT_TRUE(plain.ok());
  handles.push_back(*plain);
  StepUntilDone(*r.scheduler, handles);
  for (int i = 0; i < 4; ++i) {
    const Case& c = cases[i];
    const std::string method = *c.method ? c.method : "full";
    EXPECT_EQ(Drain(*handles[i]), RunAlone(path, method, c.budget, Prompt(i), 24, c.kv_type)) << c.kv_type;
  }
  EXPECT_EQ(Drain(*handles[4]), RunAlone(path, "full", "", Prompt(4), 24));
  r.kv.cache->CheckInvariants();
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
}

}  // namespace
}  // namespace kvsparse

namespace kvsparse {
namespace {

// Requests that share a prompt prefix with a running one reuse its pages (reference counted)
// and produce the tokens they would alone.
TEST(Scheduler, SharedPromptPrefixesReusePages) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  std::vector<int32_t> system = Prompt(2);  // 75 tokens of "system prompt"
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> p = system;
    for (int j = 0; j <= i; ++j) p.push_back(static_cast<int32_t>(10 + 7 * i + j));
    prompts.push_back(p);
  }
  int64_t pages_shared = 0, pages_alone = 0;
  std::vector<std::vector<int32_t>> shared_out, alone_out;
  for (bool share : {true, false}) {
    SchedulerOptions options;
    options.max_running = 4;
    options.share_prefixes = share;
    Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
    std::vector<std::shared_ptr<RequestHandle>> handles;
    handles.push_back(*r.scheduler->Submit(Greedy(prompts[0], 20)));
    r.scheduler->Step();  // the first prompt is computed before the others arrive
    for (int i = 1; i < 4; ++i) handles.push_back(*r.scheduler->Submit(Greedy(prompts[i], 20)));
    r.scheduler->Step();
    (share ? pages_shared : pages_alone) = r.kv.cache->pages_in_use();
    StepUntilDone(*r.scheduler, handles);
    for (auto& h : handles) (share ? shared_out : alone_out).push_back(Drain(*h));
    if (share) {
      EXPECT_GE(r.scheduler->Stats().prefix_reused_tokens, 3 * 64);
    }
    EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
    r.kv.cache->CheckInvariants();
  }
  EXPECT_EQ(shared_out, alone_out);
  EXPECT_LT(pages_shared, pages_alone);
}

// Copies of one prompt submitted together (n > 1, or a batch of questions on one context): the
// later ones wait for the first to compute the shared part and fork its pages, so the prompt is
// computed about once, and each still gets the tokens it gets alone.
TEST(Scheduler, PromptsSubmittedTogetherComputeTheirCommonPrefixOnce) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  std::vector<int32_t> context = Prompt(2);  // 75 tokens, then 75 more
  for (int32_t t : Prompt(2)) context.push_back((t + 3) % 512);
  const int32_t n_context = static_cast<int32_t>(context.size());
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(context);
    if (i > 0) prompts.back().push_back(static_cast<int32_t>(40 + i));  // the copy and two questions
  }
  prompts.insert(prompts.begin(), context);  // two exact copies
  SchedulerOptions options;
  options.max_running = 4;
  options.step_tokens = 64;  // the context takes three steps: the others must wait, not compute it
  Runtime r = MakeRuntime(path, "full", "", "f16", 0, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (const auto& p : prompts) handles.push_back(*r.scheduler->Submit(Greedy(p, 12)));
  StepUntilDone(*r.scheduler, handles);
  const SchedulerStats stats = r.scheduler->Stats();
  int64_t prompt_total = 0;
  for (const auto& p : prompts) prompt_total += static_cast<int64_t>(p.size());
  EXPECT_GE(stats.prefix_reused_tokens, 3 * (n_context / kDefaultPageSize) * kDefaultPageSize - 3 * kDefaultPageSize);
  EXPECT_LT(stats.prompt_tokens, prompt_total / 2) << "the shared context was computed more than once";
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(Drain(*handles[i]), RunAlone(path, "full", "", prompts[i], 12)) << "prompt " << i;
  }
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
  r.kv.cache->CheckInvariants();
}

// Automatic prefix caching: a finished dense request leaves its sequence in the cache; a later
// prompt that starts like it forks the kept pages and gets exactly the tokens of a cold run; under
// memory pressure admission frees cached sequences least recently used first; Stop frees the rest.
TEST(Scheduler, PrefixCacheHitsMatchColdRunsAndGiveWayUnderPressure) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  std::vector<int32_t> document = Prompt(2);  // 150 tokens
  for (int32_t t : Prompt(2)) document.push_back((t + 3) % 512);
  SchedulerOptions options;
  options.max_running = 2;
  options.prefix_cache_entries = 4;
  Runtime probe = MakeRuntime(path, "full", "", "f16", 0, options);
  const size_t one = probe.scheduler->ReserveBytes(256, 0);
  Runtime r = MakeRuntime(path, "full", "", "f16", 2 * one, options);  // room for about two requests
  auto run = [&](const std::vector<int32_t>& prompt, int32_t max_tokens) {
    auto h = r.scheduler->Submit(Greedy(prompt, max_tokens));
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    StepUntilDone(*r.scheduler, {*h});
    return Drain(**h);
  };
  EXPECT_EQ(run(document, 10), RunAlone(path, "full", "", document, 10));
  SchedulerStats s = r.scheduler->Stats();
  EXPECT_EQ(s.prefix_cache_entries, 1);
  EXPECT_GT(s.prefix_cache_bytes, 0u);
  EXPECT_GT(r.kv.cache->pages_in_use(), 0) << "the finished request's pages stay for later prompts";

  for (int32_t question : {7, 8, 9}) {
    std::vector<int32_t> prompt = document;
    prompt.push_back(question);
    EXPECT_EQ(run(prompt, 10), RunAlone(path, "full", "", prompt, 10)) << "question " << question;
  }
  s = r.scheduler->Stats();
  EXPECT_EQ(s.prefix_cache_hits, 3);
  EXPECT_EQ(s.prefix_cache_hit_tokens, 3 * 150) << "every document token came from the cache";
  EXPECT_LE(s.prefix_cache_entries, 4);

  // Other documents fill the cache; a long request then needs their room.
  for (int d = 3; d < 7; ++d) {
    std::vector<int32_t> other = Prompt(d);
    while (other.size() < 120) other.push_back(static_cast<int32_t>((other.size() * 31 + d) % 500 + 3));
    run(other, 8);
  }
  EXPECT_LE(r.scheduler->Stats().prefix_cache_entries, 4) << "at most prefix_cache_entries";
  std::vector<int32_t> long_prompt = Prompt(9);
  while (long_prompt.size() < 200) long_prompt.push_back(static_cast<int32_t>((long_prompt.size() * 7) % 500 + 3));
  EXPECT_EQ(run(long_prompt, 50), RunAlone(path, "full", "", long_prompt, 50));
  s = r.scheduler->Stats();
  EXPECT_GT(s.prefix_cache_evictions, 0) << "admission freed cached sequences";
  EXPECT_EQ(s.preemptions, 0);
  r.kv.cache->CheckInvariants();
  r.scheduler->Stop();
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0) << "Stop frees the cache's pages";
  EXPECT_EQ(r.scheduler->Stats().prefix_cache_entries, 0);
}

// n > 1 under a sparse method: copies of a whole prompt wait for the first to reach the prompt's
// end, fork it there (the compressed cache and the last logits) and sample their own first token:
// the prompt is computed once, and each copy gets what it gets alone.
TEST(Scheduler, SparsePromptCopiesForkAtThePromptsEnd) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  std::vector<int32_t> prompt = Prompt(2);  // 150 tokens
  for (int32_t t : Prompt(2)) prompt.push_back((t + 3) % 512);
  SchedulerOptions options;
  options.max_running = 4;
  options.step_tokens = 64;  // the prompt takes three chunks (and three evictions)
  std::vector<int32_t> alone;
  {
    Runtime lone = MakeRuntime(path, "h2o", "0.2", "int8", 0, options);  // the same chunks, alone
    auto h = lone.scheduler->Submit(Greedy(prompt, 12));
    ASSERT_TRUE(h.ok());
    StepUntilDone(*lone.scheduler, {*h});
    alone = Drain(**h);
  }
  Runtime r = MakeRuntime(path, "h2o", "0.2", "int8", 0, options);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 3; ++i) handles.push_back(*r.scheduler->Submit(Greedy(prompt, 12)));
  StepUntilDone(*r.scheduler, handles);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Drain(*handles[i]), alone) << "copy " << i;
  const SchedulerStats s = r.scheduler->Stats();
  EXPECT_EQ(s.prompt_tokens, static_cast<int64_t>(prompt.size())) << "the prompt was computed once";
  EXPECT_EQ(s.prefix_reused_tokens, 2 * static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(r.kv.cache->pages_in_use(), 0);
  r.kv.cache->CheckInvariants();
}

// Compressed contexts: a request's context (context_tokens) is prefilled and compressed on its own,
// then its question; the compressed context is kept, and later questions on it (one after
// another, or submitted together: the others wait for the first) fork it and give exactly the
// tokens of a cold run of the same protocol and config, while the cache holds a fraction of the
// dense context's bytes.
TEST(Scheduler, CompressedContextsAreKeptAndReusedExactly) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  std::vector<int32_t> document = Prompt(2);  // 150 tokens
  for (int32_t t : Prompt(2)) document.push_back((t + 3) % 512);
  const int32_t n_context = static_cast<int32_t>(document.size());
  auto with_question = [&](int q) {
    std::vector<int32_t> p = document;
    for (int j = 0; j < 4; ++j) p.push_back(static_cast<int32_t>(20 + 13 * q + j));
    return p;
  };
  auto request = [&](int q) {
    GenerationRequest g = Greedy(with_question(q), 10);
    g.context_tokens = n_context;
    return g;
  };
  for (const char* method : {"h2o", "snapkv"}) {
    SchedulerOptions cold_options;
    std::vector<std::vector<int32_t>> cold;
    for (int q = 0; q < 3; ++q) {
      Runtime r = MakeRuntime(path, method, "0.2", "int8", 0, cold_options);
      auto h = r.scheduler->Submit(request(q));
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      StepUntilDone(*r.scheduler, {*h});
      cold.push_back(Drain(**h));
    }
    SchedulerOptions options;
    options.prefix_cache_entries = 4;
    options.max_running = 4;
    {  // one after another
      Runtime r = MakeRuntime(path, method, "0.2", "int8", 0, options);
      for (int q = 0; q < 3; ++q) {
        auto h = r.scheduler->Submit(request(q));
        ASSERT_TRUE(h.ok());
        StepUntilDone(*r.scheduler, {*h});
        EXPECT_EQ(Drain(**h), cold[q]) << method << " question " << q;
      }
      const SchedulerStats s = r.scheduler->Stats();
      EXPECT_EQ(s.prefix_cache_hits, 2) << method;
      EXPECT_EQ(s.prefix_cache_hit_tokens, 2 * n_context) << method;
      EXPECT_EQ(s.prefix_cache_entries, 1) << method;
      // The kept context holds its budget (20% of 150 tokens, int8), not the dense context.
      const size_t dense = MakeRuntime(path, "full", "", "f16", 0).kv.controller->SequenceReserveBytes(n_context, 0);
      EXPECT_GT(s.prefix_cache_bytes, 0u);
      EXPECT_LT(s.prefix_cache_bytes, dense / 4) << method;
      r.scheduler->Stop();
      EXPECT_EQ(r.kv.cache->pages_in_use(), 0) << method;
    }
    {  // submitted together
      Runtime r = MakeRuntime(path, method, "0.2", "int8", 0, options);
      std::vector<std::shared_ptr<RequestHandle>> handles;
      for (int q = 0; q < 3; ++q) handles.push_back(*r.scheduler->Submit(request(q)));
      StepUntilDone(*r.scheduler, handles);
      for (int q = 0; q < 3; ++q) EXPECT_EQ(Drain(*handles[q]), cold[q]) << method << " together, question " << q;
      EXPECT_EQ(r.scheduler->Stats().prefix_cache_hits, 2) << method;
      EXPECT_LT(r.scheduler->Stats().prompt_tokens, 2 * n_context) << "the context was computed once";
    }
  }
}

// Sliding-window layers free the positions their window passed: a donor shares its prefix only
// while its sliding layers still hold what the new request's next query sees, so shared or not,
// every request gets the tokens it gets alone. Donors just past their prompt (sharing happens)
// and donors 40 tokens on (their windows moved past the prefix: no sharing).
TEST(Scheduler, SlidingWindowPrefixSharingStaysExact) {
  const std::string path = testing::TempPath("scheduler_tiny_gemma3.gguf");
  SynthOptions synth;
  synth.weight_type = DType::kF32;
  ASSERT_TRUE(WriteSynthModel(FindSynthShape("tiny-gemma3").value(), synth, path).ok());
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  std::vector<int32_t> system = Prompt(2);  // 75 tokens, past the 16-token windows
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> p = system;
    for (int j = 0; j <= i; ++j) p.push_back(static_cast<int32_t>(10 + 7 * i + j));
    prompts.push_back(p);
  }
  for (int donor_steps : {1, 40}) {
    std::vector<std::vector<int32_t>> outputs[2];
    int64_t reused[2] = {0, 0};
    for (bool share : {true, false}) {
      auto config = KvSparsityConfigFromFlags("full", "", "f32", c.n_layers);
      ASSERT_TRUE(config.ok());
      auto runtime = CreateServingRuntime(**model, *config, size_t{64} << 20, 1);
      ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
      SchedulerOptions options;
      options.max_running = 4;
      options.share_prefixes = share;
      options.max_context = 256;
      Scheduler scheduler((*runtime)->engine.get(), (*runtime)->controller(), options);
      std::vector<std::shared_ptr<RequestHandle>> handles;
      handles.push_back(*scheduler.Submit(Greedy(prompts[0], 48)));
      for (int step = 0; step < donor_steps; ++step) scheduler.Step();
      for (int i = 1; i < 3; ++i) handles.push_back(*scheduler.Submit(Greedy(prompts[i], 20)));
      StepUntilDone(scheduler, handles);
      for (auto& h : handles) outputs[share ? 0 : 1].push_back(Drain(*h));
      reused[share ? 0 : 1] = scheduler.Stats().prefix_reused_tokens;
      EXPECT_EQ((*runtime)->paged_cache()->pages_in_use(), 0);
    }
    EXPECT_EQ(outputs[0], outputs[1]) << "donor steps " << donor_steps;
    if (donor_steps == 1) {
      EXPECT_GT(reused[0], 0) << "a donor just past its prompt still holds its windows";
    } else {
      // The late pair shares its 75-token system prompt between its two (the second waits for
      // the first and forks it just past its prompt); the old donor gives nothing.
      EXPECT_EQ(reused[0], 75) << "a donor whose windows moved on must not be shared";
    }
  }
}

// A method that keeps every token to choose what to read cannot live on a sliding layer.
TEST(Scheduler, SpanSelectingMethodOnASlidingLayerIsAnError) {
  const std::string path = testing::TempPath("scheduler_tiny_gemma3.gguf");
  SynthOptions synth;
  synth.weight_type = DType::kF32;
  ASSERT_TRUE(WriteSynthModel(FindSynthShape("tiny-gemma3").value(), synth, path).ok());
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok());
  auto config = ParseKvSparsityConfig(R"({"layers": [{"layers": "2-3", "method": "quest", "budget": 0.5}]})",
                                      (*model)->config().n_layers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto runtime = CreateServingRuntime(**model, *config, size_t{16} << 20, 1);
  ASSERT_FALSE(runtime.ok());
  EXPECT_NE(runtime.status().message().find("sliding-window layer"), std::string::npos) << runtime.status().ToString();
  // (Quest leaves layers 0-1 dense, as its paper does.) Quest on the global layer (5) is fine.
  auto global = ParseKvSparsityConfig(R"({"layers": [{"layers": 5, "method": "quest", "budget": 0.5}]})",
                                      (*model)->config().n_layers);
  ASSERT_TRUE(global.ok());
  EXPECT_TRUE(CreateServingRuntime(**model, *global, size_t{16} << 20, 1).ok());
}

// A length-dependent budget ("budget_by_length", kv_budget.h) is applied per request by the
// request's own length: on one server, a 64-token prompt keeps half of it and a 192-token prompt
// an eighth, so the longer request holds fewer KV bytes; under a plain fraction it holds more.
TEST(SchedulerTest, BudgetByLengthAppliesPerRequest) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  SchedulerOptions options;
  options.step_tokens = 256;  // each prompt in one chunk: compressed once, at its own length
  auto peaks = [&](const std::string& config_json) {
    auto config = ParseKvSparsityConfig(config_json, 5);
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    Runtime r = MakeRuntimeFromConfig(path, *config, 0, options);
    std::vector<std::shared_ptr<RequestHandle>> handles;
    std::vector<int32_t> short_prompt{1}, long_prompt{1};
    for (int j = 1; j < 64; ++j) short_prompt.push_back(3 + (j * 17) % 500);
    for (int j = 1; j < 192; ++j) long_prompt.push_back(3 + (j * 29) % 500);
    for (const auto& prompt : {short_prompt, long_prompt}) {
      auto h = r.scheduler->Submit(Greedy(prompt, 1));
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      handles.push_back(*h);
    }
    StepUntilDone(*r.scheduler, handles);
    return std::pair<size_t, size_t>{handles[0]->stats().kv_peak_bytes, handles[1]->stats().kv_peak_bytes};
  };
  const auto [by_length_short, by_length_long] = peaks(
      R"({"default": {"method": "h2o", "budget_by_length": {"64": 0.5, "192": 0.125}, "kv_type": "f16"},
          "prefill_eviction": "chunk"})");
  const auto [plain_short, plain_long] =
      peaks(R"({"default": {"method": "h2o", "budget": 0.5, "kv_type": "f16"}, "prefill_eviction": "chunk"})");
  EXPECT_EQ(by_length_short, plain_short);  // 32 tokens either way
  EXPECT_LT(by_length_long, by_length_short) << "24 tokens of 192 against 32 of 64";
  EXPECT_GT(plain_long, plain_short) << "96 tokens of 192 against 32 of 64";
  EXPECT_NEAR(static_cast<double>(by_length_long) / by_length_short, 24.0 / 32.0, 0.05);
}

}  // namespace
}  // namespace kvsparse
