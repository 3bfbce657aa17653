// The method benchmark's runner: configuration enumeration, resume, shard + merge, reports,
// on the built-in retrieval model (small and exact, so accuracies are known).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kvsparse/bench_report.h"
#include "kvsparse/bench_runner.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/retrieval_model.h"
#include "support/retrieval_model_file.h"
#include "support/test_model_gguf.h"
#include "support/tiny_chat_model.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

namespace fs = std::filesystem;
using testing::TempPath;

const std::string& RetrievalModelFile() { return testing::RetrievalModelFile(RetrievalModelOptions{}.n_layers); }

BenchSpec SmallSpec() {
  BenchSpec spec;
  spec.model_path = RetrievalModelFile();
  spec.model_name = "retrieval";
  spec.methods = {"full", "streaming_llm", "snapkv"};
  spec.budgets = {"48"};
  spec.lengths = {256};
  spec.tasks = {"niah_single"};
  spec.depths = {0.3};
  spec.samples = 3;
  spec.n_threads = 1;
  return spec;
}

std::string FreshFile(const std::string& name) {
  const std::string p = TempPath(name);
  fs::remove(p);
  return p;
}

TEST(BenchRunnerTest, EnumeratesFullOncePerKvType) {
  BenchSpec spec = SmallSpec();
  spec.budgets = {"0.1", "0.2"};
  spec.kv_types = {"f16", "int8"};
  spec.tasks = {"niah_single", "latency"};
  // niah: 2 protocols x 2 kv types x (full + 2 methods x 2 budgets); latency: one protocol.
  EXPECT_EQ(EnumerateBenchConfigs(spec).size(), 2u * 2 * 5 + 1u * 2 * 5);
  std::set<std::string> keys;
  for (const BenchConfig& c : EnumerateBenchConfigs(spec)) keys.insert(c.Key(spec));
  EXPECT_EQ(keys.size(), EnumerateBenchConfigs(spec).size());
}

TEST(BenchRunnerTest, RejectsBadSpecs) {
  BenchSpec spec = SmallSpec();
  spec.methods = {"h2o", "nosuch"};
  Status st = ValidateBenchSpec(spec);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("nosuch"), std::string::npos) << st.message();
  spec = SmallSpec();
  spec.budgets = {"-1"};
  EXPECT_FALSE(ValidateBenchSpec(spec).ok());
  spec = SmallSpec();
  spec.tasks = {"no_task"};
  EXPECT_FALSE(ValidateBenchSpec(spec).ok());
  spec = SmallSpec();
  spec.depths = {1.5};
  EXPECT_FALSE(ValidateBenchSpec(spec).ok());
  EXPECT_FALSE(ParseBenchShard("3/2").ok());
  EXPECT_FALSE(ParseBenchShard("a/2").ok());
  EXPECT_FALSE(ParseBenchShard("1").ok());
  ASSERT_TRUE(ParseBenchShard("1/4").ok());
  EXPECT_TRUE(ParseBenchShard("1/4")->Owns(5));
}

TEST(BenchRunnerTest, FullSolvesAndSmallStreamingWindowLosesTheNeedle) {
  const BenchSpec spec = SmallSpec();
  const std::string results = FreshFile("bench_runner_rows.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto rows = ReadBenchResultsSorted(results);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), EnumerateBenchConfigs(spec).size());
  for (const nlohmann::json& row : *rows) {
    SCOPED_TRACE(row.dump());
    ASSERT_TRUE(row.contains("accuracy"));
    if (row["method"] == "full") {
      EXPECT_DOUBLE_EQ(row["accuracy"].get<double>(), 1.0);
    }
    if (row["method"] == "streaming_llm" && row["protocol"] == "question_after") {
      // 48 tokens of sinks + recent window cannot hold a needle at 30% of 256 tokens.
      EXPECT_DOUBLE_EQ(row["accuracy"].get<double>(), 0.0);
    }
    EXPECT_EQ(row["samples"].get<int>(), 3);
    EXPECT_GT(row["kv_allocated_bytes"].get<double>(), 0);
    // The live bytes by part add up; int8 pays for its scales, f16 has none.
    EXPECT_DOUBLE_EQ(row["kv_live_value_bytes"].get<double>() + row["kv_live_scale_bytes"].get<double>() +
                         row["kv_live_position_bytes"].get<double>() + row["kv_live_residual_bytes"].get<double>(),
                     row["kv_live_bytes"].get<double>());
    EXPECT_GT(row["kv_live_value_bytes"].get<double>(), 0);
    EXPECT_EQ(row["kv_live_scale_bytes"].get<double>() > 0, row["kv_type"] == "int8");
    EXPECT_EQ(row["layer_live_tokens"].size(), 4u);
    EXPECT_TRUE(row["subtasks"].contains("depth=0.3")) << row["subtasks"].dump();
  }
}

TEST(BenchRunnerTest, ResumeSkipsFinishedRowsAndRedoesATruncatedOne) {
  const BenchSpec spec = SmallSpec();
  const std::string results = FreshFile("bench_runner_resume.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto first = ReadBenchResultsSorted(results);
  ASSERT_TRUE(first.ok());
  // A second run finds every configuration done: the file is unchanged (same timings too).
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto second = ReadBenchResultsSorted(results);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*first, *second);

  // Simulate a crash in the middle of writing the last row: it is dropped and redone.
  std::string text;
  {
    std::ifstream in(results);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_GT(text.size(), 40u);
  text.resize(text.size() - 30);
  {
    std::ofstream out(results, std::ios::trunc);
    out << text;
  }
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto third = ReadBenchResultsSorted(results);
  ASSERT_TRUE(third.ok());
  ASSERT_EQ(third->size(), first->size());
  for (size_t i = 0; i < third->size(); ++i) EXPECT_EQ((*third)[i]["key"], (*first)[i]["key"]);
}

TEST(BenchRunnerTest, ACorruptMiddleLineIsAnErrorNamingTheLine) {
  const std::string results = FreshFile("bench_runner_corrupt.jsonl");
  {
    std::ofstream out(results);
    out << "{\"key\": \"a\"}\nnot json\n{\"key\": \"b\"}\n";
  }
  auto store = BenchResultStore::Open(results);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find(":2:"), std::string::npos) << store.status().message();
}

// The accuracy-related fields of a row (timings differ between runs).
nlohmann::json Outcome(const nlohmann::json& row) {
  return {row["key"], row["accuracy"], row["subtasks"], row["layer_live_tokens"], row["kv_allocated_bytes"]};
}

TEST(BenchRunnerTest, ShardsMergeIntoTheUnshardedRun) {
  const BenchSpec spec = SmallSpec();
  const std::string whole = FreshFile("bench_runner_whole.jsonl");
  BenchRunOptions options;
  options.results_path = whole;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  std::vector<std::string> shard_files;
  for (int i = 0; i < 2; ++i) {
    shard_files.push_back(FreshFile("bench_runner_shard" + std::to_string(i) + ".jsonl"));
    BenchRunOptions shard_options;
    shard_options.results_path = shard_files.back();
    shard_options.shard = BenchShard{i, 2};
    ASSERT_TRUE(RunBench(spec, shard_options).ok());
  }
  const std::string merged = FreshFile("bench_runner_merged.jsonl");
  ASSERT_TRUE(MergeBenchResults(shard_files, merged).ok());
  auto a = ReadBenchResultsSorted(whole);
  auto b = ReadBenchResultsSorted(merged);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  for (size_t i = 0; i < a->size(); ++i) EXPECT_EQ(Outcome((*a)[i]), Outcome((*b)[i]));
}

TEST(BenchRunnerTest, FidelityAndLatencyRows) {
  BenchSpec spec = SmallSpec();
  spec.tasks = {"fidelity", "latency"};
  spec.methods = {"full", "h2o"};
  spec.samples = 1;
  spec.latency_gen = 4;
  const std::string results = FreshFile("bench_runner_fidelity.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto rows = ReadBenchResultsSorted(results);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 4u);
  for (const nlohmann::json& row : *rows) {
    SCOPED_TRACE(row.dump());
    if (row["task"] == "fidelity") {
      if (row["method"] == "full") {
        EXPECT_NEAR(row["kl"].get<double>(), 0.0, 1e-3);  // f16 pages vs the f32 reference cache
        // Filler positions predict near-ties, which f16 rounding may flip.
        EXPECT_GE(row["top1_agreement"].get<double>(), 0.95);
      } else {
        EXPECT_GE(row["kl"].get<double>(), 0.0);
      }
    } else {
      EXPECT_GT(row["ttft_ms"]["median"].get<double>(), 0.0);
      EXPECT_GT(row["decode_ms"]["median"].get<double>(), 0.0);
    }
  }
  const std::string report = BenchReportMarkdown(*rows);
  EXPECT_NE(report.find("### fidelity"), std::string::npos);
  EXPECT_NE(report.find("### latency and memory"), std::string::npos);
}

// "METHOD:KEY=VALUE" sets method parameters (--kv-param's keys) in a sweep: the row keeps the
// whole name, the parameters reach the layers (AdaKV's adaptive heads here), and the method's
// paper cadence still applies; malformed names are refused before anything runs.
TEST(BenchRunnerTest, MethodNamesCarryParameters) {
  BenchSpec spec = SmallSpec();
  spec.methods = {"h2o:head_budgets=adaptive:floor=0.25"};
  spec.protocols = {BenchProtocol::kQuestionLast};
  spec.samples = 1;
  ASSERT_TRUE(ValidateBenchSpec(spec).ok());
  const std::vector<BenchConfig> configs = EnumerateBenchConfigs(spec);
  ASSERT_EQ(configs.size(), 1u);
  EXPECT_EQ(BenchEvictInterval(spec, configs[0]), 1) << "h2o's paper cadence";
  auto model = Model::Load(spec.model_path);
  ASSERT_TRUE(model.ok());
  auto row = RunBenchConfig(spec, configs[0], **model, nullptr);
  ASSERT_TRUE(row.ok()) << row.status().ToString();
  EXPECT_EQ((*row)["method"], "h2o:head_budgets=adaptive:floor=0.25");
  for (const std::string bad : {"h2o:", "h2o:floor", "h2o:=1", "nosuch:floor=1"}) {
    spec.methods = {bad};
    const Status st = ValidateBenchSpec(spec);
    ASSERT_FALSE(st.ok()) << bad;
    EXPECT_NE(st.message().find("--methods"), std::string::npos) << st.message();
  }
  // A key the method does not take fails when the configuration is built, naming the key.
  spec.methods = {"streaming_llm:floor=0.5"};
  const auto wrong = RunBenchConfig(spec, EnumerateBenchConfigs(spec)[0], **model, nullptr);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("floor"), std::string::npos) << wrong.status().ToString();
}

TEST(BenchRunnerTest, EvictIntervalIsThePaperCadenceUnlessGiven) {
  BenchSpec spec = SmallSpec();
  spec.methods = {"full", "h2o", "tova", "streaming_llm", "scissorhands", "random", "snapkv", "pyramidkv", "knorm",
                  "quest"};
  spec.tasks = {"niah_single", "fidelity", "latency"};
  const int serving = KvSparsityConfig{}.evict_interval;
  for (const BenchConfig& c : EnumerateBenchConfigs(spec)) {
    SCOPED_TRACE(c.Key(spec));
    const bool per_step = c.method == "h2o" || c.method == "tova" || c.method == "streaming_llm" ||
                          c.method == "scissorhands" || c.method == "random";
    EXPECT_EQ(BenchEvictInterval(spec, c), c.task != "latency" && per_step ? 1 : serving);
    EXPECT_NE(c.Key(spec).find(fmt::format("/i{}/", BenchEvictInterval(spec, c))), std::string::npos);
  }
  // An explicit interval applies to every method and task, and is a different configuration.
  BenchSpec given = spec;
  given.evict_interval = 4;
  const std::vector<BenchConfig> configs = EnumerateBenchConfigs(spec);
  for (const BenchConfig& c : configs) {
    EXPECT_EQ(BenchEvictInterval(given, c), 4);
    EXPECT_NE(c.Key(given), c.Key(spec));
  }
  given.evict_interval = -1;
  Status st = ValidateBenchSpec(given);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--evict-interval"), std::string::npos) << st.message();
}

TEST(BenchRunnerTest, RowsRecordTheIntervalThatRan) {
  BenchSpec spec = SmallSpec();
  spec.methods = {"full", "h2o", "snapkv"};
  spec.protocols = {BenchProtocol::kQuestionLast};
  spec.samples = 1;
  const std::string results = FreshFile("bench_runner_interval.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto rows = ReadBenchResultsSorted(results);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 3u);
  for (const nlohmann::json& row : *rows) {
    SCOPED_TRACE(row.dump());
    const int expected = row["method"] == "h2o" ? 1 : KvSparsityConfig{}.evict_interval;
    EXPECT_EQ(row["evict_interval"].get<int>(), expected);
    EXPECT_NE(row["key"].get<std::string>().find(fmt::format("/i{}/", expected)), std::string::npos);
  }
}

TEST(BenchRunnerTest, SampledFidelityStreamIsDeterministicAndSharedByEveryMethod) {
  // A random-weight model: broad next-token distributions, so the sampled streams vary (the
  // retrieval model's would repeat one symbol).
  const std::string model_path = TempPath("bench_runner_random_model.gguf");
  ASSERT_TRUE(testing::WriteTinyModelGguf(testing::TinyModelSpec{}, model_path).ok());
  BenchSpec spec = SmallSpec();
  spec.model_path = model_path;
  spec.model_name = "random";
  spec.tasks = {"fidelity"};
  spec.methods = {"full", "h2o", "streaming_llm", "snapkv"};
  spec.lengths = {128};
  spec.samples = 2;
  std::vector<std::vector<nlohmann::json>> runs;
  for (int run = 0; run < 2; ++run) {
    const std::string results = FreshFile(fmt::format("bench_runner_stream{}.jsonl", run));
    BenchRunOptions options;
    options.results_path = results;
    { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
    auto rows = ReadBenchResultsSorted(results);
    ASSERT_TRUE(rows.ok());
    ASSERT_EQ(rows->size(), 4u);
    runs.push_back(*rows);
  }
  const std::string hash = runs[0][0]["stream_hash"].get<std::string>();
  for (const std::vector<nlohmann::json>& rows : runs) {
    for (const nlohmann::json& row : rows) {
      SCOPED_TRACE(row.dump());
      EXPECT_EQ(row["stream"], "sampled(seed=1)");
      EXPECT_NE(row["key"].get<std::string>().find("sampled(seed=1)"), std::string::npos);
      EXPECT_EQ(row["stream_hash"], hash);  // every method, both runs: the same tokens
      EXPECT_EQ(row["samples"].get<int>(), 2);
    }
  }
  // One configuration run alone (no shared cache) samples the same streams.
  auto loaded = Model::Load(model_path);
  ASSERT_TRUE(loaded.ok());
  const std::unique_ptr<Model>& model = *loaded;
  auto row = RunBenchConfig(spec, EnumerateBenchConfigs(spec).back(), *model, nullptr);
  ASSERT_TRUE(row.ok()) << row.status().ToString();
  EXPECT_EQ((*row)["stream_hash"], hash);
  // Another seed samples other streams, and is another configuration.
  BenchSpec other = spec;
  other.seed = 2;
  auto other_row = RunBenchConfig(other, EnumerateBenchConfigs(other).front(), *model, nullptr);
  ASSERT_TRUE(other_row.ok()) << other_row.status().ToString();
  EXPECT_NE((*other_row)["stream_hash"], hash);
  EXPECT_EQ((*other_row)["stream"], "sampled(seed=2)");
  EXPECT_NE(EnumerateBenchConfigs(other).front().Key(other), EnumerateBenchConfigs(spec).front().Key(spec));
  const std::string report = BenchReportMarkdown(runs[0]);
  EXPECT_NE(report.find("| random | sampled(seed=1) | h2o | 48 | f16 | 1 | 128 |"), std::string::npos) << report;
}

TEST(BenchRunnerTest, FidelityStreamFlagsAreChecked) {
  BenchSpec spec = SmallSpec();
  spec.tasks = {"fidelity"};
  spec.fidelity_tokens = TempPath("bench_runner_no_such_ids.txt");
  fs::remove(spec.fidelity_tokens);
  Status st = ValidateBenchSpec(spec);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--fidelity-tokens: cannot read " + spec.fidelity_tokens), std::string::npos)
      << st.message();
  spec.fidelity_text = spec.fidelity_tokens;
  st = ValidateBenchSpec(spec);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("at most one"), std::string::npos) << st.message();
  spec.fidelity_tokens.clear();
  spec.tasks = {"niah_single"};
  st = ValidateBenchSpec(spec);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("add fidelity to --tasks"), std::string::npos) << st.message();
}

TEST(BenchRunnerTest, FidelityOnTheUsersTextWithTheModelsTokenizer) {
  std::string note;
  auto model_path = testing::WriteTinyChatModel("bench_runner_text_model.gguf", 256, &note);
  ASSERT_TRUE(model_path.ok()) << model_path.status().ToString();
  std::string text;
  for (int i = 0; i < 30; ++i) text += "The little dog ran to the park and found a red ball under a tree. ";
  const std::string text_path = TempPath("bench_runner_text.txt");
  std::ofstream(text_path, std::ios::trunc) << text;
  BenchSpec spec;
  spec.model_path = *model_path;
  spec.model_name = "tiny-chat";
  spec.tasks = {"fidelity"};
  spec.methods = {"full", "streaming_llm"};
  spec.budgets = {"24"};
  spec.lengths = {96};
  spec.samples = 3;
  spec.n_threads = 1;
  spec.fidelity_text = text_path;
  const std::string results = FreshFile("bench_runner_text.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString() << " (" << note << ")"; }
  auto rows = ReadBenchResultsSorted(results);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  for (const nlohmann::json& row : *rows) {
    SCOPED_TRACE(row.dump());
    EXPECT_EQ(row["stream"], "text:" + text_path);
    EXPECT_EQ(row["stream_hash"], (*rows)[0]["stream_hash"]);
    EXPECT_EQ(row["samples"].get<int>(), 1);  // a file is one stream
    if (row["method"] == "full") {
      EXPECT_NEAR(row["kl"].get<double>(), 0.0, 1e-3);
    }
  }
  EXPECT_NE(BenchReportMarkdown(*rows).find("| tiny-chat | text:" + text_path + " |"), std::string::npos);
}

TEST(BenchRunnerTest, ReportHasOrderingAccuracyTablesAndPlots) {
  const BenchSpec spec = SmallSpec();
  const std::string results = FreshFile("bench_runner_report.jsonl");
  BenchRunOptions options;
  options.results_path = results;
  { Status st = RunBench(spec, options); ASSERT_TRUE(st.ok()) << st.ToString(); }
  auto rows = ReadBenchResultsSorted(results);
  ASSERT_TRUE(rows.ok());
  const std::string report = BenchReportMarkdown(*rows);
  EXPECT_NE(report.find("## Method ordering"), std::string::npos) << report;
  EXPECT_NE(report.find("### niah_single — question_last"), std::string::npos) << report;
  EXPECT_NE(report.find("| full | — | f16 | — | 100 ["), std::string::npos) << report;
  // StreamingLLM evicts at every decode step (its paper's cadence), SnapKV not while decoding.
  EXPECT_NE(report.find("| streaming_llm | 48 | f16 | 1 |"), std::string::npos) << report;
  const std::string dir = TempPath("bench_runner_plots");
  fs::create_directories(dir);
  auto pngs = WriteBenchPlots(results, dir);
  if (!pngs.ok() && pngs.status().code() == StatusCode::kUnimplemented) {
    GTEST_SKIP() << "python3-matplotlib is not installed: plots not checked";
  }
  ASSERT_TRUE(pngs.ok()) << pngs.status().ToString();
  EXPECT_GE(pngs->size(), 2u);
  for (const std::string& p : *pngs) EXPECT_GT(fs::file_size(p), 1000u) << p;
}

}  // namespace
}  // namespace kvsparse
