// Every fuzz harness (fuzz/*_fuzz.cc) over its committed seed corpus (fuzz/corpus/NAME/) and the
// inputs that once crashed it (fuzz/regressions/NAME/): in every build, so a fixed crash stays
// fixed without clang or libFuzzer. scripts/fuzz.sh finds new ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "kvsparse/synth.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

struct Harness {
  const char* name;
  int (*function)(const uint8_t*, size_t);
};

class FuzzCorpus : public ::testing::TestWithParam<Harness> {};

TEST_P(FuzzCorpus, SeedsAndRegressionsRunClean) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = fs::path(KVS_FUZZ_DIR) / kind / GetParam().name;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) inputs.push_back(entry.path());
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) GTEST_SKIP() << "no committed inputs for " << GetParam().name;
  for (const fs::path& path : inputs) {
    SCOPED_TRACE(path.string());
    std::ifstream f(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), {});
    EXPECT_EQ(GetParam().function(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
}

// GGUF seeds are written, not committed (a model is a few hundred KiB): a whole tiny model, then
// prefixes and single-byte changes of it, as the fuzzer starts from.
// The mixture of experts (expert keys, 3-D tensors, the shared expert) gets changes over its
// metadata too, where the expert keys are, and so does deepseek2's latent attention (tiny-deepseek3:
// q_lora, split attn_k_b / attn_v_b, sigmoid routing with exp_probs_b) and gpt-oss (sinks, bias
// tables, MXFP4 expert blocks).
TEST(FuzzCorpus, GgufHarnessOnAWrittenModel) {
  for (const char* shape_name : {"tiny-llama", "tiny-qwen2moe", "tiny-deepseek3", "tiny-gpt-oss"}) {
    SCOPED_TRACE(shape_name);
    auto shape = FindSynthShape(shape_name);
    ASSERT_TRUE(shape.ok());
    SynthOptions options;
    options.n_layers_override = 1;
    if (std::string_view(shape_name) == "tiny-gpt-oss") options.mix = "mxfp4_moe";
    const std::string path = testing::TempPath(std::string("fuzz_corpus_") + shape_name + ".gguf");
    ASSERT_TRUE(WriteSynthModel(*shape, options, path).ok());
    std::ifstream f(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), {});
    auto run = [](const std::string& b) { return fuzz::FuzzGguf(reinterpret_cast<const uint8_t*>(b.data()), b.size()); };
    EXPECT_EQ(run(bytes), 0);
    for (size_t cut : {size_t{0}, size_t{4}, size_t{23}, bytes.size() / 3, bytes.size() - 1}) EXPECT_EQ(run(bytes.substr(0, cut)), 0);
    // Densely over the header, sparsely over the rest of the metadata.
    for (size_t at = 0; at < 2048 && at < bytes.size(); at += at < 160 ? 7 : 61) {
      std::string flipped = bytes;
      flipped[at] = static_cast<char>(flipped[at] ^ 0x5A);
      EXPECT_EQ(run(flipped), 0) << "byte " << at;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Harnesses, FuzzCorpus,
    ::testing::Values(Harness{"gguf", fuzz::FuzzGguf}, Harness{"tokenizer", fuzz::FuzzTokenizer},
                      Harness{"kv_config", fuzz::FuzzKvConfig}, Harness{"kv_param", fuzz::FuzzKvParam},
                      Harness{"user_tasks", fuzz::FuzzUserTasks}, Harness{"openai_request", fuzz::FuzzOpenAiRequest},
                      Harness{"chat_template", fuzz::FuzzChatTemplate}, Harness{"http_server", fuzz::FuzzHttpServer}),
    [](const ::testing::TestParamInfo<Harness>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvsparse
