// UTF-8 stepping and GPT-2's byte-level alphabet: every byte 0..255 maps to one
// printable code point, so byte-level BPE vocabularies never hold raw control bytes
// or spaces ("Ġ" = U+0120 stands for ' ').
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvsparse::tokenizer_internal {

// Bytes in the UTF-8 sequence that starts with `lead`, judged by its high nibble as
// llama.cpp does (continuation or invalid bytes count as 1). Callers clamp to what is left.
inline size_t Utf8SequenceLength(uint8_t lead) {
  static constexpr uint8_t kByHighNibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kByHighNibble[lead >> 4];
}

// Length of the character at text[pos]: the lead byte's sequence length, cut short at
// the end of text or at the first byte that is not a continuation byte, so that a
// stray lead byte never swallows the next character. Requires pos < size.
inline size_t Utf8CharLengthAt(std::string_view text, size_t pos) {
  const size_t n = Utf8SequenceLength(static_cast<uint8_t>(text[pos]));
  size_t len = 1;
  while (len < n && pos + len < text.size() && (static_cast<uint8_t>(text[pos + len]) & 0xC0) == 0x80) ++len;
  return len;
}

// Appends the UTF-8 encoding of code point `cp` (< 0x110000).
void AppendUtf8(uint32_t cp, std::string* out);

// Replaces every byte by its byte-level character ("hi there" → "hiĠthere").
std::string ByteLevelEncode(std::string_view bytes);

// Appends the bytes that byte-level characters stand for; other characters (and
// malformed UTF-8) are copied unchanged.
void ByteLevelDecode(std::string_view text, std::string* out);

}  // namespace kvsparse::tokenizer_internal
