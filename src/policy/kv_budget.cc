#include "kvsparse/kv_budget.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kvsparse/status.h"

namespace kvsparse {

double KvBudget::FractionAt(int32_t n_seen) const {
  if (kind != Kind::kByLength) return fraction;
  KVS_CHECK(!by_length.empty());
  if (n_seen <= by_length.front().first) return by_length.front().second;
  if (n_seen >= by_length.back().first) return by_length.back().second;
  size_t i = 1;
  while (by_length[i].first < n_seen) ++i;
  const auto [l0, f0] = by_length[i - 1];
  const auto [l1, f1] = by_length[i];
  const double t = std::log(static_cast<double>(n_seen) / l0) / std::log(static_cast<double>(l1) / l0);
  return f0 + t * (f1 - f0);
}

int32_t ResolveBudget(const KvBudget& budget, int32_t n_seen) {
  if (budget.is_tokens()) return budget.tokens;
  // The epsilon keeps 0.2 * 10 at 2 despite 0.2 not being exact in binary.
  const double exact = budget.FractionAt(n_seen) * static_cast<double>(std::max(n_seen, 0));
  const int64_t rounded = static_cast<int64_t>(std::floor(exact + 1e-9));
  return static_cast<int32_t>(std::clamp<int64_t>(rounded, 1, std::max<int32_t>(n_seen, 1)));
}

std::string KvBudgetToString(const KvBudget& budget) {
  if (budget.is_fraction()) return fmt::format("{:g} of the context", budget.fraction);
  if (budget.is_by_length()) {
    std::string points;
    for (const auto& [length, f] : budget.by_length) points += fmt::format("{}{:g} at {}", points.empty() ? "" : ", ", f, length);
    return "of the context by length (" + points + ")";
  }
  return fmt::format("{} tokens", budget.tokens);
}

}  // namespace kvsparse
