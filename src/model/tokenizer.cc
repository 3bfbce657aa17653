// Tokenizer: validates a TokenizerSpec, then routes text through special-token
// splitting and the SPM or byte-level BPE algorithm.
#include "kvsparse/tokenizer.h"

#include <cmath>
#include <limits>
#include <unordered_set>

#include "model/tokenizer_bpe.h"
#include "model/tokenizer_bytes.h"
#include "model/tokenizer_pretokenize.h"
#include "model/tokenizer_special.h"
#include "model/tokenizer_spm.h"
#include "model/tokenizer_vocab.h"

namespace kvsparse {

using tokenizer_internal::BpeEncoder;
using tokenizer_internal::Fragment;
using tokenizer_internal::PreTokenizer;
using tokenizer_internal::SpecialTokenSplitter;
using tokenizer_internal::SpmEncoder;
using tokenizer_internal::Vocab;

namespace {

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581 "▁"

// Texts of end-of-turn tokens that chat models emit in place of (or beside) EOS.
constexpr std::string_view kEndOfTurnTexts[] = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "<|EOT|>", "_<EOT>", "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",
    "<|return|>", "<|call|>",  // gpt-oss's harmony: the final answer's and a tool call's ends
};

std::string EscapeSpaces(std::string_view text, bool add_prefix) {
  std::string out;
  out.reserve(text.size() + 8);
  if (add_prefix) out += kSpmSpace;
  for (char c : text) {
    if (c == ' ') {
      out += kSpmSpace;
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// Parses "<0xNN>" (the SPM byte-token spelling); -1 otherwise.
int ParseByteToken(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') value |= c - '0';
    else if (c >= 'A' && c <= 'F') value |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') value |= c - 'a' + 10;
    else return -1;
  }
  return value;
}

Status CheckTokenId(std::string_view key, int32_t id, size_t n_vocab) {
  if (id < -1 || (id >= 0 && static_cast<size_t>(id) >= n_vocab)) {
    return InvalidArgumentError(std::string(key) + " = " + std::to_string(id) + " is out of range for " +
                                std::to_string(n_vocab) + " tokens (tokenizer.ggml.tokens)");
  }
  return Status::Ok();
}

}  // namespace

struct Tokenizer::Impl {
  std::string model;
  std::string pre;
  bool is_spm = false;
  std::unique_ptr<Vocab> vocab;
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = false, add_eos = false, add_space_prefix = true;
  std::unordered_set<int32_t> end_of_generation;
  std::unique_ptr<SpecialTokenSplitter> special;
  std::unique_ptr<SpmEncoder> spm;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<BpeEncoder> bpe;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSpec(TokenizerSpec spec) {
  auto impl = std::make_unique<Impl>();
  impl->model = spec.model;
  impl->pre = spec.pre.empty() ? "default" : spec.pre;
  if (spec.model == "llama") {
    impl->is_spm = true;
  } else if (spec.model != "gpt2") {
    return UnimplementedError("tokenizer.ggml.model = '" + spec.model +
                              "' is not supported; supported: 'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE)");
  }

  const size_t n_vocab = spec.tokens.size();
  if (n_vocab == 0) return InvalidArgumentError("tokenizer.ggml.tokens is empty");
  if (n_vocab > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgumentError("tokenizer.ggml.tokens has " + std::to_string(n_vocab) + " entries, more than int32 ids allow");
  }
  if (spec.scores.empty()) spec.scores.assign(n_vocab, 0.0f);
  if (spec.scores.size() != n_vocab) {
    return InvalidArgumentError("tokenizer.ggml.scores has " + std::to_string(spec.scores.size()) +
                                " entries but tokenizer.ggml.tokens has " + std::to_string(n_vocab));
  }
  for (size_t i = 0; i < n_vocab; ++i) {
    if (std::isnan(spec.scores[i])) {
      return InvalidArgumentError("tokenizer.ggml.scores[" + std::to_string(i) + "] is NaN");
    }
  }
  if (!spec.token_types.empty() && spec.token_types.size() != n_vocab) {
    return InvalidArgumentError("tokenizer.ggml.token_type has " + std::to_string(spec.token_types.size()) +
                                " entries but tokenizer.ggml.tokens has " + std::to_string(n_vocab));
  }
  std::vector<TokenType> types(n_vocab, TokenType::kNormal);
  for (size_t i = 0; i < spec.token_types.size(); ++i) {
    const int32_t t = spec.token_types[i];
    if (t < 0 || t > static_cast<int32_t>(TokenType::kByte)) {
      return InvalidArgumentError("tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(t) +
                                  " is not a token type (expected 0..6)");
    }
    types[i] = static_cast<TokenType>(t);
  }
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.bos_token_id", spec.bos, n_vocab));
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.eos_token_id", spec.eos, n_vocab));
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.unknown_token_id", spec.unk, n_vocab));
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.eot_token_id", spec.eot, n_vocab));
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.eom_token_id", spec.eom, n_vocab));
  KVS_RETURN_IF_ERROR(CheckTokenId("tokenizer.ggml.padding_token_id", spec.pad, n_vocab));
  impl->bos = spec.bos;
  impl->eos = spec.eos;
  impl->unk = spec.unk;

  impl->vocab = std::make_unique<Vocab>(std::move(spec.tokens), std::move(spec.scores), std::move(types));
  const Vocab& vocab = *impl->vocab;

  bool default_add_bos = impl->is_spm;
  if (impl->is_spm) {
    impl->spm = std::make_unique<SpmEncoder>(vocab, impl->unk);
  } else {
    KVS_ASSIGN_OR_RETURN(impl->pre_tokenizer, PreTokenizer::Create(impl->pre));
    KVS_ASSIGN_OR_RETURN(impl->bpe, BpeEncoder::Create(vocab, spec.merges, impl->pre_tokenizer->ignore_merges(), impl->unk));
    default_add_bos = impl->pre_tokenizer->default_add_bos();
  }
  if (spec.add_bos.value_or(false) && impl->bos < 0) {
    return InvalidArgumentError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is absent");
  }
  if (spec.add_eos.value_or(false) && impl->eos < 0) {
    return InvalidArgumentError("tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is absent");
  }
  // A defaulted add_bos quietly lapses when the vocab names no BOS token.
  impl->add_bos = spec.add_bos.value_or(default_add_bos) && impl->bos >= 0;
  impl->add_eos = spec.add_eos.value_or(false);
  impl->add_space_prefix = spec.add_space_prefix.value_or(true);

  for (int32_t id : {spec.eos, spec.eot, spec.eom}) {
    if (id >= 0) impl->end_of_generation.insert(id);
  }
  for (int32_t id = 0; id < vocab.size(); ++id) {
    const TokenType type = vocab.type(id);
    if (type != TokenType::kControl && type != TokenType::kUserDefined) continue;
    for (std::string_view text : kEndOfTurnTexts) {
      if (vocab.text(id) == text) impl->end_of_generation.insert(id);
    }
  }
  impl->special = std::make_unique<SpecialTokenSplitter>(vocab);
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos) const {
  return Encode(text, add_bos, /*parse_special=*/false);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos, bool parse_special) const {
  const Impl& impl = *impl_;
  std::vector<int32_t> out;
  if (add_bos && impl.add_bos) out.push_back(impl.bos);
  const std::vector<Fragment> fragments = impl.special->Split(text, parse_special);
  // SPM prefixes a space to text at the start and after every special token.
  bool after_special = true;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
      after_special = true;
      continue;
    }
    if (impl.is_spm) {
      impl.spm->Encode(EscapeSpaces(fragment.text, impl.add_space_prefix && after_special), &out);
    } else {
      for (std::string_view word : impl.pre_tokenizer->Split(fragment.text)) impl.bpe->EncodeWord(word, &out);
    }
    after_special = false;
  }
  if (add_bos && impl.add_eos) out.push_back(impl.eos);
  return out;
}

std::string Tokenizer::TokenToPiece(int32_t token) const {
  const Impl& impl = *impl_;
  if (!impl.vocab->Contains(token)) return {};
  const std::string& text = impl.vocab->text(token);
  switch (impl.vocab->type(token)) {
    case TokenType::kControl:
    case TokenType::kUserDefined:
    case TokenType::kUnknown:
    case TokenType::kUnused:
      return text;
    case TokenType::kByte:
      if (impl.is_spm) {
        const int byte = ParseByteToken(text);
        if (byte >= 0) return std::string(1, static_cast<char>(byte));
        return text;
      }
      break;
    case TokenType::kUndefined:
    case TokenType::kNormal:
      break;
  }
  std::string piece;
  if (impl.is_spm) {
    piece.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      if (text.compare(pos, kSpmSpace.size(), kSpmSpace) == 0) {
        piece.push_back(' ');
        pos += kSpmSpace.size();
      } else {
        piece.push_back(text[pos++]);
      }
    }
  } else {
    tokenizer_internal::ByteLevelDecode(text, &piece);
  }
  return piece;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& tokens) const {
  const Impl& impl = *impl_;
  std::string out;
  bool strip_leading_space = impl.is_spm && impl.add_space_prefix;
  for (int32_t token : tokens) {
    if (!impl.vocab->Contains(token) || impl.vocab->type(token) == TokenType::kControl) continue;
    std::string piece = TokenToPiece(token);
    if (strip_leading_space && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
    strip_leading_space = false;
    out += piece;
  }
  return out;
}

int32_t Tokenizer::n_vocab() const { return impl_->vocab->size(); }
int32_t Tokenizer::bos() const { return impl_->bos; }
int32_t Tokenizer::eos() const { return impl_->eos; }
bool Tokenizer::IsEndOfGeneration(int32_t token) const { return impl_->end_of_generation.count(token) > 0; }
std::string_view Tokenizer::model_name() const { return impl_->model; }
std::string_view Tokenizer::pre_name() const { return impl_->pre; }

std::string_view Tokenizer::TokenText(int32_t token) const {
  return impl_->vocab->Contains(token) ? std::string_view(impl_->vocab->text(token)) : std::string_view();
}

TokenType Tokenizer::GetTokenType(int32_t token) const {
  return impl_->vocab->Contains(token) ? impl_->vocab->type(token) : TokenType::kUndefined;
}

}  // namespace kvsparse
