// Internal: the loaders that fill a Model from a GGUF file or a llama2.c checkpoint.
// ModelLoader is Model's friend so the loaders can fill its private state; nothing
// outside src/model uses this header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/model.h"

namespace kvsparse {

class ModelLoader {
 public:
  static StatusOr<std::unique_ptr<Model>> FromGguf(const std::string& path, const ModelLoadOptions& options);
  static StatusOr<std::unique_ptr<Model>> FromLlama2c(const std::string& path);

 private:
  static std::unique_ptr<Model> NewModel(const std::string& path) {
    std::unique_ptr<Model> model(new Model());
    model->path_ = path;
    return model;
  }
  static ModelConfig& Config(Model& m) { return m.config_; }
  static void SetGguf(Model& m, std::unique_ptr<GgufFile> file) { m.gguf_ = std::move(file); }
  // Hands a buffer to the model; the returned pointer stays valid for the model's life.
  static uint8_t* Own(Model& m, std::vector<uint8_t> bytes) {
    m.owned_.push_back(std::move(bytes));
    return m.owned_.back().data();
  }
  // Model::KeepPanels unless KVSPARSE_REPACK=0 (llama.cpp's --no-repack).
  static void KeepPanels(Model& m);
  friend class GgufModelBuilder;
  friend class Llama2cModelBuilder;
};

// Checks the config's internal consistency (positive sizes, head divisibility, even head_dim).
// `source` names the file for the message.
Status ValidateModelConfig(const ModelConfig& c, const std::string& source);

}  // namespace kvsparse
