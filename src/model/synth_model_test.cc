// End to end: synthetic models load with Model::LoadGguf and produce finite, non-degenerate logits.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/synth.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

void RunShape(const std::string& shape_name, DType type) {
  SCOPED_TRACE(shape_name + " " + std::string(DTypeName(type)));
  const SynthShape shape = FindSynthShape(shape_name).value();
  const std::string path = testing::TempPath("synth_e2e_" + shape_name + ".gguf");
  SynthOptions options;
  options.weight_type = type;
  ASSERT_TRUE(WriteSynthModel(shape, options, path).ok());
  auto model = Model::LoadGguf(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = (*model)->config();
  EXPECT_EQ(c.n_vocab, shape.n_vocab);
  EXPECT_EQ(c.n_layers, shape.n_layers);
  EXPECT_EQ(c.tied_output, shape.tied_output);
  const KvGeometry geometry = ModelKvGeometry(**model, /*with_windows=*/false);
  ContiguousKvCache cache(geometry, KvStorage::kF32, 1, 64);
  Engine engine(**model, &cache, 1);
  // Prefill 16 tokens, then decode 16 more greedily; every logit must stay finite.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 16; ++i) prompt.push_back(1 + (i * 37) % (shape.n_vocab - 1));
  std::vector<float> logits(shape.n_vocab);
  ASSERT_TRUE(engine.Forward(0, prompt.data(), 16, 0, logits.data()).ok());
  for (int step = 0; step < 16; ++step) {
    double sum2 = 0;
    int best = 0;
    for (int v = 0; v < shape.n_vocab; ++v) {
      ASSERT_TRUE(std::isfinite(logits[v])) << "step " << step << " token " << v;
      sum2 += static_cast<double>(logits[v]) * logits[v];
      if (logits[v] > logits[best]) best = v;
    }
    const double rms = std::sqrt(sum2 / shape.n_vocab);
    EXPECT_GT(rms, 1e-3) << "logits collapsed at step " << step;
    EXPECT_LT(rms, 1e3) << "logits exploded at step " << step;
    int32_t token = best;
    ASSERT_TRUE(engine.Forward(0, &token, 1, 16 + step, logits.data()).ok());
  }
}

TEST(SynthModel, TinyShapesRunFinite) {
  for (const SynthShape& s : SynthShapes()) {
    if (s.name.rfind("tiny-", 0) != 0) continue;
    RunShape(s.name, DType::kQ8_0);
  }
}

TEST(SynthModel, EveryWeightTypeRunsFinite) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ4_0, DType::kQ4_K}) {
    RunShape("tiny-llama-256", t);
  }
}

}  // namespace
}  // namespace kvsparse
