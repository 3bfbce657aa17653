// PyramidKV — Z. Cai, Y. Zhang, B. Gao, Y. Liu, T. Liu, K. Lu, W. Xiong, Y. Dong, B. Chang,
// J. Hu, W. Xiao, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
// Funneling", arXiv:2406.02069, 2024.
//
// Attention funnels with depth: lower layers spread it widely, upper layers concentrate
// it. PyramidKV therefore scores tokens like SnapKV (same window, pooling, defaults) but
// gives layers budgets that decrease linearly with depth while preserving the average:
// above the shared observation window, the last layer gets S / beta of the mean share S
// and the first 2S - S / beta (beta = 20 by default, as the paper). Integer budgets are
// floored and the remainder handed to the first layers, so the sum is exact and the
// sequence stays non-increasing. A fraction budget is resolved first (of the tokens seen),
// then split.
#include <algorithm>
#include <cmath>

#include "policy/snapkv.h"

namespace kvsparse {

int32_t PyramidLayerBudget(int layer, int n_layers, int32_t average_budget, int32_t window, double beta) {
  KVS_CHECK(n_layers >= 1 && layer >= 0 && layer < n_layers);
  KVS_CHECK_MSG(beta >= 1.0, "PyramidKV beta must be >= 1");
  const int64_t share = static_cast<int64_t>(average_budget) - window;  // S
  if (n_layers == 1 || share <= 0) return average_budget;
  const double smallest = static_cast<double>(share) / beta;
  const double largest = 2.0 * share - smallest;
  const double step = (largest - smallest) / (n_layers - 1);
  auto floored = [&](int l) { return static_cast<int64_t>(std::floor(largest - l * step)); };
  int64_t total = 0;
  for (int l = 0; l < n_layers; ++l) total += floored(l);
  // Hand the rounding remainder to the first layers (or take an excess from the last).
  const int64_t remainder = share * n_layers - total;
  int64_t mine = floored(layer);
  if (remainder > 0 && layer < remainder) mine += 1;
  if (remainder < 0 && layer >= n_layers + remainder) mine = std::max<int64_t>(mine - 1, 0);
  return static_cast<int32_t>(window + mine);
}

std::vector<int32_t> PyramidBudgets(int n_layers, int32_t average_budget, int32_t window, double beta) {
  std::vector<int32_t> budgets(n_layers);
  for (int l = 0; l < n_layers; ++l) budgets[l] = PyramidLayerBudget(l, n_layers, average_budget, window, beta);
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
    return PyramidLayerBudget(layer_, n_layers_, ResolveBudget(budget_, n_seen), params_.obs_window, params_.beta);
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
