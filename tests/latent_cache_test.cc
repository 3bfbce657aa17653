// MLA's latent cache (deepseek2): a token stores one row per layer, its normalized latent and
// rotated key tail (kv_lora_rank + rope dims), which attention reads as both key and value.
// Checks: the paged and contiguous caches store no V and count one row per token; spans' V
// alias K; eviction frees the latent's pages; KIVI is refused by name; the model reports the
// latent as its KV bytes per token; every method runs on a latent model at every paged type and
// the full-cache int8/f16 paths agree with the f32 one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/model.h"
#include "kvsparse/paged_kv_cache.h"
#include "kvsparse/runtime.h"
#include "kvsparse/synth.h"
#include "support/random_data.h"
#include "support/shared_data.h"

namespace kvsparse {
namespace {

KvGeometry LatentGeometry(int n_layers, int row) {
  KvGeometry g{n_layers, 1, row};
  g.values_in_keys = true;
  return g;
}

StatusOr<std::unique_ptr<PagedKvCache>> MakeCache(const KvGeometry& g, KvStorage storage) {
  PagedKvCacheOptions options;
  options.n_seqs = 1;
  options.page_size = 4;
  options.budget_bytes = size_t{1} << 20;
  options.layer_storage = {storage};
  return PagedKvCache::Create(g, options);
}

class LatentPagedCacheTest : public ::testing::TestWithParam<KvStorage> {};

TEST_P(LatentPagedCacheTest, StoresOneRowPerTokenAndValuesAliasKeys) {
  const KvStorage storage = GetParam();
  const int row = 80;  // 64 latent + 16 rotated
  KvGeometry expanded{2, 1, row};
  auto latent = MakeCache(LatentGeometry(2, row), storage);
  auto keys_and_values = MakeCache(expanded, storage);
  ASSERT_TRUE(latent.ok()) << latent.status().ToString();
  ASSERT_TRUE(keys_and_values.ok());
  // One K row's bytes (and its scale) less than a K + V slot.
  const size_t row_bytes = KvRowBytes(storage, row) + (HasTokenScales(storage) ? sizeof(float) : 0);
  EXPECT_EQ((*latent)->token_bytes(0) + row_bytes, (*keys_and_values)->token_bytes(0));

  std::mt19937 rng(3);
  const int n = 11;
  const std::vector<float> k = testing::RandomNonZeroFloats(static_cast<size_t>(n) * row, rng);
  const std::vector<float> ignored = testing::RandomNonZeroFloats(static_cast<size_t>(n) * row, rng);
  std::vector<int32_t> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  ASSERT_TRUE((*latent)->Append(0, 1, n, k.data(), ignored.data(), positions.data()).ok());
  std::vector<KvSpan> spans;
  (*latent)->Spans(0, 1, &spans);
  int32_t seen = 0;
  std::vector<float> key(row), value(row);
  for (const KvSpan& span : spans) {
    EXPECT_EQ(span.v, span.k);
    EXPECT_EQ(span.v_scale, span.k_scale);
    for (int32_t t = 0; t < span.n; ++t, ++seen) {
      LoadSpanKeyRow(storage, span, t, 1, row, key.data());
      LoadSpanValueRow(storage, span, t, 1, row, value.data());
      for (int c = 0; c < row; ++c) {
        ASSERT_EQ(key[c], value[c]);
        const float want = k[static_cast<size_t>(seen) * row + c];
        // Relative rounding: f16 2^-11, bf16 and int8 ~2^-8, e4m3 2^-4, e5m2 2^-3.
        const float relative = storage == KvStorage::kFp8E5M2 ? 0.13f : 0.07f;
        ASSERT_NEAR(key[c], want, std::abs(want) * relative + 0.02f) << "token " << seen << " channel " << c;
      }
    }
  }
  EXPECT_EQ(seen, n);
  EXPECT_EQ((*latent)->LayerLiveBytesByPart(1).values, static_cast<size_t>(n) * KvRowBytes(storage, row));

  // Eviction frees the latent's pages: keep 3 of 11 tokens.
  const size_t before = (*latent)->LiveBytes();
  std::vector<uint8_t> keep(n, 0);
  keep[0] = keep[5] = keep[10] = 1;
  ASSERT_TRUE((*latent)->Evict(0, 1, keep).ok());
  EXPECT_EQ((*latent)->NumTokens(0, 1), 3);
  EXPECT_LT((*latent)->LiveBytes(), before);
  EXPECT_EQ((*latent)->LayerLiveBytesByPart(1).values, 3 * KvRowBytes(storage, row));
}

INSTANTIATE_TEST_SUITE_P(Storage, LatentPagedCacheTest,
                         ::testing::Values(KvStorage::kF32, KvStorage::kF16, KvStorage::kBf16, KvStorage::kInt8,
                                           KvStorage::kFp8E4M3, KvStorage::kFp8E5M2),
                         [](const ::testing::TestParamInfo<KvStorage>& info) {
                           return std::string(KvStorageName(info.param));
                         });

TEST(LatentCache, KiviIsRefusedByName) {
  for (KvStorage kivi : {KvStorage::kInt8Kivi, KvStorage::kInt4Kivi, KvStorage::kInt2Kivi}) {
    auto cache = MakeCache(LatentGeometry(1, 80), kivi);
    ASSERT_FALSE(cache.ok());
    EXPECT_EQ(cache.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(cache.status().message().find(KvStorageName(kivi)), std::string::npos) << cache.status().ToString();
    EXPECT_NE(cache.status().message().find("latent"), std::string::npos) << cache.status().ToString();
  }
}

TEST(LatentCache, ContiguousCacheHoldsNoValues) {
  KvGeometry expanded{2, 1, 80};
  ContiguousKvCache latent(LatentGeometry(2, 80), KvStorage::kF16, 1, 32);
  ContiguousKvCache keys_and_values(expanded, KvStorage::kF16, 1, 32);
  EXPECT_EQ(2 * latent.AllocatedBytes(), keys_and_values.AllocatedBytes());
  std::mt19937 rng(5);
  const std::vector<float> k = testing::RandomNonZeroFloats(3 * 80, rng);
  const int32_t positions[3] = {0, 1, 2};
  ASSERT_TRUE(latent.Append(0, 0, 3, k.data(), k.data(), positions).ok());  // (v is not read)
  std::vector<KvSpan> spans;
  latent.Spans(0, 0, &spans);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].v, spans[0].k);
}

std::unique_ptr<Model> LoadTinyDeepseek(DType type) {
  SynthOptions options;
  options.weight_type = type;
  const std::string path = testing::TempPath("latent_tiny_deepseek2_" + std::string(DTypeName(type)) + ".gguf");
  EXPECT_TRUE(WriteSynthModel(FindSynthShape("tiny-deepseek2").value(), options, path).ok());
  auto model = Model::Load(path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? std::move(model).value() : nullptr;
}

TEST(LatentCache, ModelCountsTheLatentAsItsKvBytes) {
  const auto model = LoadTinyDeepseek(DType::kF32);
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  ASSERT_TRUE(c.IsMla());
  EXPECT_EQ(c.KvValuesPerToken(), 64 + 16);  // kv_lora_rank + rope dims, not heads x (K + V)
  EXPECT_EQ(c.head_dim, 80);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_DOUBLE_EQ(c.DenseKvBytes(10, 2.0), 3 * 10 * 80 * 2.0);
  const KvGeometry g = ModelKvGeometry(*model);
  EXPECT_TRUE(g.values_in_keys);
  EXPECT_EQ(g.head_dim, 80);
}

// Every method on the latent (one shared KV head) at every paged type runs to finite logits
// that the budget bounds; the full cache at f16 / int8 stays close to f32.
TEST(LatentCache, EveryMethodRunsOnTheLatent) {
  const auto model = LoadTinyDeepseek(DType::kF32);
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 48; ++i) tokens.push_back((i * 37 + 11) % 1000);
  const int n = static_cast<int>(tokens.size());
  const size_t vocab = static_cast<size_t>(c.n_vocab);
  auto run = [&](const std::string& method, const std::string& type, std::vector<float>* logits) -> Status {
    auto flags = KvSparsityConfigFromFlags(method, method == "full" ? "" : "0.25", type, c.n_layers);
    KVS_RETURN_IF_ERROR(flags.status());
    auto runtime = CreateRuntime(*model, &*flags, KvStorage::kF32, 1, n, 1);
    KVS_RETURN_IF_ERROR(runtime.status());
    logits->assign(static_cast<size_t>(n) * vocab, 0.0f);
    KVS_RETURN_IF_ERROR((*runtime)->engine->Forward(0, tokens.data(), 16, 0, logits->data(), true));
    for (int i = 16; i < n; ++i) {
      KVS_RETURN_IF_ERROR(
          (*runtime)->engine->Forward(0, &tokens[i], 1, i, &(*logits)[static_cast<size_t>(i) * vocab]));
    }
    // (quest, reuse and oracle select at decode and keep every token; the others evict.)
    const bool evicts = method != "full" && method != "quest" && method != "reuse" && method != "oracle";
    if (evicts && (*runtime)->cache().NumTokens(0, c.n_layers - 1) >= n) {
      return InternalError(method + " kept all " + std::to_string(n) + " tokens at budget 0.25");
    }
    return Status::Ok();
  };
  std::vector<float> reference, logits;
  ASSERT_TRUE(run("full", "f32", &reference).ok());
  // f16 rounds the latent as it rounds K and V (measured 0.004 here, 0.002 on tiny-qwen3moe). int8
  // moves logits by up to 0.5: a router near-tie then picks another expert (tiny-qwen3moe: 0.07,
  // tiny-olmoe 1.3), so int8 is held to the greedy choice on most positions, not to a logit bound.
  ASSERT_TRUE(run("full", "f16", &logits).ok());
  double worst = 0;
  for (size_t i = 0; i < logits.size(); ++i) worst = std::max(worst, std::abs(double{logits[i]} - reference[i]));
  EXPECT_LT(worst, 0.02) << "f16 full cache against f32";
  ASSERT_TRUE(run("full", "int8", &logits).ok());
  int agree = 0;
  for (int i = 0; i < n; ++i) {
    const float* got = &logits[static_cast<size_t>(i) * vocab];
    const float* want = &reference[static_cast<size_t>(i) * vocab];
    agree += std::max_element(got, got + vocab) - got == std::max_element(want, want + vocab) - want;
  }
  EXPECT_GE(agree, n * 3 / 4) << "int8 full cache: greedy ids against f32";
  const std::string names = ValidKvMethodNames();  // "full, streaming_llm, ..."
  std::vector<std::string> methods;
  for (size_t start = 0; start < names.size();) {
    const size_t end = std::min(names.find(", ", start), names.size());
    methods.push_back(names.substr(start, end - start));
    start = end + 2;
  }
  ASSERT_GE(methods.size(), 10u);
  for (const std::string& method : methods) {
    for (const char* type : {"f16", "int8", "fp8_e4m3"}) {
      const Status status = run(method, type, &logits);
      ASSERT_TRUE(status.ok()) << method << " " << type << ": " << status.ToString();
      for (float v : logits) ASSERT_TRUE(std::isfinite(v)) << method << " " << type;
    }
  }
}

}  // namespace
}  // namespace kvsparse
