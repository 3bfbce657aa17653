// GGUF v2/v3 reader: maps the file read-only and validates every byte it exposes.
// All arithmetic on untrusted sizes is overflow-checked; nothing is allocated from an
// untrusted count before that count has been bounded by the bytes actually present.
#include <algorithm>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "kvsparse/gguf.h"

namespace kvsparse {

namespace {


struct GgmlTypeTraits {
  uint32_t id;
  const char* name;
  int64_t block_elems;
  size_t block_bytes;
};

// Every ggml type id that can appear in a GGUF file (ids 4, 5, 31-33 and 36-38 were
// removed from ggml and are rejected as unknown).
constexpr GgmlTypeTraits kGgmlTypes[] = {
    {0, "f32", 1, 4},          {1, "f16", 1, 2},          {2, "q4_0", 32, 18},
    {3, "q4_1", 32, 20},       {6, "q5_0", 32, 22},       {7, "q5_1", 32, 24},
    {8, "q8_0", 32, 34},       {9, "q8_1", 32, 36},       {10, "q2_k", 256, 84},
    {11, "q3_k", 256, 110},    {12, "q4_k", 256, 144},    {13, "q5_k", 256, 176},
    {14, "q6_k", 256, 210},    {15, "q8_k", 256, 292},    {16, "iq2_xxs", 256, 66},
    {17, "iq2_xs", 256, 74},   {18, "iq3_xxs", 256, 98},  {19, "iq1_s", 256, 50},
    {20, "iq4_nl", 32, 18},    {21, "iq3_s", 256, 110},   {22, "iq2_s", 256, 82},
    {23, "iq4_xs", 256, 136},  {24, "i8", 1, 1},          {25, "i16", 1, 2},
    {26, "i32", 1, 4},         {27, "i64", 1, 8},         {28, "f64", 1, 8},
    {29, "iq1_m", 256, 56},    {30, "bf16", 1, 2},        {34, "tq1_0", 256, 54},
    {35, "tq2_0", 256, 66},    {39, "mxfp4", 32, 17},
};

const GgmlTypeTraits* FindGgmlType(uint32_t id) {
  for (const GgmlTypeTraits& t : kGgmlTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

bool IsKnownGgufType(uint32_t raw) { return raw <= static_cast<uint32_t>(GgufType::kF64); }

bool IsUnsignedType(GgufType t) {
  return t == GgufType::kU8 || t == GgufType::kU16 || t == GgufType::kU32 || t == GgufType::kU64;
}
bool IsSignedType(GgufType t) {
  return t == GgufType::kI8 || t == GgufType::kI16 || t == GgufType::kI32 || t == GgufType::kI64;
}

// Decodes one little-endian scalar of type `t` at `p` (which holds GgufScalarSize(t) bytes) into `v`.
void DecodeScalar(GgufType t, const uint8_t* p, GgufValue* v) {
  switch (t) {
    case GgufType::kU8: v->u = p[0]; break;
    case GgufType::kI8: { int8_t x; std::memcpy(&x, p, 1); v->i = x; break; }
    case GgufType::kU16: { uint16_t x; std::memcpy(&x, p, 2); v->u = x; break; }
    case GgufType::kI16: { int16_t x; std::memcpy(&x, p, 2); v->i = x; break; }
    case GgufType::kU32: { uint32_t x; std::memcpy(&x, p, 4); v->u = x; break; }
    case GgufType::kI32: { int32_t x; std::memcpy(&x, p, 4); v->i = x; break; }
    case GgufType::kF32: { float x; std::memcpy(&x, p, 4); v->f = x; break; }
    case GgufType::kBool: v->b = p[0] != 0; break;
    case GgufType::kU64: { uint64_t x; std::memcpy(&x, p, 8); v->u = x; break; }
    case GgufType::kI64: { int64_t x; std::memcpy(&x, p, 8); v->i = x; break; }
    case GgufType::kF64: { double x; std::memcpy(&x, p, 8); v->f = x; break; }
    case GgufType::kString: case GgufType::kArray: break;
  }
}

std::string Quote(std::string_view s) {
  // Keys/names come from the file: keep messages printable and bounded.
  std::string out = "'";
  size_t n = std::min<size_t>(s.size(), 120);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > n) out += "...";
  out += "'";
  return out;
}

std::string TypeDesc(const GgufValue& v) {
  if (v.type != GgufType::kArray) return std::string(GgufTypeName(v.type));
  return "array of " + std::string(GgufTypeName(v.elem_type));
}

}  // namespace

std::string_view GgufTypeName(GgufType t) {
  switch (t) {
    case GgufType::kU8: return "u8";
    case GgufType::kI8: return "i8";
    case GgufType::kU16: return "u16";
    case GgufType::kI16: return "i16";
    case GgufType::kU32: return "u32";
    case GgufType::kI32: return "i32";
    case GgufType::kF32: return "f32";
    case GgufType::kBool: return "bool";
    case GgufType::kString: return "string";
    case GgufType::kArray: return "array";
    case GgufType::kU64: return "u64";
    case GgufType::kI64: return "i64";
    case GgufType::kF64: return "f64";
  }
  return "unknown";
}

size_t GgufScalarSize(GgufType t) {
  switch (t) {
    case GgufType::kU8: case GgufType::kI8: case GgufType::kBool: return 1;
    case GgufType::kU16: case GgufType::kI16: return 2;
    case GgufType::kU32: case GgufType::kI32: case GgufType::kF32: return 4;
    case GgufType::kU64: case GgufType::kI64: case GgufType::kF64: return 8;
    case GgufType::kString: case GgufType::kArray: return 0;
  }
  return 0;
}

std::optional<size_t> GgmlTypeBytes(uint32_t ggml_type, int64_t n) {
  const GgmlTypeTraits* t = FindGgmlType(ggml_type);
  if (t == nullptr || n < 0 || n % t->block_elems != 0) return std::nullopt;
  uint64_t blocks = static_cast<uint64_t>(n / t->block_elems);
  if (blocks > std::numeric_limits<size_t>::max() / t->block_bytes) return std::nullopt;
  return static_cast<size_t>(blocks) * t->block_bytes;
}

int64_t GgmlTypeBlockSize(uint32_t ggml_type) {
  const GgmlTypeTraits* t = FindGgmlType(ggml_type);
  return t ? t->block_elems : 0;
}

std::string_view GgmlTypeName(uint32_t ggml_type) {
  const GgmlTypeTraits* t = FindGgmlType(ggml_type);
  return t ? std::string_view(t->name) : std::string_view("unknown");
}

int64_t GgufTensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated against overflow when the file was parsed
  return n;
}

// Walks the mapped bytes front to back. Every read goes through Need(), which checks
// the remaining length without overflow, so `pos_` never passes `size_`.
class GgufParser {
 public:
  explicit GgufParser(GgufFile& file) : f_(file), base_(file.base_), size_(file.size_) {}

  Status Parse() {
    KVS_RETURN_IF_ERROR(ParseHeader());
    KVS_RETURN_IF_ERROR(ParseMetadata());
    KVS_RETURN_IF_ERROR(ParseAlignment());
    KVS_RETURN_IF_ERROR(ParseTensorInfos());
    return ResolveTensorData();
  }

 private:
  std::string Where() const { return f_.path_ + ": "; }

  Status Truncated(uint64_t need, const std::string& what) const {
    return DataLossError(Where() + "truncated file: reading " + what + " at offset " + std::to_string(pos_) +
                         " needs " + std::to_string(need) + " bytes but only " + std::to_string(size_ - pos_) +
                         " remain (file size " + std::to_string(size_) + ")");
  }

  Status Need(uint64_t n, const std::string& what) const {
    if (n > size_ - pos_) return Truncated(n, what);
    return Status::Ok();
  }

  template <typename T>
  Status Read(T* out, const std::string& what) {
    KVS_RETURN_IF_ERROR(Need(sizeof(T), what));
    std::memcpy(out, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }

  Status ReadString(std::string_view* out, const std::string& what) {
    uint64_t len = 0;
    KVS_RETURN_IF_ERROR(Read(&len, "length of " + what));
    if (len > size_ - pos_) {
      return DataLossError(Where() + what + ": string length " + std::to_string(len) + " at offset " +
                           std::to_string(pos_ - 8) + " exceeds the " + std::to_string(size_ - pos_) +
                           " bytes left in the file");
    }
    *out = std::string_view(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return Status::Ok();
  }

  Status ParseHeader() {
    if (size_ < 4 || std::memcmp(base_, "GGUF", 4) != 0) {
      std::string found = size_ >= 4 ? Quote(std::string_view(reinterpret_cast<const char*>(base_), 4))
                                     : "only " + std::to_string(size_) + " bytes";
      return DataLossError(Where() + "not a GGUF file: expected magic 'GGUF' at offset 0, found " + found);
    }
    pos_ = 4;
    uint32_t version = 0;
    KVS_RETURN_IF_ERROR(Read(&version, "version"));
    if (version == 1) {
      return UnimplementedError(Where() + "GGUF version 1 is not supported (expected 2 or 3); "
                                "re-convert the model with a current llama.cpp");
    }
    if (version != 2 && version != 3) {
      if ((version & 0xFFFF) == 0 && (version >> 16) != 0) {
        return UnimplementedError(Where() + "GGUF version field " + std::to_string(version) +
                                  " looks byte-swapped: big-endian GGUF files are not supported");
      }
      return DataLossError(Where() + "unsupported GGUF version at offset 4: expected 2 or 3, found " +
                           std::to_string(version));
    }
    f_.version_ = version;
    KVS_RETURN_IF_ERROR(Read(&n_tensors_, "tensor count"));
    KVS_RETURN_IF_ERROR(Read(&n_kv_, "metadata count"));
    // Each metadata entry needs at least a key length, a type tag and a 1-byte value;
    // each tensor info at least a name length, n_dims, one dimension, a type and an offset.
    constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
    constexpr uint64_t kMinTensorBytes = 8 + 4 + 8 + 4 + 8;
    uint64_t remaining = size_ - pos_;
    if (n_kv_ > remaining / kMinKvBytes) {
      return DataLossError(Where() + "metadata count " + std::to_string(n_kv_) + " (offset 16) is implausible: " +
                           "the remaining " + std::to_string(remaining) + " bytes hold at most " +
                           std::to_string(remaining / kMinKvBytes) + " entries");
    }
    if (n_tensors_ > remaining / kMinTensorBytes) {
      return DataLossError(Where() + "tensor count " + std::to_string(n_tensors_) +
                           " (offset 8) is implausible: the remaining " + std::to_string(remaining) +
                           " bytes hold at most " + std::to_string(remaining / kMinTensorBytes) + " tensor infos");
    }
    return Status::Ok();
  }

  Status ReadValue(GgufType type, GgufValue* v, const std::string& key) {
    v->type = type;
    if (type == GgufType::kString) return ReadString(&v->str, "value of key " + Quote(key));
    if (type != GgufType::kArray) {
      size_t sz = GgufScalarSize(type);
      KVS_RETURN_IF_ERROR(Need(sz, "value of key " + Quote(key)));
      DecodeScalar(type, base_ + pos_, v);
      pos_ += sz;
      return Status::Ok();
    }
    uint32_t raw_elem = 0;
    uint64_t elem_offset = pos_;
    KVS_RETURN_IF_ERROR(Read(&raw_elem, "array element type of key " + Quote(key)));
    if (!IsKnownGgufType(raw_elem)) {
      return DataLossError(Where() + "key " + Quote(key) + ": unknown array element type " +
                           std::to_string(raw_elem) + " at offset " + std::to_string(elem_offset) +
                           " (expected 0..12)");
    }
    v->elem_type = static_cast<GgufType>(raw_elem);
    if (v->elem_type == GgufType::kArray) {
      return UnimplementedError(Where() + "key " + Quote(key) + ": nested arrays are not supported (offset " +
                                std::to_string(elem_offset) + ")");
    }
    uint64_t count_offset = pos_;
    KVS_RETURN_IF_ERROR(Read(&v->count, "array length of key " + Quote(key)));
    uint64_t remaining = size_ - pos_;
    // Strings need at least their 8-byte length each.
    uint64_t min_elem = v->elem_type == GgufType::kString ? 8 : GgufScalarSize(v->elem_type);
    if (v->count > remaining / min_elem) {
      return DataLossError(Where() + "key " + Quote(key) + ": array of " + std::to_string(v->count) + " " +
                           std::string(GgufTypeName(v->elem_type)) + " at offset " + std::to_string(count_offset) +
                           " needs at least " + (v->count > std::numeric_limits<uint64_t>::max() / min_elem
                                                     ? std::string("more than 2^64")
                                                     : std::to_string(v->count * min_elem)) +
                           " bytes but only " + std::to_string(remaining) + " remain");
    }
    if (v->elem_type != GgufType::kString) {
      v->elems = base_ + pos_;
      pos_ += v->count * min_elem;
      return Status::Ok();
    }
    v->strings.reserve(v->count);  // bounded above by remaining / 8
    for (uint64_t i = 0; i < v->count; ++i) {
      std::string_view s;
      KVS_RETURN_IF_ERROR(ReadString(&s, "element " + std::to_string(i) + " of key " + Quote(key)));
      v->strings.push_back(s);
    }
    return Status::Ok();
  }

  Status ParseMetadata() {
    std::unordered_set<std::string_view> seen;
    f_.kv_.reserve(n_kv_);  // bounded by the plausibility check in ParseHeader
    for (uint64_t k = 0; k < n_kv_; ++k) {
      uint64_t key_offset = pos_;
      std::string_view key;
      KVS_RETURN_IF_ERROR(ReadString(&key, "key of metadata entry " + std::to_string(k)));
      if (key.empty()) {
        return DataLossError(Where() + "metadata entry " + std::to_string(k) + " at offset " +
                             std::to_string(key_offset) + " has an empty key");
      }
      if (!seen.insert(key).second) {
        return DataLossError(Where() + "duplicate metadata key " + Quote(key) + " at offset " +
                             std::to_string(key_offset));
      }
      uint64_t type_offset = pos_;
      uint32_t raw_type = 0;
      KVS_RETURN_IF_ERROR(Read(&raw_type, "type of key " + Quote(key)));
      if (!IsKnownGgufType(raw_type)) {
        return DataLossError(Where() + "key " + Quote(key) + ": unknown value type " + std::to_string(raw_type) +
                             " at offset " + std::to_string(type_offset) + " (expected 0..12)");
      }
      GgufValue v;
      KVS_RETURN_IF_ERROR(ReadValue(static_cast<GgufType>(raw_type), &v, std::string(key)));
      f_.kv_.emplace_back(std::string(key), std::move(v));
    }
    return Status::Ok();
  }

  Status ParseAlignment() {
    const GgufValue* a = f_.Find("general.alignment");
    if (a == nullptr) {
      f_.alignment_ = kGgufDefaultAlignment;
      return Status::Ok();
    }
    if (a->type != GgufType::kU32) {
      return DataLossError(Where() + "key 'general.alignment': expected type u32, found " + TypeDesc(*a));
    }
    // The GGUF spec requires a multiple of 8; it also guarantees kernels naturally aligned
    // f32/f16 elements and block headers, since the mapping itself is page-aligned.
    if (a->u < kGgufMinAlignment || (a->u & (a->u - 1)) != 0) {
      return DataLossError(Where() + "key 'general.alignment': expected a power of two that is a multiple of " +
                           std::to_string(kGgufMinAlignment) + ", found " + std::to_string(a->u));
    }
    f_.alignment_ = a->u;
    return Status::Ok();
  }

  Status ParseTensorInfos() {
    std::unordered_set<std::string_view> seen;
    f_.tensors_.reserve(n_tensors_);  // bounded by the plausibility check in ParseHeader
    for (uint64_t t = 0; t < n_tensors_; ++t) {
      uint64_t name_offset = pos_;
      std::string_view name;
      KVS_RETURN_IF_ERROR(ReadString(&name, "name of tensor " + std::to_string(t)));
      if (!seen.insert(name).second) {
        return DataLossError(Where() + "duplicate tensor name " + Quote(name) + " at offset " +
                             std::to_string(name_offset));
      }
      std::string tname = "tensor " + Quote(name);
      GgufTensorInfo info;
      info.name = std::string(name);
      uint32_t n_dims = 0;
      uint64_t dims_offset = pos_;
      KVS_RETURN_IF_ERROR(Read(&n_dims, "n_dims of " + tname));
      if (n_dims == 0 || n_dims > kGgufMaxDims) {
        return DataLossError(Where() + tname + ": n_dims at offset " + std::to_string(dims_offset) +
                             " must be 1.." + std::to_string(kGgufMaxDims) + ", found " + std::to_string(n_dims));
      }
      int64_t n_elems = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        uint64_t dim_offset = pos_;
        int64_t ne = 0;
        KVS_RETURN_IF_ERROR(Read(&ne, "ne[" + std::to_string(d) + "] of " + tname));
        if (ne <= 0) {
          return DataLossError(Where() + tname + ": ne[" + std::to_string(d) + "] at offset " +
                               std::to_string(dim_offset) + " must be positive, found " + std::to_string(ne));
        }
        if (n_elems > std::numeric_limits<int64_t>::max() / ne) {
          return DataLossError(Where() + tname + ": element count overflows 64 bits at ne[" + std::to_string(d) +
                               "] = " + std::to_string(ne) + " (offset " + std::to_string(dim_offset) + ")");
        }
        n_elems *= ne;
        info.ne.push_back(ne);
      }
      uint64_t type_offset = pos_;
      KVS_RETURN_IF_ERROR(Read(&info.ggml_type, "type of " + tname));
      const GgmlTypeTraits* traits = FindGgmlType(info.ggml_type);
      if (traits == nullptr) {
        return UnimplementedError(Where() + tname + ": unknown ggml type id " + std::to_string(info.ggml_type) +
                                  " at offset " + std::to_string(type_offset) +
                                  "; its size is unknown, so the file cannot be validated");
      }
      if (info.ne[0] % traits->block_elems != 0) {
        return DataLossError(Where() + tname + ": ne[0] = " + std::to_string(info.ne[0]) +
                             " is not a multiple of the " + traits->name + " block size " +
                             std::to_string(traits->block_elems));
      }
      std::optional<size_t> nbytes = GgmlTypeBytes(info.ggml_type, n_elems);
      if (!nbytes) {
        return DataLossError(Where() + tname + ": byte size of " + std::to_string(n_elems) + " " + traits->name +
                             " elements overflows");
      }
      info.nbytes = *nbytes;
      info.type = DTypeFromId(info.ggml_type);
      uint64_t offset_offset = pos_;
      KVS_RETURN_IF_ERROR(Read(&info.offset, "data offset of " + tname));
      if (info.offset % f_.alignment_ != 0) {
        return DataLossError(Where() + tname + ": data offset " + std::to_string(info.offset) + " (at offset " +
                             std::to_string(offset_offset) + ") is not a multiple of the alignment " +
                             std::to_string(f_.alignment_));
      }
      f_.tensors_.push_back(std::move(info));
    }
    return Status::Ok();
  }

  Status ResolveTensorData() {
    if (f_.tensors_.empty()) return Status::Ok();  // vocab-only files may end right after the infos
    uint64_t align = f_.alignment_;
    uint64_t pad = (align - pos_ % align) % align;
    if (pad > size_ - pos_) {
      return DataLossError(Where() + "truncated file: the data section should start at offset " +
                           std::to_string(pos_ + pad) + " (after the tensor infos, aligned to " +
                           std::to_string(align) + ") but the file size is " + std::to_string(size_));
    }
    uint64_t data_start = pos_ + pad;
    uint64_t data_size = size_ - data_start;
    for (GgufTensorInfo& info : f_.tensors_) {
      if (info.offset > data_size || info.nbytes > data_size - info.offset) {
        return DataLossError(Where() + "tensor " + Quote(info.name) + ": data [" +
                             std::to_string(info.offset) + ", +" + std::to_string(info.nbytes) +
                             ") lies past the end of the data section (" + std::to_string(data_size) +
                             " bytes starting at file offset " + std::to_string(data_start) + ", file size " +
                             std::to_string(size_) + ")");
      }
      info.data = base_ + data_start + info.offset;
    }
    // No two tensors may share bytes (ggml lays them out one after another): an overlap means a
    // tensor's type or shape claims more data than it was written with (an MXFP4 tensor read as
    // an 18-byte-block type, say).
    std::vector<const GgufTensorInfo*> by_offset;
    by_offset.reserve(f_.tensors_.size());
    for (const GgufTensorInfo& info : f_.tensors_) by_offset.push_back(&info);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensorInfo& prev = *by_offset[i - 1];
      const GgufTensorInfo& next = *by_offset[i];
      if (next.offset - prev.offset < prev.nbytes) {
        return DataLossError(Where() + "tensor " + Quote(prev.name) + ": data [" + std::to_string(prev.offset) +
                             ", +" + std::to_string(prev.nbytes) + ") (type " + std::string(GgmlTypeName(prev.ggml_type)) +
                             ") overlaps tensor " + Quote(next.name) + " at " + std::to_string(next.offset) +
                             "; its type or shape does not match its data");
      }
    }
    return Status::Ok();
  }

  GgufFile& f_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
};

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the S_ISREG check below rejects it.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    std::string msg = path + ": cannot open: " + std::strerror(err);
    if (err == ENOENT) return NotFoundError(msg);
    return InvalidArgumentError(msg);
  }
  file->fd_ = fd;  // closed by the destructor on every path below
  struct stat st;
  if (::fstat(fd, &st) != 0) return InvalidArgumentError(path + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + ": not a regular file");
  if (st.st_size == 0) return DataLossError(path + ": empty file (0 bytes), expected a GGUF header");
  if (static_cast<uint64_t>(st.st_size) > std::numeric_limits<size_t>::max()) {
    return ResourceExhaustedError(path + ": file too large to map");
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) {
    return ResourceExhaustedError(path + ": mmap of " + std::to_string(size) + " bytes failed: " +
                                  std::strerror(errno));
  }
  file->base_ = static_cast<const uint8_t*>(map);
  file->size_ = size;
  // The mapping stays valid after the descriptor is closed.
  ::close(fd);
  file->fd_ = -1;
  GgufParser parser(*file);
  KVS_RETURN_IF_ERROR(parser.Parse());
  return file;
}

void GgufFile::ReleasePages(const void* data, size_t bytes) const {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  const uintptr_t map_begin = reinterpret_cast<uintptr_t>(base_), map_end = map_begin + size_;
  if (base_ == nullptr || begin < map_begin || end > map_end || end < begin) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  // (Advice only: on failure the pages simply stay resident.)
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

GgufFile::~GgufFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  for (const auto& [k, v] : kv_) {
    if (k == key) return &v;
  }
  return nullptr;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  for (const GgufTensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

namespace {

Status MissingKey(const std::string& path, std::string_view key) {
  return NotFoundError(path + ": metadata key " + Quote(key) + " not found");
}

Status WrongType(const std::string& path, std::string_view key, std::string_view expected, const GgufValue& v) {
  return InvalidArgumentError(path + ": metadata key " + Quote(key) + ": expected " + std::string(expected) +
                              ", found " + TypeDesc(v));
}

Status OutOfRangeValue(const std::string& path, std::string_view key, std::string_view expected,
                       const std::string& value) {
  return InvalidArgumentError(path + ": metadata key " + Quote(key) + ": value " + value + " does not fit " +
                              std::string(expected));
}

// Reads array element `i` (an integer type) widened to int64; false if a u64 exceeds int64.
bool ArrayIntAt(const GgufValue& v, uint64_t i, int64_t* out) {
  size_t sz = GgufScalarSize(v.elem_type);
  GgufValue tmp;
  DecodeScalar(v.elem_type, v.elems + i * sz, &tmp);
  if (IsUnsignedType(v.elem_type)) {
    if (tmp.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(tmp.u);
  } else {
    *out = tmp.i;
  }
  return true;
}

}  // namespace

StatusOr<uint64_t> GgufFile::GetUInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (IsUnsignedType(v->type)) return v->u;
  if (IsSignedType(v->type)) {
    if (v->i < 0) return OutOfRangeValue(path_, key, "an unsigned integer", std::to_string(v->i));
    return static_cast<uint64_t>(v->i);
  }
  return WrongType(path_, key, "an unsigned integer", *v);
}

StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (IsSignedType(v->type)) return v->i;
  if (IsUnsignedType(v->type)) {
    if (v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return OutOfRangeValue(path_, key, "a signed 64-bit integer", std::to_string(v->u));
    }
    return static_cast<int64_t>(v->u);
  }
  return WrongType(path_, key, "an integer", *v);
}

StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type == GgufType::kF32 || v->type == GgufType::kF64) return v->f;
  if (IsUnsignedType(v->type)) return static_cast<double>(v->u);
  if (IsSignedType(v->type)) return static_cast<double>(v->i);
  return WrongType(path_, key, "a number", *v);
}

StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type != GgufType::kBool) return WrongType(path_, key, "bool", *v);
  return v->b;
}

StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type != GgufType::kString) return WrongType(path_, key, "string", *v);
  return v->str;
}

StatusOr<const std::vector<std::string_view>*> GgufFile::GetStringArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type != GgufType::kArray || v->elem_type != GgufType::kString) {
    return WrongType(path_, key, "array of string", *v);
  }
  return &v->strings;
}

StatusOr<std::vector<float>> GgufFile::GetF32Array(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type != GgufType::kArray || (v->elem_type != GgufType::kF32 && v->elem_type != GgufType::kF64)) {
    return WrongType(path_, key, "array of f32", *v);
  }
  std::vector<float> out(v->count);
  if (v->elem_type == GgufType::kF32) {
    std::memcpy(out.data(), v->elems, v->count * sizeof(float));
  } else {
    for (uint64_t i = 0; i < v->count; ++i) {
      double d;
      std::memcpy(&d, v->elems + i * 8, 8);
      out[i] = static_cast<float>(d);
    }
  }
  return out;
}

StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path_, key);
  if (v->type != GgufType::kArray || !(IsUnsignedType(v->elem_type) || IsSignedType(v->elem_type))) {
    return WrongType(path_, key, "array of integers", *v);
  }
  std::vector<int64_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    if (!ArrayIntAt(*v, i, &out[i])) {
      return InvalidArgumentError(path_ + ": metadata key " + Quote(key) + ": element " + std::to_string(i) +
                                  " does not fit a signed 64-bit integer");
    }
  }
  return out;
}

StatusOr<uint64_t> GgufFile::GetUIntOr(std::string_view key, uint64_t dflt) const {
  if (Find(key) == nullptr) return dflt;
  return GetUInt(key);
}

StatusOr<double> GgufFile::GetFloatOr(std::string_view key, double dflt) const {
  if (Find(key) == nullptr) return dflt;
  return GetFloat(key);
}

}  // namespace kvsparse
