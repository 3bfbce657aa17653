#include "model/tokenizer_bytes.h"

#include <array>

namespace kvsparse::tokenizer_internal {
namespace {

// GPT-2's table: printable Latin-1 bytes map to themselves; the 68 others (controls,
// space, DEL, NBSP, soft hyphen...) map in order to U+0100, U+0101, ...
struct ByteLevelTables {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 0x144> cp_to_byte{};  // code points used are all < 0x100 + 68
  std::array<std::string, 256> byte_to_utf8;

  ByteLevelTables() {
    cp_to_byte.fill(-1);
    uint32_t next_extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next_extra++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
      AppendUtf8(byte_to_cp[b], &byte_to_utf8[b]);
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

// Decodes one well-formed UTF-8 character at text[pos]; false when malformed.
bool DecodeUtf8(std::string_view text, size_t pos, uint32_t* cp, size_t* len) {
  const auto at = [&](size_t i) { return static_cast<uint8_t>(text[pos + i]); };
  const uint8_t lead = at(0);
  size_t n;
  uint32_t value;
  if (lead < 0x80) { *cp = lead; *len = 1; return true; }
  if ((lead & 0xE0) == 0xC0) { n = 2; value = lead & 0x1F; }
  else if ((lead & 0xF0) == 0xE0) { n = 3; value = lead & 0x0F; }
  else if ((lead & 0xF8) == 0xF0) { n = 4; value = lead & 0x07; }
  else return false;
  if (text.size() - pos < n) return false;
  for (size_t i = 1; i < n; ++i) {
    if ((at(i) & 0xC0) != 0x80) return false;
    value = (value << 6) | (at(i) & 0x3F);
  }
  *cp = value;
  *len = n;
  return true;
}

}  // namespace

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string ByteLevelEncode(std::string_view bytes) {
  const ByteLevelTables& t = Tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += t.byte_to_utf8[static_cast<uint8_t>(c)];
  return out;
}

void ByteLevelDecode(std::string_view text, std::string* out) {
  const ByteLevelTables& t = Tables();
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp = 0;
    size_t len = 0;
    if (!DecodeUtf8(text, pos, &cp, &len)) {
      out->push_back(text[pos]);
      ++pos;
      continue;
    }
    if (cp < t.cp_to_byte.size() && t.cp_to_byte[cp] >= 0) {
      out->push_back(static_cast<char>(t.cp_to_byte[cp]));
    } else {
      out->append(text.substr(pos, len));
    }
    pos += len;
  }
}

}  // namespace kvsparse::tokenizer_internal
