// llama-quantize's per-tensor types for its file types (quant_mix.h), on real model shapes.
#include "kvsparse/quant_mix.h"

#include <gtest/gtest.h>

#include <string>

namespace kvsparse {
namespace {

DType TypeOf(const QuantMix& mix, const std::string& name, int64_t cols, int layer, int n_layers, bool has_output = true,
             int n_gqa = 8) {
  MixTensor t;
  t.name = name;
  t.cols = cols;
  t.layer = layer;
  t.n_layers = n_layers;
  t.model_has_output = has_output;
  t.n_gqa = n_gqa;
  return MixTensorType(mix, t);
}

TEST(QuantMixTest, Q4_K_MOnTinyLlama) {
  const QuantMix mix = *FindQuantMix("Q4_K_M");
  EXPECT_EQ(mix.file_type, 15u);
  EXPECT_TRUE(mix.mixed);
  EXPECT_EQ(TypeOf(mix, "output.weight", 2048, 0, 22), DType::kQ6_K);
  EXPECT_EQ(TypeOf(mix, "token_embd.weight", 2048, 0, 22), DType::kQ4_K);
  // 22 layers: more bits for layers < 2, >= 19, and 2 + 3k + 2 (4, 7, 10, 13, 16).
  for (int layer = 0; layer < 22; ++layer) {
    const bool more = layer < 2 || layer >= 19 || (layer - 2) % 3 == 2;
    const std::string b = "blk." + std::to_string(layer) + ".";
    EXPECT_EQ(TypeOf(mix, b + "attn_v.weight", 2048, layer, 22), more ? DType::kQ6_K : DType::kQ4_K) << layer;
    EXPECT_EQ(TypeOf(mix, b + "ffn_down.weight", 5632, layer, 22), more ? DType::kQ6_K : DType::kQ4_K) << layer;
    EXPECT_EQ(TypeOf(mix, b + "attn_q.weight", 2048, layer, 22), DType::kQ4_K);
    EXPECT_EQ(TypeOf(mix, b + "ffn_up.weight", 2048, layer, 22), DType::kQ4_K);
  }
}

TEST(QuantMixTest, FallbacksWhereRowsAreNotWhole256Blocks) {
  // Qwen2.5-0.5B: 896-wide rows (3.5 super-blocks), tied classifier.
  const QuantMix q4km = *FindQuantMix("q4_k_m");
  EXPECT_EQ(TypeOf(q4km, "token_embd.weight", 896, 0, 24, /*has_output=*/false), DType::kQ8_0);
  EXPECT_EQ(TypeOf(q4km, "blk.5.attn_q.weight", 896, 5, 24, false), DType::kQ5_0);
  EXPECT_EQ(TypeOf(q4km, "blk.0.attn_v.weight", 896, 0, 24, false), DType::kQ8_0);  // Q6_K -> Q8_0
  EXPECT_EQ(TypeOf(q4km, "blk.6.ffn_down.weight", 4864, 6, 24, false), DType::kQ4_K);
  EXPECT_EQ(TypeOf(q4km, "blk.5.ffn_down.weight", 4864, 5, 24, false), DType::kQ6_K);  // (5 - 24 / 8) % 3 == 2
  const QuantMix q5km = *FindQuantMix("q5_k_m");
  EXPECT_EQ(TypeOf(q5km, "blk.5.attn_q.weight", 896, 5, 24, false), DType::kQ5_1);
  const QuantMix q3km = *FindQuantMix("q3_k_m");
  EXPECT_EQ(TypeOf(q3km, "blk.5.ffn_up.weight", 896, 5, 24, false), DType::kIQ4_NL);
  // A tied classifier whose rows fit takes the output rule.
  EXPECT_EQ(TypeOf(q4km, "token_embd.weight", 2048, 0, 16, false), DType::kQ6_K);
}

TEST(QuantMixTest, OtherMixes) {
  const QuantMix q2k = *FindQuantMix("q2_k");
  EXPECT_EQ(TypeOf(q2k, "blk.3.attn_v.weight", 2048, 3, 16, true, 8), DType::kQ4_K);
  EXPECT_EQ(TypeOf(q2k, "blk.3.attn_v.weight", 2048, 3, 16, true, 2), DType::kQ3_K);
  EXPECT_EQ(TypeOf(q2k, "blk.3.ffn_down.weight", 8192, 3, 16), DType::kQ3_K);
  EXPECT_EQ(TypeOf(q2k, "blk.3.attn_output.weight", 2048, 3, 16), DType::kQ3_K);
  EXPECT_EQ(TypeOf(q2k, "blk.3.ffn_gate.weight", 2048, 3, 16), DType::kQ2_K);
  const QuantMix q3km = *FindQuantMix("q3_k_m");
  EXPECT_EQ(TypeOf(q3km, "blk.1.attn_v.weight", 2048, 1, 16), DType::kQ5_K);
  EXPECT_EQ(TypeOf(q3km, "blk.2.attn_v.weight", 2048, 2, 16), DType::kQ4_K);
  EXPECT_EQ(TypeOf(q3km, "blk.0.ffn_down.weight", 8192, 0, 16), DType::kQ5_K);
  EXPECT_EQ(TypeOf(q3km, "blk.1.ffn_down.weight", 8192, 1, 16), DType::kQ4_K);
  EXPECT_EQ(TypeOf(q3km, "blk.1.attn_output.weight", 2048, 1, 16), DType::kQ4_K);
  const QuantMix q4_0 = *FindQuantMix("q4_0");
  EXPECT_EQ(TypeOf(q4_0, "output.weight", 2048, 0, 16), DType::kQ6_K);
  EXPECT_EQ(TypeOf(q4_0, "blk.0.attn_v.weight", 2048, 0, 16), DType::kQ4_0);
  const QuantMix q8_0 = *FindQuantMix("q8_0");
  EXPECT_EQ(TypeOf(q8_0, "output.weight", 2048, 0, 16), DType::kQ8_0);
  const QuantMix iq4xs = *FindQuantMix("iq4_xs");
  EXPECT_EQ(TypeOf(iq4xs, "blk.0.ffn_down.weight", 8192, 0, 16), DType::kQ5_K);
  EXPECT_EQ(TypeOf(iq4xs, "blk.9.ffn_down.weight", 8192, 9, 16), DType::kIQ4_XS);
  EXPECT_EQ(TypeOf(iq4xs, "blk.9.attn_v.weight", 2048, 9, 16, true, 4), DType::kQ5_K);
}

TEST(QuantMixTest, PureTypesAndErrors) {
  const QuantMix pure = *FindQuantMix("q4_k");
  EXPECT_FALSE(pure.mixed);
  EXPECT_EQ(TypeOf(pure, "output.weight", 2048, 0, 16), DType::kQ4_K);
  EXPECT_EQ(TypeOf(pure, "blk.0.attn_q.weight", 896, 0, 16), DType::kQ8_0);
  EXPECT_EQ(PureQuantMix(DType::kF16).file_type, 1u);
  const auto bad = FindQuantMix("q9_k_m");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("q4_k_m"), std::string::npos) << bad.status().message();
}

}  // namespace
}  // namespace kvsparse
