// GGUF files: the reader (header, metadata, tensor table, offsets), then what reads a model from
// it (the architecture's keys, tensor shapes and types, the quantization mix) and its tokenizer
// keys. Any input must end in an error Status or a usable model, never a crash.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "fuzz_target.h"
#include "kvsparse/gguf.h"
#include "kvsparse/model.h"
#include "kvsparse/tokenizer.h"

namespace kvsparse::fuzz {

int FuzzGguf(const uint8_t* data, size_t size) {
  // The reader maps files: the input goes to a per-process file (memory-backed /dev/shm).
  static const std::string path =
      (std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                 : std::filesystem::temp_directory_path()) /
      ("kvsparse-fuzz-" + std::to_string(getpid()) + ".gguf");
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  const bool written = std::fwrite(data, 1, size, f) == size;
  std::fclose(f);
  if (!written) return 0;
  auto file = GgufFile::Open(path);
  if (file.ok()) {
    auto tokenizer = Tokenizer::FromGguf(**file);
    if (tokenizer.ok()) (*tokenizer)->Encode("Hello world, 123 <|im_end|>", true, true);
    file->reset();
    auto model = Model::LoadGguf(path);
    (void)model;
  }
  std::remove(path.c_str());
  return 0;
}

}  // namespace kvsparse::fuzz
