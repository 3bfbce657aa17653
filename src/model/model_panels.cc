// Kept panels: the model's matrices packed once, at load, into the active kernel family's
// panel layout (ops::PackPanels), as llama.cpp repacks its CPU weight buffers. Batched decode
// and prefill then skip the per-call weight packing, and decode reads the panels too. Only types
// whose panels hold exactly the rows' bytes are kept (Q8_0 on avx512), and the rows' file pages
// are released, so memory does not grow.
#include <cstdlib>
#include <cstring>

#include "kvsparse/model.h"
#include "kvsparse/ops.h"
#include "model/model_loader.h"

namespace kvsparse {

void Model::KeepPanels() {
  auto keep = [&](WeightView& w) {
    const size_t bytes = ops::PanelBytes(w);
    if (bytes == 0) return;
    void* dst = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (dst == nullptr) return;  // (MatMul reads the rows instead: same results)
    kept_panels_.emplace_back(dst, &std::free);
    w = ops::PackPanels(w, dst, /*n_threads=*/0);
    kept_panel_bytes_ += bytes;
    // The rows' pages now serve only other readers (another kernel family, a tied embedding's
    // lookups), which load them from the file again.
    if (gguf_ != nullptr) gguf_->ReleasePages(w.data, static_cast<size_t>(w.rows) * DTypeRowBytes(w.type, w.cols));
  };
  for (LayerWeights& l : layers) {
    for (WeightView* w : {&l.wq_a, &l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down, &l.router, &l.shared_gate,
                          &l.shared_up, &l.shared_down}) {
      if (w->data != nullptr) keep(*w);
    }
    for (std::vector<WeightView>* experts : {&l.expert_gate, &l.expert_up, &l.expert_down, &l.k_b, &l.v_b}) {
      for (WeightView& w : *experts) keep(w);
    }
  }
  keep(output);
}

void ModelLoader::KeepPanels(Model& m) {
  const char* env = std::getenv("KVSPARSE_REPACK");
  if (env != nullptr && std::strcmp(env, "0") == 0) return;
  m.KeepPanels();
}

}  // namespace kvsparse
