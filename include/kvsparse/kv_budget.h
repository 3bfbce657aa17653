// A layer's KV budget: an absolute token count, a fraction of the context, or a fraction that
// depends on the context's length.
//
// A fraction is taken of the tokens the sequence has seen so far (prompt + generated,
// n_seen), not of the model's maximum context: "budget": 0.2 keeps a fifth of what was
// read, so the kept set grows as generation proceeds. Sinks and recent windows count
// inside the budget.
//
// A length-dependent budget ("budget_by_length": {"4096": 0.5, "32768": 0.1}) gives fractions at
// context lengths; between two lengths the fraction is interpolated linearly in log(length), and
// outside them the nearest one holds. The length is n_seen, so a request is compressed by its own
// length: a 4K prompt keeps half of it, a 32K prompt a tenth (longer contexts tolerate more
// sparsity; `kvsparse calibrate` fits the points).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvsparse {

struct KvBudget {
  enum class Kind { kTokens, kFraction, kByLength };
  Kind kind = Kind::kTokens;
  int32_t tokens = 0;     // kTokens: >= 1
  double fraction = 0.0;  // kFraction: in (0, 1]
  // kByLength: (context length >= 1, fraction in (0, 1]), lengths strictly ascending.
  std::vector<std::pair<int32_t, double>> by_length;

  static KvBudget Tokens(int32_t n) { return {Kind::kTokens, n, 0.0, {}}; }
  static KvBudget Fraction(double f) { return {Kind::kFraction, 0, f, {}}; }
  static KvBudget ByLength(std::vector<std::pair<int32_t, double>> points) {
    return {Kind::kByLength, 0, 0.0, std::move(points)};
  }
  bool is_fraction() const { return kind == Kind::kFraction; }
  bool is_tokens() const { return kind == Kind::kTokens; }
  bool is_by_length() const { return kind == Kind::kByLength; }
  // The fraction kept at n_seen tokens (kFraction, kByLength).
  double FractionAt(int32_t n_seen) const;
};

// Tokens allowed once n_seen tokens were processed. A fraction rounds down and is at least
// 1 (and at most n_seen); a token count is returned as is.
int32_t ResolveBudget(const KvBudget& budget, int32_t n_seen);

// "512 tokens" or "0.2 of the context".
std::string KvBudgetToString(const KvBudget& budget);

}  // namespace kvsparse
