// Phi-3 / Phi-3.5 mini: fused attn_qkv and fused ffn_up ([gate; up]), NeoX RoPE; the 128K files
// carry LongRoPE's short and long factor tables (rope_factors_short/long.weight, bound by the
// common loader like Llama 3.1's rope_freqs). A sliding_window key is ignored, as llama.cpp
// ignores it (its Phi-3 path runs every layer globally).
#include "model/arch.h"

namespace kvsparse {

const ArchSpec kPhi3ArchSpec = {
    .arch = Arch::kPhi3,
    .gguf_name = "phi3",
    .models = "Phi-3, Phi-3.5 mini",
    .rope_style = RopeStyle::kNeox,
    .fused_qkv = true,
    .fused_gate_up = true,
};

}  // namespace kvsparse
