#include "kvsparse/kv_cache.h"

namespace kvsparse {

const char* KvStorageName(KvStorage s) {
  switch (s) {
    case KvStorage::kF32: return "f32";
    case KvStorage::kF16: return "f16";
    case KvStorage::kInt8: return "int8";
    case KvStorage::kInt8Kivi: return "int8_kivi";
  }
  return "?";
}

size_t KvStorageValueBytes(KvStorage s) {
  switch (s) {
    case KvStorage::kF32: return 4;
    case KvStorage::kF16: return 2;
    case KvStorage::kInt8: return 1;
    case KvStorage::kInt8Kivi: return 1;
  }
  return 0;
}

}  // namespace kvsparse
