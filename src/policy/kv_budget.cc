#include "kvsparse/kv_budget.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace kvsparse {

int32_t ResolveBudget(const KvBudget& budget, int32_t n_seen) {
  if (!budget.is_fraction()) return budget.tokens;
  // The epsilon keeps 0.2 * 10 at 2 despite 0.2 not being exact in binary.
  const double exact = budget.fraction * static_cast<double>(std::max(n_seen, 0));
  const int64_t rounded = static_cast<int64_t>(std::floor(exact + 1e-9));
  return static_cast<int32_t>(std::clamp<int64_t>(rounded, 1, std::max<int32_t>(n_seen, 1)));
}

std::string KvBudgetToString(const KvBudget& budget) {
  if (budget.is_fraction()) return fmt::format("{:g} of the context", budget.fraction);
  return fmt::format("{} tokens", budget.tokens);
}

}  // namespace kvsparse
