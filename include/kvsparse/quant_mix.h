// llama-quantize's file types ("mixes"): which weight type each tensor of a model gets. A mix
// such as Q4_K_M is mostly Q4_K with Q6_K on the output and on attn_v / ffn_down of some layers,
// and with fallbacks where a row is not a multiple of the type's block (Q4_K -> Q5_0, ...).
// synth and convert write these so benchmarks and tests run on the files people download.
// The rules follow llama.cpp's llama_tensor_get_type (src/llama-quant.cpp) for dense,
// non-Falcon models without an importance matrix.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct QuantMix {
  std::string name;          // "q4_k_m", or a pure type's name ("q4_k")
  uint32_t file_type = 0;    // llama_ftype, written as general.file_type
  DType base = DType::kF32;  // the type most matrices get
  bool mixed = false;        // false: every matrix gets `base` (with the pure fallback below)
};

// Mixes (q2_k, q3_k_s/m/l, q4_k_s/m, q5_k_s/m, q6_k, iq4_nl, iq4_xs, q4_0, q4_1, q5_0, q5_1,
// q8_0, mxfp4_moe: the experts MXFP4, everything else Q8_0) and pure types (any weight type name). Errors name the valid choices.
StatusOr<QuantMix> FindQuantMix(std::string_view name);
std::string QuantMixNames();  // "q2_k, q3_k_s, ..."
// Every matrix `type` (llama-quantize --pure; an unquantized file for f32/f16/bf16).
QuantMix PureQuantMix(DType type);

// What the per-tensor rules need to know of a 2-D weight and its model.
struct MixTensor {
  std::string_view name;    // GGUF tensor name: "output.weight", "blk.3.attn_v.weight", ...
  int64_t cols = 0;         // row length (ne0)
  int layer = 0;            // its block index (blk.N), for attn_v / ffn_down
  int n_layers = 0;
  bool model_has_output = true;  // false: the classifier is tied to token_embd, which gets output's rule
  int n_gqa = 1;                 // n_heads / n_kv_heads
  bool expert_stack = false;     // a 3-D tensor of one matrix per expert (ffn_*_exps)
};

// The type llama-quantize gives this tensor under `mix`. A pure mix gives `base` where the row
// fits its block, else q8_0, f16, f32 (the first that fits). A K mix falls back as llama-quantize
// does: Q2_K / Q3_K / IQ4_XS -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16.
DType MixTensorType(const QuantMix& mix, const MixTensor& tensor);

}  // namespace kvsparse
