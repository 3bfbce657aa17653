// The KV-sparsity flags of `kvsparse generate` and `bench-speed`: they run end to end on
// stories260K, --kv-stats prints the per-layer table, a full paged run prints exactly the
// dense run's tokens, and flag mistakes give a clear error (never a crash).
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "support/cli_runner.h"

namespace kvsparse {
namespace {

using testing::CliResult;
using testing::ExpectCleanFailure;
using testing::RunCli;
using Result = CliResult;

// Runs the CLI, expecting it to succeed (the failure shows the command and its output).
Result RunOk(const std::string& args) {
  Result result = RunCli(args);
  EXPECT_EQ(result.exit_code, 0) << args << "\n" << result.all;
  return result;
}

TEST(CliKv, FullPagedGeneratesExactlyTheDenseTokens) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 80 --temp 0 -t 2";
  const Result dense = RunOk(base + " --kv-type f32");
  for (const std::string extra : {"--kv-method full --kv-type f32", "--kv-method full --kv-type f32 --page-size 5",
                                  "--kv-method h2o --kv-budget 1.0 --kv-type f32"}) {
    const Result paged = RunOk(base + " " + extra);
    EXPECT_EQ(paged.out, dense.out) << extra;
  }
}

TEST(CliKv, SparseMethodsRunWithStats) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 60 --temp 0 -t 2 --kv-stats";
  for (const std::string extra : {"--kv-method streaming_llm --kv-budget 0.25 --evict-interval 4",
                                  "--kv-method snapkv --kv-budget 48 --kv-type int8",
                                  "--kv-method tova --kv-budget 0.5 --kv-type f16 --page-size 8",
                                  "--kv-method h2o --kv-budget 0.3 --kv-type int8_kivi --evict-interval 4"}) {
    const Result r = RunOk(base + " " + extra);
    EXPECT_NE(r.all.find("| layer | method"), std::string::npos) << r.all;
    EXPECT_NE(r.all.find("policy time:"), std::string::npos) << r.all;
    EXPECT_NE(r.all.find("live KV bytes: K and V values"), std::string::npos) << r.all;
  }
  const Result bench =
      RunOk("bench-speed -m " + model + " -p 32 -n 16 -d 0 -r 1 -t 2 --kv-method h2o --kv-budget 16 --kv-stats");
  EXPECT_NE(bench.out.find("policy ms/tok"), std::string::npos) << bench.out;
  EXPECT_NE(bench.out.find("KV stats after tg16"), std::string::npos) << bench.out;
}

// Every method family and KV type runs on the new architectures and weight mixes: qwen3 (Q/K norms,
// 64-wide heads over a 256-wide residual, so per-head and page layouts use key_length, not
// dim / n_heads) and a Q4_K_M llama. A full paged cache prints the dense cache's tokens.
TEST(CliKv, MethodsAndKvTypesOnNewArchitectures) {
  for (const std::string shape_and_type : {"tiny-qwen3 --type q4_k_m", "tiny-mix --type q4_k_m", "tiny-gemma3 --type q8_0",
                                           "tiny-gemma2 --type q4_k_m", "tiny-phi3 --type q4_k_m"}) {
    const std::string model = testing::TempPath("cli_kv_arch.gguf");
    RunOk("synth --shape " + shape_and_type + " -o " + model);
    const std::string base = "generate -m " + model + " --tokens 1,17,99,42,300,7,256,500 -n 40 --temp 0 -t 2";
    const Result dense = RunOk(base + " --kv-type f32 --print-ids");
    EXPECT_EQ(RunOk(base + " --kv-method full --kv-type f32 --print-ids").out, dense.out) << shape_and_type;
    // Every method family on qwen3's wide heads; the weight mix only needs a few (CI time).
    const std::vector<std::string> all = {
        "--kv-method h2o --kv-budget 0.5 --kv-type int8", "--kv-method snapkv --kv-budget 40 --kv-type f16",
        "--kv-method streaming_llm --kv-budget 0.25 --kv-type fp8_e4m3", "--kv-method quest --kv-budget 0.5",
        "--kv-method tova --kv-budget 0.5 --kv-type int4_kivi --page-size 8",
        "--kv-method cumulative --kv-budget 0.5 --kv-type int8_kivi",
        "--kv-method h2o --kv-budget 0.5 --kv-type int2_kivi --kv-shared-heads",
        "--kv-method h2o --kv-budget 0.5 --kv-type bf16"};
    const bool qwen3 = shape_and_type.rfind("tiny-qwen3", 0) == 0;
    if (qwen3) {  // bf16 in the dense cache and in pages: the same attention, the same ids
      EXPECT_EQ(RunOk(base + " --kv-method full --kv-type bf16 --print-ids").out,
                RunOk(base + " --kv-type bf16 --print-ids").out);
    }
    const bool windows = shape_and_type.rfind("tiny-gemma", 0) == 0;
    const std::vector<std::string> few = windows ? std::vector<std::string>{all[0], all[3], all[4], all[6]}
                                                 : std::vector<std::string>(all.begin(), all.begin() + 2);
    for (const std::string& extra : qwen3 ? all : few) {
      const Result r = RunOk(base + " --kv-stats " + extra);
      EXPECT_NE(r.all.find("| layer | method"), std::string::npos) << shape_and_type << " " << extra << r.all;
    }
    if (shape_and_type.rfind("tiny-gemma3", 0) == 0) {
      // The flags' method is for the global layer (5); the sliding layers stay windowed "full".
      const Result r = RunOk(base + " --kv-stats --kv-method h2o --kv-budget 0.5");
      EXPECT_NE(r.all.find("| 5 | h2o"), std::string::npos) << r.all;
      EXPECT_NE(r.all.find("| 0 | full"), std::string::npos) << r.all;
      // An explicit entry puts a method on a sliding layer.
      const std::string config = testing::TempPath("cli_kv_gemma3.json");
      std::ofstream(config) << R"({"default": {"method": "h2o", "budget": 0.5},
                                   "layers": [{"layers": "0-1", "method": "tova", "budget": 8}]})";
      const Result explicit_entry = RunOk(base + " --kv-stats --kv-config " + config);
      EXPECT_NE(explicit_entry.all.find("| 0 | tova"), std::string::npos) << explicit_entry.all;
      EXPECT_NE(explicit_entry.all.find("| 2 | full"), std::string::npos) << explicit_entry.all;
      EXPECT_NE(explicit_entry.all.find("| 5 | h2o"), std::string::npos) << explicit_entry.all;
    }
  }
}

TEST(CliKv, ConfigFile) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string path = testing::TempPath("cli_kv_config.json");
  {
    std::ofstream f(path);
    f << R"({"default": {"method": "h2o", "budget": 32, "kv_type": "int8"},
             "layers": [{"layers": "0-1", "method": "full", "kv_type": "f16"}],
             "evict_interval": 4})";
  }
  const Result r = RunOk("generate -m " + model + " -n 50 --temp 0 -t 2 --kv-stats --kv-config " + path);
  EXPECT_NE(r.all.find("| 0 | full | f16"), std::string::npos) << r.all;
  EXPECT_NE(r.all.find("| 4 | h2o | int8"), std::string::npos) << r.all;
}

TEST(CliKv, FlagMistakesAreCleanErrors) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 4 ";
  ExpectCleanFailure(RunCli(base + "--kv-budget 0.5"), "--kv-method");
  ExpectCleanFailure(RunCli(base + "--kv-method nope"), "nope");
  ExpectCleanFailure(RunCli(base + "--kv-method h2o"), "budget");
  ExpectCleanFailure(RunCli(base + "--kv-method h2o --kv-budget 1.5"), "budget");
  ExpectCleanFailure(RunCli(base + "--kv-type q4"), "--kv-type");
  ExpectCleanFailure(RunCli(base + "--kv-config /nonexistent/kv.json"), "/nonexistent/kv.json");
  ExpectCleanFailure(RunCli(base + "--kv-config /nonexistent/kv.json --kv-method h2o"), "--kv-config");
  const Result zero_page = RunCli(base + "--kv-method full --page-size 0");
  EXPECT_FALSE(zero_page.crashed);
  EXPECT_NE(zero_page.exit_code, 0);
  ExpectCleanFailure(RunCli("bench-speed -m " + model + " -p 8 -n 0 -r 1 --kv-method h2o --kv-budget 0"), "budget");
}

// --sparse-prefill and bench-speed --compare-prefill: a sparse run reports its share of pairs next
// to the dense one; mistakes are clean errors naming the flag.
TEST(CliKv, SparsePrefillFlags) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const Result compared = RunOk("bench-speed -m " + model + " -p 300 -n 0 -r 1 --warmup 0 --no-bandwidth -t 2 " +
                                "--kv-method full --compare-prefill block_sparse:top_blocks=1:min_context=0");
  EXPECT_NE(compared.out.find("pairs computed"), std::string::npos) << compared.out;
  EXPECT_NE(compared.out.find("prefill=block_sparse block=64 top_blocks=1"), std::string::npos) << compared.out;
  RunOk("generate -m " + model + " -n 4 --temp 0 -t 2 --tokens 1,2,3 --sparse-prefill xattention");
  const std::string base = "generate -m " + model + " -n 4 ";
  ExpectCleanFailure(RunCli(base + "--sparse-prefill minference"), "--sparse-prefill");
  ExpectCleanFailure(RunCli(base + "--sparse-prefill xattention:threshold=3"), "threshold");
  ExpectCleanFailure(RunCli(base + "--kv-config /nonexistent/kv.json --sparse-prefill xattention"), "--sparse-prefill");
  ExpectCleanFailure(RunCli("bench-speed -m " + model + " -p 8 -n 0 -r 1 --compare-prefill xattention"),
                     "--compare-prefill");
}

// --kivi-residual: a window longer than the whole run never quantizes, so int8_kivi prints
// exactly f16's tokens; a window that is not whole pages is refused, naming the field;
// --kivi-v-group only where a layer stores int4 or int2 KIVI.
TEST(CliKv, KiviResidualFlag) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 40 --temp 0 -t 2 --kv-method full --page-size 16";
  const Result f16 = RunOk(base + " --kv-type f16");
  const Result windowed = RunOk(base + " --kv-type int8_kivi --kivi-residual 512");
  EXPECT_EQ(windowed.out, f16.out);
  const Result quantized = RunOk(base + " --kv-type int2_kivi --kivi-residual 16 --kv-stats");
  EXPECT_NE(quantized.out, f16.out);
  ExpectCleanFailure(RunCli(base + " --kv-type int8_kivi --kivi-residual 24"), "kivi_residual");
  // Nothing to keep in f16 on an f16 cache, paged or dense: refused rather than ignored.
  ExpectCleanFailure(RunCli(base + " --kv-type f16 --kivi-residual 16"), "--kivi-residual applies to the KIVI");
  ExpectCleanFailure(RunCli("generate -m " + model + " -n 4 --kv-type f16 --kivi-residual 16"), "--kv-type is f16");
  // V groups are int4/int2 KIVI's; int8_kivi has none to size.
  RunOk(base + " --kv-type int4_kivi --kivi-v-group 4");
  ExpectCleanFailure(RunCli(base + " --kv-type int8_kivi --kivi-v-group 4"), "--kivi-v-group applies to int4_kivi");
}

// --kv-per-head: Full per head prints exactly the dense tokens, a sparse method marks its
// per-head layers in the stats, and it conflicts with --kv-config (which says "per_head").
TEST(CliKv, PerHeadFlag) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 40 --temp 0 -t 2";
  const Result dense = RunOk(base + " --kv-type f32");
  const Result full = RunOk(base + " --kv-method full --kv-type f32 --kv-per-head");
  EXPECT_EQ(full.out, dense.out);
  const Result h2o = RunOk(base + " --kv-method h2o --kv-budget 24 --kv-type f16 --kv-per-head --kv-stats");
  EXPECT_NE(h2o.all.find("| 0 | h2o | f16/head"), std::string::npos) << h2o.all;
  ExpectCleanFailure(RunCli(base + " --kv-config /nonexistent/kv.json --kv-per-head"), "--kv-per-head");
}

// --kv-param sets method parameters on top of the paper defaults: AdaKV on per-head SnapKV,
// cumulative in mask mode with its re-ranks reported; unknown, misplaced or malformed keys are
// clean errors naming them.
TEST(CliKv, MethodParamsFromFlags) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string base = "generate -m " + model + " -n 40 --temp 0 -t 2 --kv-stats";
  const Result ada = RunOk(base +
                           " --kv-method snapkv --kv-budget 0.5 --kv-param head_budgets=adaptive "
                           "--kv-param floor=0.25 --kv-param decode_evict=true");
  EXPECT_NE(ada.all.find("| 0 | snapkv | f16/head"), std::string::npos) << ada.all;
  const Result mask = RunOk(base +
                            " --kv-method cumulative --kv-budget 0.5 --kv-param mode=mask "
                            "--kv-param rerank_period=4");
  EXPECT_NE(mask.all.find("global re-ranks"), std::string::npos) << mask.all;
  EXPECT_NE(mask.all.find("query-aware selection"), std::string::npos) << mask.all;
  ExpectCleanFailure(RunCli(base + " --kv-method h2o --kv-budget 24 --kv-param hed_budgets=adaptive"), "head_budgets");
  ExpectCleanFailure(RunCli(base + " --kv-method h2o --kv-budget 24 --kv-param mode=mask"), "cumulative");
  ExpectCleanFailure(RunCli(base + " --kv-method h2o --kv-budget 24 --kv-param floor"), "KEY=VALUE");
  ExpectCleanFailure(RunCli(base + " --kv-method h2o --kv-budget 24 --kv-param floor=2"), "floor");
  ExpectCleanFailure(RunCli(base + " --kv-param floor=0.5"), "--kv-method");
}

}  // namespace
}  // namespace kvsparse
