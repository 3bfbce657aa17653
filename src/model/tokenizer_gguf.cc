// Tokenizer::FromGguf: gathers the tokenizer.ggml.* keys into a TokenizerSpec.
#include <limits>

#include "kvsparse/gguf.h"
#include "kvsparse/tokenizer.h"

namespace kvsparse {
namespace {

// Optional token id key: -1 when absent. GgufFile errors already name the file and key.
StatusOr<int32_t> ReadTokenId(const GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return -1;
  KVS_ASSIGN_OR_RETURN(const int64_t id, file.GetInt(key));
  if (id == 0xFFFFFFFF) return -1;  // -1 stored as u32 by some converters: "no such token"
  if (id < -1 || id > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(file.path() + ": " + std::string(key) + " = " + std::to_string(id) +
                                " is not a valid token id");
  }
  return static_cast<int32_t>(id);
}

StatusOr<std::optional<bool>> ReadOptionalBool(const GgufFile& file, std::string_view key) {
  if (file.Find(key) == nullptr) return std::optional<bool>();
  KVS_ASSIGN_OR_RETURN(const bool value, file.GetBool(key));
  return std::optional<bool>(value);
}

StatusOr<std::vector<std::string>> ReadStrings(const GgufFile& file, std::string_view key) {
  KVS_ASSIGN_OR_RETURN(const std::vector<std::string_view>* views, file.GetStringArray(key));
  return std::vector<std::string>(views->begin(), views->end());
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
  TokenizerSpec spec;
  KVS_ASSIGN_OR_RETURN(const std::string_view model, file.GetString("tokenizer.ggml.model"));
  spec.model = std::string(model);
  if (file.Find("tokenizer.ggml.pre") != nullptr) {
    KVS_ASSIGN_OR_RETURN(const std::string_view pre, file.GetString("tokenizer.ggml.pre"));
    spec.pre = std::string(pre);
  }
  KVS_ASSIGN_OR_RETURN(spec.tokens, ReadStrings(file, "tokenizer.ggml.tokens"));
  if (file.Find("tokenizer.ggml.scores") != nullptr) {
    KVS_ASSIGN_OR_RETURN(spec.scores, file.GetF32Array("tokenizer.ggml.scores"));
  }
  if (file.Find("tokenizer.ggml.token_type") != nullptr) {
    KVS_ASSIGN_OR_RETURN(const std::vector<int64_t> types, file.GetIntArray("tokenizer.ggml.token_type"));
    spec.token_types.reserve(types.size());
    for (size_t i = 0; i < types.size(); ++i) {
      // Out-of-int32 values are clamped to -1 so FromSpec reports them with their index.
      const bool fits = types[i] >= 0 && types[i] <= std::numeric_limits<int32_t>::max();
      spec.token_types.push_back(fits ? static_cast<int32_t>(types[i]) : -1);
    }
  }
  if (spec.model == "gpt2") {
    KVS_ASSIGN_OR_RETURN(spec.merges, ReadStrings(file, "tokenizer.ggml.merges"));
  }
  KVS_ASSIGN_OR_RETURN(spec.bos, ReadTokenId(file, "tokenizer.ggml.bos_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.eos, ReadTokenId(file, "tokenizer.ggml.eos_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.unk, ReadTokenId(file, "tokenizer.ggml.unknown_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.eot, ReadTokenId(file, "tokenizer.ggml.eot_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.eom, ReadTokenId(file, "tokenizer.ggml.eom_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.pad, ReadTokenId(file, "tokenizer.ggml.padding_token_id"));
  KVS_ASSIGN_OR_RETURN(spec.add_bos, ReadOptionalBool(file, "tokenizer.ggml.add_bos_token"));
  KVS_ASSIGN_OR_RETURN(spec.add_eos, ReadOptionalBool(file, "tokenizer.ggml.add_eos_token"));
  KVS_ASSIGN_OR_RETURN(spec.add_space_prefix, ReadOptionalBool(file, "tokenizer.ggml.add_space_prefix"));

  auto tokenizer = FromSpec(std::move(spec));
  if (!tokenizer.ok()) {
    return Status(tokenizer.status().code(), file.path() + ": " + tokenizer.status().message());
  }
  return tokenizer;
}

}  // namespace kvsparse
