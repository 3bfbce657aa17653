// The libFuzzer entry point of one harness: KVS_FUZZ_FUNCTION (set per binary by CMakeLists.txt).
#include "fuzz_target.h"

// One empty input first: the harness loads what it keeps (vocabularies, a running server) before
// libFuzzer's per-input timeout starts counting.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvsparse::fuzz::KVS_FUZZ_FUNCTION(nullptr, 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvsparse::fuzz::KVS_FUZZ_FUNCTION(data, size);
}
