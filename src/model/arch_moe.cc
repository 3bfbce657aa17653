// The mixture-of-experts architectures whose attention is the common decoder's: Qwen1.5/Qwen2
// MoE (Q/K/V biases, a shared expert behind a sigmoid gate), Qwen3 MoE (Qwen3's per-head Q/K
// norms, renormalized top-k) and OLMoE (Q/K norms over the whole projection). Mixtral is a llama
// file with experts (arch_llama.cc). What each fixes follows llama.cpp's graphs for them
// (src/models/{qwen2moe,qwen3moe,olmoe}.cpp: build_moe_ffn's norm_w and the shared expert).
#include "model/arch.h"

namespace kvsparse {

const ArchSpec kQwen2MoeArchSpec = {
    .arch = Arch::kQwen2Moe,
    .gguf_name = "qwen2moe",
    .models = "Qwen1.5-MoE, Qwen2-57B-A14B",
    .rope_style = RopeStyle::kNeox,
    .experts_required = true,
    .expert_weights_norm = false,
    .shared_expert = true,
};

const ArchSpec kQwen3MoeArchSpec = {
    .arch = Arch::kQwen3Moe,
    .gguf_name = "qwen3moe",
    .models = "Qwen3-30B-A3B, Qwen3-235B-A22B",
    .rope_style = RopeStyle::kNeox,
    .qk_norm = true,
    .experts_required = true,
    .expert_weights_norm = true,
};

const ArchSpec kOlmoeArchSpec = {
    .arch = Arch::kOlmoe,
    .gguf_name = "olmoe",
    .models = "OLMoE-1B-7B",
    .rope_style = RopeStyle::kNeox,
    .qk_norm = true,
    .qk_norm_full_width = true,
    .experts_required = true,
    .expert_weights_norm = false,
};

}  // namespace kvsparse
