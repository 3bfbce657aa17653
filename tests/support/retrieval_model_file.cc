#include "support/retrieval_model_file.h"

#include <map>
#include <mutex>

#include "kvsparse/retrieval_model.h"
#include "support/shared_data.h"

namespace kvsparse::testing {

const std::string& RetrievalModelFile(int n_layers, RetrievalShape shape) {
  static std::mutex mutex;
  static std::map<std::pair<int, RetrievalShape>, std::string> paths;  // (n_layers, shape) -> file
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = paths.emplace(std::make_pair(n_layers, shape), "");
  if (inserted) {
    const bool mha = shape == RetrievalShape::kMultiHead;
    it->second = TempPath((mha ? "retrieval-mha-" : "retrieval-") + std::to_string(n_layers) + "l.gguf");
    RetrievalModelOptions options;
    options.n_layers = n_layers;
    options.shape = shape;
    const Status written = WriteRetrievalModel(options, it->second);
    KVS_CHECK_MSG(written.ok(), written.ToString());
  }
  return it->second;
}

std::unique_ptr<Model> LoadRetrievalModel(int n_layers, RetrievalShape shape) {
  auto model = Model::Load(RetrievalModelFile(n_layers, shape));
  KVS_CHECK_MSG(model.ok(), model.status().ToString());
  return std::move(*model);
}

}  // namespace kvsparse::testing
