// End-to-end checks of the `kvsparse` binary: bad inputs give a clear error and a non-zero
// exit (never a crash), and convert produces a GGUF that generates exactly like the original.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
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

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(CliBadInput, MissingFile) {
  ExpectCleanFailure(RunCli("inspect /nonexistent/model.gguf"), "/nonexistent/model.gguf");
  ExpectCleanFailure(RunCli("generate -m /nonexistent/model.gguf -n 1"), "/nonexistent/model.gguf");
}

// The kernel family is reported, can be chosen, and a bad choice is a clear error before any work.
TEST(CliKernels, VersionNamesTheKernelFamily) {
  const Result r = RunCli("--version");
  EXPECT_EQ(r.exit_code, 0) << r.all;
  EXPECT_NE(r.out.find("kernels: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("compiled: "), std::string::npos) << r.out;
  const Result scalar = RunCli("--isa scalar synth --list");
  EXPECT_EQ(scalar.exit_code, 0) << scalar.all;
  EXPECT_EQ(RunCli("synth --list --isa scalar").exit_code, 0);
  const Result env = RunCli("--version", "KVSPARSE_ISA=scalar");
  EXPECT_NE(env.out.find("kernels: scalar"), std::string::npos) << env.out;
}

TEST(CliKernels, BadFamilyIsAClearError) {
  for (const std::string& args : {std::string("--isa avx9 synth --list"), std::string("synth --list --isa sse")}) {
    const Result r = RunCli(args);
    EXPECT_FALSE(r.crashed) << r.all;
    EXPECT_NE(r.exit_code, 0) << r.all;
    EXPECT_NE(r.all.find("expected scalar, avx2 or avx512"), std::string::npos) << r.all;
  }
  const Result env = RunCli("synth --list", "KVSPARSE_ISA=avx9");
  EXPECT_NE(env.exit_code, 0) << env.all;
  EXPECT_NE(env.all.find("KVSPARSE_ISA"), std::string::npos) << env.all;
}

TEST(CliBadInput, BenchSpeedWithNothingToTime) {
  ExpectCleanFailure(RunCli("bench-speed -p 0 -n 0 -m /nonexistent/model.gguf"), "nothing to time");
  ExpectCleanFailure(RunCli("bench-speed -p -4 -n 1 -m /nonexistent/model.gguf"), "-p/--n-prompt");
}

TEST(CliBadInput, WrongMagic) {
  const std::string path = testing::TempPath("wrong_magic.gguf");
  WriteFile(path, std::string("NOPE") + std::string(64, '\x01'));
  const Result r = RunCli("inspect " + path);
  EXPECT_FALSE(r.crashed) << r.all;
  EXPECT_NE(r.exit_code, 0) << r.all;
}

TEST(CliBadInput, TruncatedGguf) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string gguf = testing::TempPath("cli_trunc_src.gguf");
  ASSERT_EQ(RunCli("convert " + model + " -o " + gguf).exit_code, 0);
  const std::string bytes = ReadFile(gguf);
  for (size_t cut : {size_t{3}, size_t{20}, bytes.size() / 3, bytes.size() - 1}) {
    const std::string path = testing::TempPath("cli_trunc.gguf");
    WriteFile(path, bytes.substr(0, cut));
    ExpectCleanFailure(RunCli("generate -m " + path + " -n 1"), "cli_trunc.gguf");
  }
}

TEST(CliBadInput, TruncatedLlama2c) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string path = testing::TempPath("cli_trunc.bin");
  WriteFile(path, ReadFile(model).substr(0, 5000));
  ExpectCleanFailure(RunCli("generate -m " + path + " -n 1"), "cli_trunc.bin");
}

TEST(CliBadInput, PromptLongerThanContext) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  ExpectCleanFailure(RunCli("generate -m " + model + " -c 4 --tokens 1,2,3,4,5,6"), "context");
}

TEST(CliBadInput, TokenOutOfRange) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  ExpectCleanFailure(RunCli("generate -m " + model + " --tokens 1,100000"), "100000");
  ExpectCleanFailure(RunCli("generate -m " + model + " --tokens 1,x"), "x");
}

TEST(CliBadInput, TextPromptWithoutTokenizer) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  ExpectCleanFailure(RunCli("generate -m " + model + " -p hello"), "tokenizer");
}

TEST(CliBadInput, BadOptions) {
  ExpectCleanFailure(RunCli("synth --shape no-such-shape -o /tmp/x.gguf"), "no-such-shape");
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  ExpectCleanFailure(RunCli("generate -m " + model + " --kv-type int3"), "int3");
  ExpectCleanFailure(RunCli("convert " + model + " -o /tmp/x.gguf --type q4_k"), "divisible by 256");
}

// Issue 30's probes: sizes the machine cannot hold are refused before anything is allocated, with
// the bytes needed and available; sampling values get the server's ranges (SamplerValueRequirement);
// counts are checked by the flag parser. Never a crash or the OOM killer.
TEST(CliBadInput, ResourceAndSamplingProbes) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string gen = "generate -m " + model + " --tokens 1,2 ";
  // 100M tokens of a dense f16 cache are 61 GiB; the cap makes the answer the same on any machine.
  const Result huge = RunCli(gen + "-n 4 -c 100000000", "KVSPARSE_MEMORY_LIMIT_MIB=16384");
  ExpectCleanFailure(huge, "100000000 tokens (5 layers, 61.47 GiB) with the engine's scratch for 2048-row steps needs");
  // The batch: a 2048-token cache (1.3 MiB) fits in 4 MiB, with its 2048-row steps' scratch it does not.
  ExpectCleanFailure(RunCli(gen + "-n 4 -c 2048", "KVSPARSE_MEMORY_LIMIT_MIB=4"), "scratch for 2048-row steps needs");
  EXPECT_NE(huge.all.find("16.00 GiB available (KVSPARSE_MEMORY_LIMIT_MIB)"), std::string::npos) << huge.all;
  ExpectCleanFailure(RunCli(gen + "--top-p 2"), "--top-p must be greater than 0 and at most 1, got 2");
  ExpectCleanFailure(RunCli(gen + "--temp -1"), "--temp must be between 0 and 2, got -1");
  ExpectCleanFailure(RunCli(gen + "--top-k -3"), "--top-k must be an integer of at least -1");
  ExpectCleanFailure(RunCli(gen + "--repeat-penalty 0"), "--repeat-penalty must be greater than 0");
  ExpectCleanFailure(RunCli(gen + "-t -1"), "--threads: Value -1 not in range 0 to 1024");
  ExpectCleanFailure(RunCli(gen + "-b 0"), "--batch-size: must be positive, got 0");
  ExpectCleanFailure(RunCli(gen + "-c -5"), "--ctx-size");
  // The paged cache allocates as tokens come: past the machine's memory it stops with an error.
  // 1.5 MiB: the 500-row scratch (1.39 MiB) fits and leaves the pages about 110 KiB.
  ExpectCleanFailure(RunCli(gen + "-n 400 -c 500 --kv-method h2o --kv-budget 0.9", "KVSPARSE_MEMORY_LIMIT_MIB=1.5"),
                     "KV budget");
  ExpectCleanFailure(RunCli(gen + "-n 400 -c 500 --kv-method h2o --kv-budget 0.9", "KVSPARSE_MEMORY_LIMIT_MIB=0.1"),
                     "the engine's scratch for 500-row steps needs 1.4 MiB");
  // A sparse cache of a 100M-token context reserves address space only: it runs.
  const Result sparse = RunCli(gen + "-n 4 -c 100000000 --kv-method h2o --kv-budget 0.2");
  EXPECT_EQ(sparse.exit_code, 0) << sparse.all;
  // -1 generates until the context is full.
  const Result fill = RunCli("generate -m " + model + " --tokens 1,2 -n -1 -c 40");
  EXPECT_EQ(fill.exit_code, 0) << fill.all;
  EXPECT_NE(fill.all.find("generated: 38 tokens"), std::string::npos) << fill.all;
}

// The keys of a bench results file, in file order.
std::vector<std::string> ResultKeys(const std::string& path) {
  std::vector<std::string> keys;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("\"key\":\"");
    if (at == std::string::npos) continue;
    const size_t start = at + 7;
    keys.push_back(line.substr(start, line.find('"', start) - start));
  }
  return keys;
}

// `kvsparse bench` killed with SIGKILL in the middle of its run, with a half-written row left at
// the end of its results (as a kill during a write leaves), resumes: every configuration ends up
// in the file exactly once, the same set a run without a kill writes.
TEST(CliBench, SigkillMidRunResumesWithoutLosingOrRepeatingAConfiguration) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string args = "bench -m " + model +
                           " --tasks fidelity --methods full,h2o,snapkv,streaming_llm,tova,quest --budgets 0.2,0.5 "
                           "--lengths 256 --samples 4 --no-plots -t 1 -o ";
  const std::string clean_dir = testing::TempPath("bench_sigkill_clean"), killed_dir = testing::TempPath("bench_sigkill");
  std::filesystem::remove_all(clean_dir);
  std::filesystem::remove_all(killed_dir);
  ASSERT_EQ(RunCli(args + clean_dir).exit_code, 0);
  std::vector<std::string> expected = ResultKeys(clean_dir + "/results.jsonl");
  ASSERT_EQ(expected.size(), 11u);  // full once, 5 methods x 2 budgets

  // Kill it once 3 rows are written, then leave half a row behind.
  const std::string results = killed_dir + "/results.jsonl";
  const std::string script = "mkdir -p " + killed_dir + "; " + testing::CliPath() + " " + args + killed_dir +
                             " >/dev/null 2>&1 & pid=$!; "
                             "while [ \"$(cat " + results + " 2>/dev/null | wc -l)\" -lt 3 ]; do sleep 0.002; done; "
                             "kill -9 $pid; wait $pid; exit 0";
  ASSERT_EQ(std::system(("bash -c '" + script + "'").c_str()), 0);
  const std::vector<std::string> before = ResultKeys(results);
  ASSERT_GE(before.size(), 3u);
  ASSERT_LT(before.size(), expected.size()) << "the run finished before the kill";
  {
    std::ofstream out(results, std::ios::app);
    out << "{\"key\":\"half-writ";
  }
  const Result resumed = RunCli(args + killed_dir);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.all;
  EXPECT_NE(resumed.all.find("dropping an incomplete last line"), std::string::npos) << resumed.all;
  std::vector<std::string> after = ResultKeys(results);
  std::sort(after.begin(), after.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(after, expected);  // none lost, none twice
}

// Generated token ids (the line after "generated:").
std::string GeneratedIds(const std::string& output) {
  const size_t at = output.find("generated:");
  if (at == std::string::npos) return "";
  return output.substr(at, output.find('\n', at) - at);
}

TEST(CliConvert, GgufGeneratesLikeTheCheckpoint) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string gguf = testing::TempPath("stories260K_f32.gguf");
  const Result conv = RunCli("convert " + model + " -o " + gguf + " --type f32");
  ASSERT_EQ(conv.exit_code, 0) << conv.all;
  const std::string args = " --tokens 1 -n 100 --temp 0 --kv-type f32 -t 2";
  const Result a = RunCli("generate -m " + model + args);
  const Result b = RunCli("generate -m " + gguf + args);
  ASSERT_EQ(a.exit_code, 0) << a.all;
  ASSERT_EQ(b.exit_code, 0) << b.all;
  EXPECT_FALSE(GeneratedIds(a.all).empty()) << a.all;
  EXPECT_EQ(GeneratedIds(a.all), GeneratedIds(b.all));
  const Result info = RunCli("inspect " + gguf);
  EXPECT_EQ(info.exit_code, 0) << info.all;
  EXPECT_NE(info.all.find("blk.4.ffn_down.weight"), std::string::npos) << info.all;
}

TEST(CliSynth, TinyShapeRuns) {
  const std::string path = testing::TempPath("cli_tiny_synth.gguf");
  const Result s = RunCli("synth --shape tiny-llama --type q8_0 -o " + path);
  ASSERT_EQ(s.exit_code, 0) << s.all;
  const Result g = RunCli("generate -m " + path + " -n 8 --temp 0 -t 1");
  ASSERT_EQ(g.exit_code, 0) << g.all;
  const Result b = RunCli("bench-speed -m " + path + " -p 16 -n 4 -d 0,8 -r 1 -o json");
  ASSERT_EQ(b.exit_code, 0) << b.all;
  EXPECT_NE(b.all.find("\"tg4\""), std::string::npos) << b.all;
}

}  // namespace
}  // namespace kvsparse
