#include "support/synth_model_file.h"

#include <gtest/gtest.h>

#include "kvsparse/synth.h"
#include "support/shared_data.h"

namespace kvsparse::testing {

std::unique_ptr<Model> LoadSynthModelF32(const std::string& shape_name, const std::string& file_name) {
  auto shape = FindSynthShape(shape_name);
  EXPECT_TRUE(shape.ok()) << shape.status().ToString();
  if (!shape.ok()) return nullptr;
  const std::string path = TempPath(file_name);
  SynthOptions options;
  options.weight_type = DType::kF32;
  const Status written = WriteSynthModel(*shape, options, path);
  EXPECT_TRUE(written.ok()) << written.ToString();
  if (!written.ok()) return nullptr;
  auto model = Model::Load(path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? std::move(*model) : nullptr;
}

}  // namespace kvsparse::testing
