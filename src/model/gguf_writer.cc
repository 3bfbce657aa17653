// GGUF v3 writer. Output goes to a temporary file beside the target that is renamed
// into place only after every byte was written, so a failed write never leaves a
// truncated model behind.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <unordered_set>

#include "kvsparse/gguf.h"

namespace kvsparse {

namespace {

constexpr uint32_t kGgufVersion = 3;

template <typename T>
void Append(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void AppendString(std::string* out, std::string_view s) {
  Append<uint64_t>(out, s.size());
  out->append(s.data(), s.size());
}

uint64_t AlignUp(uint64_t x, uint64_t align) { return (x + align - 1) / align * align; }

// Owns the FILE* and deletes the temporary file unless Commit() succeeded.
class TempOutput {
 public:
  explicit TempOutput(std::string final_path)
      : final_(std::move(final_path)), temp_(final_ + ".tmp." + std::to_string(::getpid())) {}
  ~TempOutput() {
    if (f_ != nullptr) std::fclose(f_);
    if (!committed_) std::remove(temp_.c_str());
  }

  Status Open() {
    f_ = std::fopen(temp_.c_str(), "wb");
    if (f_ == nullptr) return InvalidArgumentError(temp_ + ": cannot create: " + std::strerror(errno));
    return Status::Ok();
  }

  Status Write(const void* data, size_t n) {
    if (n != 0 && std::fwrite(data, 1, n, f_) != n) {
      return ResourceExhaustedError(temp_ + ": write of " + std::to_string(n) + " bytes at offset " +
                                    std::to_string(written_) + " failed: " + std::strerror(errno));
    }
    written_ += n;
    return Status::Ok();
  }

  Status Pad(uint64_t align) {
    static const char kZeros[64] = {};
    uint64_t target = AlignUp(written_, align);
    while (written_ < target) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof(kZeros), target - written_));
      KVS_RETURN_IF_ERROR(Write(kZeros, n));
    }
    return Status::Ok();
  }

  Status Commit() {
    int rc = std::fclose(f_);
    f_ = nullptr;
    if (rc != 0) return ResourceExhaustedError(temp_ + ": close failed: " + std::strerror(errno));
    if (std::rename(temp_.c_str(), final_.c_str()) != 0) {
      return InvalidArgumentError("cannot rename " + temp_ + " to " + final_ + ": " + std::strerror(errno));
    }
    committed_ = true;
    return Status::Ok();
  }

  uint64_t written() const { return written_; }

 private:
  std::string final_;
  std::string temp_;
  std::FILE* f_ = nullptr;
  uint64_t written_ = 0;
  bool committed_ = false;
};

}  // namespace

void GgufWriter::Put(const std::string& key, GgufType type, std::string bytes, GgufType elem) {
  // Setting a key again replaces its value but keeps its original position.
  for (Kv& kv : kv_) {
    if (kv.key == key) {
      kv.type = type;
      kv.elem_type = elem;
      kv.bytes = std::move(bytes);
      return;
    }
  }
  kv_.push_back(Kv{key, type, elem, std::move(bytes)});
}

void GgufWriter::SetU32(const std::string& key, uint32_t v) {
  std::string b;
  Append(&b, v);
  Put(key, GgufType::kU32, std::move(b));
}

void GgufWriter::SetI32(const std::string& key, int32_t v) {
  std::string b;
  Append(&b, v);
  Put(key, GgufType::kI32, std::move(b));
}

void GgufWriter::SetU64(const std::string& key, uint64_t v) {
  std::string b;
  Append(&b, v);
  Put(key, GgufType::kU64, std::move(b));
}

void GgufWriter::SetF32(const std::string& key, float v) {
  std::string b;
  Append(&b, v);
  Put(key, GgufType::kF32, std::move(b));
}

void GgufWriter::SetBool(const std::string& key, bool v) {
  std::string b;
  Append<uint8_t>(&b, v ? 1 : 0);
  Put(key, GgufType::kBool, std::move(b));
}

void GgufWriter::SetString(const std::string& key, const std::string& v) {
  std::string b;
  AppendString(&b, v);
  Put(key, GgufType::kString, std::move(b));
}

void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  std::string b;
  Append<uint32_t>(&b, static_cast<uint32_t>(GgufType::kString));
  Append<uint64_t>(&b, v.size());
  for (const std::string& s : v) AppendString(&b, s);
  Put(key, GgufType::kArray, std::move(b), GgufType::kString);
}

void GgufWriter::SetF32Array(const std::string& key, const std::vector<float>& v) {
  std::string b;
  Append<uint32_t>(&b, static_cast<uint32_t>(GgufType::kF32));
  Append<uint64_t>(&b, v.size());
  b.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  Put(key, GgufType::kArray, std::move(b), GgufType::kF32);
}

void GgufWriter::SetI32Array(const std::string& key, const std::vector<int32_t>& v) {
  std::string b;
  Append<uint32_t>(&b, static_cast<uint32_t>(GgufType::kI32));
  Append<uint64_t>(&b, v.size());
  b.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
  Put(key, GgufType::kArray, std::move(b), GgufType::kI32);
}

void GgufWriter::SetValue(const std::string& key, const GgufValue& v) {
  std::string b;
  if (v.type == GgufType::kString) {
    AppendString(&b, v.str);
    Put(key, v.type, std::move(b));
    return;
  }
  if (v.type != GgufType::kArray) {
    switch (v.type) {
      case GgufType::kU8: Append<uint8_t>(&b, static_cast<uint8_t>(v.u)); break;
      case GgufType::kI8: Append<int8_t>(&b, static_cast<int8_t>(v.i)); break;
      case GgufType::kU16: Append<uint16_t>(&b, static_cast<uint16_t>(v.u)); break;
      case GgufType::kI16: Append<int16_t>(&b, static_cast<int16_t>(v.i)); break;
      case GgufType::kU32: Append<uint32_t>(&b, static_cast<uint32_t>(v.u)); break;
      case GgufType::kI32: Append<int32_t>(&b, static_cast<int32_t>(v.i)); break;
      case GgufType::kF32: Append<float>(&b, static_cast<float>(v.f)); break;
      case GgufType::kBool: Append<uint8_t>(&b, v.b ? 1 : 0); break;
      case GgufType::kU64: Append<uint64_t>(&b, v.u); break;
      case GgufType::kI64: Append<int64_t>(&b, v.i); break;
      case GgufType::kF64: Append<double>(&b, v.f); break;
      case GgufType::kString: case GgufType::kArray: break;
    }
    Put(key, v.type, std::move(b));
    return;
  }
  Append<uint32_t>(&b, static_cast<uint32_t>(v.elem_type));
  if (v.elem_type == GgufType::kString) {
    // The count written must be the number of strings that follow.
    Append<uint64_t>(&b, v.strings.size());
    for (std::string_view s : v.strings) AppendString(&b, s);
  } else {
    Append<uint64_t>(&b, v.count);
    b.append(reinterpret_cast<const char*>(v.elems), v.count * GgufScalarSize(v.elem_type));
  }
  Put(key, GgufType::kArray, std::move(b), v.elem_type);
}

void GgufWriter::AddTensor(const std::string& name, uint32_t ggml_type, std::vector<int64_t> ne, Filler fill) {
  tensors_.push_back(Tensor{name, ggml_type, std::move(ne), std::move(fill)});
}

void GgufWriter::AddTensor(const std::string& name, uint32_t ggml_type, std::vector<int64_t> ne, const void* data) {
  // `data` must stay valid until Write(): it is copied only then.
  AddTensor(name, ggml_type, std::move(ne), [data](void* dst, size_t nbytes) { std::memcpy(dst, data, nbytes); });
}

void GgufWriter::AddTensor(const std::string& name, DType type, std::vector<int64_t> ne, Filler fill) {
  AddTensor(name, static_cast<uint32_t>(type), std::move(ne), std::move(fill));
}

void GgufWriter::AddTensor(const std::string& name, DType type, std::vector<int64_t> ne, const void* data) {
  AddTensor(name, static_cast<uint32_t>(type), std::move(ne), data);
}

Status GgufWriter::Write(const std::string& path) const {
  // Validate everything before touching the disk.
  uint64_t alignment = kGgufDefaultAlignment;
  for (const Kv& kv : kv_) {
    if (kv.key != "general.alignment") continue;
    uint32_t a = 0;
    if (kv.type != GgufType::kU32) return InvalidArgumentError(path + ": 'general.alignment' must be u32");
    std::memcpy(&a, kv.bytes.data(), 4);
    if (a < kGgufMinAlignment || (a & (a - 1)) != 0) {  // what GgufFile (and the GGUF spec) accept
      return InvalidArgumentError(path + ": 'general.alignment' must be a power of two that is a multiple of " +
                                  std::to_string(kGgufMinAlignment) + ", found " + std::to_string(a));
    }
    alignment = a;
  }
  std::vector<size_t> nbytes(tensors_.size());
  std::unordered_set<std::string_view> names;
  size_t max_bytes = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    std::string where = path + ": tensor '" + t.name + "'";
    if (!names.insert(t.name).second) return InvalidArgumentError(where + " is added twice");
    if (t.ne.empty() || t.ne.size() > kGgufMaxDims) {
      return InvalidArgumentError(where + ": expected 1.." + std::to_string(kGgufMaxDims) + " dimensions, found " +
                                  std::to_string(t.ne.size()));
    }
    int64_t n = 1;
    for (size_t d = 0; d < t.ne.size(); ++d) {
      if (t.ne[d] <= 0) {
        return InvalidArgumentError(where + ": ne[" + std::to_string(d) + "] must be positive, found " +
                                    std::to_string(t.ne[d]));
      }
      if (n > INT64_MAX / t.ne[d]) return InvalidArgumentError(where + ": element count overflows");
      n *= t.ne[d];
    }
    const int64_t block = GgmlTypeBlockSize(t.ggml_type);
    if (block <= 0) {
      return InvalidArgumentError(where + ": unknown ggml type id " + std::to_string(t.ggml_type) +
                                  " (its byte size is unknown)");
    }
    if (t.ne[0] % block != 0) {
      return InvalidArgumentError(where + ": ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                                  std::string(GgmlTypeName(t.ggml_type)) + " block size " + std::to_string(block));
    }
    std::optional<size_t> size = GgmlTypeBytes(t.ggml_type, n);
    if (!size) return InvalidArgumentError(where + ": byte size overflows");
    nbytes[i] = *size;
    max_bytes = std::max(max_bytes, *size);
    if (!t.fill) return InvalidArgumentError(where + ": no data or filler");
  }

  std::string head;
  head += "GGUF";
  Append<uint32_t>(&head, kGgufVersion);
  Append<uint64_t>(&head, tensors_.size());
  Append<uint64_t>(&head, kv_.size());
  for (const Kv& kv : kv_) {
    AppendString(&head, kv.key);
    Append<uint32_t>(&head, static_cast<uint32_t>(kv.type));
    head += kv.bytes;
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    AppendString(&head, t.name);
    Append<uint32_t>(&head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) Append<int64_t>(&head, d);
    Append<uint32_t>(&head, t.ggml_type);
    Append<uint64_t>(&head, offset);
    offset = AlignUp(offset + nbytes[i], alignment);
  }

  TempOutput out(path);
  KVS_RETURN_IF_ERROR(out.Open());
  KVS_RETURN_IF_ERROR(out.Write(head.data(), head.size()));
  if (!tensors_.empty()) KVS_RETURN_IF_ERROR(out.Pad(alignment));
  // One buffer, reused: the filler must write all nbytes.
  std::unique_ptr<uint8_t[]> buffer = std::make_unique_for_overwrite<uint8_t[]>(std::max<size_t>(max_bytes, 1));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    tensors_[i].fill(buffer.get(), nbytes[i]);
    KVS_RETURN_IF_ERROR(out.Write(buffer.get(), nbytes[i]));
    KVS_RETURN_IF_ERROR(out.Pad(alignment));
  }
  return out.Commit();
}

}  // namespace kvsparse
