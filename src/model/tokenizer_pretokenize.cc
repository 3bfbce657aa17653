#include "model/tokenizer_pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <string>

#include "kvsparse/tokenizer.h"
#include "model/tokenizer_bytes.h"

namespace kvsparse::tokenizer_internal {
namespace {

// GPT-2's split: contractions, letter runs, digit runs, other-symbol runs (each with
// one optional leading space), and whitespace not followed by a non-space. Whitespace
// it leaves unmatched becomes a gap word, as the original pattern's final \s+ would.
constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";

// Llama-3 / Qwen2 split; (?i:'s|...) is spelled with explicit case classes, as in llama.cpp.
constexpr const char* kLlama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// CJK ideographs, the blocks below them, and Hangul syllables, as DeepSeek's tokenizer.json lists them.
constexpr const char* kDeepseekCjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";

// DeepSeek-LLM's letter class: the cased letters (Lu, Ll, Lt) as its tokenizer.json enumerates them.
constexpr const char* kDeepseekLlmLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF})"
    R"(\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1})"
    R"(\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5})"
    R"(\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A})"
    R"(\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B})"
    R"(\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC})"
    R"(\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107})"
    R"(\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134})"
    R"(\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4})"
    R"(\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787})"
    R"(\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A})"
    R"(\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2})"
    R"(\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
// ASCII punctuation/symbols, their full-width forms, curly quotes, CJK space and full stops.
constexpr const char* kDeepseekLlmPunct =
    R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)";

struct PreTokenizerDef {
  std::vector<std::string_view> names;
  std::vector<const char*> regexes;
  bool ignore_merges = false;
  bool default_add_bos = false;
};

const std::vector<PreTokenizerDef>& Definitions() {
  static const std::vector<PreTokenizerDef> defs = {
      // "default" (key absent) gets GPT-2's split, the canonical byte-level BPE one.
      {{"default", "gpt-2", "gpt2", "gpt-neox", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"}, {kGpt2}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}, {R"(\p{N})", kGpt2}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2, R"([0-9][0-9][0-9])"}},
      {{"deepseek-llm"},
       {R"([\r\n])", kDeepseekLlmLetters, kDeepseekLlmPunct, R"(\s+$)", kDeepseekCjk, R"(\p{N}+)"}},
      {{"deepseek-coder"}, {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", kDeepseekCjk, R"(\p{N})"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3"}, {kLlama3}, /*ignore_merges=*/true, /*default_add_bos=*/true},
      {{"dbrx", "smaug-bpe", "chatglm-bpe"}, {kLlama3}},
      {{"qwen2", "stablelm2", "megrez"}, {kQwen2}},
  };
  return defs;
}

struct CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
struct JitStackDeleter {
  void operator()(pcre2_jit_stack* stack) const { pcre2_jit_stack_free(stack); }
};

}  // namespace

struct PreTokenizer::Regex {
  std::unique_ptr<pcre2_code, CodeDeleter> code;
  bool jit = false;
};

PreTokenizer::~PreTokenizer() = default;

StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::Create(std::string_view pre_name) {
  const PreTokenizerDef* def = nullptr;
  for (const PreTokenizerDef& d : Definitions()) {
    for (std::string_view name : d.names) {
      if (name == pre_name) def = &d;
    }
  }
  if (def == nullptr) {
    std::string supported;
    for (std::string_view name : SupportedBpePreTokenizers()) {
      if (!supported.empty()) supported += ", ";
      supported += name;
    }
    return UnimplementedError("tokenizer.ggml.pre = '" + std::string(pre_name) +
                              "' is not a supported pre-tokenizer; supported: " + supported);
  }
  std::unique_ptr<PreTokenizer> pre(new PreTokenizer());
  pre->ignore_merges_ = def->ignore_merges;
  pre->default_add_bos_ = def->default_add_bos;
  for (const char* pattern : def->regexes) {
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY,
                                     &error_code, &error_offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof(message));
      return InternalError("pre-tokenizer '" + std::string(pre_name) + "': PCRE2 rejected regex at offset " +
                           std::to_string(error_offset) + ": " + reinterpret_cast<const char*>(message));
    }
    auto regex = std::make_unique<Regex>();
    regex->code.reset(code);
    regex->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;  // falls back to the interpreter
    pre->regexes_.push_back(std::move(regex));
  }
  return pre;
}

std::vector<std::string_view> PreTokenizer::Split(std::string_view text) const {
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;
  pieces.push_back(text);
  // Long runs of one character class can outgrow JIT's default 32 KiB stack.
  std::unique_ptr<pcre2_jit_stack, JitStackDeleter> jit_stack(pcre2_jit_stack_create(32 * 1024, 8 << 20, nullptr));
  std::unique_ptr<pcre2_match_context, void (*)(pcre2_match_context*)> context(pcre2_match_context_create(nullptr),
                                                                               pcre2_match_context_free);
  if (jit_stack && context) pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());

  std::vector<std::string_view> next;
  for (const auto& regex : regexes_) {
    std::unique_ptr<pcre2_match_data, MatchDataDeleter> match(
        pcre2_match_data_create_from_pattern(regex->code.get(), nullptr));
    next.clear();
    next.reserve(pieces.size());
    for (std::string_view piece : pieces) {
      const auto subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      size_t gap_start = 0;  // first byte not yet assigned to a word
      size_t search_from = 0;
      while (search_from < piece.size()) {
        int rc = pcre2_match(regex->code.get(), subject, piece.size(), search_from, 0, match.get(), context.get());
        if (rc < 0 && rc != PCRE2_ERROR_NOMATCH && regex->jit) {
          // JIT resource limits: retry with the interpreter, which keeps its frames on the heap.
          rc = pcre2_match(regex->code.get(), subject, piece.size(), search_from, PCRE2_NO_JIT, match.get(),
                           context.get());
        }
        if (rc < 0) break;  // no further match (or a resource limit): the rest is a gap
        const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
        const size_t begin = ovector[0];
        const size_t end = ovector[1];
        if (end <= begin) {  // empty match: step over one character
          if (begin >= piece.size()) break;
          search_from = begin + Utf8CharLengthAt(piece, begin);
          continue;
        }
        if (begin > gap_start) next.push_back(piece.substr(gap_start, begin - gap_start));
        next.push_back(piece.substr(begin, end - begin));
        gap_start = search_from = end;
      }
      if (gap_start < piece.size()) next.push_back(piece.substr(gap_start));
    }
    pieces.swap(next);
  }
  return pieces;
}

}  // namespace kvsparse::tokenizer_internal

namespace kvsparse {

std::vector<std::string_view> SupportedBpePreTokenizers() {
  std::vector<std::string_view> names;
  for (const auto& def : tokenizer_internal::Definitions()) names.insert(names.end(), def.names.begin(), def.names.end());
  return names;
}

}  // namespace kvsparse
