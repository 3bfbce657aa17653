// Tokenizers on arbitrary text (any bytes, invalid UTF-8 included): the real vocabularies in
// ../shared/vocab (SPM: llama-spm, phi-3; BPE: gpt-2, falcon, mpt, starcoder, refact,
// deepseek-llm, deepseek-coder, gpt-neox) when present, and a small byte-level BPE vocabulary
// under every pre-tokenizer kvsparse supports (so each pre-tokenizer regex runs even without
// the shared data). Byte 0 picks the tokenizer, byte 1 the flags (BOS, special tokens); the
// rest is the text. Checked: ids stay in the vocabulary; byte-level BPE decodes back to the
// exact input without special-token parsing.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_target.h"
#include "kvsparse/gguf.h"
#include "kvsparse/status.h"
#include "kvsparse/tokenizer.h"
#include "model/tokenizer_bytes.h"

namespace kvsparse::fuzz {
namespace {

// The 256 byte-level characters, a few merges over them, and specials.
std::unique_ptr<Tokenizer> ByteLevelTokenizer(std::string_view pre) {
  TokenizerSpec spec;
  spec.model = "gpt2";
  spec.pre = std::string(pre);
  for (int b = 0; b < 256; ++b) spec.tokens.push_back(tokenizer_internal::ByteLevelEncode(std::string(1, static_cast<char>(b))));
  for (const char* merge : {"Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "Ġ Ġ"}) {
    std::string m = merge;
    const size_t space = m.find(' ');
    spec.merges.push_back(m);
    spec.tokens.push_back(m.substr(0, space) + m.substr(space + 1));
  }
  spec.token_types.assign(spec.tokens.size(), static_cast<int32_t>(TokenType::kNormal));
  for (const char* special : {"<|endoftext|>", "<|im_end|>"}) {
    spec.tokens.push_back(special);
    spec.token_types.push_back(static_cast<int32_t>(TokenType::kControl));
  }
  spec.eos = static_cast<int32_t>(spec.tokens.size()) - 2;
  spec.bos = spec.eos;
  auto t = Tokenizer::FromSpec(std::move(spec));
  KVS_CHECK_MSG(t.ok(), t.status().ToString());
  return std::move(*t);
}

struct Tokenizers {
  std::vector<std::unique_ptr<Tokenizer>> all;
  std::vector<bool> byte_level;  // decodes back to the input exactly
};

const Tokenizers& Load() {
  static const Tokenizers* tokenizers = [] {
    auto* t = new Tokenizers;
    for (std::string_view pre : SupportedBpePreTokenizers()) {
      t->all.push_back(ByteLevelTokenizer(pre));
      t->byte_level.push_back(true);
    }
    const std::string shared = SharedDir();
    std::error_code ec;
    if (!shared.empty() && std::filesystem::is_directory(shared + "/vocab", ec)) {
      std::vector<std::string> paths;
      for (const auto& entry : std::filesystem::directory_iterator(shared + "/vocab", ec)) {
        if (entry.path().extension() == ".gguf") paths.push_back(entry.path().string());
      }
      std::sort(paths.begin(), paths.end());  // the same selector byte picks the same vocabulary
      for (const std::string& path : paths) {
        auto file = GgufFile::Open(path);
        if (!file.ok()) continue;
        auto tokenizer = Tokenizer::FromGguf(**file);
        if (!tokenizer.ok()) continue;
        t->all.push_back(std::move(*tokenizer));
        t->byte_level.push_back(false);
      }
    }
    return t;
  }();
  return *tokenizers;
}

}  // namespace

int FuzzTokenizer(const uint8_t* data, size_t size) {
  const Tokenizers& t = Load();
  if (size < 2) return 0;
  const size_t which = data[0] % t.all.size();
  const Tokenizer& tokenizer = *t.all[which];
  const bool add_bos = data[1] & 1, parse_special = data[1] & 2;
  const std::string_view text = AsText(data + 2, size - 2);
  const std::vector<int32_t> ids = tokenizer.Encode(text, add_bos, parse_special);
  for (int32_t id : ids) {
    KVS_CHECK_MSG(id >= 0 && id < tokenizer.n_vocab(), "token id out of the vocabulary");
    (void)tokenizer.TokenToPiece(id);
  }
  const std::string decoded = tokenizer.Decode(ids);
  if (t.byte_level[which] && !parse_special) {
    KVS_CHECK_MSG(decoded == text, "byte-level BPE did not decode back to its input");
  }
  return 0;
}

}  // namespace kvsparse::fuzz
