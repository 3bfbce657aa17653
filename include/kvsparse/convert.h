// llama2.c checkpoint -> GGUF conversion (llama architecture, llama.cpp tensor names).
#pragma once

#include <string>

#include "kvsparse/dtype.h"
#include "kvsparse/status.h"

namespace kvsparse {

struct ConvertOptions {
  // Type of the 2-D weight matrices; norms stay f32. Quantized types need cols divisible by the block size.
  DType weight_type = DType::kF32;
  // Optional vocab-only GGUF whose tokenizer.* keys are copied (token count must equal the model's vocab).
  std::string vocab_gguf;
};

Status ConvertLlama2cToGguf(const std::string& in_path, const std::string& out_path, const ConvertOptions& options);

}  // namespace kvsparse
