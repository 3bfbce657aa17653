#include "support/tiny_chat_model.h"

#include "kvsparse/synth.h"
#include "support/shared_data.h"

namespace kvsparse::testing {

StatusOr<std::string> WriteTinyChatModel(const std::string& file_name, int32_t context, std::string* note) {
  KVS_ASSIGN_OR_RETURN(SynthShape shape, FindSynthShape("tiny-llama"));
  shape.name = "tiny-llama-chat-test";
  shape.context = context;
  SynthOptions options;
  options.weight_type = DType::kF32;
  if (auto vocab = SharedPath("vocab/ggml-vocab-llama-spm.gguf")) {
    shape.n_vocab = 32000;
    options.vocab_gguf = *vocab;
    *note = "llama-spm vocab from ../shared";
  } else {
    *note = "generated vocab (../shared/vocab/ggml-vocab-llama-spm.gguf not found)";
  }
  const std::string path = TempPath(file_name);
  KVS_RETURN_IF_ERROR(WriteSynthModel(shape, options, path));
  return path;
}

}  // namespace kvsparse::testing
