#include "policy/selection.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsparse/status.h"

namespace kvsparse::policy {

int32_t RecentWindowTokens(const KvMethodParams& params, int32_t target) {
  const int64_t window = params.recent >= 0
                             ? params.recent
                             : static_cast<int64_t>(std::floor(params.recent_ratio * target + 1e-9));
  return static_cast<int32_t>(std::clamp<int64_t>(window, 0, std::max(target, 0)));
}

void KeepSinksRecentAndTop(const float* scores, int32_t n_live, int32_t target, int32_t n_sink, int32_t n_recent,
                           std::vector<int32_t>* scratch, std::vector<uint8_t>* keep) {
  KVS_CHECK(n_live >= 0 && target >= 0 && target <= n_live);
  keep->assign(n_live, 0);
  // The newest token comes first (the next step's attention needs it), then the sinks, then
  // the rest of the window: a tiny target keeps the real first tokens and shrinks the window.
  const int32_t newest = target > 0 ? 1 : 0;
  const int32_t sinks = std::clamp(n_sink, 0, target - newest);
  const int32_t recent = std::clamp(std::max(n_recent, newest), 0, target - sinks);
  for (int32_t t = 0; t < sinks; ++t) (*keep)[t] = 1;
  for (int32_t t = n_live - recent; t < n_live; ++t) (*keep)[t] = 1;

  const int32_t k = target - sinks - recent;
  if (k == 0) return;
  const int32_t begin = sinks, end = n_live - recent;  // candidates: [begin, end), end - begin >= k
  scratch->resize(end - begin);
  for (int32_t t = begin; t < end; ++t) (*scratch)[t - begin] = t;
  auto key = [scores](int32_t t) {
    const float s = scores[t];
    return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  };
  // Strict order: higher score first, then the newer token.
  auto better = [&key](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    return ka != kb ? ka > kb : a > b;
  };
  if (k < end - begin) std::nth_element(scratch->begin(), scratch->begin() + k, scratch->end(), better);
  for (int32_t i = 0; i < k; ++i) (*keep)[(*scratch)[i]] = 1;
}

void ReduceHeads(const float* values, int32_t n, int n_heads, HeadReduce reduce, float* out) {
  KVS_CHECK(n_heads > 0);
  for (int32_t t = 0; t < n; ++t) {
    const float* row = values + static_cast<size_t>(t) * n_heads;
    if (reduce == HeadReduce::kMean) {
      float sum = 0.f;
      for (int h = 0; h < n_heads; ++h) sum += row[h];
      out[t] = sum / static_cast<float>(n_heads);
    } else {
      float best = row[0];
      for (int h = 1; h < n_heads; ++h) best = std::max(best, row[h]);
      out[t] = best;
    }
  }
}

}  // namespace kvsparse::policy
