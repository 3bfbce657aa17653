// StreamingLLM's positions within the cache ("cache_positions": true) end to end:
// - with a budget of the whole context nothing is evicted, and the output is bit-identical to
//   Full and to plain StreamingLLM (f32 and f16, shared and per-head layers, both RoPE styles);
// - generating past the budget, every layer's cached positions stay 0..n-1 after every call,
//   and layer 0's cached keys equal those a fresh dense run computes for the surviving tokens
//   at positions 0..n-1 (layer 0's K/V depend on the token and position only); a layer
//   without the option keeps absolute positions in the same run;
// - the key is parsed from JSON and rejected for every other method, naming layer and field;
// - `kvsparse generate --kv-config` runs with it (stories260K, skipped without ../shared).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/synth.h"
#include "support/cli_runner.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

constexpr int kThreads = 2;

std::unique_ptr<Model> LoadSynth(const std::string& shape_name) {
  auto shape = FindSynthShape(shape_name);
  KVS_CHECK_MSG(shape.ok(), shape.status().ToString());
  const std::string path = testing::TempPath("cache_positions_" + shape_name + ".gguf");
  SynthOptions options;
  options.weight_type = DType::kF32;
  const Status written = WriteSynthModel(*shape, options, path);
  KVS_CHECK_MSG(written.ok(), written.ToString());
  auto model = Model::Load(path);
  KVS_CHECK_MSG(model.ok(), model.status().ToString());
  return std::move(model).value();
}

std::vector<int32_t> Prompt(size_t n, int vocab) {
  std::vector<int32_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>((i * 131 + 7) % vocab);
  return p;
}

int32_t ArgMax(const std::vector<float>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

struct SparseRun {
  SparseKvSetup kv;
  std::unique_ptr<Engine> engine;
};

SparseRun NewRun(const Model& model, const KvSparsityConfig& config, int32_t max_tokens) {
  const ModelConfig& c = model.config();
  auto setup = CreateSparseKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, config, 1, max_tokens, 5);
  KVS_CHECK_MSG(setup.ok(), setup.status().ToString());
  SparseRun run;
  run.kv = std::move(*setup);
  run.engine = std::make_unique<Engine>(model, run.kv.cache.get(), kThreads, run.kv.controller.get());
  return run;
}

// Prompt in one call (the engine chunks it), then greedy decode; logits after every call.
// after_call(inputs so far) runs after every Forward.
std::vector<std::vector<float>> Generate(Engine& engine, const std::vector<int32_t>& prompt, int n_decode,
                                         const std::function<void(const std::vector<int32_t>&)>& after_call = {}) {
  std::vector<std::vector<float>> out;
  std::vector<float> logits(engine.model().config().n_vocab);
  std::vector<int32_t> inputs = prompt;
  Status s = engine.Forward(0, prompt.data(), static_cast<int32_t>(prompt.size()), 0, logits.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  out.push_back(logits);
  if (after_call) after_call(inputs);
  for (int step = 0; step < n_decode && s.ok(); ++step) {
    const int32_t token = ArgMax(logits);
    inputs.push_back(token);
    s = engine.Forward(0, &token, 1, static_cast<int32_t>(inputs.size()) - 1, logits.data());
    EXPECT_TRUE(s.ok()) << s.ToString();
    out.push_back(logits);
    if (after_call) after_call(inputs);
  }
  return out;
}

KvSparsityConfig Config(const Model& model, const std::string& method, const std::string& budget,
                        KvStorage storage, bool cache_positions, bool per_head) {
  auto config = KvSparsityConfigFromFlags(method, budget, KvStorageName(storage), model.config().n_layers);
  KVS_CHECK_MSG(config.ok(), config.status().ToString());
  for (LayerKvConfig& layer : config->layers) {
    layer.params.cache_positions = cache_positions;
    layer.per_head = per_head;
  }
  config->prefill_chunk = 16;
  config->evict_interval = 4;
  return *config;
}

// Positions of one table ((seq 0, layer), head `head` in a per-head layer).
std::vector<int32_t> Positions(const PagedKvCache& cache, int layer, int head = 0) {
  std::vector<KvSpan> spans;
  if (cache.per_head(layer)) {
    cache.HeadSpans(0, layer, head, &spans);
  } else {
    cache.Spans(0, layer, &spans);
  }
  std::vector<int32_t> p;
  for (const KvSpan& s : spans) p.insert(p.end(), s.positions, s.positions + s.n);
  return p;
}

TEST(CachePositions, WithoutEvictionIsBitIdenticalToFullAndStreamingLlm) {
  struct Case {
    const char* shape;  // tiny-llama: adjacent-pair RoPE; tiny-qwen2: NeoX, biases, GQA
    KvStorage storage;
    bool per_head;
  };
  for (const Case& k : {Case{"tiny-llama", KvStorage::kF32, false}, Case{"tiny-llama", KvStorage::kF16, true},
                        Case{"tiny-qwen2", KvStorage::kF32, true}, Case{"tiny-qwen2", KvStorage::kF16, false}}) {
    const std::string what = std::string(k.shape) + " " + KvStorageName(k.storage) + (k.per_head ? " per-head" : "");
    const auto model = LoadSynth(k.shape);
    const std::vector<int32_t> prompt = Prompt(40, model->config().n_vocab);
    const int n_decode = 24;
    const int32_t context = static_cast<int32_t>(prompt.size()) + n_decode + 1;
    SparseRun full = NewRun(*model, Config(*model, "full", "", k.storage, false, k.per_head), context);
    const auto want = Generate(*full.engine, prompt, n_decode);
    for (bool cache_positions : {false, true}) {
      SparseRun run = NewRun(
          *model, Config(*model, "streaming_llm", std::to_string(context), k.storage, cache_positions, k.per_head),
          context);
      const auto got = Generate(*run.engine, prompt, n_decode);
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t call = 0; call < want.size(); ++call) {
        ASSERT_EQ(std::memcmp(got[call].data(), want[call].data(), want[call].size() * sizeof(float)), 0)
            << what << (cache_positions ? " cache_positions" : "") << ": logits differ after call " << call;
      }
      EXPECT_EQ(run.kv.controller->layer_stats()[0].evictions, 0) << what;
      EXPECT_EQ(run.kv.cache->Stats().rerotated_tokens, 0) << what;
    }
  }
}

// Layer 0's K/V of a token depend only on the token and its position, so after any number of
// evictions layer 0 must hold exactly what a dense run over the survivors (sinks + the most
// recent tokens) at positions 0..n-1 computes. Layer 1 runs H2O with absolute positions.
TEST(CachePositions, GeneratingPastTheBudgetKeepsPositionsInsideTheCache) {
  const auto model = LoadSynth("tiny-qwen2");  // NeoX RoPE, q/k/v biases, 2 kv heads for 4 heads
  const ModelConfig& c = model->config();
  const std::vector<int32_t> prompt = Prompt(50, c.n_vocab);
  const int n_decode = 45;
  const int32_t budget = 24;
  KvSparsityConfig config = Config(*model, "streaming_llm", std::to_string(budget), KvStorage::kF32, true, false);
  config.layers[1].method = KvMethod::kH2O;
  config.layers[1].params = DefaultMethodParams(KvMethod::kH2O);
  SparseRun run = NewRun(*model, config, 200);
  ASSERT_TRUE(run.kv.controller->UsesCachePositions(0));
  ASSERT_FALSE(run.kv.controller->UsesCachePositions(1));
  const int n_sink = config.layers[0].params.n_sink;
  const size_t row = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  int checked = 0, calls = 0;
  auto check = [&](const std::vector<int32_t>& inputs) {
    const PagedKvCache& cache = *run.kv.cache;
    const int32_t n = cache.NumTokens(0, 0);
    ASSERT_LE(n, budget + config.evict_interval);
    const std::vector<int32_t> pos = Positions(cache, 0);
    for (int32_t i = 0; i < n; ++i) ASSERT_EQ(pos[i], i) << "layer 0 after " << inputs.size() << " tokens";
    EXPECT_EQ(Positions(cache, 1).back(), static_cast<int32_t>(inputs.size()) - 1) << "layer 1 keeps absolute";
    if (++calls % 3 != 1) return;  // the dense reference on every third call
    // The survivors' tokens, run densely at positions 0..n-1.
    std::vector<int32_t> kept(inputs.begin(), inputs.begin() + n_sink);
    kept.insert(kept.end(), inputs.end() - (n - n_sink), inputs.end());
    ContiguousKvCache dense(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, KvStorage::kF32, 1, n);
    Engine reference(*model, &dense, kThreads);
    std::vector<float> logits(c.n_vocab);
    ASSERT_TRUE(reference.Forward(0, kept.data(), n, 0, logits.data()).ok());
    std::vector<KvSpan> want_spans, got_spans;
    dense.Spans(0, 0, &want_spans);
    cache.Spans(0, 0, &got_spans);
    std::vector<float> want_k, want_v, got_k, got_v;
    for (const KvSpan& s : want_spans) {
      want_k.insert(want_k.end(), static_cast<const float*>(s.k), static_cast<const float*>(s.k) + s.n * row);
      want_v.insert(want_v.end(), static_cast<const float*>(s.v), static_cast<const float*>(s.v) + s.n * row);
    }
    for (const KvSpan& s : got_spans) {
      got_k.insert(got_k.end(), static_cast<const float*>(s.k), static_cast<const float*>(s.k) + s.n * row);
      got_v.insert(got_v.end(), static_cast<const float*>(s.v), static_cast<const float*>(s.v) + s.n * row);
    }
    ASSERT_EQ(got_k.size(), want_k.size());
    float scale = 0, v_scale = 0;
    for (float x : want_k) scale = std::max(scale, std::fabs(x));
    for (float x : want_v) v_scale = std::max(v_scale, std::fabs(x));
    // f32 RoPE of a re-rotated key vs a direct rotation (angles < 200 rad), plus the matmul's
    // rounding (a batch of tokens vs one at a time).
    for (size_t i = 0; i < want_k.size(); ++i) {
      ASSERT_NEAR(got_k[i], want_k[i], 1e-4f * scale) << "layer 0 key value " << i << " after " << inputs.size();
      ASSERT_NEAR(got_v[i], want_v[i], 1e-5f * v_scale) << "layer 0 value " << i;
    }
    ++checked;
  };
  const auto logits = Generate(*run.engine, prompt, n_decode, check);
  EXPECT_EQ(calls, 1 + n_decode);
  EXPECT_EQ(checked, (calls + 2) / 3);
  for (const auto& l : logits)
    for (float x : l) ASSERT_TRUE(std::isfinite(x));
  EXPECT_GT(run.kv.controller->layer_stats()[0].evictions, 10);
  EXPECT_GT(run.kv.cache->Stats().rerotated_tokens, 0);
  run.kv.cache->CheckInvariants();
}

// Per-head layers and quantized storage: heads renumber on their own, every head stays 0..n-1.
TEST(CachePositions, PerHeadAndQuantizedLayersStayNumberedInsideTheCache) {
  const auto model = LoadSynth("tiny-gqa-untied");  // llama3 RoPE scaling, 8 heads on 2 kv heads
  const ModelConfig& c = model->config();
  for (KvStorage storage : {KvStorage::kF16, KvStorage::kInt8, KvStorage::kInt8Kivi, KvStorage::kFp8E4M3,
                            KvStorage::kFp8E5M2, KvStorage::kBf16}) {
    for (bool per_head : {false, true}) {
      const std::string what = std::string(KvStorageName(storage)) + (per_head ? " per-head" : "");
      SparseRun run = NewRun(*model, Config(*model, "streaming_llm", "20", storage, true, per_head), 200);
      auto check = [&](const std::vector<int32_t>& inputs) {
        for (int layer = 0; layer < c.n_layers; ++layer) {
          for (int head = 0; head < (per_head ? c.n_kv_heads : 1); ++head) {
            const std::vector<int32_t> pos = Positions(*run.kv.cache, layer, head);
            ASSERT_LE(pos.size(), 24u) << what;
            for (size_t i = 0; i < pos.size(); ++i)
              ASSERT_EQ(pos[i], static_cast<int32_t>(i)) << what << " layer " << layer << " head " << head;
          }
        }
      };
      const auto logits = Generate(*run.engine, Prompt(45, c.n_vocab), 40, check);
      for (float x : logits.back()) ASSERT_TRUE(std::isfinite(x)) << what;
      EXPECT_GT(run.kv.cache->Stats().rerotated_tokens, 0) << what;
      run.kv.cache->CheckInvariants();
    }
  }
}

TEST(CachePositions, ConfigKeyIsStreamingLlmOnly) {
  // JSON: parsed for streaming_llm, shown in the summary, off by default.
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "streaming_llm", "budget": 64},
          "layers": [{"layers": 1, "cache_positions": true, "n_sink": 2}]})",
      3);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_FALSE(config->layers[0].params.cache_positions);
  EXPECT_TRUE(config->layers[1].params.cache_positions);
  EXPECT_NE(KvSparsityConfigSummary(*config).find("n_sink=2 cache_positions"), std::string::npos)
      << KvSparsityConfigSummary(*config);

  // Other methods: rejected, naming the entry and the field.
  auto wrong = ParseKvSparsityConfig(
      R"({"default": {"method": "streaming_llm", "budget": 64},
          "layers": [{"layers": 2, "method": "h2o", "cache_positions": true}]})",
      3);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("layers[0] (layers 2)"), std::string::npos) << wrong.status().message();
  EXPECT_NE(wrong.status().message().find("'cache_positions'"), std::string::npos) << wrong.status().message();
  EXPECT_NE(wrong.status().message().find("streaming_llm"), std::string::npos) << wrong.status().message();
  auto not_bool = ParseKvSparsityConfig(R"({"default": {"method": "streaming_llm", "budget": 8, "cache_positions": 1}})", 2);
  ASSERT_FALSE(not_bool.ok());
  EXPECT_NE(not_bool.status().message().find("expected true or false"), std::string::npos)
      << not_bool.status().message();

  // Built in code: validation (and the sparse KV setup) names the layer and the field.
  const auto model = LoadSynth("tiny-llama");
  KvSparsityConfig coded = Config(*model, "streaming_llm", "32", KvStorage::kF32, false, false);
  coded.layers[1].method = KvMethod::kH2O;
  coded.layers[1].params = DefaultMethodParams(KvMethod::kH2O);
  coded.layers[1].params.cache_positions = true;
  const ModelConfig& c = model->config();
  auto setup = CreateSparseKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, coded, 1, 64);
  ASSERT_FALSE(setup.ok());
  EXPECT_EQ(setup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(setup.status().message().find("layer 1"), std::string::npos) << setup.status().message();
  EXPECT_NE(setup.status().message().find("'cache_positions'"), std::string::npos) << setup.status().message();
}

TEST(CachePositions, CliGenerateWithConfigFile) {
  KVS_SKIP_IF_NO_SHARED(model, "models/stories260K.bin");
  const std::string path = testing::TempPath("cache_positions_kv.json");
  {
    std::ofstream f(path);
    f << R"({"default": {"method": "streaming_llm", "budget": 24, "cache_positions": true, "kv_type": "f16"},
             "evict_interval": 4})";
  }
  const testing::CliResult r =
      testing::RunCli("generate -m " + model + " -n 60 --temp 0 -t 2 --kv-stats --kv-config " + path);
  ASSERT_EQ(r.exit_code, 0) << r.all;
  EXPECT_NE(r.all.find("| 0 | streaming_llm | f16"), std::string::npos) << r.all;
  const std::string bad_path = testing::TempPath("cache_positions_bad_kv.json");
  {
    std::ofstream f(bad_path);
    f << R"({"default": {"method": "tova", "budget": 24, "cache_positions": true}})";
  }
  testing::ExpectCleanFailure(
      testing::RunCli("generate -m " + model + " -n 4 --temp 0 -t 2 --kv-config " + bad_path), "cache_positions");
}

}  // namespace
}  // namespace kvsparse
