// Random-weight GGUF models with the exact shapes, keys and tensor names (llama.cpp
// conventions) of real models. Weights are generated row by row from a counter-based
// PRNG, so the output is identical for any thread count, and streamed to disk one tensor
// at a time through GgufWriter.
#include "kvsparse/synth.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/model.h"
#include "kvsparse/ops.h"
#include "kvsparse/quant_mix.h"
#include "model/model_loader.h"

namespace kvsparse {

namespace {

SynthShape Shape(std::string name, std::string arch, int n_vocab, int dim, int hidden, int layers, int heads,
                 int kv_heads, int context, float theta, float eps, bool tied, bool bias, float llama3_factor = 0) {
  SynthShape s;
  s.name = std::move(name);
  s.arch = std::move(arch);
  s.n_vocab = n_vocab;
  s.dim = dim;
  s.hidden_dim = hidden;
  s.n_layers = layers;
  s.n_heads = heads;
  s.n_kv_heads = kv_heads;
  s.context = context;
  s.rope_theta = theta;
  s.rms_eps = eps;
  s.tied_output = tied;
  s.qkv_bias = bias;
  s.rope_llama3_factor = llama3_factor;
  return s;
}

SynthShape WithHeadDim(SynthShape s, int head_dim) {
  s.head_dim = head_dim;
  return s;
}

SynthShape WithWindow(SynthShape s, int window, float attn_softcap = 0, float final_softcap = 0) {
  s.sliding_window = window;
  s.attn_softcap = attn_softcap;
  s.final_softcap = final_softcap;
  return s;
}

SynthShape WithYarn(SynthShape s, float factor, int original_context) {
  s.rope_yarn_factor = factor;
  s.rope_original_context = original_context;
  return s;
}

SynthShape WithLongRope(SynthShape s, int original_context) {
  s.long_rope = true;
  s.rope_original_context = original_context;
  return s;
}

SynthShape WithExperts(SynthShape s, int n_experts, int n_used, int expert_hidden, int shared_hidden = 0) {
  s.n_experts = n_experts;
  s.n_experts_used = n_used;
  s.expert_hidden_dim = expert_hidden;
  s.shared_expert_hidden_dim = shared_hidden;
  return s;
}

// DeepSeek's attention at the given sizes; the latent cache row is kv_lora + rope values.
SynthShape WithLatentAttention(SynthShape s, int kv_lora, int q_lora, int nope, int rope, int v_head,
                               int dense_lead) {
  s.kv_lora_rank = kv_lora;
  s.q_lora_rank = q_lora;
  s.mla_nope_dim = nope;
  s.mla_rope_dim = rope;
  s.mla_v_head_dim = v_head;
  s.n_dense_lead_layers = dense_lead;
  return s;
}

SynthShape WithDeepseekYarn(SynthShape s, float factor, int original_context, float log_multiplier) {
  s.rope_yarn_factor = factor;
  s.rope_original_context = original_context;
  s.yarn_log_multiplier = log_multiplier;
  return s;
}

SynthShape WithV3Routing(SynthShape s, float scale) {
  s.sigmoid_gating = true;
  s.expert_weights_norm = true;
  s.expert_weights_scale = scale;
  return s;
}

SynthShape WithUnsplitKvB(SynthShape s) {
  s.mla_unsplit_kv_b = true;
  return s;
}

// splitmix64: a tiny, high-quality mixer; used as a counter-based generator.
inline uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fills out[0..n) with uniform values of mean `center` and half-width `half_width`,
// determined only by (stream, row).
void UniformRow(uint64_t stream, int64_t row, float center, float half_width, float* out, int64_t n) {
  uint64_t state = SplitMix(stream ^ SplitMix(static_cast<uint64_t>(row) + 0x51ed270b27a4f1ull));
  constexpr float kScale = 1.0f / 8388608.0f;  // 2^-23
  int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    uint64_t r = SplitMix(state++);
    // Two 23-bit uniforms in [0, 1) from one 64-bit draw.
    float a = static_cast<float>(r >> 41) * kScale;
    float b = static_cast<float>((r >> 9) & 0x7fffff) * kScale;
    out[i] = center + half_width * (2.0f * a - 1.0f);
    out[i + 1] = center + half_width * (2.0f * b - 1.0f);
  }
  if (i < n) {
    float a = static_cast<float>(SplitMix(state) >> 41) * kScale;
    out[i] = center + half_width * (2.0f * a - 1.0f);
  }
}

// Per-frequency divisors of llama3 RoPE scaling, as llama.cpp's converter writes them
// into rope_freqs.weight: long wavelengths are slowed by `factor`, short ones kept, and
// the band between interpolated smoothly.
std::vector<float> Llama3RopeFactors(int64_t head_dim, float theta, float factor) {
  constexpr double kLowFreqFactor = 1.0, kHighFreqFactor = 4.0, kOriginalContext = 8192.0;
  const double low_freq_wavelen = kOriginalContext / kLowFreqFactor;
  const double high_freq_wavelen = kOriginalContext / kHighFreqFactor;
  std::vector<float> factors(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double freq = 1.0 / std::pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / head_dim);
    const double wavelen = 2.0 * std::numbers::pi / freq;
    double f = 1.0;
    if (wavelen > low_freq_wavelen) {
      f = factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (kOriginalContext / wavelen - kLowFreqFactor) / (kHighFreqFactor - kLowFreqFactor);
      f = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    factors[static_cast<size_t>(i)] = static_cast<float>(f);
  }
  return factors;
}

// The chat-format control tokens of an architecture's real vocab, so that a synthetic model of
// it renders its chat template (and llama.cpp, which looks some of them up by name, loads it).
std::vector<std::string> ChatSpecialTokens(const std::string& arch) {
  if (arch == "phi3") return {"<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"};
  if (arch == "gemma2" || arch == "gemma3") return {"<start_of_turn>", "<end_of_turn>"};
  if (arch == "gpt-oss") return {"<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"};
  return {};
}

// A generated SentencePiece-style vocab: <unk> <s> </s>, 256 byte tokens, then unique
// pieces "a".."z", "▁a".."▁z", "aa", "▁aa", ... with decreasing scores; the last ids are the
// architecture's chat control tokens.
void AddGeneratedVocab(int n_vocab, const std::vector<std::string>& specials, GgufWriter* w) {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  tokens.reserve(n_vocab);
  auto add = [&](std::string piece, float score, int32_t type) {
    tokens.push_back(std::move(piece));
    scores.push_back(score);
    types.push_back(type);
  };
  constexpr int32_t kNormal = 1, kUnknown = 2, kControl = 3, kByte = 6;
  add("<unk>", 0.0f, kUnknown);
  add("<s>", 0.0f, kControl);
  add("</s>", 0.0f, kControl);
  for (int b = 0; b < 256 && static_cast<int>(tokens.size()) < n_vocab; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    add(buf, 0.0f, kByte);
  }
  const std::string kSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's word-boundary marker
  std::string letters;
  for (int len = 1; static_cast<int>(tokens.size()) < n_vocab; ++len) {
    // Enumerate all lowercase strings of length `len` in lexicographic order.
    std::vector<int> digits(len, 0);
    while (static_cast<int>(tokens.size()) < n_vocab) {
      letters.assign(len, 'a');
      for (int k = 0; k < len; ++k) letters[k] = static_cast<char>('a' + digits[k]);
      float score = -static_cast<float>(tokens.size());
      add(kSpace + letters, score, kNormal);
      if (static_cast<int>(tokens.size()) < n_vocab) add(letters, score - 0.5f, kNormal);
      int k = len - 1;
      while (k >= 0 && ++digits[k] == 26) digits[k--] = 0;
      if (k < 0) break;
    }
  }
  constexpr int kFirstFree = 3 + 256;
  for (size_t i = 0; i < specials.size() && n_vocab - static_cast<int>(specials.size()) >= kFirstFree; ++i) {
    const size_t id = static_cast<size_t>(n_vocab) - specials.size() + i;
    tokens[id] = specials[i];
    scores[id] = 0.0f;
    types[id] = kControl;
  }
  w->SetString("tokenizer.ggml.model", "llama");
  w->SetStringArray("tokenizer.ggml.tokens", tokens);
  w->SetF32Array("tokenizer.ggml.scores", scores);
  w->SetI32Array("tokenizer.ggml.token_type", types);
  w->SetU32("tokenizer.ggml.bos_token_id", 1);
  w->SetU32("tokenizer.ggml.eos_token_id", 2);
  w->SetU32("tokenizer.ggml.unknown_token_id", 0);
  w->SetBool("tokenizer.ggml.add_bos_token", true);
  w->SetBool("tokenizer.ggml.add_eos_token", false);
}

// Copies every tokenizer.* key (SetValue copies the bytes, so the vocab file may close).
Status CopyVocab(const std::string& vocab_path, const SynthShape& shape, GgufWriter* w) {
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> vocab, GgufFile::Open(vocab_path));
  KVS_ASSIGN_OR_RETURN(const std::vector<std::string_view>* tokens, vocab->GetStringArray("tokenizer.ggml.tokens"));
  if (tokens->size() != static_cast<size_t>(shape.n_vocab)) {
    return InvalidArgumentError("vocab " + vocab_path + " has " + std::to_string(tokens->size()) +
                                " tokens (tokenizer.ggml.tokens) but shape '" + shape.name + "' needs n_vocab = " +
                                std::to_string(shape.n_vocab));
  }
  for (const auto& [key, value] : vocab->metadata()) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    w->SetValue(key, value);
  }
  return Status::Ok();
}

Status ValidateShape(const SynthShape& s, int n_layers) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("synth shape '" + s.name + "': " + what);
  };
  static const char* const kArchs[] = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe",
                                        "olmoe", "deepseek2", "gpt-oss"};
  if (std::find(std::begin(kArchs), std::end(kArchs), s.arch) == std::end(kArchs)) {
    return bad("arch must be llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen2moe, qwen3moe, olmoe, deepseek2 or gpt-oss, "
               "found '" + s.arch + "'");
  }
  const bool moe_arch = s.arch == "qwen2moe" || s.arch == "qwen3moe" || s.arch == "olmoe" || s.arch == "gpt-oss";
  if (s.arch == "gpt-oss" && (s.sliding_window <= 0 || !s.qkv_bias)) {
    return bad("gpt-oss slides a window over every other layer and has Q/K/V biases");
  }
  const bool deepseek = s.arch == "deepseek2";
  if ((moe_arch && s.n_experts == 0) || (s.n_experts > 0 && s.arch != "llama" && !moe_arch && !deepseek) ||
      s.n_experts_used > s.n_experts || (s.n_experts > 0 && s.n_experts_used <= 0) ||
      (s.shared_expert_hidden_dim > 0 && s.arch != "qwen2moe" && !deepseek) ||
      (s.arch == "qwen2moe" && s.shared_expert_hidden_dim == 0) || s.expert_hidden_dim % 32 != 0 ||
      s.shared_expert_hidden_dim % 32 != 0 ||
      (deepseek && s.expert_hidden_dim > 0 && s.shared_expert_hidden_dim % s.expert_hidden_dim != 0)) {
    return bad("experts: " + std::to_string(s.n_experts_used) + " of " + std::to_string(s.n_experts) +
               " (widths " + std::to_string(s.expert_hidden_dim) + ", shared " +
               std::to_string(s.shared_expert_hidden_dim) +
               ") do not fit arch '" + s.arch + "' (qwen2moe, qwen3moe, olmoe need experts, llama and deepseek2 may "
               "have them; 1 <= used <= experts; a shared expert only on qwen2moe and deepseek2 (a whole number of "
               "experts there); widths multiples of 32)");
  }
  if (deepseek != (s.kv_lora_rank > 0) ||
      (deepseek && (s.mla_rope_dim <= 0 || s.mla_rope_dim % 2 != 0 || s.mla_nope_dim % 32 != 0 ||
                    s.mla_nope_dim <= 0 || s.mla_v_head_dim <= 0 || s.mla_v_head_dim % 32 != 0 ||
                    s.kv_lora_rank % 32 != 0 || s.q_lora_rank % 32 != 0 || s.n_kv_heads != 1 ||
                    s.n_dense_lead_layers < 0 || s.n_dense_lead_layers > n_layers))) {
    return bad("latent attention: deepseek2 and only deepseek2 has a kv_lora_rank; ranks and head widths must be "
               "multiples of 32, rope dims even, one KV head, at most n_layers dense lead layers");
  }
  // The checks every loaded model passes, so synth never writes a file the loader refuses.
  ModelConfig c;
  c.n_vocab = s.n_vocab;
  c.dim = s.dim;
  c.hidden_dim = s.hidden_dim;
  c.n_layers = n_layers;
  c.n_heads = s.n_heads;
  c.n_kv_heads = s.n_kv_heads;
  c.head_dim = deepseek ? s.kv_lora_rank + s.mla_rope_dim : s.head_dim > 0 ? s.head_dim : s.n_heads > 0 ? s.dim / s.n_heads : 0;
  c.max_context = s.context;
  c.rms_eps = s.rms_eps;
  c.rope_theta = s.rope_theta;
  const Status valid = ValidateModelConfig(c, "synth shape '" + s.name + "'");
  if (!valid.ok()) return InvalidArgumentError(valid.message());
  if (s.dim % 32 != 0 || s.hidden_dim % 32 != 0) {
    return bad("dim and hidden_dim must be multiples of 32 (quantization block), found " + std::to_string(s.dim) +
               " and " + std::to_string(s.hidden_dim));
  }
  if (s.n_vocab < 3 + 256 + 1) return bad("n_vocab must be at least 260 (specials + 256 byte tokens)");
  return Status::Ok();
}

}  // namespace

const std::vector<SynthShape>& SynthShapes() {
  static const std::vector<SynthShape> shapes = {
      // name, arch, vocab, dim, hidden, layers, heads, kv, ctx, theta, eps, tied, qkv_bias[, llama3 rope factor]
      Shape("tinyllama-1.1b", "llama", 32000, 2048, 5632, 22, 32, 4, 2048, 10000.0f, 1e-5f, false, false),
      Shape("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 131072, 500000.0f, 1e-5f, true, false, 32.0f),
      Shape("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 32768, 1000000.0f, 1e-6f, true, true),
      Shape("llama-3.1-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 131072, 500000.0f, 1e-5f, false, false, 8.0f),
      WithHeadDim(Shape("qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 40960, 1000000.0f, 1e-6f, true, false), 128),
      // Gemma 3 1B: 4 heads of 256 over 1152, one kv head, 512-token windows on 5 of 6 layers.
      WithWindow(WithHeadDim(Shape("gemma-3-1b", "gemma3", 262144, 1152, 6912, 26, 4, 1, 32768, 1000000.0f, 1e-6f,
                                   true, false),
                             256),
                 512),
      WithWindow(WithHeadDim(Shape("gemma-2-2b", "gemma2", 256000, 2304, 9216, 26, 8, 4, 8192, 10000.0f, 1e-6f, true,
                                   false),
                             256),
                 4096, 50.0f, 30.0f),
      WithLongRope(Shape("phi-3.5-mini", "phi3", 32064, 3072, 8192, 32, 32, 32, 131072, 10000.0f, 1e-5f, false, false),
                   4096),
      // Tiny shapes for tests (seconds to write, milliseconds to run).
      Shape("tiny-llama", "llama", 512, 64, 160, 2, 4, 4, 256, 10000.0f, 1e-5f, false, false),
      Shape("tiny-qwen2", "qwen2", 512, 64, 128, 2, 4, 2, 256, 1000000.0f, 1e-6f, true, true),
      // Also exercises llama3 RoPE scaling (rope_freqs.weight).
      Shape("tiny-gqa-untied", "llama", 512, 128, 256, 3, 8, 2, 512, 10000.0f, 1e-5f, false, false, 8.0f),
      // Every row a multiple of 256, so q4_k applies to every matrix without fallback.
      Shape("tiny-llama-256", "llama", 1024, 256, 512, 2, 4, 2, 512, 10000.0f, 1e-5f, false, false),
      // For llama-quantize mixes: rows of 256 take K-quants, ffn_down's 640-wide rows (2.5 super-blocks)
      // take the 32-element fallbacks; 8 layers spread attn_v / ffn_down over the mixes' layer rules.
      Shape("tiny-mix", "llama", 1024, 256, 640, 8, 4, 1, 1024, 10000.0f, 1e-5f, false, false),
      // Qwen3's features at test size: Q/K norms, no biases, 8 heads of 64 over a 256-wide residual.
      WithHeadDim(Shape("tiny-qwen3", "qwen3", 1024, 256, 768, 4, 8, 2, 1024, 1000000.0f, 1e-6f, true, false), 64),
      // Gemma 2 at test size: 16-token windows on every other layer, softcaps small enough to bite.
      WithWindow(WithHeadDim(Shape("tiny-gemma2", "gemma2", 1024, 256, 768, 4, 4, 2, 1024, 10000.0f, 1e-6f, true,
                                   false),
                             64),
                 16, 5.0f, 10.0f),
      // Gemma 3 at test size: 7 layers (5 sliding, 1 global, 1 sliding), 4 heads of 128 over 256.
      WithWindow(WithHeadDim(Shape("tiny-gemma3", "gemma3", 1024, 256, 512, 7, 4, 1, 1024, 1000000.0f, 1e-6f, true,
                                   false),
                             128),
                 16),
      // Phi-3 at test size: fused QKV and gate/up, LongRoPE (context 4096 over 1024: long factors).
      WithLongRope(Shape("tiny-phi3", "phi3", 1024, 256, 512, 3, 8, 8, 4096, 10000.0f, 1e-5f, false, false), 1024),
      // Mixtures of experts, from their config.json files.
      WithExperts(WithHeadDim(Shape("qwen3-30b-a3b", "qwen3moe", 151936, 2048, 6144, 48, 32, 4, 40960, 1000000.0f,
                                    1e-6f, false, false),
                              128),
                  128, 8, 768),
      WithExperts(Shape("olmoe-1b-7b", "olmoe", 50304, 2048, 1024, 16, 16, 16, 4096, 10000.0f, 1e-5f, false, false), 64,
                  8, 1024),
      WithExperts(Shape("mixtral-8x7b", "llama", 32000, 4096, 14336, 32, 32, 8, 32768, 1000000.0f, 1e-5f, false, false),
                  8, 2, 14336),
      WithExperts(Shape("qwen1.5-moe-a2.7b", "qwen2moe", 151936, 2048, 5632, 24, 16, 16, 8192, 1000000.0f, 1e-6f, false,
                        true),
                  60, 4, 1408, 5632),
      // Their features at test size: 8 experts of 128 (2 chosen), per-head or whole-width Q/K
      // norms, qwen2moe's biases and sigmoid-gated shared expert, Mixtral's adjacent-pair RoPE.
      WithExperts(WithHeadDim(Shape("tiny-qwen3moe", "qwen3moe", 1024, 256, 768, 2, 8, 2, 1024, 1000000.0f, 1e-6f,
                                    false, false),
                              64),
                  8, 2, 128),
      WithExperts(Shape("tiny-qwen2moe", "qwen2moe", 1024, 256, 512, 2, 4, 4, 1024, 1000000.0f, 1e-6f, false, true), 8,
                  2, 128, 256),
      WithExperts(Shape("tiny-olmoe", "olmoe", 1024, 256, 128, 2, 4, 4, 1024, 10000.0f, 1e-5f, false, false), 8, 2, 128),
      WithExperts(Shape("tiny-mixtral", "llama", 1024, 256, 128, 2, 4, 2, 1024, 1000000.0f, 1e-5f, false, false), 8, 2,
                  128),
      // DeepSeek-V2-Lite (config.json): MLA with a 512 + 64 latent and no query bottleneck, one
      // dense layer, 64 experts of 1408 (6 chosen) plus 2 shared, YaRN 40 over 4096.
      WithDeepseekYarn(WithLatentAttention(WithExperts(Shape("deepseek-v2-lite", "deepseek2", 102400, 2048, 10944, 27, 16,
                                                             1, 163840, 10000.0f, 1e-6f, false, false),
                                                       64, 6, 1408, 2816),
                                           512, 0, 128, 64, 128, 1),
                       40.0f, 4096, 0.0707f),
      // Its features at test size: the latent (64 + 16) and per-head sizes, a dense lead layer,
      // shared experts, YaRN with its log multiplier; then the V3 form (query bottleneck, sigmoid
      // gating with exp_probs_b, renormalized and scaled weights) and an older file's attn_kv_b.
      WithDeepseekYarn(WithLatentAttention(WithExperts(Shape("tiny-deepseek2", "deepseek2", 1024, 256, 512, 3, 4, 1, 1024,
                                                             10000.0f, 1e-6f, false, false),
                                                       8, 2, 128, 256),
                                           64, 0, 32, 16, 32, 1),
                       4.0f, 256, 0.0707f),
      WithV3Routing(WithLatentAttention(WithExperts(Shape("tiny-deepseek3", "deepseek2", 1024, 256, 512, 2, 4, 1, 1024,
                                                          10000.0f, 1e-6f, false, false),
                                                    8, 2, 128, 128),
                                        64, 96, 32, 16, 32, 0),
                    2.5f),
      WithUnsplitKvB(WithLatentAttention(WithExperts(Shape("tiny-deepseek2-kvb", "deepseek2", 1024, 256, 512, 2, 4, 1,
                                                           1024, 10000.0f, 1e-6f, false, false),
                                                     8, 2, 128, 128),
                                         64, 0, 32, 16, 32, 1)),
      // gpt-oss-20b (config.json): 24 layers of 64 heads of 64 over 2880 (8 KV heads), 128-token
      // windows on the even layers, 32 experts of 2880 (4 chosen), YaRN 32 over 4096.
      WithYarn(WithWindow(WithExperts(WithHeadDim(Shape("gpt-oss-20b", "gpt-oss", 201088, 2880, 2880, 24, 64, 8,
                                                        131072, 150000.0f, 1e-5f, false, true),
                                                  64),
                                      32, 4, 2880),
                          128),
               32.0f, 4096),
      // Its features at test size: a sliding (16 tokens) and a global layer, sinks, biases, YaRN.
      WithYarn(WithWindow(WithExperts(WithHeadDim(Shape("tiny-gpt-oss", "gpt-oss", 1024, 256, 128, 2, 4, 2, 1024,
                                                        150000.0f, 1e-5f, false, true),
                                                  64),
                                      8, 2, 128),
                          16),
               4.0f, 256),
      // Qwen2.5 long-context files: YaRN factor 4 over a 256-token original context.
      WithYarn(Shape("tiny-qwen2-yarn", "qwen2", 512, 64, 128, 2, 4, 2, 1024, 1000000.0f, 1e-6f, true, true), 4.0f, 256),
  };
  return shapes;
}

StatusOr<SynthShape> FindSynthShape(std::string_view name) {
  std::string names;
  for (const SynthShape& s : SynthShapes()) {
    if (s.name == name) return s;
    names += (names.empty() ? "" : ", ") + s.name;
  }
  return NotFoundError("unknown synth shape '" + std::string(name) + "'; valid shapes: " + names);
}

Status WriteSynthModel(const SynthShape& shape, const SynthOptions& options, const std::string& out_path) {
  const int n_layers = options.n_layers_override > 0 ? options.n_layers_override : shape.n_layers;
  KVS_RETURN_IF_ERROR(ValidateShape(shape, n_layers));
  QuantMix mix;
  if (!options.mix.empty()) {
    KVS_ASSIGN_OR_RETURN(mix, FindQuantMix(options.mix));
  } else {
    if (!IsSupportedWeightType(options.weight_type)) {
      return InvalidArgumentError("synth weight type must be one of " + std::string(SupportedWeightTypeNames()) +
                                  ", found " + std::string(DTypeName(options.weight_type)));
    }
    mix = PureQuantMix(options.weight_type);
  }
  const std::string& arch = shape.arch;
  const int64_t dim = shape.dim;
  const int64_t head_dim = shape.head_dim > 0 ? shape.head_dim : shape.dim / shape.n_heads;
  const int64_t q_dim = shape.n_heads * head_dim;
  const int64_t kv_dim = shape.n_kv_heads * head_dim;
  const int64_t hidden = shape.hidden_dim;
  const int64_t n_vocab = shape.n_vocab;

  GgufWriter w;
  w.SetString("general.architecture", arch);
  w.SetString("general.name", shape.name + " (synthetic random weights)");
  w.SetU32("general.file_type", mix.file_type);
  w.SetU32(arch + ".context_length", static_cast<uint32_t>(shape.context));
  w.SetU32(arch + ".embedding_length", static_cast<uint32_t>(dim));
  w.SetU32(arch + ".block_count", static_cast<uint32_t>(n_layers));
  w.SetU32(arch + ".feed_forward_length", static_cast<uint32_t>(hidden));
  w.SetU32(arch + ".attention.head_count", static_cast<uint32_t>(shape.n_heads));
  w.SetU32(arch + ".attention.head_count_kv", static_cast<uint32_t>(shape.n_kv_heads));
  w.SetF32(arch + ".attention.layer_norm_rms_epsilon", shape.rms_eps);
  w.SetF32(arch + ".rope.freq_base", shape.rope_theta);
  const bool mla = shape.kv_lora_rank > 0;
  if (mla) {  // as llama.cpp's converter writes deepseek2 (one KV head)
    const int64_t rank = shape.kv_lora_rank, rope = shape.mla_rope_dim;
    w.SetU32(arch + ".rope.dimension_count", static_cast<uint32_t>(rope));
    w.SetU32(arch + ".attention.kv_lora_rank", static_cast<uint32_t>(rank));
    w.SetU32(arch + ".attention.q_lora_rank", static_cast<uint32_t>(shape.q_lora_rank));
    w.SetU32(arch + ".leading_dense_block_count", static_cast<uint32_t>(shape.n_dense_lead_layers));
    if (shape.mla_unsplit_kv_b) {  // an older file: per-head sizes, n_heads KV heads
      w.SetU32(arch + ".attention.head_count_kv", static_cast<uint32_t>(shape.n_heads));
      w.SetU32(arch + ".attention.key_length", static_cast<uint32_t>(shape.mla_nope_dim + rope));
      w.SetU32(arch + ".attention.value_length", static_cast<uint32_t>(shape.mla_v_head_dim));
    } else {
      w.SetU32(arch + ".attention.key_length", static_cast<uint32_t>(rank + rope));
      w.SetU32(arch + ".attention.value_length", static_cast<uint32_t>(rank));
      w.SetU32(arch + ".attention.key_length_mla", static_cast<uint32_t>(shape.mla_nope_dim + rope));
      w.SetU32(arch + ".attention.value_length_mla", static_cast<uint32_t>(shape.mla_v_head_dim));
    }
  } else {
    w.SetU32(arch + ".rope.dimension_count", static_cast<uint32_t>(head_dim));
  }
  if (shape.head_dim > 0 && !mla) {
    w.SetU32(arch + ".attention.key_length", static_cast<uint32_t>(head_dim));
    w.SetU32(arch + ".attention.value_length", static_cast<uint32_t>(head_dim));
  }
  w.SetU32(arch + ".vocab_size", static_cast<uint32_t>(n_vocab));
  if (shape.sliding_window > 0) w.SetU32(arch + ".attention.sliding_window", static_cast<uint32_t>(shape.sliding_window));
  if (arch == "gemma2") {
    w.SetF32(arch + ".attn_logit_softcapping", shape.attn_softcap);
    w.SetF32(arch + ".final_logit_softcapping", shape.final_softcap);
  }
  if (shape.rope_yarn_factor > 0) {
    w.SetString(arch + ".rope.scaling.type", "yarn");
    w.SetF32(arch + ".rope.scaling.factor", shape.rope_yarn_factor);
    w.SetU32(arch + ".rope.scaling.original_context_length", static_cast<uint32_t>(shape.rope_original_context));
    if (shape.yarn_log_multiplier > 0) {
      w.SetF32(arch + ".rope.scaling.yarn_log_multiplier", shape.yarn_log_multiplier);
    }
  }
  if (shape.long_rope) {
    // Phi-3's converter: attn_factor = sqrt(1 + ln(context / original) / ln(original)).
    const double scale = static_cast<double>(shape.context) / shape.rope_original_context;
    w.SetF32(arch + ".rope.scaling.attn_factor",
             static_cast<float>(std::sqrt(1.0 + std::log(scale) / std::log(shape.rope_original_context))));
    w.SetU32(arch + ".rope.scaling.original_context_length", static_cast<uint32_t>(shape.rope_original_context));
  }

  const int64_t n_experts = shape.n_experts;
  const int64_t expert_hidden = shape.expert_hidden_dim > 0 ? shape.expert_hidden_dim : hidden;
  if (n_experts > 0) {
    w.SetU32(arch + ".expert_count", static_cast<uint32_t>(n_experts));
    w.SetU32(arch + ".expert_used_count", static_cast<uint32_t>(shape.n_experts_used));
    // llama (Mixtral) and olmoe files carry the experts' width as feed_forward_length only.
    if (arch == "qwen2moe" || arch == "qwen3moe" || arch == "deepseek2" || arch == "gpt-oss") {
      w.SetU32(arch + ".expert_feed_forward_length", static_cast<uint32_t>(expert_hidden));
    }
    if (arch == "deepseek2") {  // shared experts as a count of expert widths
      w.SetU32(arch + ".expert_shared_count", static_cast<uint32_t>(shape.shared_expert_hidden_dim / expert_hidden));
      if (shape.expert_weights_scale > 0) w.SetF32(arch + ".expert_weights_scale", shape.expert_weights_scale);
      if (shape.expert_weights_norm) w.SetBool(arch + ".expert_weights_norm", true);
      if (shape.sigmoid_gating) w.SetU32(arch + ".expert_gating_func", 2);
    } else if (shape.shared_expert_hidden_dim > 0) {
      w.SetU32(arch + ".expert_shared_feed_forward_length", static_cast<uint32_t>(shape.shared_expert_hidden_dim));
    }
  }

  if (!options.vocab_gguf.empty()) {
    KVS_RETURN_IF_ERROR(CopyVocab(options.vocab_gguf, shape, &w));
  } else {
    AddGeneratedVocab(shape.n_vocab, ChatSpecialTokens(arch), &w);
  }

  uint64_t tensor_index = 0;
  // Each tensor gets its own PRNG stream, so its values do not depend on the others.
  auto next_stream = [&]() { return SplitMix(options.seed * 0x2545f4914f6cdd1dull + (++tensor_index)); };

  // A [rows, cols] matrix (GGUF ne = {cols, rows}) with uniform values of std 1/sqrt(cols),
  // so y = W x keeps the scale of a unit-RMS input.
  MixTensor mix_tensor;
  mix_tensor.n_layers = n_layers;
  mix_tensor.model_has_output = !shape.tied_output;
  mix_tensor.n_gqa = shape.n_heads / shape.n_kv_heads;
  // n_experts > 0: a 3-D tensor of that many [rows, cols] matrices (ne = {cols, rows, n_experts}).
  // force_f32: kept unquantized whatever the mix (the router: llama-quantize never quantizes it).
  auto add_matrix = [&](const std::string& name, int64_t rows, int64_t cols, int64_t n_matrices = 0,
                        bool force_f32 = false) {
    mix_tensor.name = name;
    mix_tensor.cols = cols;
    mix_tensor.expert_stack = n_matrices > 0;
    const DType type = force_f32 ? DType::kF32 : MixTensorType(mix, mix_tensor);
    const uint64_t stream = next_stream();
    const float half_width = std::sqrt(3.0f / static_cast<float>(cols));
    std::vector<int64_t> ne = {cols, rows};
    if (n_matrices > 0) {
      ne.push_back(n_matrices);
      rows *= n_matrices;
    }
    w.AddTensor(name, type, ne, [=](void* dst, size_t nbytes) {
      const size_t row_bytes = DTypeRowBytes(type, cols);
      KVS_CHECK(row_bytes * static_cast<size_t>(rows) == nbytes);
      uint8_t* out = static_cast<uint8_t*>(dst);
#pragma omp parallel
      {
        std::vector<float> row(static_cast<size_t>(cols));  // [cols]
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          UniformRow(stream, r, 0.0f, half_width, row.data(), cols);
          ops::QuantizeRow(type, row.data(), out + static_cast<size_t>(r) * row_bytes, cols);
        }
      }
    });
  };
  // An f32 vector: norms ~1 (center 1), biases ~0; with n_rows > 0 a table of that many
  // (gpt-oss's per-expert biases, ne = {n, n_rows}).
  auto add_vector = [&](const std::string& name, int64_t n, float center, float half_width, int64_t n_rows = 0) {
    const uint64_t stream = next_stream();
    std::vector<int64_t> ne = {n};
    if (n_rows > 0) ne.push_back(n_rows);
    const int64_t total = n * std::max<int64_t>(n_rows, 1);
    w.AddTensor(name, DType::kF32, ne, [=](void* dst, size_t nbytes) {
      KVS_CHECK(nbytes == static_cast<size_t>(total) * sizeof(float));
      UniformRow(stream, 0, center, half_width, static_cast<float*>(dst), total);
    });
  };

  add_matrix("token_embd.weight", n_vocab, dim);
  if (shape.rope_llama3_factor > 0) {
    auto factors = std::make_shared<std::vector<float>>(
        Llama3RopeFactors(head_dim, shape.rope_theta, shape.rope_llama3_factor));  // [head_dim/2]
    w.AddTensor("rope_freqs.weight", DType::kF32, {head_dim / 2}, [factors](void* dst, size_t nbytes) {
      KVS_CHECK(nbytes == factors->size() * sizeof(float));
      std::memcpy(dst, factors->data(), nbytes);
    });
  }
  if (shape.long_rope) {
    // LongRoPE's per-frequency divisors: short near 1, long growing to ~the context ratio.
    add_vector("rope_factors_short.weight", head_dim / 2, 1.1f, 0.1f);
    add_vector("rope_factors_long.weight", head_dim / 2, 2.5f, 1.5f);
  }
  add_vector("output_norm.weight", dim, 1.0f, 0.05f);
  if (!shape.tied_output) add_matrix("output.weight", n_vocab, dim);
  for (int l = 0; l < n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    mix_tensor.layer = l;
    add_vector(b + "attn_norm.weight", dim, 1.0f, 0.05f);
    const bool fused = arch == "phi3";  // llama.cpp's phi3 files fuse QKV and gate/up
    if (mla) {
      const int64_t rank = shape.kv_lora_rank, nope = shape.mla_nope_dim, v_head = shape.mla_v_head_dim;
      const int64_t heads = shape.n_heads, q_rows = heads * (nope + shape.mla_rope_dim);
      if (shape.q_lora_rank > 0) {
        add_matrix(b + "attn_q_a.weight", shape.q_lora_rank, dim);
        add_vector(b + "attn_q_a_norm.weight", shape.q_lora_rank, 1.0f, 0.05f);
        add_matrix(b + "attn_q_b.weight", q_rows, shape.q_lora_rank);
      } else {
        add_matrix(b + "attn_q.weight", q_rows, dim);
      }
      add_matrix(b + "attn_kv_a_mqa.weight", rank + shape.mla_rope_dim, dim);
      add_vector(b + "attn_kv_a_norm.weight", rank, 1.0f, 0.05f);
      if (shape.mla_unsplit_kv_b) {
        add_matrix(b + "attn_kv_b.weight", heads * (nope + v_head), rank);
      } else {
        add_matrix(b + "attn_k_b.weight", rank, nope, heads);    // ne = {nope, rank, heads}
        add_matrix(b + "attn_v_b.weight", v_head, rank, heads);  // ne = {rank, v_head, heads}
      }
    } else if (fused) {
      add_matrix(b + "attn_qkv.weight", q_dim + 2 * kv_dim, dim);
    } else {
      add_matrix(b + "attn_q.weight", q_dim, dim);
      add_matrix(b + "attn_k.weight", kv_dim, dim);
      add_matrix(b + "attn_v.weight", kv_dim, dim);
    }
    if (shape.qkv_bias) {
      add_vector(b + "attn_q.bias", q_dim, 0.0f, 0.1f);
      add_vector(b + "attn_k.bias", kv_dim, 0.0f, 0.1f);
      add_vector(b + "attn_v.bias", kv_dim, 0.0f, 0.1f);
    }
    add_matrix(b + "attn_output.weight", dim, mla ? shape.n_heads * shape.mla_v_head_dim : q_dim);
    const bool gemma = arch == "gemma2" || arch == "gemma3";
    const bool gpt_oss = arch == "gpt-oss";
    if (gpt_oss) {
      add_vector(b + "attn_output.bias", dim, 0.0f, 0.1f);
      add_vector(b + "attn_sinks.weight", shape.n_heads, 0.0f, 2.0f);  // logits of the scores' size
    }
    if (arch == "qwen3" || arch == "qwen3moe" || arch == "gemma3") {
      add_vector(b + "attn_q_norm.weight", head_dim, 1.0f, 0.05f);
      add_vector(b + "attn_k_norm.weight", head_dim, 1.0f, 0.05f);
    } else if (arch == "olmoe") {  // over the whole projection
      add_vector(b + "attn_q_norm.weight", q_dim, 1.0f, 0.05f);
      add_vector(b + "attn_k_norm.weight", kv_dim, 1.0f, 0.05f);
    }
    if (gemma) add_vector(b + "post_attention_norm.weight", dim, 1.0f, 0.05f);
    add_vector(b + (gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight"), dim, 1.0f, 0.05f);
    const bool moe_layer = n_experts > 0 && l >= shape.n_dense_lead_layers;
    if (moe_layer) {
      add_matrix(b + "ffn_gate_inp.weight", n_experts, dim, 0, /*force_f32=*/true);
      if (gpt_oss) {
        add_vector(b + "ffn_gate_inp.bias", n_experts, 0.0f, 0.5f);
        add_vector(b + "ffn_gate_exps.bias", expert_hidden, 0.0f, 0.1f, n_experts);
        add_vector(b + "ffn_up_exps.bias", expert_hidden, 0.0f, 0.1f, n_experts);
        add_vector(b + "ffn_down_exps.bias", dim, 0.0f, 0.1f, n_experts);
      }
      if (shape.sigmoid_gating) add_vector(b + "exp_probs_b.bias", n_experts, 0.0f, 0.05f);
      add_matrix(b + "ffn_gate_exps.weight", expert_hidden, dim, n_experts);
      add_matrix(b + "ffn_up_exps.weight", expert_hidden, dim, n_experts);
      add_matrix(b + "ffn_down_exps.weight", dim, expert_hidden, n_experts);
      if (shape.shared_expert_hidden_dim > 0) {
        const int64_t shared = shape.shared_expert_hidden_dim;
        if (arch == "qwen2moe") {
          add_vector(b + "ffn_gate_inp_shexp.weight", dim, 0.0f, std::sqrt(3.0f / static_cast<float>(dim)));
        }
        add_matrix(b + "ffn_gate_shexp.weight", shared, dim);
        add_matrix(b + "ffn_up_shexp.weight", shared, dim);
        add_matrix(b + "ffn_down_shexp.weight", dim, shared);
      }
    } else if (fused) {
      add_matrix(b + "ffn_up.weight", 2 * hidden, dim);
    } else {
      add_matrix(b + "ffn_gate.weight", hidden, dim);
      add_matrix(b + "ffn_up.weight", hidden, dim);
    }
    if (!moe_layer) add_matrix(b + "ffn_down.weight", dim, hidden);
    if (gemma) add_vector(b + "post_ffw_norm.weight", dim, 1.0f, 0.05f);
  }
  return w.Write(out_path);
}

std::filesystem::path ModelCacheDir() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("KVSPARSE_CACHE")) return env;
  if (const char* home = std::getenv("HOME")) return fs::path(home) / ".cache" / "kvsparse";
  return fs::temp_directory_path() / "kvsparse";
}

}  // namespace kvsparse
