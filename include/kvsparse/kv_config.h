// KV sparsity configuration for a whole model: one LayerKvConfig per layer plus the
// engine-wide knobs, read from a JSON file or from command-line flags.
//
// JSON form (every field optional except each entry's "layers"):
//   {
//     "default": {"method": "h2o", "budget": 0.2, "kv_type": "int8", "recent_ratio": 0.5,
//                 "per_head": false},
//     "layers": [{"layers": "0-1", "method": "full", "kv_type": "f16"},
//                {"layers": 7, "budget": 64}],
//     "evict_interval": 16, "page_size": 16, "gqa_aggregation": "mean", "prefill_chunk": 512,
//     "kivi_residual": 128, "kivi_v_group": 32
//   }
// - "budget": an integer is a token count (>= 1); a non-integer number is a fraction in
//   (0, 1] of the tokens seen so far (see kv_budget.h).
// - "budget_by_length": {"4096": 0.5, "32768": 0.1} instead of "budget": fractions at context
//   lengths, interpolated in log(length) between them and held beyond them (kv_budget.h); each
//   request is compressed by its own length. Not for cumulative (its schedule scales one budget).
// - "layers": an index (3 or "3") or an inclusive range "a-b"; entries may not overlap.
// - "per_head": true gives the layer one policy and one page table per KV head, so heads
//   keep different tokens; the budget then applies to each head (default false: every head
//   keeps the same tokens).
// - "cache_positions": true (streaming_llm only) numbers RoPE positions inside the cache, as
//   StreamingLLM does; any other method rejects it, naming the layer and the field.
// - An entry inherits budget, kv_type and per_head from "default". It inherits the default's method
//   parameters when it keeps the default's method; naming another method starts from
//   that method's paper defaults.
// - Without "default", uncovered layers are "full".
// - KIVI layers (int8_kivi, int4_kivi, int2_kivi; Liu et al. 2024) default to the reference's
//   settings (its models/llama_kivi.py and quant/new_pack.py): K is quantized per channel over a
//   page, and page_size defaults to 32 (KIVI's group) when any layer stores a KIVI type (16
//   otherwise); kivi_residual R keeps the newest R tokens in f16 besides the partly filled page,
//   KIVI's residual length (a multiple of page_size; default 128, rounded up to whole pages; 0:
//   only the partly filled page); kivi_v_group G quantizes int4 / int2 V per G channels of a
//   (token, kv head) row (default 32 where it divides head_dim, else the whole row; 0: the
//   whole row, kvsparse's widest group, fewer bytes).
// - evict_interval N: a decoding layer grows to budget + N tokens, then N are evicted at
//   once (1 = every step). Prompt chunks are trimmed to the budget after each chunk.
// Mistakes (unknown keys or values, wrong types, bad ranges, overlaps, windows that do
// not fit the budget, malformed JSON) are rejected with the layer and field named.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/kv_budget.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/status.h"

namespace kvsparse {

// When prompts are compressed. kEveryChunk (default) trims every layer to its budget after
// each prompt chunk, so a long prompt never holds more than budget + chunk tokens; methods then
// choose without seeing the rest of the prompt. kPromptEnd keeps the whole prompt until its
// last chunk was attended and trims once (the protocol of SnapKV and kvpress: a question at the
// end of the prompt can steer the choice), at the price of the prompt's full KV at peak.
enum class PrefillEviction { kEveryChunk, kPromptEnd };

struct KvSparsityConfig {
  std::vector<LayerKvConfig> layers;  // [n_layers]
  int evict_interval = 16;
  int page_size = 0;       // 0: EffectivePageSize's default
  int kivi_residual = -1;  // tokens, a multiple of the page size; -1: EffectiveKiviResidual's default
  int kivi_v_group = -1;   // channels; -1: EffectiveKiviVGroup's default; 0: the whole row
  GqaAggregation agg = GqaAggregation::kMean;
  int prefill_chunk = 512;
  PrefillEviction prefill_eviction = PrefillEviction::kEveryChunk;  // JSON "prefill_eviction": "chunk" | "prompt_end"
};

inline constexpr int kDefaultPageSize = 16;
inline constexpr int kKiviPageSize = 32;       // KIVI's K group (tokens)
inline constexpr int kKiviResidualTokens = 128;  // KIVI's residual length R
inline constexpr int kKiviVGroup = 32;         // KIVI's V group (channels)
// The settings the cache gets: the config's own, or the defaults above (KIVI's where a layer
// stores a KIVI type).
int EffectivePageSize(const KvSparsityConfig& config);
int EffectiveKiviResidual(const KvSparsityConfig& config);  // 0 when no layer stores a KIVI type
int EffectiveKiviVGroup(const KvSparsityConfig& config, int head_dim);  // 0: the whole row

// `source` names the text in messages (a file path, or "kv config").
StatusOr<KvSparsityConfig> ParseKvSparsityConfig(std::string_view json_text, int n_layers,
                                                 std::string_view source = "kv config");
StatusOr<KvSparsityConfig> LoadKvSparsityConfig(const std::string& path, int n_layers);

// --kv-method h2o --kv-budget 0.2 --kv-type int8: every layer alike, paper defaults.
// `budget` may be empty only for "full"; `kv_type` empty means f32.
StatusOr<KvSparsityConfig> KvSparsityConfigFromFlags(std::string_view method, std::string_view budget,
                                                     std::string_view kv_type, int n_layers);

// A request's override of a running config (the server's "kvsparse" extension field): every
// layer gets `method` with its paper defaults and `budget`; an empty method keeps each layer's
// method and parameters, an empty budget keeps each layer's budget (a non-full method on a
// layer without one is an error), and a non-empty kv_type stores every layer in that type.
// per_head stays as in `base` (the cache's tables are laid out at start-up). Messages name the
// field ("kv_method", "kv_budget", "kv_type") and the layer.
StatusOr<std::vector<LayerKvConfig>> KvLayersWithOverride(const KvSparsityConfig& base, std::string_view method,
                                                          std::string_view budget, std::string_view kv_type = {});

// --kv-param KEY=VALUE: sets a method parameter (its JSON key, e.g. "head_budgets=adaptive",
// "rerank_period=8", "mode=mask") on every layer whose method takes it, after the paper
// defaults; "per_head=true|false" sets the layer field on every sparse layer. VALUE is read as
// JSON (numbers, true / false, "quoted") or else as a bare string.
// An unknown key, a key no layer's method takes, or a bad value is an error naming it; the
// layers are validated again afterwards.
Status ApplyKvParams(std::span<const std::string> key_values, KvSparsityConfig* config);

// A method with parameters, as `bench --methods` and `bench-speed --compare-method` take it:
// "snapkv:head_budgets=adaptive:floor=0.2" -> ("snapkv", {"head_budgets=adaptive", "floor=0.2"}),
// the parameters in ApplyKvParams' form. Messages start with `flag`.
struct KvMethodSpec {
  std::string name;
  std::vector<std::string> params;
};
StatusOr<KvMethodSpec> ParseKvMethodSpec(const std::string& text, std::string_view flag);

// "512" -> 512 tokens, "0.2" -> a fifth of the context.
StatusOr<KvBudget> ParseKvBudget(std::string_view text);
// "f32" | "f16" | "bf16" | "int8" | "int8_kivi" | "fp8_e4m3" | "fp8_e5m2" | "fp8" (= fp8_e4m3) |
// "int4_kivi" | "int2_kivi"
std::optional<KvStorage> KvStorageFromName(std::string_view name);

// The config as JSON that ParseKvSparsityConfig reads back to the same layers and settings:
// explicit values for every field (the file does not depend on the paper defaults of the
// version that reads it), one "layers" entry per run of equal layers, and a "default" for the
// layers no entry named (so sliding-window layers keep their meaning, see LayerKvConfig).
std::string KvSparsityConfigToJson(const KvSparsityConfig& config);

// Re-checks a config built in code (ranges, every layer's values).
Status ValidateKvSparsityConfig(const KvSparsityConfig& config);

// One line per run of identical layers, e.g. "layers 0-1: full f16; layers 2-4: h2o 0.2 of the context int8".
std::string KvSparsityConfigSummary(const KvSparsityConfig& config);

}  // namespace kvsparse
