// Synthetic models (kvsparse synth shapes) for tests: f32 weights, written into the test temp
// folder and loaded.
#pragma once

#include <memory>
#include <string>

#include "kvsparse/model.h"

namespace kvsparse::testing {

// The shape `shape_name` (FindSynthShape) written as `file_name` in the per-process temp folder
// and loaded; a failure is a test failure and returns null.
std::unique_ptr<Model> LoadSynthModelF32(const std::string& shape_name, const std::string& file_name);

}  // namespace kvsparse::testing
