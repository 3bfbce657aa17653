#include "kvsparse/calibrate.h"
#include "kvsparse/kv_policies.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>

#include "support/cli_runner.h"
#include "support/retrieval_model_file.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A search with a known answer on the one-head retrieval model (retrieval_model.h), 4 layers:
// layer 3 holds the induction head that reads the needle, layers 1-2 are exact no-ops. Under
// StreamingLLM (sinks + the newest tokens) the induction layer loses every needle outside its
// window at any budget of the ladder, so it must stay dense; the no-op layers need nothing and
// must take the lowest rung.
CalibrateSpec KnownAnswerSpec() {
  CalibrateSpec spec;
  spec.model_path = testing::RetrievalModelFile(4);
  spec.tasks = {"niah_single"};
  spec.lengths = {256};
  spec.methods = {"streaming_llm"};
  spec.budgets = {"0.5", "0.05", "0.2"};  // given in any order: the ladder is sorted
  spec.kv_types = {"f16"};
  spec.samples = 5;
  spec.proxy_samples = 5;
  spec.holdout_samples = 5;
  spec.n_threads = 1;
  return spec;
}

TEST(CalibrateTest, SensitiveLayerStaysDenseAndNoOpLayersTakeTheLowestRung) {
  const std::string dir = testing::TempPath("calibrate_known_answer");
  fs::remove_all(dir);
  CalibrateOptions options;
  options.work_dir = dir;
  options.plots = false;
  StatusOr<CalibrateResult> result = RunCalibrate(KnownAnswerSpec(), options);
  ASSERT_TRUE(result.ok()) << result.status().message();
  const KvSparsityConfig& config = result->config;
  std::printf("chosen: %s\n", result->report["chosen"].get<std::string>().c_str());
  ASSERT_EQ(config.layers.size(), 4u);
  EXPECT_EQ(config.layers[3].method, KvMethod::kFull) << KvSparsityConfigSummary(config);
  for (int l : {1, 2}) {
    EXPECT_EQ(config.layers[l].method, KvMethod::kStreamingLlm) << "layer " << l;
    EXPECT_DOUBLE_EQ(config.layers[l].budget.fraction, 0.05) << "layer " << l;
  }
  const json& report = result->report;
  EXPECT_TRUE(report["holdout_pass"].get<bool>()) << report.dump(1);
  // Uniform StreamingLLM never keeps the needle: no baseline passes, and the report says so.
  ASSERT_EQ(report["uniform"].size(), 1u);
  EXPECT_FALSE(report["uniform"][0]["pass"].get<bool>());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "report.md"));

  // Resumes without running anything again: the same answer from the cached evaluations.
  const size_t evaluations_lines = [&] {
    std::ifstream f(fs::path(dir) / "evaluations.jsonl");
    return static_cast<size_t>(std::count(std::istreambuf_iterator<char>(f), {}, '\n'));
  }();
  StatusOr<CalibrateResult> again = RunCalibrate(KnownAnswerSpec(), options);
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(KvSparsityConfigSummary(again->config), KvSparsityConfigSummary(config));
  std::ifstream f(fs::path(dir) / "evaluations.jsonl");
  EXPECT_EQ(static_cast<size_t>(std::count(std::istreambuf_iterator<char>(f), {}, '\n')), evaluations_lines);
}

// calibrate -> kv-config.json -> `kvsparse generate --kv-config` gives the greedy ids that
// calibrate's own held-out check produced on the same prompt.
TEST(CalibrateTest, ConfigFileRoundTripsThroughGenerate) {
  const std::string dir = testing::TempPath("calibrate_round_trip");
  fs::remove_all(dir);
  CalibrateSpec spec = KnownAnswerSpec();
  spec.methods = {"streaming_llm", "snapkv"};  // a mixed config: snapkv where the needle is read
  spec.kv_types = {"f16", "int8"};
  CalibrateOptions options;
  options.work_dir = dir;
  options.plots = false;
  StatusOr<CalibrateResult> result = RunCalibrate(spec, options);
  ASSERT_TRUE(result.ok()) << result.status().message();
  std::printf("chosen: %s\n", result->report["chosen"].get<std::string>().c_str());
  const json& check = result->report["check"];
  ASSERT_TRUE(check.is_object()) << result->report.dump(1);
  std::string tokens;
  for (const json& t : check["prompt_tokens"]) tokens += (tokens.empty() ? "" : ",") + std::to_string(t.get<int>());
  const testing::CliResult r =
      testing::RunCli(fmt::format("generate -m {} --kv-config {} --tokens {} -n {} --print-ids -b 4096 -c 1024 -t 1",
                                  spec.model_path, result->config_path, tokens, check["max_new_tokens"].get<int>()));
  ASSERT_EQ(r.exit_code, 0) << r.all;
  const size_t at = r.out.find("generated: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::istringstream ids(r.out.substr(at + 11));
  std::vector<int> generated;
  for (int id; ids >> id;) generated.push_back(id);
  const std::vector<int> expected = check["generated"].get<std::vector<int>>();
  ASSERT_FALSE(expected.empty());
  // generate runs to -n; calibrate's sample stops where the task's answer ends: compare that much.
  ASSERT_GE(generated.size(), expected.size()) << r.out;
  generated.resize(expected.size());
  EXPECT_EQ(generated, expected) << r.out;
  std::printf("generate --kv-config: %s\n", r.out.substr(at).c_str());
}

// Cumulative layers in a per-layer config keep their searched budgets as their retentions (no
// depth schedule on top), and the shared ranking's re-rank period is raised while accuracy holds.
TEST(CalibrateTest, CumulativeLayersGetRetentionsAndALongerRerankPeriod) {
  CalibrateSpec spec = KnownAnswerSpec();
  spec.methods = {"cumulative", "snapkv"};  // cumulative first: it takes the layers that need nothing
  CalibrateOptions options;
  options.work_dir = testing::TempPath("calibrate_cumulative");
  options.plots = false;
  StatusOr<CalibrateResult> result = RunCalibrate(spec, options);
  ASSERT_TRUE(result.ok()) << result.status().message();
  std::printf("chosen: %s\n", result->report["chosen"].get<std::string>().c_str());
  const KvSparsityConfig& config = result->config;
  for (int l : {1, 2}) {
    const LayerKvConfig& layer = config.layers[l];
    ASSERT_EQ(layer.method, KvMethod::kCumulative) << "layer " << l;
    EXPECT_EQ(layer.params.schedule, RetentionSchedule::kNone);
    EXPECT_DOUBLE_EQ(layer.budget.fraction, 0.05);
    EXPECT_GT(layer.params.rerank_period, DefaultMethodParams(KvMethod::kCumulative).rerank_period);
  }
  StatusOr<KvSparsityConfig> file = LoadKvSparsityConfig(result->config_path, 4);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(KvSparsityConfigSummary(*file), KvSparsityConfigSummary(config));
  EXPECT_TRUE(result->report["holdout_pass"].get<bool>());
}

TEST(CalibrateTest, RejectsBadSpecsWithTheFlagNamed) {
  CalibrateSpec spec = KnownAnswerSpec();
  CalibrateOptions options;
  options.work_dir = testing::TempPath("calibrate_bad");
  const std::pair<std::function<void(CalibrateSpec&)>, std::string> cases[] = {
      {[](CalibrateSpec& s) { s.keep = 1.5; }, "--keep"},
      {[](CalibrateSpec& s) { s.tasks = {"latency"}; }, "latency"},
      {[](CalibrateSpec& s) { s.methods = {"nosuch"}; }, "nosuch"},
      {[](CalibrateSpec& s) { s.methods = {"full"}; }, "'full' is not a candidate"},
      {[](CalibrateSpec& s) { s.methods = {"h2o:nosuch=1"}; }, "--methods h2o:nosuch=1"},
      {[](CalibrateSpec& s) { s.budgets = {"2.5"}; }, "budget"},
      {[](CalibrateSpec& s) { s.objective = "fast"; }, "--objective"},
  };
  for (const auto& [change, mention] : cases) {
    CalibrateSpec s = spec;
    change(s);
    StatusOr<CalibrateResult> r = RunCalibrate(s, options);
    ASSERT_FALSE(r.ok()) << mention;
    EXPECT_NE(r.status().message().find(mention), std::string::npos) << r.status().message();
  }
}

// The command fails cleanly on bad flags and files, naming them.
TEST(CalibrateTest, CommandRejectsBadInputCleanly) {
  const std::string dir = testing::TempPath("calibrate_cli_bad");
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m /nonexistent/model.gguf -o " + dir), "/nonexistent/model.gguf");
  const std::string model = testing::RetrievalModelFile(4);
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m " + model + " --keep 2 -o " + dir), "--keep");
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m " + model + " --lengths 1q -o " + dir), "--lengths");
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m " + model + " --methods h2o:nosuch=1 -o " + dir), "nosuch");
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m " + model + " --tasks nosuch -o " + dir), "nosuch");
  testing::ExpectCleanFailure(testing::RunCli("calibrate -m " + model + " --shard 3/2 -o " + dir), "--shard");
}

}  // namespace
}  // namespace kvsparse
