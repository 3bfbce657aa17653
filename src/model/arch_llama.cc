// The llama family: the common decoder itself, and the Qwen variants that only switch parts of it.
#include "model/arch.h"

namespace kvsparse {

// Llama 2/3 (with Llama 3.1's rope_freqs), TinyLlama, Mistral: nothing beyond the common path.
// Mixtral is a llama file with expert_count: its experts' probabilities renormalize over the
// chosen two (llama.cpp's llama graph, norm_w).
const ArchSpec kLlamaArchSpec = {
    .arch = Arch::kLlama,
    .gguf_name = "llama",
    .models = "Llama 2/3, TinyLlama, Mistral, Mixtral",
    .rope_style = RopeStyle::kAdjacentPairs,
    .expert_weights_norm = true,
};

// Qwen2 / Qwen2.5: Q/K/V biases, NeoX RoPE.
const ArchSpec kQwen2ArchSpec = {
    .arch = Arch::kQwen2,
    .gguf_name = "qwen2",
    .models = "Qwen2, Qwen2.5",
    .rope_style = RopeStyle::kNeox,
    .qkv_bias_required = true,
};

// Qwen3 (dense): RMSNorm of each query and key head before RoPE, no biases; the head size comes
// from attention.key_length (128 on the 0.6B's 1024-wide residual).
const ArchSpec kQwen3ArchSpec = {
    .arch = Arch::kQwen3,
    .gguf_name = "qwen3",
    .models = "Qwen3",
    .rope_style = RopeStyle::kNeox,
    .qk_norm = true,
};

}  // namespace kvsparse
