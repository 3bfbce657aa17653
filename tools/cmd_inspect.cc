// `kvsparse inspect MODEL`: metadata, tensors, parameter count and KV bytes per token.
#include <fmt/format.h>

#include <cstdio>

#include "commands.h"
#include "kvsparse/isa.h"
#include "kvsparse/model.h"

namespace kvsparse::cli {
namespace {

std::string ValueToString(const GgufValue& v) {
  switch (v.type) {
    case GgufType::kU8: case GgufType::kU16: case GgufType::kU32: case GgufType::kU64: return std::to_string(v.u);
    case GgufType::kI8: case GgufType::kI16: case GgufType::kI32: case GgufType::kI64: return std::to_string(v.i);
    case GgufType::kF32: case GgufType::kF64: return fmt::format("{:g}", v.f);
    case GgufType::kBool: return v.b ? "true" : "false";
    case GgufType::kString: {
      std::string s(v.str.substr(0, 120));
      return fmt::format("\"{}\"{}", s, v.str.size() > 120 ? "..." : "");
    }
    case GgufType::kArray: {
      std::string s = fmt::format("[{} x {}]", v.count, GgufTypeName(v.elem_type));
      if (v.elem_type == GgufType::kString && !v.strings.empty()) {
        s += " {";
        for (size_t i = 0; i < std::min<size_t>(v.strings.size(), 5); ++i) s += fmt::format("{}\"{}\"", i ? ", " : "", v.strings[i]);
        s += v.strings.size() > 5 ? ", ...}" : "}";
      }
      return s;
    }
  }
  return "?";
}

int Run(const std::string& path, bool show_tensors) {
  // Metadata only: no kept panels (packing them would read every weight).
  auto model_or = Model::Load(path, ModelLoadOptions{.keep_panels = false});
  if (!model_or.ok()) return Fail(model_or.status());
  const Model& model = **model_or;
  const ModelConfig& c = model.config();

  if (const GgufFile* g = model.gguf()) {
    std::printf("GGUF v%u, %zu metadata keys, %zu tensors, alignment %llu, %.1f MiB\n\n", g->version(), g->metadata().size(),
                g->tensors().size(), static_cast<unsigned long long>(g->alignment()), g->file_size() / 1048576.0);
    std::printf("metadata:\n");
    for (const auto& [key, value] : g->metadata()) std::printf("  %-45s %s\n", key.c_str(), ValueToString(value).c_str());
    if (show_tensors) {
      std::printf("\ntensors:\n");
      for (const GgufTensorInfo& t : g->tensors()) {
        std::string shape;
        for (size_t i = 0; i < t.ne.size(); ++i) shape += fmt::format("{}{}", i ? " x " : "", t.ne[i]);
        std::printf("  %-32s %-6s [%s] %.2f MiB\n", t.name.c_str(), std::string(GgmlTypeName(t.ggml_type)).c_str(),
                    shape.c_str(), t.nbytes / 1048576.0);
      }
    }
  } else {
    std::printf("llama2.c checkpoint (f32)\n");
  }

  std::printf("\nmodel:\n");
  std::printf("  architecture  %s\n", std::string(ArchName(c.arch)).c_str());
  std::printf("  layers %d, dim %d, ffn %d, heads %d, kv heads %d, head dim %d, vocab %d, context %d\n", c.n_layers,
              c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.n_vocab, c.max_context);
  std::printf("  rope %s, theta %g; rms eps %g; output %s\n",
              c.rope_style == RopeStyle::kNeox ? "neox" : "adjacent pairs", c.rope_theta, c.rms_eps,
              c.tied_output ? "tied to embedding" : "separate");
  std::printf("  parameters    %lld (%.3f B)\n", static_cast<long long>(model.ParameterCount()), model.ParameterCount() / 1e9);
  std::printf("  weight bytes  %.1f MiB\n", model.WeightBytes() / 1048576.0);
  if (c.IsMoe()) {
    std::printf("  experts       %d, %d per token, width %d%s; %s\n", c.n_experts, c.n_experts_used,
                c.expert_hidden_dim,
                c.shared_expert_hidden_dim > 0 ? fmt::format(", shared expert width {}", c.shared_expert_hidden_dim).c_str() : "",
                c.expert_gating == ExpertGating::kSoftmaxChosen ? "softmax over the chosen experts"
                : c.expert_gating == ExpertGating::kSigmoid     ? "sigmoid weights"
                : c.expert_weights_norm                         ? "chosen weights renormalized"
                                                                : "softmax weights");
  }
  if (c.NumSlidingLayers() > 0) {
    std::printf("  windows       %d of %d layers attend to the last %d positions\n", c.NumSlidingLayers(), c.n_layers,
                c.sliding_window);
  }
  std::printf("  active bytes  %.1f MiB read per decoded token (weights)\n", model.ActiveWeightBytesPerToken() / 1048576.0);

  // K and V per token per layer: n_kv_heads * head_dim values each; under MLA one latent row.
  const double values = static_cast<double>(c.KvValuesPerToken());
  const double rows = c.IsMla() ? 1.0 : 2.0;
  const double f16 = values * 2;
  const double int8 = values * 1 + rows * c.n_kv_heads * 4;  // + one f32 scale per (token, kv head) for K and V, as the paged cache stores it
  std::printf("\nKV cache per token:\n");
  std::printf("  KV bytes/token  f16 %.0f, int8 %.0f (all %d layers)\n", f16 * c.n_layers, int8 * c.n_layers, c.n_layers);
  if (c.IsMla()) {
    std::printf("  latent        %d + %d values per layer (kv_lora_rank + rotated key), one row serving as K and V; "
                "expanded per head it would be %lld values\n",
                c.kv_lora_rank, c.mla_rope_dim,
                static_cast<long long>(c.n_heads) * (c.QueryHeadDim() + c.mla_v_head_dim));
  }
  std::printf("  per layer     f16 %.0f B, int8 %.0f B (int8 = 1 B/value + f32 scale per token and head)\n", f16, int8);
  std::printf("  all layers    f16 %.1f KiB, int8 %.1f KiB\n", f16 * c.n_layers / 1024, int8 * c.n_layers / 1024);
  if (c.max_context > 0) {
    // Sliding layers hold only their window (DenseKvBytes), as llama.cpp's cache does.
    const double per_value_f16 = f16 / values, per_value_int8 = int8 / values;
    std::printf("  at context %d: f16 %.1f MiB, int8 %.1f MiB%s\n", c.max_context,
                c.DenseKvBytes(c.max_context, per_value_f16) / 1048576.0,
                c.DenseKvBytes(c.max_context, per_value_int8) / 1048576.0,
                c.NumSlidingLayers() > 0 ? " (sliding layers hold their window)" : "");
  }
  std::printf("\nkernels: %s\n", IsaSummary().c_str());
  return 0;
}

}  // namespace

void RegisterInspect(CLI::App& app, int* exit_code) {
  auto path = std::make_shared<std::string>();
  auto tensors = std::make_shared<bool>(true);
  CLI::App* cmd = app.add_subcommand("inspect", "Show a model's metadata, tensors, size and KV bytes per token");
  cmd->add_option("model", *path, "GGUF or llama2.c .bin file")->required();
  cmd->add_flag("!--no-tensors", *tensors, "omit the tensor list");
  cmd->callback([path, tensors, exit_code] { *exit_code = Run(*path, *tensors); });
}

}  // namespace kvsparse::cli
