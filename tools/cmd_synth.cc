// `kvsparse synth --shape NAME --type q8_0 -o FILE`: random weights, a real model's exact shape.
#include <cstdio>

#include "commands.h"
#include "kvsparse/quant_mix.h"
#include "kvsparse/retrieval_model.h"
#include "kvsparse/synth.h"

namespace kvsparse::cli {
namespace {
struct SynthArgs {
  std::string shape, type = "q8_0", out, vocab;
  uint64_t seed = 1;
  int layers = 0;
  bool list = false;
  bool pure = false;
};
}  // namespace

void RegisterSynth(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<SynthArgs>();
  CLI::App* cmd = app.add_subcommand("synth", "Write a random-weight GGUF with the exact shape of a real model");
  cmd->add_option("--shape", a->shape, "shape name (see --list); 'retrieval' and 'retrieval-mha' write the built-in retrieval models");
  cmd->add_option("--type", a->type,
                  "weight type (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k ... q6_k, iq4_nl, iq4_xs) or a "
                  "llama-quantize mix (q4_k_m, q5_k_m, q3_k_m, q2_k, ...)")
      ->capture_default_str();
  cmd->add_option("-o,--output", a->out, "GGUF file to write");
  cmd->add_option("--vocab", a->vocab, "vocab-only GGUF to copy the tokenizer from (token count must match)");
  cmd->add_option("--seed", a->seed, "weight seed")->capture_default_str();
  cmd->add_option("--layers", a->layers, "override the layer count (0 = the shape's)")->capture_default_str();
  cmd->add_flag("--pure", a->pure, "every matrix gets the --type's base type (llama-quantize --pure)");
  cmd->add_flag("--list", a->list, "list the known shapes");
  cmd->callback([a, exit_code, cmd] {
    if (a->list) {
      for (const SynthShape& s : SynthShapes()) {
        std::printf("%-17s %-8s vocab %6d dim %5d ffn %5d layers %3d heads %3d kv %2d ctx %6d", s.name.c_str(),
                    s.arch.c_str(), s.n_vocab, s.dim, s.hidden_dim, s.n_layers, s.n_heads, s.n_kv_heads, s.context);
        if (s.n_experts > 0) {
          std::printf(" experts %d of %d x %d", s.n_experts_used, s.n_experts,
                      s.expert_hidden_dim > 0 ? s.expert_hidden_dim : s.hidden_dim);
          if (s.shared_expert_hidden_dim > 0) std::printf(" + shared %d", s.shared_expert_hidden_dim);
        }
        std::printf("\n");
      }
      std::printf("%-16s %-6s constructed weights for token-level retrieval (see retrieval_model.h)\n", "retrieval",
                  "llama");
      std::printf("%-16s %-6s the same circuit in 2 of 16 KV heads, distractor heads elsewhere (8 heads, kv 4)\n",
                  "retrieval-mha", "llama");
      return;
    }
    if (a->shape.empty() || a->out.empty()) {
      *exit_code = Fail(InvalidArgumentError("synth needs --shape NAME and -o FILE (see --list)"));
      return;
    }
    if (a->shape == "retrieval" || a->shape == "retrieval-mha") {
      // Constructed, not random: f32 unless --type asks for f16; --layers >= 2 (0 = default).
      RetrievalModelOptions options;
      if (a->shape == "retrieval-mha") options.shape = RetrievalShape::kMultiHead;
      if (a->layers > 0) options.n_layers = a->layers;
      if (cmd->count("--type") > 0) {
        auto type = DTypeFromName(a->type);
        if (!type) {
          *exit_code = Fail(InvalidArgumentError("--type: expected f32 or f16 for --shape " + a->shape + ", found '" + a->type + "'"));
          return;
        }
        options.weight_type = *type;  // WriteRetrievalModel rejects types other than f32/f16
      }
      Status s = WriteRetrievalModel(options, a->out);
      if (!s.ok()) {
        *exit_code = Fail(s);
        return;
      }
      std::printf("wrote %s\n", a->out.c_str());
      return;
    }
    auto shape = FindSynthShape(a->shape);
    if (!shape.ok()) {
      *exit_code = Fail(shape.status());
      return;
    }
    auto mix = FindQuantMix(a->type);
    if (!mix.ok()) {
      *exit_code = Fail(InvalidArgumentError("--type: " + mix.status().message()));
      return;
    }
    SynthOptions options;
    if (a->pure || !mix->mixed) {
      options.weight_type = mix->base;
    } else {
      options.mix = mix->name;
    }
    options.seed = a->seed;
    options.vocab_gguf = a->vocab;
    options.n_layers_override = a->layers;
    Status s = WriteSynthModel(*shape, options, a->out);
    if (!s.ok()) {
      *exit_code = Fail(s);
      return;
    }
    std::printf("wrote %s\n", a->out.c_str());
  });
}

}  // namespace kvsparse::cli
