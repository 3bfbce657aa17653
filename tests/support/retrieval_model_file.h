// The built-in retrieval model for tests: written once per process into the test temp folder
// and loaded (the model is constructed in code, so no ../shared data is needed).
#pragma once

#include <memory>
#include <string>

#include "kvsparse/model.h"
#include "kvsparse/retrieval_model.h"

namespace kvsparse::testing {

// Path of the model with `n_layers` layers (f32), written on first use.
const std::string& RetrievalModelFile(int n_layers = 2, RetrievalShape shape = RetrievalShape::kOneHead);
std::unique_ptr<Model> LoadRetrievalModel(int n_layers = 2, RetrievalShape shape = RetrievalShape::kOneHead);

}  // namespace kvsparse::testing
