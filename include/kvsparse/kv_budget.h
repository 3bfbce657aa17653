// A layer's KV budget: an absolute token count, or a fraction of the context.
//
// A fraction is taken of the tokens the sequence has seen so far (prompt + generated,
// n_seen), not of the model's maximum context: "budget": 0.2 keeps a fifth of what was
// read, so the kept set grows as generation proceeds. Sinks and recent windows count
// inside the budget.
#pragma once

#include <cstdint>
#include <string>

namespace kvsparse {

struct KvBudget {
  enum class Kind { kTokens, kFraction };
  Kind kind = Kind::kTokens;
  int32_t tokens = 0;     // kTokens: >= 1
  double fraction = 0.0;  // kFraction: in (0, 1]

  static KvBudget Tokens(int32_t n) { return {Kind::kTokens, n, 0.0}; }
  static KvBudget Fraction(double f) { return {Kind::kFraction, 0, f}; }
  bool is_fraction() const { return kind == Kind::kFraction; }
};

// Tokens allowed once n_seen tokens were processed. A fraction rounds down and is at least
// 1 (and at most n_seen); a token count is returned as is.
int32_t ResolveBudget(const KvBudget& budget, int32_t n_seen);

// "512 tokens" or "0.2 of the context".
std::string KvBudgetToString(const KvBudget& budget);

}  // namespace kvsparse
