// The architecture registry and the metadata reader the architectures' hooks use.
#include "model/arch.h"

#include <array>
#include <cmath>
#include <fmt/format.h>

namespace kvsparse {

StatusOr<std::optional<int32_t>> ArchKeys::Count(std::string_view key) const {
  const std::string full = prefix_ + std::string(key);
  if (file_.Find(full) == nullptr) return std::optional<int32_t>();
  KVS_ASSIGN_OR_RETURN(const uint64_t v, file_.GetUInt(full));
  if (v > static_cast<uint64_t>(INT32_MAX)) {
    return DataLossError(fmt::format("{}: metadata '{}' = {} is out of range [0, {}]", source_, full, v, INT32_MAX));
  }
  return std::optional<int32_t>(static_cast<int32_t>(v));
}

StatusOr<float> ArchKeys::FloatOr(std::string_view key, float dflt) const {
  const std::string full = prefix_ + std::string(key);
  KVS_ASSIGN_OR_RETURN(const double v, file_.GetFloatOr(full, dflt));
  if (!std::isfinite(v) || std::abs(v) > 1e30) {
    return DataLossError(fmt::format("{}: metadata '{}' = {} is not a finite number", source_, full, v));
  }
  return static_cast<float>(v);
}

namespace {

// One of every `period` layers is global, the last of each group (llama.cpp's swa pattern:
// layer i slides when i % period < period - 1); period 0 makes every layer slide.
void SetSlidingPattern(int period, ModelConfig* c) {
  c->sliding_layers.assign(static_cast<size_t>(c->n_layers), 0);
  for (int i = 0; i < c->n_layers; ++i) c->sliding_layers[i] = period == 0 || i % period < period - 1 ? 1 : 0;
}

}  // namespace

Status ReadSlidingWindow(const ArchKeys& keys, int32_t dflt_window, int default_period, ModelConfig* c) {
  KVS_ASSIGN_OR_RETURN(const std::optional<int32_t> window, keys.Count("attention.sliding_window"));
  c->sliding_window = window.value_or(dflt_window);
  if (c->sliding_window == 0) {  // no sliding layers (llama.cpp: swa_type none)
    c->sliding_layers.clear();
    return Status::Ok();
  }
  if (keys.Has("attention.sliding_window_pattern") &&
      keys.file().Find(keys.prefix() + "attention.sliding_window_pattern")->type == GgufType::kArray) {
    return UnimplementedError(fmt::format("{}: '{}attention.sliding_window_pattern' is an array (per-layer pattern); "
                                          "kvsparse reads the period form (one integer)",
                                          keys.source(), keys.prefix()));
  }
  KVS_ASSIGN_OR_RETURN(const std::optional<int32_t> period, keys.Count("attention.sliding_window_pattern"));
  SetSlidingPattern(period.value_or(default_period), c);
  return Status::Ok();
}

std::span<const ArchSpec* const> KnownArchSpecs() {
  static const std::array<const ArchSpec*, 11> specs = {
      &kLlamaArchSpec,    &kQwen2ArchSpec,    &kQwen3ArchSpec,    &kGemma2ArchSpec, &kGemma3ArchSpec,   &kPhi3ArchSpec,
      &kQwen2MoeArchSpec, &kQwen3MoeArchSpec, &kOlmoeArchSpec, &kDeepseek2ArchSpec, &kGptOssArchSpec};
  return specs;
}

const ArchSpec* FindArchSpec(std::string_view gguf_name) {
  for (const ArchSpec* spec : KnownArchSpecs()) {
    if (spec->gguf_name == gguf_name) return spec;
  }
  return nullptr;
}

const ArchSpec& ArchSpecOf(Arch arch) {
  for (const ArchSpec* spec : KnownArchSpecs()) {
    if (spec->arch == arch) return *spec;
  }
  KVS_CHECK_MSG(false, "ArchSpecOf: an Arch without a spec");
  return kLlamaArchSpec;
}

std::string SupportedArchNames() {
  std::string names;
  for (const ArchSpec* spec : KnownArchSpecs()) {
    names += fmt::format("{}{} ({})", names.empty() ? "" : ", ", spec->gguf_name, spec->models);
  }
  return names;
}

}  // namespace kvsparse
