// Tiny random-weight llama / qwen2 GGUF files for model tests, with switches for the
// features the loader must handle (GQA, untied output, rope_freqs, rope theta, Q/K/V
// biases, every weight type) and fault injection for loader-error tests.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/gguf.h"
#include "kvsparse/status.h"

namespace kvsparse::testing {

struct TinyModelSpec {
  std::string arch = "llama";  // general.architecture
  int n_vocab = 96;
  int dim = 64;
  int hidden_dim = 128;
  int n_layers = 2;
  int n_heads = 4;
  int n_kv_heads = 2;
  int context = 256;
  float rms_eps = 1e-5f;
  std::optional<float> rope_theta;   // written as {arch}.rope.freq_base when set (default 10000)
  DType weight_type = DType::kF32;   // every 2-D weight
  DType norm_type = DType::kF32;     // RMSNorm weights (f16 checks the loader's conversion)
  bool tied_output = true;           // false: writes output.weight
  bool rope_freqs = false;           // writes a Llama 3.1-style rope_freqs.weight [head_dim/2]
  bool qkv_bias = false;             // writes blk.N.attn_{q,k,v}.bias
  int head_dim = 0;                  // > 0: written as attention.key_length / value_length (else dim / n_heads)
  bool qk_norm = false;              // writes blk.N.attn_{q,k}_norm.weight [head_dim] (qwen3)
  uint64_t seed = 1;

  // ---- fault injection ----
  std::string omit_tensor;             // this tensor is left out
  std::string reshape_tensor;          // this tensor is written with shape reshape_ne (f32)
  std::vector<int64_t> reshape_ne;
  std::string retype_tensor;           // this tensor is written with ggml type id retype_id
  uint32_t retype_id = 0;              // any ggml type id, e.g. 13 = q5_K (random bytes of its size)
  std::function<void(GgufWriter&)> extra_metadata;  // called after the standard keys
};

Status WriteTinyModelGguf(const TinyModelSpec& spec, const std::string& path);

}  // namespace kvsparse::testing
