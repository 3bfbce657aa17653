#include "kvsparse/quant_mix.h"

#include <array>
#include <cctype>

namespace kvsparse {

namespace {

// llama_ftype ids (llama.h).
enum FileType : uint32_t {
  kAllF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 7, kQ5_0 = 8, kQ5_1 = 9, kQ2_K = 10, kQ3_K_S = 11,
  kQ3_K_M = 12, kQ3_K_L = 13, kQ4_K_S = 14, kQ4_K_M = 15, kQ5_K_S = 16, kQ5_K_M = 17, kQ6_K = 18, kQ2_K_S = 21,
  kIQ4_NL = 25, kIQ4_XS = 30, kBF16 = 32, kMXFP4_MOE = 38,
};

struct MixInfo {
  std::string_view name;
  FileType file_type;
  DType base;
};

constexpr std::array<MixInfo, 15> kMixes = {{
    {"q2_k", kQ2_K, DType::kQ2_K},       {"q2_k_s", kQ2_K_S, DType::kQ2_K},   {"q3_k_s", kQ3_K_S, DType::kQ3_K},
    {"q3_k_m", kQ3_K_M, DType::kQ3_K},   {"q3_k_l", kQ3_K_L, DType::kQ3_K},   {"q4_k_s", kQ4_K_S, DType::kQ4_K},
    {"q4_k_m", kQ4_K_M, DType::kQ4_K},   {"q5_k_s", kQ5_K_S, DType::kQ5_K},   {"q5_k_m", kQ5_K_M, DType::kQ5_K},
    {"q6_k", kQ6_K, DType::kQ6_K},       {"iq4_nl", kIQ4_NL, DType::kIQ4_NL}, {"iq4_xs", kIQ4_XS, DType::kIQ4_XS},
    {"q4_0", kQ4_0, DType::kQ4_0},       {"q4_1", kQ4_1, DType::kQ4_1},       {"q8_0", kQ8_0, DType::kQ8_0},
}};
// q5_0 / q5_1 and mxfp4_moe are mixes too; listed apart to keep the table's columns short.
constexpr std::array<MixInfo, 3> kLegacyMixes = {
    {{"q5_0", kQ5_0, DType::kQ5_0}, {"q5_1", kQ5_1, DType::kQ5_1}, {"mxfp4_moe", kMXFP4_MOE, DType::kMXFP4}}};

// llama_ftype of a file whose matrices are all `t` (llama-quantize --pure, or an unquantized one).
uint32_t PureFileType(DType t) {
  switch (t) {
    case DType::kF32: return kAllF32;
    case DType::kF16: return kF16;
    case DType::kBF16: return kBF16;
    case DType::kQ4_0: return kQ4_0;
    case DType::kQ4_1: return kQ4_1;
    case DType::kQ5_0: return kQ5_0;
    case DType::kQ5_1: return kQ5_1;
    case DType::kQ8_0: return kQ8_0;
    case DType::kQ2_K: return kQ2_K;
    case DType::kQ3_K: return kQ3_K_S;  // every matrix q3_K
    case DType::kQ4_K: return kQ4_K_S;
    case DType::kQ5_K: return kQ5_K_S;
    case DType::kQ6_K: return kQ6_K;
    case DType::kIQ4_NL: return kIQ4_NL;
    case DType::kIQ4_XS: return kIQ4_XS;
    default: return kAllF32;
  }
}

bool Fits(DType t, int64_t cols) { return cols % DTypeBlockSize(t) == 0; }

// llama-quantize gives these layers more bits: the first and last eighth, and every third between.
bool UseMoreBits(int layer, int n_layers) {
  return layer < n_layers / 8 || layer >= 7 * n_layers / 8 || (layer - n_layers / 8) % 3 == 2;
}

bool Contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

}  // namespace

StatusOr<QuantMix> FindQuantMix(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto* table : {kMixes.data(), kLegacyMixes.data()}) {
    const size_t n = table == kMixes.data() ? kMixes.size() : kLegacyMixes.size();
    for (size_t i = 0; i < n; ++i) {
      if (table[i].name == lower) return QuantMix{lower, table[i].file_type, table[i].base, true};
    }
  }
  // A pure type: "q4_k" (no mix suffix), "f16", ...
  if (auto type = DTypeFromName(lower); type && *type != DType::kQ8_K) return PureQuantMix(*type);
  return InvalidArgumentError("unknown weight type or quantization mix '" + std::string(name) +
                              "'; valid: " + QuantMixNames());
}

QuantMix PureQuantMix(DType type) {
  std::string name(DTypeName(type));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return QuantMix{name, PureFileType(type), type, false};
}

std::string QuantMixNames() {
  std::string out;
  for (const MixInfo& m : kMixes) out += std::string(m.name) + ", ";
  for (const MixInfo& m : kLegacyMixes) out += std::string(m.name) + ", ";
  return out + "or a pure type (f32, f16, bf16, q4_k, q5_k, q6_k, ...)";
}

DType MixTensorType(const QuantMix& mix, const MixTensor& t) {
  if (!mix.mixed) {
    for (DType type : {mix.base, DType::kQ8_0, DType::kF16}) {
      if (Fits(type, t.cols)) return type;
    }
    return DType::kF32;
  }
  const uint32_t ft = mix.file_type;
  if (ft == kMXFP4_MOE) {  // experts MXFP4, every other matrix Q8_0 (llama-quantize's MXFP4_MOE)
    for (DType type : {t.expert_stack ? DType::kMXFP4 : DType::kQ8_0, DType::kQ8_0, DType::kF16}) {
      if (Fits(type, t.cols)) return type;
    }
    return DType::kF32;
  }
  DType type = mix.base;
  const std::string_view name = t.name;
  if (name == "output.weight" || (!t.model_has_output && name == "token_embd.weight")) {
    if (!Fits(type, t.cols)) {
      type = DType::kQ8_0;
    } else if (type != DType::kQ8_0) {
      type = DType::kQ6_K;
    }
  } else if (name == "token_embd.weight") {
    // Keeps the base type for every mix kvsparse writes.
  } else if (Contains(name, "attn_v.weight")) {
    const int i = t.layer, n = t.n_layers;
    if (ft == kQ2_K) {
      type = t.n_gqa >= 4 ? DType::kQ4_K : DType::kQ3_K;
    } else if (ft == kQ2_K_S && t.n_gqa >= 4) {
      type = DType::kQ4_K;
    } else if (ft == kQ3_K_M) {
      type = i < 2 ? DType::kQ5_K : DType::kQ4_K;
    } else if (ft == kQ3_K_L) {
      type = DType::kQ5_K;
    } else if ((ft == kIQ4_NL || ft == kIQ4_XS) && t.n_gqa >= 4) {
      type = DType::kQ5_K;
    } else if ((ft == kQ4_K_M || ft == kQ5_K_M) && UseMoreBits(i, n)) {
      type = DType::kQ6_K;
    } else if (ft == kQ4_K_S && i < 4) {
      type = DType::kQ5_K;
    }
  } else if (Contains(name, "ffn_down")) {
    const int i = t.layer, n = t.n_layers;
    if (ft == kQ2_K) {
      type = DType::kQ3_K;
    } else if (ft == kQ2_K_S) {
      if (i < n / 8) type = DType::kQ4_K;
    } else if (ft == kQ3_K_M) {
      type = i < n / 16 ? DType::kQ5_K : DType::kQ4_K;
    } else if (ft == kQ3_K_L) {
      type = DType::kQ5_K;
    } else if (ft == kQ4_K_M) {
      if (UseMoreBits(i, n)) type = DType::kQ6_K;
    } else if (i < n / 8 && (ft == kIQ4_NL || ft == kIQ4_XS)) {
      type = DType::kQ5_K;
    } else if (ft == kQ5_K_M && UseMoreBits(i, n)) {
      type = DType::kQ6_K;
    } else if (ft == kQ4_K_S && i < n / 8) {
      type = DType::kQ5_K;
    }
  } else if (Contains(name, "attn_output.weight")) {
    if (ft == kQ2_K) {
      type = DType::kQ3_K;
    } else if (ft == kQ3_K_M) {
      type = DType::kQ4_K;
    } else if (ft == kQ3_K_L) {
      type = DType::kQ5_K;
    }
  } else if (Contains(name, "attn_qkv.weight")) {
    if (ft == kQ3_K_M || ft == kQ3_K_L) {
      type = DType::kQ4_K;
    } else if (ft == kQ4_K_M) {
      type = DType::kQ5_K;
    } else if (ft == kQ5_K_M) {
      type = DType::kQ6_K;
    }
  }
  if (!Fits(type, t.cols)) {
    switch (type) {
      case DType::kQ2_K:
      case DType::kQ3_K:
      case DType::kIQ4_XS: type = DType::kIQ4_NL; break;
      case DType::kQ4_K: type = DType::kQ5_0; break;
      case DType::kQ5_K: type = DType::kQ5_1; break;
      case DType::kQ6_K: type = DType::kQ8_0; break;
      default: break;
    }
    if (!Fits(type, t.cols)) type = DType::kF16;
    if (!Fits(type, t.cols)) type = DType::kF32;
  }
  return type;
}

}  // namespace kvsparse
