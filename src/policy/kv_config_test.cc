#include "kvsparse/kv_config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace kvsparse {
namespace {

constexpr int kLayers = 5;

// The message of a config that must be rejected.
std::string Rejection(std::string_view json, int n_layers = kLayers) {
  StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(json, n_layers);
  EXPECT_FALSE(config.ok()) << "accepted: " << json;
  return config.ok() ? std::string() : config.status().message();
}

#define EXPECT_MENTIONS(message, text) EXPECT_NE((message).find(text), std::string::npos) << (message)

TEST(KvBudgetTest, ResolvesTokensAndFractions) {
  EXPECT_EQ(ResolveBudget(KvBudget::Tokens(512), 100), 512);
  EXPECT_EQ(ResolveBudget(KvBudget::Fraction(0.2), 10), 2);  // not 1 despite 0.2 being inexact
  EXPECT_EQ(ResolveBudget(KvBudget::Fraction(0.2), 14), 2);  // rounds down
  EXPECT_EQ(ResolveBudget(KvBudget::Fraction(0.2), 3), 1);   // at least one token
  EXPECT_EQ(ResolveBudget(KvBudget::Fraction(1.0), 77), 77);
  EXPECT_EQ(ResolveBudget(KvBudget::Fraction(0.5), 0), 1);
}

TEST(KvBudgetTest, ParsesFlagValues) {
  EXPECT_EQ(ParseKvBudget("512")->tokens, 512);
  EXPECT_FALSE(ParseKvBudget("512")->is_fraction());
  EXPECT_DOUBLE_EQ(ParseKvBudget("0.2")->fraction, 0.2);
  EXPECT_DOUBLE_EQ(ParseKvBudget("25%")->fraction, 0.25);
  EXPECT_TRUE(ParseKvBudget("1.0")->is_fraction());
  EXPECT_FALSE(ParseKvBudget("0").ok());
  EXPECT_FALSE(ParseKvBudget("-3").ok());
  EXPECT_FALSE(ParseKvBudget("1.5").ok());
  EXPECT_FALSE(ParseKvBudget("abc").ok());
  EXPECT_FALSE(ParseKvBudget("").ok());
}

TEST(KvConfigTest, ParsesTheDocumentedExample) {
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "h2o", "budget": 0.2, "kv_type": "int8"},
          "layers": [{"layers": "0-1", "method": "full", "kv_type": "f16"}],
          "evict_interval": 16, "page_size": 16, "gqa_aggregation": "mean", "prefill_chunk": 512})",
      kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_EQ(config->layers.size(), 5u);
  for (int l : {0, 1}) {
    EXPECT_EQ(config->layers[l].method, KvMethod::kFull);
    EXPECT_EQ(config->layers[l].kv_type, KvStorage::kF16);
  }
  for (int l : {2, 3, 4}) {
    EXPECT_EQ(config->layers[l].method, KvMethod::kH2O);
    EXPECT_EQ(config->layers[l].kv_type, KvStorage::kInt8);
    EXPECT_TRUE(config->layers[l].budget.is_fraction());
    EXPECT_DOUBLE_EQ(config->layers[l].budget.fraction, 0.2);
    EXPECT_DOUBLE_EQ(config->layers[l].params.recent_ratio, 0.5);  // H2O's paper default
  }
  EXPECT_EQ(config->evict_interval, 16);
  EXPECT_EQ(config->page_size, 16);
  EXPECT_EQ(config->agg, GqaAggregation::kMean);
  EXPECT_EQ(config->prefill_chunk, 512);
  EXPECT_EQ(KvSparsityConfigSummary(*config),
            "layers 0-1: full kv=f16; layers 2-4: h2o budget=0.2 of the context kv=int8 per_head n_sink=0 "
            "recent_ratio=0.5 "
            "head_reduce=mean; evict_interval=16 page_size=16 gqa_aggregation=mean prefill_chunk=512");
}

TEST(KvConfigTest, EntriesInheritAndOverride) {
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "snapkv", "budget": 128, "window": 16, "pooling": "avg"},
          "layers": [{"layers": 3, "budget": 64},
                     {"layers": "4", "method": "pyramidkv", "beta": 10},
                     {"layers": "1-2", "method": "streaming_llm", "n_sink": 2}],
          "gqa_aggregation": "max"})",
      kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const auto& l = config->layers;
  EXPECT_EQ(l[0].params.obs_window, 16);
  EXPECT_EQ(l[3].method, KvMethod::kSnapKv);
  EXPECT_EQ(l[3].budget.tokens, 64);
  EXPECT_EQ(l[3].params.pooling, VotePooling::kAvg);  // same method: parameters carry over
  EXPECT_EQ(l[4].method, KvMethod::kPyramidKv);
  EXPECT_EQ(l[4].params.obs_window, 8);  // another method: its own defaults (KVCache-Factory's window)
  EXPECT_EQ(l[4].params.beta, 10.0);
  EXPECT_EQ(l[4].budget.tokens, 128);     // budget always carries over
  EXPECT_EQ(l[1].method, KvMethod::kStreamingLlm);
  EXPECT_EQ(l[2].params.n_sink, 2);
  EXPECT_EQ(config->agg, GqaAggregation::kMax);
}

TEST(KvConfigTest, NoDefaultMeansFull) {
  auto config = ParseKvSparsityConfig(R"({"layers": [{"layers": 2, "method": "tova", "budget": 32}]})", kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layers[0].method, KvMethod::kFull);
  EXPECT_EQ(config->layers[2].method, KvMethod::kTova);
}

TEST(KvConfigTest, FromFlags) {
  auto config = KvSparsityConfigFromFlags("h2o", "0.2", "int8", 3);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_EQ(config->layers.size(), 3u);
  EXPECT_EQ(config->layers[2].method, KvMethod::kH2O);
  EXPECT_EQ(config->layers[2].kv_type, KvStorage::kInt8);
  EXPECT_DOUBLE_EQ(config->layers[2].budget.fraction, 0.2);
  EXPECT_TRUE(KvSparsityConfigFromFlags("full", "", "", 3).ok());
  auto kivi = KvSparsityConfigFromFlags("h2o", "0.2", "int8_kivi", 3);
  ASSERT_TRUE(kivi.ok()) << kivi.status().ToString();
  EXPECT_EQ(kivi->layers[1].kv_type, KvStorage::kInt8Kivi);

  EXPECT_MENTIONS(KvSparsityConfigFromFlags("h2", "0.2", "", 3).status().message(), "did you mean 'h2o'");
  EXPECT_MENTIONS(KvSparsityConfigFromFlags("h2o", "", "", 3).status().message(), "--kv-budget");
  EXPECT_MENTIONS(KvSparsityConfigFromFlags("h2o", "2.5", "", 3).status().message(), "--kv-budget");
  EXPECT_MENTIONS(KvSparsityConfigFromFlags("h2o", "64", "q4", 3).status().message(), "--kv-type");
  EXPECT_MENTIONS(KvSparsityConfigFromFlags("snapkv", "16", "", 3).status().message(), "'window'");
}

TEST(KvConfigTest, LoadsFromFileAndNamesIt) {
  const std::string path = testing::TempDir() + "/kv_config_test.json";
  {
    std::ofstream out(path);
    out << "{\"default\": {\"method\": \"knorm\", \"budget\": 0.5}}\n";
  }
  auto config = LoadKvSparsityConfig(path, 2);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layers[1].method, KvMethod::kKNorm);
  std::remove(path.c_str());
  auto missing = LoadKvSparsityConfig(path, 2);
  ASSERT_FALSE(missing.ok());
  EXPECT_MENTIONS(missing.status().message(), path);
}

// One test per kind of mistake; each message names where (layer / entry) and the field.

TEST(KvConfigErrorTest, UnknownMethodListsTheValidOnes) {
  const std::string m = Rejection(R"({"layers": [{"layers": "1-2", "method": "snap_kv", "budget": 64}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 1-2)");
  EXPECT_MENTIONS(m, "field 'method'");
  EXPECT_MENTIONS(m, "unknown method 'snap_kv'");
  EXPECT_MENTIONS(m, "did you mean 'snapkv'");
  EXPECT_MENTIONS(m, "full, streaming_llm, h2o, tova, scissorhands, snapkv, pyramidkv, knorm, random");
}

TEST(KvConfigErrorTest, BudgetNotPositive) {
  std::string m = Rejection(R"({"default": {"method": "h2o", "budget": 0}})");
  EXPECT_MENTIONS(m, "default");
  EXPECT_MENTIONS(m, "field 'budget'");
  EXPECT_MENTIONS(m, "> 0");
  m = Rejection(R"({"layers": [{"layers": 4, "method": "h2o", "budget": -0.5}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 4)");
  EXPECT_MENTIONS(m, "field 'budget'");
}

TEST(KvConfigErrorTest, BudgetFractionAboveOne) {
  const std::string m = Rejection(R"({"layers": [{"layers": 3, "method": "tova", "budget": 1.5}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 3)");
  EXPECT_MENTIONS(m, "field 'budget'");
  EXPECT_MENTIONS(m, "<= 1");
}

TEST(KvConfigErrorTest, MissingBudget) {
  const std::string m = Rejection(R"({"layers": [{"layers": 3, "method": "tova"}]})");
  EXPECT_MENTIONS(m, "layer 3 (tova)");
  EXPECT_MENTIONS(m, "field 'budget': missing");
  EXPECT_MENTIONS(m, "set by layers[0]");
}

TEST(KvConfigErrorTest, UnknownKvType) {
  const std::string m = Rejection(R"({"layers": [{"layers": "0-1", "kv_type": "fp16"}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 0-1)");
  EXPECT_MENTIONS(m, "field 'kv_type'");
  EXPECT_MENTIONS(m, "'fp16'");
  EXPECT_MENTIONS(m, "f32, f16, bf16, int8, int8_kivi");
  EXPECT_MENTIONS(Rejection(R"({"default": {"kv_type": "int8_kivy"}})"), "did you mean 'int8_kivi'");
}

TEST(KvConfigErrorTest, LayerRangeOutOfBounds) {
  const std::string m = Rejection(R"({"layers": [{"layers": "3-5", "method": "full"}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 3-5)");
  EXPECT_MENTIONS(m, "field 'layers'");
  EXPECT_MENTIONS(m, "0-4 (5 layers)");
  EXPECT_MENTIONS(Rejection(R"({"layers": [{"layers": -1}]})"), "field 'layers'");
}

TEST(KvConfigErrorTest, LayerRangeReversed) {
  const std::string m = Rejection(R"({"layers": [{"layers": "3-1", "method": "full"}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 3-1)");
  EXPECT_MENTIONS(m, "field 'layers'");
  EXPECT_MENTIONS(m, "reversed");
}

TEST(KvConfigErrorTest, LayerRangeMalformed) {
  const std::string m = Rejection(R"({"layers": [{"layers": "two", "method": "full"}]})");
  EXPECT_MENTIONS(m, "field 'layers'");
  EXPECT_MENTIONS(m, "\"two\"");
}

TEST(KvConfigErrorTest, OverlappingRangesSayWhich) {
  const std::string m = Rejection(
      R"({"layers": [{"layers": "0-2", "method": "full"}, {"layers": 4, "method": "full"},
                     {"layers": "2-3", "method": "full"}]})");
  EXPECT_MENTIONS(m, "layers[2] (layers 2-3)");
  EXPECT_MENTIONS(m, "field 'layers'");
  EXPECT_MENTIONS(m, "overlaps layers[0] (layers 0-2) at layer 2");
}

TEST(KvConfigErrorTest, UnknownKeyInEntryNamesTheValidOnes) {
  const std::string m = Rejection(R"({"default": {"method": "h2o", "budget": 64, "recnet": 8}})");
  EXPECT_MENTIONS(m, "default");
  EXPECT_MENTIONS(m, "field 'recnet'");
  EXPECT_MENTIONS(m, "did you mean 'recent'");
  EXPECT_MENTIONS(m, "method, budget, budget_by_length, kv_type, n_sink, recent, recent_ratio, head_reduce");
}

TEST(KvConfigErrorTest, ParameterOfAnotherMethod) {
  const std::string m = Rejection(R"({"layers": [{"layers": 1, "method": "h2o", "budget": 64, "kernel": 5}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 1)");
  EXPECT_MENTIONS(m, "field 'kernel'");
  EXPECT_MENTIONS(m, "not a parameter of method 'h2o' (it belongs to snapkv, pyramidkv, cake)");
}

TEST(KvConfigErrorTest, UnknownTopLevelKey) {
  const std::string m = Rejection(R"({"evict_intervall": 4})");
  EXPECT_MENTIONS(m, "top level");
  EXPECT_MENTIONS(m, "field 'evict_intervall'");
  EXPECT_MENTIONS(m, "did you mean 'evict_interval'");
  EXPECT_MENTIONS(m, "default, layers, evict_interval, page_size, kivi_residual, kivi_v_group, gqa_aggregation, "
                     "prefill_chunk");
}

TEST(KvConfigErrorTest, WrongJsonTypes) {
  std::string m = Rejection(R"({"default": {"method": "h2o", "budget": "20%"}})");
  EXPECT_MENTIONS(m, "field 'budget'");
  EXPECT_MENTIONS(m, "found string \"20%\"");
  m = Rejection(R"({"layers": [{"layers": 2, "method": "scissorhands", "budget": 64, "history_window": 8.5}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 2)");
  EXPECT_MENTIONS(m, "field 'history_window'");
  EXPECT_MENTIONS(m, "expected an integer, found number 8.5");
  m = Rejection(R"({"default": {"method": 3}})");
  EXPECT_MENTIONS(m, "field 'method'");
  m = Rejection(R"({"default": {"method": "snapkv", "budget": 64, "decode_evict": "yes"}})");
  EXPECT_MENTIONS(m, "field 'decode_evict'");
  EXPECT_MENTIONS(m, "true or false");
  m = Rejection(R"({"evict_interval": "16"})");
  EXPECT_MENTIONS(m, "field 'evict_interval'");
  m = Rejection(R"({"layers": {"layers": 1}})");
  EXPECT_MENTIONS(m, "field 'layers'");
  EXPECT_MENTIONS(m, "expected an array");
  m = Rejection(R"([1, 2])");
  EXPECT_MENTIONS(m, "top level");
}

TEST(KvConfigErrorTest, SinksAndWindowsLargerThanTheBudget) {
  std::string m = Rejection(R"({"layers": [{"layers": "2-4", "method": "streaming_llm", "budget": 3, "n_sink": 4}]})");
  EXPECT_MENTIONS(m, "layer 2 (streaming_llm)");
  EXPECT_MENTIONS(m, "field 'n_sink'");
  EXPECT_MENTIONS(m, "set by layers[0] (layers 2-4)");
  m = Rejection(R"({"default": {"method": "h2o", "budget": 32, "n_sink": 4, "recent": 30}})");
  EXPECT_MENTIONS(m, "layer 0 (h2o)");
  EXPECT_MENTIONS(m, "field 'recent'");
  EXPECT_MENTIONS(m, "budget of 32 tokens");
  m = Rejection(R"({"layers": [{"layers": 1, "method": "snapkv", "budget": 32}]})");  // default window 32
  EXPECT_MENTIONS(m, "layer 1 (snapkv)");
  EXPECT_MENTIONS(m, "field 'window'");
  // A fraction budget cannot be checked up front: windows are clamped as it resolves.
  EXPECT_TRUE(ParseKvSparsityConfig(R"({"default": {"method": "snapkv", "budget": 0.1}})", kLayers).ok());
}

TEST(KvConfigErrorTest, ParameterOutOfRange) {
  std::string m = Rejection(R"({"layers": [{"layers": 0, "method": "snapkv", "budget": 64, "kernel": 4}]})");
  EXPECT_MENTIONS(m, "layer 0 (snapkv)");
  EXPECT_MENTIONS(m, "field 'kernel'");
  m = Rejection(R"({"default": {"method": "pyramidkv", "budget": 64, "beta": 0.5}})");
  EXPECT_MENTIONS(m, "field 'beta'");
  m = Rejection(R"({"default": {"method": "h2o", "budget": 64, "recent_ratio": 1.5}})");
  EXPECT_MENTIONS(m, "field 'recent_ratio'");
  m = Rejection(R"({"default": {"method": "scissorhands", "budget": 64, "history_window": 65}})");
  EXPECT_MENTIONS(m, "field 'history_window'");
  m = Rejection(R"({"default": {"method": "h2o", "budget": 64, "recent": 4, "recent_ratio": 0.5}})");
  EXPECT_MENTIONS(m, "not both");
  m = Rejection(R"({"prefill_chunk": 0})");
  EXPECT_MENTIONS(m, "field 'prefill_chunk'");
}

TEST(KvConfigErrorTest, MalformedJsonGivesLineAndColumn) {
  const std::string m = Rejection("{\n  \"default\": {\"method\": \"h2o\",\n    \"budget\": 0.2,}\n}");
  EXPECT_MENTIONS(m, "malformed JSON at line 3, column 19");  // at the stray "}"
  EXPECT_MENTIONS(Rejection(""), "malformed JSON at line 1");
}

TEST(KvConfigErrorTest, EntryWithoutLayers) {
  const std::string m = Rejection(R"({"layers": [{"method": "full"}]})");
  EXPECT_MENTIONS(m, "layers[0]");
  EXPECT_MENTIONS(m, "field 'layers': missing");
}

TEST(KvConfigErrorTest, MangledConfigsNeverCrash) {
  // Every truncation and a few single-character substitutions of a valid config either
  // parse or come back as an error naming the source.
  const std::string valid =
      R"({"default": {"method": "pyramidkv", "budget": 0.2, "kv_type": "int8", "window": 8, "beta": 4},
          "layers": [{"layers": "0-1", "method": "full"}, {"layers": 3, "method": "h2o", "recent": 2, "budget": 40}],
          "evict_interval": 16, "gqa_aggregation": "max"})";
  ASSERT_TRUE(ParseKvSparsityConfig(valid, kLayers).ok());
  auto check = [](const std::string& text) {
    StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(text, kLayers);
    if (!config.ok()) {
      EXPECT_EQ(config.status().message().rfind("kv config: ", 0), 0u) << config.status().message();
    } else {
      EXPECT_EQ(config->layers.size(), static_cast<size_t>(kLayers));
    }
  };
  for (size_t n = 0; n < valid.size(); ++n) check(valid.substr(0, n));
  for (size_t i = 0; i < valid.size(); ++i) {
    for (char c : {'9', '-', '"', '{', ']', 'x', '.', '\0'}) {
      std::string mangled = valid;
      mangled[i] = c;
      check(mangled);
    }
  }
}

TEST(KvConfigTest, ValidateCatchesConfigsBuiltInCode) {
  KvSparsityConfig config = *KvSparsityConfigFromFlags("h2o", "64", "f32", 2);
  EXPECT_TRUE(ValidateKvSparsityConfig(config).ok());
  config.layers[1].params.recent = 100;
  const Status status = ValidateKvSparsityConfig(config);
  ASSERT_FALSE(status.ok());
  EXPECT_MENTIONS(status.message(), "layer 1 (h2o): field 'recent'");
  config.layers[1].params.recent = -1;
  config.evict_interval = 0;
  EXPECT_FALSE(ValidateKvSparsityConfig(config).ok());
}

// "per_head" defaults to the method's reference granularity, is inherited from "default" like
// the method parameters (within the same method; another method starts from its own default),
// set or cleared per entry, shown in the summary, and must be a boolean.
TEST(KvConfigTest, PerHeadIsInheritedAndChecked) {
  auto config = ParseKvSparsityConfig(
      R"({"default": {"method": "tova", "budget": 32, "per_head": true},
          "layers": [{"layers": 0, "method": "full"}, {"layers": "3-4", "per_head": false}]})",
      kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_FALSE(config->layers[0].per_head);  // another method: its own default
  EXPECT_TRUE(config->layers[1].per_head);
  EXPECT_TRUE(config->layers[2].per_head);
  EXPECT_FALSE(config->layers[3].per_head);
  EXPECT_FALSE(config->layers[4].per_head);
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "layers 1-2: tova budget=32 tokens kv=f32 per_head");
  // The references' granularity: per KV head for H2O, SnapKV, PyramidKV and KNorm.
  for (const char* method : {"h2o", "snapkv", "pyramidkv", "knorm"}) {
    EXPECT_TRUE(ParseKvSparsityConfig(fmt::format(R"({{"default": {{"method": "{}", "budget": 64}}}})", method),
                                      kLayers)
                    ->layers[2]
                    .per_head)
        << method;
    EXPECT_TRUE(KvSparsityConfigFromFlags(method, "64", "f32", kLayers)->layers[0].per_head) << method;
  }
  for (const char* method : {"tova", "streaming_llm", "scissorhands", "random", "quest", "full"}) {
    EXPECT_FALSE(KvSparsityConfigFromFlags(method, method == std::string("full") ? "" : "64", "f32", kLayers)
                     ->layers[0]
                     .per_head)
        << method;
  }
  EXPECT_FALSE(ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 32, "per_head": false}})", kLayers)
                   ->layers[2]
                   .per_head);

  std::string m = Rejection(R"({"layers": [{"layers": "1-2", "per_head": "yes"}]})");
  EXPECT_MENTIONS(m, "layers[0] (layers 1-2)");
  EXPECT_MENTIONS(m, "field 'per_head'");
  EXPECT_MENTIONS(m, "expected true or false");
  m = Rejection(R"({"default": {"method": "tova", "budget": 8, "per_head": 1}})");
  EXPECT_MENTIONS(m, "default: field 'per_head'");
  m = Rejection(R"({"default": {"method": "tova", "budget": 8, "per_heads": true}})");
  EXPECT_MENTIONS(m, "did you mean 'per_head'");
}

// --kv-param per_head=...: the layer field on every sparse layer (Full layers stay shared).
TEST(KvParams, PerHeadSetsTheLayerField) {
  auto config = KvSparsityConfigFromFlags("cumulative", "0.25", "f16", 3);
  ASSERT_TRUE(config.ok());
  config->layers[0].method = KvMethod::kFull;
  const std::vector<std::string> on = {"per_head=true", "head_budgets=adaptive"};
  ASSERT_TRUE(ApplyKvParams(on, &*config).ok());
  EXPECT_FALSE(config->layers[0].per_head);
  EXPECT_TRUE(config->layers[1].per_head && config->layers[2].per_head);
  EXPECT_EQ(config->layers[2].params.head_budgets, HeadBudgets::kAdaptive);
  const std::vector<std::string> bad = {"per_head=maybe"};
  const Status status = ApplyKvParams(bad, &*config);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("per_head"), std::string::npos) << status.ToString();
}

// "prefill" per layer: a method name (its defaults) or an object with parameters; mistakes name
// the object and the parameter.
TEST(KvConfigTest, SparsePrefillPerLayer) {
  StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(
      R"({"default": {"method": "h2o", "budget": 0.2, "prefill": "vertical_slash"},
          "layers": [{"layers": "0-1", "method": "full", "prefill": "dense"},
                     {"layers": 4, "prefill": {"method": "xattention", "threshold": 0.8, "stride": 16}}]})",
      kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->layers[0].prefill.method, PrefillMethod::kDense);
  EXPECT_EQ(config->layers[2].prefill.method, PrefillMethod::kVerticalSlash);
  EXPECT_EQ(config->layers[2].prefill.vertical, 1000);
  EXPECT_EQ(config->layers[4].prefill.method, PrefillMethod::kXAttention);
  EXPECT_EQ(config->layers[4].prefill.block, 128);
  EXPECT_EQ(config->layers[4].prefill.stride, 16);
  EXPECT_DOUBLE_EQ(config->layers[4].prefill.threshold, 0.8);
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "prefill=xattention block=128 stride=16 threshold=0.8");

  std::string m = Rejection(R"({"layers": [{"layers": 1, "prefill": {"method": "xattention", "top_blocks": 3}}]})");
  EXPECT_MENTIONS(m, "layers[0]");
  EXPECT_MENTIONS(m, "prefill.top_blocks");
  EXPECT_MENTIONS(m, "stride, threshold");
  m = Rejection(R"({"default": {"prefill": "minference"}})");
  EXPECT_MENTIONS(m, "unknown sparse prefill method 'minference'");
  m = Rejection(R"({"default": {"prefill": {"method": "block_sparse", "block": 0}}})");
  EXPECT_MENTIONS(m, "'block' must be in [1, 8192]");
  m = Rejection(R"({"default": {"prefill": {"threshold": 0.5}}})");
  EXPECT_MENTIONS(m, "\"method\"");
}

// KIVI's residual length: whole pages, named in the summary; anything else is refused.
TEST(KvConfigTest, KiviResidualIsWholePages) {
  StatusOr<KvSparsityConfig> config =
      ParseKvSparsityConfig(R"({"default": {"kv_type": "int2_kivi"}, "page_size": 32, "kivi_residual": 128})", kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->kivi_residual, 128);
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "page_size=32");
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "kivi_residual=128");
  std::string m = Rejection(R"({"page_size": 32, "kivi_residual": 48})");
  EXPECT_MENTIONS(m, "kivi_residual must be a multiple of page_size (32)");
  EXPECT_MENTIONS(m, "found 48");
  // KIVI's defaults: 32-token pages and a 128-token residual where a layer stores a KIVI type;
  // 16-token pages and no residual otherwise; a residual rounded up to whole pages.
  config = ParseKvSparsityConfig(R"({"default": {"kv_type": "int4_kivi"}})", kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(EffectivePageSize(*config), 32);
  EXPECT_EQ(EffectiveKiviResidual(*config), 128);
  EXPECT_EQ(EffectiveKiviVGroup(*config, 64), 32);
  EXPECT_EQ(EffectiveKiviVGroup(*config, 8), 0);  // 32 does not divide head_dim 8: the whole row
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "page_size=32");
  EXPECT_MENTIONS(KvSparsityConfigSummary(*config), "kivi_residual=128");
  config = ParseKvSparsityConfig(R"({"default": {"kv_type": "int2_kivi"}, "page_size": 96, "kivi_v_group": 0})",
                                 kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(EffectiveKiviResidual(*config), 192);
  EXPECT_EQ(EffectiveKiviVGroup(*config, 64), 0);
  config = ParseKvSparsityConfig(R"({"default": {"kv_type": "f16"}})", kLayers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(EffectivePageSize(*config), 16);
  EXPECT_EQ(EffectiveKiviResidual(*config), 0);
  m = Rejection(R"({"default": {"kv_type": "int2_kivi"}, "kivi_residual": 16})");  // default pages of 32
  EXPECT_MENTIONS(m, "kivi_residual must be a multiple of page_size (32)");
  m = Rejection(R"({"kivi_v_group": 6})");
  EXPECT_MENTIONS(m, "kivi_v_group must be a multiple of 4");
  m = Rejection(R"({"kivi_residual": -16})");
  EXPECT_MENTIONS(m, "found -16");
  m = Rejection(R"({"kivi_residual": "128"})");
  EXPECT_MENTIONS(m, "field 'kivi_residual'");
}

// A cumulative mean budget the default spread cannot meet (0.8 > 2/3 at spread 3) is met with a
// lower spread, and the summary says so rather than silently keeping less.
TEST(KvConfigTest, CumulativeSummaryReportsALoweredSpread) {
  auto high = ParseKvSparsityConfig(R"({"default": {"method": "cumulative", "budget": 0.8}})", kLayers);
  ASSERT_TRUE(high.ok()) << high.status().ToString();
  EXPECT_MENTIONS(KvSparsityConfigSummary(*high), "spread=3 (lowered to 1.67: the first layer keeps 100%)");
  auto low = ParseKvSparsityConfig(R"({"default": {"method": "cumulative", "budget": 0.5}})", kLayers);
  ASSERT_TRUE(low.ok()) << low.status().ToString();
  EXPECT_EQ(KvSparsityConfigSummary(*low).find("lowered"), std::string::npos);
}

}  // namespace
}  // namespace kvsparse

namespace kvsparse {
namespace {

// KvSparsityConfigToJson reads back to the same config, and writing that again gives the same text.
TEST(KvConfigWriterTest, RoundTripsEveryMethodAndSetting) {
  const char* configs[] = {
      R"({"default": {"method": "h2o", "budget": 0.2, "kv_type": "int8"},
          "layers": [{"layers": "0-1", "method": "full", "kv_type": "f16"}, {"layers": 4, "budget": 64}],
          "evict_interval": 4, "page_size": 8, "gqa_aggregation": "max", "prefill_chunk": 128})",
      R"({"layers": [{"layers": 0, "method": "snapkv", "budget": 1.0, "window": 8, "kernel": 5, "pooling": "avg",
                      "head_budgets": "adaptive", "alpha": 0.3, "per_head": true},
                     {"layers": 1, "method": "h2o", "budget": 32, "recent": 20},
                     {"layers": 2, "method": "cumulative", "budget": 0.3, "rerank_period": 8, "decay": 0.9},
                     {"layers": 3, "method": "razor", "budget": 0.1, "retrieval_heads": 2},
                     {"layers": 4, "method": "quest", "budget": 0.25, "page_tokens": 8, "dense_layers": 0,
                      "prefill": {"method": "xattention", "threshold": 0.8}}],
          "prefill_eviction": "prompt_end"})",
      R"({"default": {"method": "tova", "budget": 100, "kv_type": "int4_kivi"}, "kivi_residual": 64,
          "kivi_v_group": 0})",
  };
  for (const char* text : configs) {
    StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(text, kLayers);
    ASSERT_TRUE(config.ok()) << config.status().message() << "\n" << text;
    const std::string written = KvSparsityConfigToJson(*config);
    StatusOr<KvSparsityConfig> back = ParseKvSparsityConfig(written, kLayers, "written");
    ASSERT_TRUE(back.ok()) << back.status().message() << "\n" << written;
    EXPECT_EQ(KvSparsityConfigSummary(*back), KvSparsityConfigSummary(*config)) << written;
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(back->layers[l].named_by_layers_entry, config->layers[l].named_by_layers_entry) << "layer " << l;
      EXPECT_EQ(back->layers[l].budget.is_fraction(), config->layers[l].budget.is_fraction()) << "layer " << l;
    }
    EXPECT_EQ(KvSparsityConfigToJson(*back), written);
  }
  // A config changed in code after parsing: a layer that left the default gets its own entry.
  StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(R"({"default": {"method": "h2o", "budget": 0.2}})", kLayers);
  ASSERT_TRUE(config.ok());
  config->layers[3].method = KvMethod::kFull;
  StatusOr<KvSparsityConfig> back = ParseKvSparsityConfig(KvSparsityConfigToJson(*config), kLayers);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(KvSparsityConfigSummary(*back), KvSparsityConfigSummary(*config));
}

}  // namespace
}  // namespace kvsparse

namespace kvsparse {
namespace {

TEST(KvBudgetByLengthTest, InterpolatesInLogLengthAndHoldsBeyondThePoints) {
  const KvBudget b = KvBudget::ByLength({{1024, 0.4}, {4096, 0.1}});
  EXPECT_DOUBLE_EQ(b.FractionAt(512), 0.4);   // below the first length: the first fraction
  EXPECT_DOUBLE_EQ(b.FractionAt(1024), 0.4);
  EXPECT_NEAR(b.FractionAt(2048), 0.25, 1e-12);  // halfway in log(length)
  EXPECT_DOUBLE_EQ(b.FractionAt(4096), 0.1);
  EXPECT_DOUBLE_EQ(b.FractionAt(100000), 0.1);
  EXPECT_EQ(ResolveBudget(b, 1024), 409);
  EXPECT_EQ(ResolveBudget(b, 2048), 512);
  EXPECT_EQ(ResolveBudget(b, 4096), 409);
  EXPECT_EQ(KvBudgetToString(b), "of the context by length (0.4 at 1024, 0.1 at 4096)");
}

TEST(KvBudgetByLengthTest, ParsesChecksAndRoundTrips) {
  StatusOr<KvSparsityConfig> config = ParseKvSparsityConfig(
      R"({"default": {"method": "snapkv", "budget_by_length": {"32768": 0.1, "4096": 0.5}},
          "layers": [{"layers": 0, "method": "full"}, {"layers": 1, "budget": 0.3}]})",
      kLayers);
  ASSERT_TRUE(config.ok()) << config.status().message();
  ASSERT_TRUE(config->layers[2].budget.is_by_length());
  ASSERT_EQ(config->layers[2].budget.by_length.size(), 2u);
  EXPECT_EQ(config->layers[2].budget.by_length[0], (std::pair<int32_t, double>{4096, 0.5}));  // sorted by length
  EXPECT_TRUE(config->layers[1].budget.is_fraction());  // an entry's budget replaces the default's
  const std::string written = KvSparsityConfigToJson(*config);
  StatusOr<KvSparsityConfig> back = ParseKvSparsityConfig(written, kLayers);
  ASSERT_TRUE(back.ok()) << back.status().message() << written;
  EXPECT_EQ(KvSparsityConfigSummary(*back), KvSparsityConfigSummary(*config));

  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget": 0.2, "budget_by_length": {"1024": 0.1}}})"),
                  "not both");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget_by_length": {"1k": 0.1}}})"), "'1k'");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget_by_length": {"1024": 1.5}}})"), "(0, 1]");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget_by_length": {}}})"), "budget_by_length");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget_by_length": [0.1]}})"), "budget_by_length");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "cumulative", "budget_by_length": {"1024": 0.1}}})"),
                  "cumulative");
  EXPECT_MENTIONS(Rejection(R"({"default": {"method": "h2o", "budget_by_length": {"1024": 0.1, "01024": 0.2}}})"),
                  "twice");
}

}  // namespace
}  // namespace kvsparse
