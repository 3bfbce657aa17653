// PyramidKV — Z. Cai, Y. Zhang, B. Gao, Y. Liu, T. Liu, K. Lu, W. Xiong, Y. Dong, B. Chang,
// J. Hu, W. Xiao, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
// Funneling", arXiv:2406.02069, 2024.
//
// Attention funnels with depth: lower layers spread it widely, upper layers concentrate
// it. PyramidKV therefore scores tokens like SnapKV (same voting, pooling and per-head
// selection) but gives layers budgets that decrease linearly with depth while preserving the
// average, as KVCache-Factory's PyramidKVCluster does: above the shared observation window W,
// the last layer gets S / beta of the mean share S = C - W and the first 2S - S / beta
// (beta = 20). Defaults are the reference runs' (run_longbench.py): window 8, kernel 7, max
// pooling.
// Clamp and redistribution, as the reference: when the first layer's share would exceed the
// prompt (2S - S / beta > n - W for n tokens seen), it is clamped to n - W and the last layer's
// share raised to 2S - (n - W), so the line keeps its mean and no layer is given more than it
// can hold; a prompt of at most C tokens is not compressed, and one shorter than 2S gets the
// uniform budget C in every layer (the reference's SnapKV fallback). Deliberate difference:
// integer budgets are floored and the remainder handed to the first layers with room, so the
// budgets sum to exactly n_layers * C (the reference floors the step and overshoots the mean).
// A fraction budget is resolved first (of the tokens seen), then split.
#include <algorithm>
#include <cmath>

#include "policy/snapkv.h"

namespace kvsparse {

int32_t PyramidLayerBudget(int layer, int n_layers, int32_t average_budget, int32_t window, double beta,
                           int32_t n_seen) {
  KVS_CHECK(n_layers >= 1 && layer >= 0 && layer < n_layers);
  KVS_CHECK_MSG(beta >= 1.0, "PyramidKV beta must be >= 1");
  const int64_t share = static_cast<int64_t>(average_budget) - window;  // S
  if (n_layers == 1 || share <= 0) return average_budget;
  // Short prompts: nothing to compress, or the reference's uniform fallback.
  if (n_seen <= average_budget || n_seen < 2 * share) return average_budget;
  double smallest = static_cast<double>(share) / beta;
  double largest = 2.0 * share - smallest;
  const double room = static_cast<double>(n_seen) - window;  // what a layer can hold above the window
  if (largest > room) {
    largest = room;
    smallest = 2.0 * share - largest;
  }
  // Layer l's share lies on the line from `largest` (l = 0) to `smallest`; a share that is a whole
  // number must floor to itself, so the point is interpolated directly and floored with a tolerance.
  auto floored = [&](int l) {
    const double share_l = (largest * (n_layers - 1 - l) + smallest * l) / (n_layers - 1);
    return static_cast<int64_t>(std::floor(share_l + 1e-9 * std::max(1.0, share_l)));
  };
  int64_t total = 0;
  for (int l = 0; l < n_layers; ++l) total += floored(l);
  // Hand the rounding remainder to the first layers below the room (or take an excess from the last).
  int64_t remainder = share * n_layers - total;
  int64_t mine = floored(layer);
  for (int l = 0; l < n_layers && remainder > 0; ++l) {
    if (floored(l) + 1 > room) continue;
    if (l == layer) mine += 1;
    --remainder;
  }
  if (remainder < 0 && layer >= n_layers + remainder) mine = std::max<int64_t>(mine - 1, 0);
  return static_cast<int32_t>(window + mine);
}

std::vector<int32_t> PyramidBudgets(int n_layers, int32_t average_budget, int32_t window, double beta,
                                    int32_t n_seen) {
  std::vector<int32_t> budgets(n_layers);
  for (int l = 0; l < n_layers; ++l) budgets[l] = PyramidLayerBudget(l, n_layers, average_budget, window, beta, n_seen);
  return budgets;
}

namespace policy {
namespace {

class PyramidKvPolicy final : public SnapKvPolicy {
 public:
  PyramidKvPolicy(const KvBudget& average_budget, const KvMethodParams& params, int layer, int n_layers)
      : SnapKvPolicy(average_budget, params), layer_(layer), n_layers_(n_layers) {}
  std::string_view name() const override { return "pyramidkv"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<PyramidKvPolicy>(*this); }
  int32_t BudgetTokens(int32_t n_seen) const override {
    return PyramidLayerBudget(layer_, n_layers_, ResolveBudget(budget_, n_seen), params_.obs_window, params_.beta,
                              n_seen);
  }

 private:
  int layer_;
  int n_layers_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakePyramidKvPolicy(const KvBudget& average_budget, const KvMethodParams& params,
                                              int layer, int n_layers) {
  return std::make_unique<PyramidKvPolicy>(average_budget, params, layer, n_layers);
}

}  // namespace policy
}  // namespace kvsparse
