// GGUF v2/v3 reader (over mmap) and writer.
// The reader validates everything before exposing it: every length, count, string,
// array, tensor dimension and data extent is bounds-checked against the file size,
// so a truncated, corrupt or hostile file yields a Status naming the key, tensor or
// offset at fault and never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

namespace kvsparse {

// GGUF format limits, shared by the reader and the writer: tensors have 1..4 dimensions, and
// general.alignment (default 32) is a power of two of at least 8.
inline constexpr uint32_t kGgufMaxDims = 4;
inline constexpr uint64_t kGgufDefaultAlignment = 32;
inline constexpr uint64_t kGgufMinAlignment = 8;

enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};
std::string_view GgufTypeName(GgufType t);

// One metadata value. Scalars are widened into u/i/f/b; strings and array contents
// point into the mapped file (valid while the GgufFile lives).
struct GgufValue {
  GgufType type = GgufType::kU8;
  uint64_t u = 0;        // unsigned integer types
  int64_t i = 0;         // signed integer types
  double f = 0;          // f32 / f64
  bool b = false;        // bool
  std::string_view str;  // string
  // Arrays (type == kArray):
  GgufType elem_type = GgufType::kU8;
  uint64_t count = 0;
  const uint8_t* elems = nullptr;          // raw little-endian elements for non-string arrays
  std::vector<std::string_view> strings;   // string arrays
  // Nested arrays are rejected as unsupported (no known model uses them).
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;     // dimensions, ne[0] contiguous (GGUF order)
  uint32_t ggml_type = 0;      // raw type id as stored
  std::optional<DType> type;   // set when kvsparse can compute with it
  uint64_t offset = 0;         // relative to the data section
  const void* data = nullptr;  // into the mapping; null when the type's size is unknown
  size_t nbytes = 0;
  int64_t NumElements() const;
};

class GgufFile {
 public:
  // Maps and validates `path`. Errors name the path and what is wrong.
  static StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* Find(std::string_view key) const;

  // Typed getters: NotFound if absent, InvalidArgument naming the key, the expected
  // and the found type when it does not fit. Integers convert between widths with a range check.
  StatusOr<uint64_t> GetUInt(std::string_view key) const;
  StatusOr<int64_t> GetInt(std::string_view key) const;
  StatusOr<double> GetFloat(std::string_view key) const;  // accepts f32/f64 and integers
  StatusOr<bool> GetBool(std::string_view key) const;
  StatusOr<std::string_view> GetString(std::string_view key) const;
  StatusOr<const std::vector<std::string_view>*> GetStringArray(std::string_view key) const;
  StatusOr<std::vector<float>> GetF32Array(std::string_view key) const;   // f32 elements
  StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;  // any integer elements
  // Convenience: value or default when absent (errors still reported for wrong types).
  StatusOr<uint64_t> GetUIntOr(std::string_view key, uint64_t dflt) const;
  StatusOr<double> GetFloatOr(std::string_view key, double dflt) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(std::string_view name) const;

  // Drops the whole mapped pages inside [data, data + bytes) from memory (a range outside the
  // mapping is ignored). The mapping is read-only, so a later read loads them from the file again:
  // for tensors whose bytes another copy now serves (Model's kept panels).
  void ReleasePages(const void* data, size_t bytes) const;

 private:
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  friend class GgufParser;
};

// Byte size of `n` elements of a ggml type id, for every standard ggml type
// (not only the ones kvsparse computes with), or nullopt for unknown ids / bad n.
std::optional<size_t> GgmlTypeBytes(uint32_t ggml_type, int64_t n);
int64_t GgmlTypeBlockSize(uint32_t ggml_type);      // elements per block; 0 for unknown ids
std::string_view GgmlTypeName(uint32_t ggml_type);  // "q5_k", ... or "unknown"
// Bytes of one scalar metadata value; 0 for kString and kArray.
size_t GgufScalarSize(GgufType t);

// Writes GGUF v3. Metadata keys keep insertion order; tensors are written aligned.
class GgufWriter {
 public:
  void SetU32(const std::string& key, uint32_t v);
  void SetI32(const std::string& key, int32_t v);
  void SetU64(const std::string& key, uint64_t v);
  void SetF32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetString(const std::string& key, const std::string& v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetF32Array(const std::string& key, const std::vector<float>& v);
  void SetI32Array(const std::string& key, const std::vector<int32_t>& v);
  // Copies a value read by GgufFile (any type, arrays included), e.g. tokenizer.* keys.
  void SetValue(const std::string& key, const GgufValue& v);

  // Fills the tensor's bytes ([nbytes] in `type` layout) when the file is written,
  // so multi-GB models are produced one tensor at a time.
  using Filler = std::function<void(void* dst, size_t nbytes)>;
  void AddTensor(const std::string& name, DType type, std::vector<int64_t> ne, Filler fill);
  // `data` ([nbytes] in `type` layout) must stay valid until Write().
  void AddTensor(const std::string& name, DType type, std::vector<int64_t> ne, const void* data);
  // Same, for any ggml type id whose size GgmlTypeBytes knows (e.g. 13 = q5_K), including
  // ones kvsparse cannot compute with; Write() rejects unknown ids.
  void AddTensor(const std::string& name, uint32_t ggml_type, std::vector<int64_t> ne, Filler fill);
  void AddTensor(const std::string& name, uint32_t ggml_type, std::vector<int64_t> ne, const void* data);

  // Errors (nothing is written): duplicate tensor names, bad dims, unknown ggml type ids, ne[0]
  // not a multiple of the type's block size, general.alignment not a power of two >= 8. Setting a key twice replaces its value.
  Status Write(const std::string& path) const;

 private:
  struct Kv {
    std::string key;
    GgufType type;
    GgufType elem_type;
    std::string bytes;  // encoded payload (after the type tag)
  };
  struct Tensor {
    std::string name;
    uint32_t ggml_type;
    std::vector<int64_t> ne;
    Filler fill;
  };
  void Put(const std::string& key, GgufType type, std::string bytes, GgufType elem = GgufType::kU8);
  std::vector<Kv> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace kvsparse
