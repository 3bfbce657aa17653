// Internal: what one architecture adds to the common decoder.
//
// Every supported architecture is the same pre-norm transformer (embedding, then per layer
// RMSNorm -> attention -> residual, RMSNorm -> gated FFN -> residual, then a final norm and
// the classifier). An architecture differs only in switches on that path: biases, Q/K norms,
// post-norms, the FFN activation, fused projections, embedding scale, softcaps, sliding
// windows and RoPE variants. So an architecture is an ArchSpec: flags for the tensors the
// loader binds, plus an optional hook that reads its own metadata into ModelConfig. The
// forward pass (engine.cc) and the float64 reference read only ModelConfig and LayerWeights.
//
// Adding an architecture: one arch_<name>.cc defining its spec, and one line in
// KnownArchSpecs() (arch.cc). The study models were llama.cpp's per-architecture graph
// files and gemma.cpp's config structs; kvsparse keeps one graph and many configs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvsparse/gguf.h"
#include "kvsparse/model.h"
#include "kvsparse/status.h"

namespace kvsparse {

// Reads "<arch>.<key>" metadata for an architecture's hook, with messages naming the file and key.
class ArchKeys {
 public:
  ArchKeys(const GgufFile& file, std::string prefix, std::string source)
      : file_(file), prefix_(std::move(prefix)), source_(std::move(source)) {}
  bool Has(std::string_view key) const { return file_.Find(prefix_ + std::string(key)) != nullptr; }
  // Absent: std::nullopt. Present but not an unsigned integer (or above INT32_MAX): an error.
  StatusOr<std::optional<int32_t>> Count(std::string_view key) const;
  // Absent: `dflt`. Present: must be a finite number.
  StatusOr<float> FloatOr(std::string_view key, float dflt) const;
  const std::string& prefix() const { return prefix_; }
  const std::string& source() const { return source_; }
  const GgufFile& file() const { return file_; }

 private:
  const GgufFile& file_;
  std::string prefix_;  // "gemma3."
  std::string source_;  // "GGUF model 'x.gguf'"
};

// attention.sliding_window (absent: dflt_window; 0: no sliding layers) and the period form of
// attention.sliding_window_pattern (absent: default_period): one of every `period` layers is
// global, the last of each group (llama.cpp's swa pattern); period 0 makes every layer slide.
Status ReadSlidingWindow(const ArchKeys& keys, int32_t dflt_window, int default_period, ModelConfig* c);

struct ArchSpec {
  Arch arch = Arch::kLlama;
  std::string_view gguf_name;  // general.architecture
  std::string_view models;     // the model families it covers, for messages and docs
  RopeStyle rope_style = RopeStyle::kAdjacentPairs;
  FfnActivation ffn_activation = FfnActivation::kSilu;
  bool qkv_bias_required = false;  // attn_{q,k,v}.bias always present (qwen2); else bound when present
  bool qk_norm = false;            // attn_q_norm / attn_k_norm [head_dim]
  bool post_norms = false;         // post_attention_norm / post_ffw_norm [dim]
  bool fused_qkv = false;          // attn_qkv.weight [q_dim + 2 kv_dim, dim] where attn_q/k/v are absent
  bool fused_gate_up = false;      // ffn_up.weight [2 hidden, dim] = [gate; up], no ffn_gate
  bool scale_embeddings = false;   // token embeddings times sqrt(dim)
  bool qk_norm_full_width = false; // olmoe: attn_q_norm [n_heads * head_dim], attn_k_norm [n_kv_heads * head_dim]
  // Mixture of experts: experts_required: expert_count must be present and positive (qwen2moe,
  // qwen3moe, olmoe); otherwise a file may have experts (llama: Mixtral) or not. The other two
  // are what llama.cpp's graph for the architecture fixes, whatever the file's keys say.
  bool experts_required = false;
  bool expert_weights_norm = false;  // renormalize the chosen experts' probabilities (qwen3moe, Mixtral)
  bool shared_expert = false;        // ffn_{gate,up,down}_shexp with the sigmoid gate ffn_gate_inp_shexp (qwen2moe)
  // gpt-oss: biases on Q/K/V and the attention output, on the router and on every expert's
  // gate/up/down, all required; attn_sinks [n_heads]; the FFN's norm is named
  // post_attention_norm (llama.cpp's name for it there).
  bool gpt_oss_biases = false;
  bool attention_sinks = false;
  std::string_view ffn_norm_tensor = "ffn_norm";
  // Metadata of the architecture's own (windows, softcaps, attention scale, MLA), read after the
  // common and expert keys filled `config`; null when there is none.
  Status (*read_config)(const ArchKeys& keys, ModelConfig* config) = nullptr;
};

// Every architecture kvsparse computes, in the order messages list them.
std::span<const ArchSpec* const> KnownArchSpecs();
// The spec for general.architecture `gguf_name`; null when unsupported.
const ArchSpec* FindArchSpec(std::string_view gguf_name);
const ArchSpec& ArchSpecOf(Arch arch);
// "llama (Llama 2/3, TinyLlama, Mistral), qwen2 (...), ..." for messages.
std::string SupportedArchNames();

// The specs, one per arch_<name>.cc.
extern const ArchSpec kLlamaArchSpec;
extern const ArchSpec kQwen2ArchSpec;
extern const ArchSpec kQwen3ArchSpec;
extern const ArchSpec kGemma2ArchSpec;
extern const ArchSpec kGemma3ArchSpec;
extern const ArchSpec kPhi3ArchSpec;
extern const ArchSpec kQwen2MoeArchSpec;
extern const ArchSpec kQwen3MoeArchSpec;
extern const ArchSpec kOlmoeArchSpec;
extern const ArchSpec kDeepseek2ArchSpec;
extern const ArchSpec kGptOssArchSpec;

}  // namespace kvsparse
