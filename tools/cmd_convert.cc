// `kvsparse convert IN.bin -o OUT.gguf`: llama2.c checkpoint -> GGUF.
#include <cstdio>

#include "commands.h"
#include "kvsparse/convert.h"
#include "kvsparse/model.h"

namespace kvsparse::cli {
namespace {
struct ConvertArgs {
  std::string in, out, type = "f32", vocab;
};
}  // namespace

void RegisterConvert(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<ConvertArgs>();
  CLI::App* cmd = app.add_subcommand("convert", "Convert a llama2.c checkpoint (.bin) to GGUF");
  cmd->add_option("input", a->in, "llama2.c checkpoint")->required();
  cmd->add_option("-o,--output", a->out, "GGUF file to write")->required();
  cmd->add_option("--type", a->type, std::string("weight type: ") + std::string(SupportedWeightTypeNames()))
      ->capture_default_str();
  cmd->add_option("--vocab", a->vocab, "vocab-only GGUF whose tokenizer to embed (token count must match)");
  cmd->callback([a, exit_code] {
    auto type = DTypeFromName(a->type);
    if (!type || !IsSupportedWeightType(*type)) {
      *exit_code = Fail(InvalidArgumentError("--type: expected one of " + std::string(SupportedWeightTypeNames()) +
                                             ", found '" + a->type + "'"));
      return;
    }
    ConvertOptions options;
    options.weight_type = *type;
    options.vocab_gguf = a->vocab;
    Status s = ConvertLlama2cToGguf(a->in, a->out, options);
    if (!s.ok()) {
      *exit_code = Fail(s);
      return;
    }
    std::printf("wrote %s\n", a->out.c_str());
  });
}

}  // namespace kvsparse::cli
