// bench-serve on the real stories260K model at tiny sizes: the figures are counted right, the
// admission ordering follows the bytes per request, no page outlives its request, and bad
// settings fail before any model loads.
#include "kvsparse/serve_bench.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvsparse/engine.h"
#include "kvsparse/model.h"
#include "support/cli_runner.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

ServeBenchConfig TinyConfig() {
  ServeBenchConfig c;
  c.n_threads = 1;
  c.streams = {1, 2};
  c.prompt_tokens = 16;
  c.gen_tokens = 4;
  c.prefill_tokens = 64;
  c.kv_memory_mib = 1.0;
  c.depth = 200;
  c.capacity_gen = 4;
  c.capacity_max = 64;
  c.load_requests = 8;
  c.load_prompt = 160;  // long enough that per-head H2O tables (4 x page rounding) still hold less
  c.load_gen = 16;
  c.load_dense_slots = 3;
  return c;
}

TEST(ServeBench, TinyRunOnStories260K) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ServeBenchConfig config = TinyConfig();
  auto report = RunServeBench(**model, config);
  ASSERT_TRUE(report.ok()) << report.status().ToString();

  EXPECT_FALSE(report->isa.empty());
  EXPECT_EQ(report->n_threads, 1);
  EXPECT_GT(report->prefill_tps, 0);
  ASSERT_EQ(report->throughput.size(), 2u);
  for (const ServeThroughputResult& r : report->throughput) {
    SCOPED_TRACE(r.streams);
    EXPECT_EQ(r.generated_tokens, static_cast<int64_t>(r.streams) * config.gen_tokens);
    // After the last first token every stream still has gen - 1 tokens to come.
    EXPECT_GE(r.decode_window_tokens, static_cast<int64_t>(r.streams) * (config.gen_tokens - 1));
    EXPECT_LE(r.decode_window_tokens, r.generated_tokens);
    EXPECT_GT(r.aggregate_decode_tps, 0);
    EXPECT_NEAR(r.per_stream_decode_tps * r.streams, r.aggregate_decode_tps, 1e-9 * r.aggregate_decode_tps);
    EXPECT_GT(r.ttft_p50_s, 0);
    EXPECT_LE(r.ttft_p50_s, r.ttft_p95_s);
    EXPECT_GT(r.itl_p50_s, 0);
    EXPECT_LE(r.itl_p50_s, r.itl_p95_s);
    EXPECT_GT(r.kv_peak_bytes, 0u);
    EXPECT_LE(r.kv_peak_bytes, static_cast<size_t>(r.streams) * r.kv_reserved_bytes);
    EXPECT_GT(r.ratio_to_prefill, 0);
    EXPECT_EQ(r.preemptions, 0);
    EXPECT_EQ(r.pages_leaked, 0);
  }

  ASSERT_EQ(report->capacity.size(), 3u);
  const ServeCapacityResult& dense = report->capacity[0];
  const ServeCapacityResult& h2o_f16 = report->capacity[1];
  const ServeCapacityResult& h2o_int8 = report->capacity[2];
  EXPECT_EQ(dense.label, "full f16");
  EXPECT_EQ(h2o_int8.label, "h2o 0.2 int8");
  EXPECT_GT(dense.admitted, 0);
  EXPECT_LE(dense.admitted, h2o_f16.admitted);
  EXPECT_LT(h2o_f16.admitted, h2o_int8.admitted);  // int8 pages are smaller
  EXPECT_DOUBLE_EQ(dense.admitted_vs_first, 1.0);
  const size_t budget = static_cast<size_t>(config.kv_memory_mib * 1048576.0);
  for (const ServeCapacityResult& r : report->capacity) {
    SCOPED_TRACE(r.label);
    EXPECT_EQ(r.admitted, static_cast<int64_t>((budget - r.chunk_reserve_bytes) / r.reserve_bytes));
    EXPECT_EQ(r.ran, std::min<int64_t>(r.admitted, config.capacity_max));
    EXPECT_EQ(r.steps, config.capacity_gen);
    EXPECT_GT(r.decode_tps, 0);
    EXPECT_LE(r.step_p50_s, r.step_p95_s);
    EXPECT_GT(r.kv_used_bytes, 0u);
    EXPECT_LE(r.kv_used_bytes, r.kv_peak_bytes);
    EXPECT_LE(r.kv_peak_bytes, budget);
    EXPECT_EQ(r.pages_leaked, 0);
  }
  EXPECT_EQ(dense.live_tokens_per_layer, config.depth + config.capacity_gen);  // nothing evicted
  EXPECT_EQ(dense.evicted_tokens, 0);
  EXPECT_EQ(dense.chunk_reserve_bytes, 0u) << "a dense request reserves its whole prompt already";
  EXPECT_GT(h2o_f16.chunk_reserve_bytes, 0u);
  EXPECT_LT(h2o_f16.live_tokens_per_layer, config.depth);
  EXPECT_GT(h2o_f16.evicted_tokens, 0);

  const std::string md = ServeBenchMarkdown(*report);
  EXPECT_NE(md.find("kernels " + report->isa), std::string::npos) << md;
  EXPECT_NE(md.find("| h2o 0.2 int8 |"), std::string::npos) << md;
  EXPECT_NE(md.find("synthetically"), std::string::npos) << md;
  const nlohmann::json j = nlohmann::json::parse(ServeBenchJson(*report));
  EXPECT_EQ(j["throughput"].size(), 2u);
  EXPECT_EQ(j["capacity"]["configs"].size(), 3u);
  EXPECT_EQ(j["capacity"]["configs"][2]["admitted"].get<int64_t>(), h2o_int8.admitted);

  // Latency under memory pressure: the budget holds two dense requests at once; the sparse
  // configs run more at once, and every request finishes without a preemption.
  ASSERT_EQ(report->load.size(), 3u);
  EXPECT_GT(report->load_budget_bytes, 0u);
  EXPECT_EQ(report->load[0].most_running, config.load_dense_slots);
  EXPECT_GT(report->load[1].most_running, report->load[0].most_running);
  EXPECT_GE(report->load[2].most_running, report->load[1].most_running);
  for (const ServeLoadResult& r : report->load) {
    SCOPED_TRACE(r.label);
    EXPECT_EQ(r.requests, config.load_requests);
    EXPECT_EQ(r.preemptions, 0);
    EXPECT_EQ(r.pages_leaked, 0);
    EXPECT_LE(r.kv_peak_bytes, report->load_budget_bytes);
    EXPECT_GT(r.ttft_p50_s, 0);
    EXPECT_LE(r.ttft_p50_s, r.ttft_p95_s);
    EXPECT_GT(r.tokens_per_s, 0);
  }
  EXPECT_NE(md.find("Latency under memory pressure"), std::string::npos) << md;
  EXPECT_EQ(j["load"]["configs"].size(), 3u);
}

// With a chunk below the depth, a 20% budget also bounds the prompt: more requests fit than dense.
TEST(ServeBench, SparseAdmitsMoreThanDenseBeyondOneChunk) {
  KVS_SKIP_IF_NO_SHARED(path, "models/stories260K.bin");
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ServeBenchConfig config = TinyConfig();
  config.streams = {1};
  config.prefill_tokens = 0;
  config.kv_memory_mib = 8.0;
  config.depth = 1500;
  config.capacity_gen = 2;
  config.capacity_configs = {{"full", "", "f16"}, {"h2o", "0.2", "f16"}};
  auto report = RunServeBench(**model, config);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->capacity.size(), 2u);
  EXPECT_LT(report->capacity[0].admitted, report->capacity[1].admitted);
  EXPECT_GT(report->capacity[1].admitted_vs_first, 1.5);
  EXPECT_EQ(report->prefill_tps, 0);
  EXPECT_EQ(report->throughput[0].ratio_to_prefill, 0);
}

TEST(ServeBench, ValidationNamesTheFlag) {
  const auto expect_error = [](ServeBenchConfig c, const std::string& flag) {
    const Status s = ValidateServeBenchConfig(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(s.message().find(flag), std::string::npos) << s.message();
  };
  EXPECT_TRUE(ValidateServeBenchConfig(ServeBenchConfig{}).ok());
  ServeBenchConfig c;
  c.streams = {};
  expect_error(c, "--streams");
  c.streams = {1, 0};
  expect_error(c, "--streams");
  c = {};
  c.streams = {-3};
  expect_error(c, "--streams");
  c = {};
  c.prompt_tokens = 0;
  expect_error(c, "--prompt");
  c = {};
  c.gen_tokens = -1;
  expect_error(c, "--gen");
  c = {};
  c.kv_memory_mib = 0;
  expect_error(c, "--kv-memory");
  c = {};
  c.depth = 0;
  expect_error(c, "--depth");
  c = {};
  c.capacity_gen = 0;
  expect_error(c, "--capacity-gen");
  c = {};
  c.step_tokens = Engine::kMaxBatchRows + 1;
  expect_error(c, "--step-tokens");
  c = {};
  c.load_requests = 0;
  expect_error(c, "--load-requests");
  c = {};
  c.load_dense_slots = -1;
  expect_error(c, "--load-slots");
  c.run_load = false;
  EXPECT_TRUE(ValidateServeBenchConfig(c).ok()) << "unused when the part is skipped";
}

TEST(ServeBench, KvSpecs) {
  auto specs = ParseServeKvSpecs("full:f16,h2o:0.2:int8,streaming_llm:512,snapkv:0.1,full");
  ASSERT_TRUE(specs.ok()) << specs.status().ToString();
  ASSERT_EQ(specs->size(), 5u);
  EXPECT_EQ((*specs)[0].label(), "full f16");
  EXPECT_EQ((*specs)[1].label(), "h2o 0.2 int8");
  EXPECT_EQ((*specs)[2].label(), "streaming_llm 512 f16");
  EXPECT_EQ((*specs)[3].budget, "0.1");
  EXPECT_EQ((*specs)[4].kv_type, "f16");
  EXPECT_FALSE(ParseServeKvSpecs("").ok());
  EXPECT_FALSE(ParseServeKvSpecs("nosuch:0.2").ok());
  EXPECT_FALSE(ParseServeKvSpecs("h2o:f16").ok());  // no budget
  EXPECT_FALSE(ParseServeKvSpecs("h2o:0.2:f8").ok());
  EXPECT_FALSE(ParseServeKvSpecs("h2o:0.2:f16:x").ok());
}

// The command checks its flags before loading (or synthesizing) any model.
TEST(ServeBenchCli, BadFlagsFailBeforeTheModelLoads) {
  using testing::ExpectCleanFailure;
  using testing::RunCli;
  const std::string model = " -m /nonexistent/model.gguf";
  ExpectCleanFailure(RunCli("bench-serve --streams 0" + model), "--streams");
  ExpectCleanFailure(RunCli("bench-serve --streams 1,-2" + model), "--streams");
  ExpectCleanFailure(RunCli("bench-serve --prompt 0" + model), "--prompt");
  ExpectCleanFailure(RunCli("bench-serve --gen -1" + model), "--gen");
  ExpectCleanFailure(RunCli("bench-serve --kv-memory 0" + model), "--kv-memory");
  ExpectCleanFailure(RunCli("bench-serve --depth 0" + model), "--depth");
  ExpectCleanFailure(RunCli("bench-serve --load-prompt 0" + model), "--load-prompt");
  ExpectCleanFailure(RunCli("bench-serve --capacity-configs h2o:0.2:f9" + model), "--capacity-configs");
}

}  // namespace
}  // namespace kvsparse
