// Test helpers: hand-built GGUF bytes (so tests control every field, including wrong ones).
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "support/shared_data.h"

namespace kvsparse {

// Builds GGUF bytes by hand so tests control every field (including wrong ones).
class RawGguf {
 public:
  template <typename T>
  RawGguf& Pod(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  RawGguf& Str(const std::string& s) {
    Pod<uint64_t>(s.size());
    bytes_ += s;
    return *this;
  }
  RawGguf& Header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    bytes_ += "GGUF";
    return Pod(version).Pod(n_tensors).Pod(n_kv);
  }
  RawGguf& KvU32(const std::string& key, uint32_t v) { return Str(key).Pod<uint32_t>(4).Pod(v); }
  RawGguf& KvStr(const std::string& key, const std::string& v) { return Str(key).Pod<uint32_t>(8).Str(v); }
  RawGguf& Tensor(const std::string& name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    Str(name).Pod<uint32_t>(ne.size());
    for (int64_t d : ne) Pod(d);
    return Pod(type).Pod(offset);
  }
  RawGguf& PadTo(size_t align) {
    while (bytes_.size() % align) bytes_ += '\0';
    return *this;
  }
  RawGguf& Zeros(size_t n) {
    bytes_.append(n, '\0');
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

inline std::string WriteTemp(const std::string& name, const std::string& bytes) {
  std::string path = testing::TempPath(name);
  // Unlink rather than truncate: ext4 flushes a truncated-and-rewritten file to disk on
  // close, which makes thousands of fuzz iterations crawl.
  std::remove(path.c_str());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// A small valid file: 3 metadata keys (incl. a string array), 2 f32 tensors.
inline std::string SmallValidFile() {
  RawGguf g;
  g.Header(3, 2, 3);
  g.KvStr("general.architecture", "llama");
  g.KvU32("llama.block_count", 2);
  g.Str("tokenizer.ggml.tokens").Pod<uint32_t>(9).Pod<uint32_t>(8).Pod<uint64_t>(2).Str("a").Str("bc");
  g.Tensor("w", {4, 2}, 0, 0);
  g.Tensor("b", {8}, 0, 32);
  g.PadTo(32);
  std::vector<float> w(8), b(8);
  for (int i = 0; i < 8; ++i) w[i] = static_cast<float>(i) + 0.5f;
  for (int i = 0; i < 8; ++i) b[i] = -static_cast<float>(i);
  for (float x : w) g.Pod(x);
  g.PadTo(32);
  for (float x : b) g.Pod(x);
  return g.bytes();
}

}  // namespace kvsparse
