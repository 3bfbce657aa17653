// Conformance of the sparsity policies to their methods' rules (issue 10).
//
// "Conformance" here: one policy instance, driven exactly as the engine drives it (kv_policy.h
// "Call order": OnAppend, Observe, EvictionTarget, SelectKeep, OnEvict) over random keys and
// queries, keeps at every eviction point exactly the set that a plainly written implementation of
// its method's rule keeps. That reference lives in this file and never calls the policy: it
// recomputes the kept set from the history of what happened (every observed query's attention
// probabilities, by token position, and the keys), following the rules written above each
// Reference* function (the project's definition of each method; see each method's file).
//
// The simulator computes attention itself (double softmax, query heads folded per KV head by the
// mean, causal: a query sees the live tokens at positions up to its own, its chunk's tokens
// included) and hands the policy the observation the kernel would build (sum_all, last,
// window_rows of the call's last min(ObservationWindow(), n_queries) queries).
// Covered: H2O, TOVA, Scissorhands, SnapKV, PyramidKV, KNorm, StreamingLLM; shared layers (one
// policy, 2 KV heads) and per-head layers (one policy per KV head, 1-head observations); 2 query
// heads per KV head; prompts of ragged chunkings followed by decode steps; eviction after every
// prompt chunk and at the prompt's end only (PrefillEviction::kPromptEnd); token and fraction
// budgets around the windows. Every method here is chunk-size independent with prompt-end
// eviction: the kept sets after the prompt and after each decode step must not depend on how the
// prompt was chunked.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/kv_budget.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"

namespace kvsparse {
namespace {

constexpr int kKvHeads = 2;
constexpr int kGroup = 2;  // query heads per KV head (GQA)
constexpr int kQHeads = kKvHeads * kGroup;
constexpr int kHeadDim = 8;

// ---------------------------------------------------------------------------------------------
// Inputs: one key and one query per token position.

struct Inputs {
  std::vector<float> keys;     // [n_tokens, kKvHeads, kHeadDim] by position
  std::vector<float> queries;  // [n_tokens, kQHeads, kHeadDim]; query head q reads KV head q / kGroup
  const float* key(int32_t pos, int h) const {
    return keys.data() + (static_cast<size_t>(pos) * kKvHeads + h) * kHeadDim;
  }
  const float* query(int32_t pos, int qh) const {
    return queries.data() + (static_cast<size_t>(pos) * kQHeads + qh) * kHeadDim;
  }
};

constexpr int32_t kMaxTokens = 64;  // positions a case may use (prompt + decode)

Inputs RandomInputs(uint32_t seed, int32_t n_tokens = kMaxTokens) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> length(0.5f, 2.f);  // varied key norms: KNorm has something to rank
  Inputs in;
  for (int32_t t = 0; t < n_tokens * kKvHeads; ++t) {
    const float scale = length(rng);
    for (int d = 0; d < kHeadDim; ++d) in.keys.push_back(scale * normal(rng));
  }
  for (int32_t i = 0; i < n_tokens * kQHeads * kHeadDim; ++i) in.queries.push_back(1.5f * normal(rng));
  return in;
}

// The inputs of `seed`, generated once.
const Inputs& SeedInputs(uint32_t seed) {
  static std::map<uint32_t, Inputs> cache;
  auto it = cache.find(seed);
  if (it == cache.end()) it = cache.emplace(seed, RandomInputs(seed)).first;
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// A case: one layer's configuration, a prompt chunking, the decode steps, a seed.

struct Case {
  LayerKvConfig config;        // method, budget, params, per_head
  int layer = 0, n_layers = 1;
  bool prompt_end = false;     // PrefillEviction::kPromptEnd: no eviction after non-last chunks
  std::vector<int32_t> chunks;  // the prompt's chunk sizes
  int32_t n_decode = 6;        // decode steps of one token after the prompt
  uint32_t seed = 1;
};

std::string Describe(const Case& c) {
  const KvMethodParams& p = c.config.params;
  return fmt::format(
      "{} ({}) budget {} | n_sink {} recent {} recent_ratio {} head_reduce {} history {} window {} kernel {} "
      "pooling {} decode_evict {} beta {} dense_layers {} | layer {}/{} | {} | chunks [{}] + {} decode | seed {}",
      KvMethodName(c.config.method), c.config.per_head ? "per-head" : "shared", KvBudgetToString(c.config.budget),
      p.n_sink, p.recent, p.recent_ratio, HeadReduceName(p.head_reduce), p.history_window, p.obs_window, p.kernel,
      VotePoolingName(p.pooling), p.decode_evict, p.beta, p.dense_layers, c.layer, c.n_layers,
      c.prompt_end ? "prompt-end eviction" : "every-chunk eviction", fmt::join(c.chunks, ","), c.n_decode, c.seed);
}

// The tokens one policy manages: every KV head on a shared layer, one head on a per-head layer.
struct Table {
  std::vector<int> heads;  // KV heads held
  std::unique_ptr<KvPolicy> policy;
  std::vector<int32_t> live;  // positions, ascending (the cache's live list)

  // What the reference remembers of every observed query (oldest first): how many live tokens it
  // saw (Scissorhands' t), and its probability for the token at each position, folded over the
  // query heads; -1 where it saw no token (not yet appended, already evicted, or after the query).
  std::vector<int32_t> n_visible;  // [n_observed]
  std::vector<float> probs;        // [n_observed, heads, kMaxTokens]
  size_t n_observed() const { return n_visible.size(); }
  float p(size_t query, size_t head, int32_t position) const {
    return probs[(query * heads.size() + head) * kMaxTokens + position];
  }
};

// ---------------------------------------------------------------------------------------------
// The references. Each returns the kept positions (ascending) of t.live for `target`.

// One value per KV head of a table (1 or kKvHeads of them).
struct PerHead {
  PerHead(size_t n_heads, double init) : n(n_heads) { std::fill(v, v + n, init); }
  double& operator[](size_t h) { return v[h]; }
  double v[kKvHeads];
  size_t n;
};

// A token's per-head values as one score: their mean, or their max.
double Fold(const PerHead& per_head, HeadReduce reduce) {
  double out = reduce == HeadReduce::kMean ? 0.0 : -std::numeric_limits<double>::infinity();
  for (size_t h = 0; h < per_head.n; ++h)
    out = reduce == HeadReduce::kMean ? out + per_head.v[h] / per_head.n : std::max(out, per_head.v[h]);
  return out;
}

// The best `k` of the live indices [begin, end) by score (higher first, NaN lowest; ties: newer).
std::vector<int32_t> Best(const std::vector<double>& score, int32_t begin, int32_t end, int32_t k) {
  std::vector<int32_t> order;
  for (int32_t i = begin; i < end; ++i) order.push_back(i);
  auto key = [&](int32_t i) { return std::isnan(score[i]) ? -std::numeric_limits<double>::infinity() : score[i]; };
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key(a) != key(b) ? key(a) > key(b) : a > b; });
  order.resize(k);
  return order;
}

std::vector<int32_t> Positions(const std::vector<int32_t>& live, const std::vector<bool>& keep) {
  std::vector<int32_t> kept;
  for (size_t i = 0; i < live.size(); ++i)
    if (keep[i]) kept.push_back(live[i]);
  return kept;
}

// The common rule (H2O, TOVA, Scissorhands, KNorm): the newest live token (target >= 1), then
// the first min(n_sink, target - 1) tokens, then the recent window (`recent` tokens, else
// floor(recent_ratio * target + 1e-9); at least the newest, at most what the sinks leave), then
// the highest-scored tokens between sinks and window.
std::vector<int32_t> KeepCommon(const std::vector<int32_t>& live, const std::vector<double>& score, int32_t target,
                                const KvMethodParams& p) {
  const int32_t n = static_cast<int32_t>(live.size());
  std::vector<bool> keep(n, false);
  if (target == 0) return {};
  const int32_t sinks = std::min(p.n_sink, target - 1);
  const int32_t wanted = p.recent >= 0 ? p.recent : static_cast<int32_t>(std::floor(p.recent_ratio * target + 1e-9));
  const int32_t window = std::min(std::max(wanted, 1), target - sinks);
  for (int32_t i = 0; i < sinks; ++i) keep[i] = true;
  for (int32_t i = n - window; i < n; ++i) keep[i] = true;
  for (int32_t i : Best(score, sinks, n - window, target - sinks - window)) keep[i] = true;
  return Positions(live, keep);
}

// H2O: a token's score per head is the sum of the probabilities every query that saw it gave it
// (prompt and decode queries alike), folded over the heads.
std::vector<int32_t> ReferenceH2O(const Table& t, int32_t target, const KvMethodParams& p) {
  std::vector<double> score;
  for (int32_t pos : t.live) {
    PerHead per_head(t.heads.size(), 0.0);
    for (size_t q = 0; q < t.n_observed(); ++q)
      for (size_t h = 0; h < t.heads.size(); ++h)
        if (t.p(q, h, pos) >= 0) per_head[h] += t.p(q, h, pos);
    score.push_back(Fold(per_head, p.head_reduce));
  }
  return KeepCommon(t.live, score, target, p);
}

// TOVA: a token's score is the probability the latest observed query gave it, folded over the
// heads; a token that query did not see scores +inf.
std::vector<int32_t> ReferenceTova(const Table& t, int32_t target, const KvMethodParams& p) {
  std::vector<double> score;
  for (int32_t pos : t.live) {
    PerHead per_head(t.heads.size(), std::numeric_limits<double>::infinity());
    if (t.n_observed() > 0)
      for (size_t h = 0; h < t.heads.size(); ++h) {
        const float v = t.p(t.n_observed() - 1, h, pos);
        if (v >= 0) per_head[h] = v;
      }
    score.push_back(Fold(per_head, p.head_reduce));
  }
  return KeepCommon(t.live, score, target, p);
}

// Scissorhands: per head, count the latest history_window queries (over all calls) that saw the
// token and gave it less than 1 / (the live tokens they saw); score = minus that count, folded
// over the heads (mean of -count, or max = minus the fewest).
std::vector<int32_t> ReferenceScissorhands(const Table& t, int32_t target, const KvMethodParams& p) {
  const size_t n_history = t.n_observed();
  const size_t from = n_history - std::min<size_t>(n_history, p.history_window);
  std::vector<double> score;
  for (int32_t pos : t.live) {
    PerHead per_head(t.heads.size(), 0.0);
    for (size_t q = from; q < n_history; ++q)
      for (size_t h = 0; h < t.heads.size(); ++h) {
        const float v = t.p(q, h, pos);
        if (v >= 0 && v < 1.0 / t.n_visible[q]) per_head[h] -= 1.0;
      }
    score.push_back(Fold(per_head, p.head_reduce));
  }
  return KeepCommon(t.live, score, target, p);
}

// SnapKV (and PyramidKV): window w' = obs_window when target > obs_window, else max(1, target / 2).
// Per head, votes(token) = Σ over the latest w' observed queries (across calls) of p(query, token);
// the candidates are the live tokens before the last w'; the votes are pooled over the candidate
// list (max, or sum / kernel, over the kernel neighbours centred on the token, clipped to the
// candidates), then folded over the heads. Kept: the last w' tokens + the best target - w'
// candidates (ties: newer).
std::vector<int32_t> ReferenceSnapKv(const Table& t, int32_t target, const KvMethodParams& p) {
  const int32_t n = static_cast<int32_t>(t.live.size());
  const int32_t window = target > p.obs_window ? p.obs_window : std::max(1, target / 2);
  const int32_t n_cand = n - window;
  const size_t n_history = t.n_observed();
  const size_t from = n_history - std::min<size_t>(n_history, window);
  std::vector<std::vector<double>> pooled(t.heads.size(), std::vector<double>(n_cand));  // [heads, n_cand]
  for (size_t h = 0; h < t.heads.size(); ++h) {
    std::vector<double> votes(n_cand, 0.0);  // [n_cand]
    for (int32_t i = 0; i < n_cand; ++i)
      for (size_t q = from; q < n_history; ++q) {
        const float v = t.p(q, h, t.live[i]);
        if (v >= 0) votes[i] += v;
      }
    const int32_t radius = p.kernel / 2;
    for (int32_t i = 0; i < n_cand; ++i) {
      double best = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int32_t j = std::max(0, i - radius); j <= std::min(n_cand - 1, i + radius); ++j) {
        best = std::max(best, votes[j]);
        sum += votes[j];
      }
      pooled[h][i] = p.pooling == VotePooling::kMax ? best : sum / p.kernel;
    }
  }
  std::vector<double> score(n, 0.0);
  for (int32_t i = 0; i < n_cand; ++i) {
    PerHead per_head(t.heads.size(), 0.0);
    for (size_t h = 0; h < t.heads.size(); ++h) per_head[h] = pooled[h][i];
    score[i] = Fold(per_head, p.head_reduce);
  }
  std::vector<bool> keep(n, false);
  for (int32_t i = n_cand; i < n; ++i) keep[i] = true;
  for (int32_t i : Best(score, 0, n_cand, target - window)) keep[i] = true;
  return Positions(t.live, keep);
}

// KNorm: score = minus the key's L2 norm per head, folded over the heads; the common rule.
std::vector<int32_t> ReferenceKNorm(const Table& t, const Inputs& in, int32_t target, const KvMethodParams& p) {
  std::vector<double> score;
  for (int32_t pos : t.live) {
    PerHead per_head(t.heads.size(), 0.0);
    for (size_t h = 0; h < t.heads.size(); ++h) {
      const float* k = in.key(pos, t.heads[h]);
      double sq = 0.0;
      for (int d = 0; d < kHeadDim; ++d) sq += static_cast<double>(k[d]) * k[d];
      per_head[h] = -std::sqrt(sq);
    }
    score.push_back(Fold(per_head, p.head_reduce));
  }
  return KeepCommon(t.live, score, target, p);
}

// StreamingLLM: the first min(n_sink, target - 1) live tokens and the newest target - sinks.
std::vector<int32_t> ReferenceStreamingLlm(const Table& t, int32_t target, const KvMethodParams& p) {
  const int32_t n = static_cast<int32_t>(t.live.size());
  const int32_t sinks = std::max(0, std::min(p.n_sink, target - 1));
  std::vector<bool> keep(n, false);
  for (int32_t i = 0; i < sinks; ++i) keep[i] = true;
  for (int32_t i = n - (target - sinks); i < n; ++i) keep[i] = true;
  return Positions(t.live, keep);
}

// PyramidKV's per-layer budgets, from pyramidkv.cc's description: S = C - W above the window W;
// the first layer gets 2S - S/beta, the last S/beta, linearly in between; when the first would
// exceed what n tokens fill (n - W) it is clamped to n - W and the last raised to 2S - (n - W).
// Shares are floored and the remainder (up to n_layers * S) handed to the first layers that have
// room (share + 1 <= n - W). Every layer gets C when there is one layer, S <= 0, n <= C or n < 2S.
// *whole_share (optional): some layer's share on a sloped line is a whole number (see
// PyramidBudgetsFloorWholeShares).
std::vector<int32_t> ReferencePyramidBudgets(int n_layers, int32_t average, int32_t window, double beta, int32_t n,
                                             bool* whole_share = nullptr) {
  if (whole_share) *whole_share = false;
  std::vector<int32_t> budgets(n_layers, average);
  const int64_t share = static_cast<int64_t>(average) - window;
  if (n_layers == 1 || share <= 0 || n <= average || n < 2 * share) return budgets;
  const double room = static_cast<double>(n) - window;
  double first = 2.0 * share - share / beta, last = share / beta;
  if (first > room) {
    first = room;
    last = 2.0 * share - room;
  }
  std::vector<int64_t> shares(n_layers);
  int64_t total = 0;
  for (int l = 0; l < n_layers; ++l) {
    // The exact value's floor: 1e-9 absorbs the rounding of values that are whole numbers.
    const double value = first + (last - first) * l / (n_layers - 1);
    shares[l] = static_cast<int64_t>(std::floor(value + 1e-9));
    total += shares[l];
    if (whole_share && first != last && std::fabs(value - std::round(value)) < 1e-9) *whole_share = true;
  }
  int64_t remainder = share * n_layers - total;
  for (int l = 0; l < n_layers && remainder > 0; ++l)
    if (shares[l] + 1 <= room) ++shares[l], --remainder;
  for (int l = n_layers - 1; l >= 0 && remainder < 0; --l) shares[l] = std::max<int64_t>(shares[l] - 1, 0), ++remainder;
  for (int l = 0; l < n_layers; ++l) budgets[l] = static_cast<int32_t>(window + shares[l]);
  return budgets;
}

// The layer's budget after n_seen tokens: a fraction rounds down (>= 1, <= n_seen); PyramidKV
// then splits it over the layers.
int32_t ReferenceBudget(const Case& c, int32_t n_seen) {
  const KvBudget& b = c.config.budget;
  int32_t budget = b.tokens;
  if (b.is_fraction())
    budget = std::clamp(static_cast<int32_t>(std::floor(b.fraction * n_seen + 1e-9)), 1, std::max(n_seen, 1));
  if (c.config.method == KvMethod::kPyramidKv)
    budget = ReferencePyramidBudgets(c.n_layers, budget, c.config.params.obs_window, c.config.params.beta, n_seen)[c.layer];
  return budget;
}

// Tokens to keep: everything while within budget; SnapKV, PyramidKV and KNorm keep generated
// tokens unless decode_evict; otherwise the budget (evict_interval 1).
int32_t ReferenceTarget(const Case& c, int32_t n_live, int32_t n_seen, EvictionPoint point) {
  const int32_t budget = ReferenceBudget(c, n_seen);
  const KvMethod m = c.config.method;
  const bool prompt_only = m == KvMethod::kSnapKv || m == KvMethod::kPyramidKv || m == KvMethod::kKNorm;
  if (n_live <= budget) return n_live;
  if (point == EvictionPoint::kDecodeStep && prompt_only && !c.config.params.decode_evict) return n_live;
  return budget;
}

std::vector<int32_t> ReferenceKeep(const Case& c, const Table& t, const Inputs& in, int32_t target) {
  const KvMethodParams& p = c.config.params;
  switch (c.config.method) {
    case KvMethod::kH2O: return ReferenceH2O(t, target, p);
    case KvMethod::kTova: return ReferenceTova(t, target, p);
    case KvMethod::kScissorhands: return ReferenceScissorhands(t, target, p);
    case KvMethod::kSnapKv:
    case KvMethod::kPyramidKv: return ReferenceSnapKv(t, target, p);
    case KvMethod::kKNorm: return ReferenceKNorm(t, in, target, p);
    case KvMethod::kStreamingLlm: return ReferenceStreamingLlm(t, target, p);
    default: ADD_FAILURE() << "no reference for " << KvMethodName(c.config.method); return {};
  }
}

// ---------------------------------------------------------------------------------------------
// The simulator.

// Attention of the call's queries (positions first .. first + n_q - 1) over t's live tokens,
// recorded for the reference (t->n_visible, t->probs), and the observation the kernel would build, given to the policy.
void ObserveCall(const Inputs& in, int32_t first, int32_t n_q, Table* t) {
  const int n_heads = static_cast<int>(t->heads.size());
  const int32_t n = static_cast<int32_t>(t->live.size());
  std::vector<double> rows(static_cast<size_t>(n_q) * n_heads * n, 0.0);  // [n_q, n_heads, n]; 0 = unseen
  std::vector<double> logits(n);                                          // [n]
  for (int32_t q = 0; q < n_q; ++q) {
    const int32_t position = first + q;
    int32_t visible = 0;  // live tokens at positions <= the query's (the live list ascends)
    while (visible < n && t->live[visible] <= position) ++visible;
    t->n_visible.push_back(visible);
    const size_t record = t->probs.size();  // [n_heads, kMaxTokens]
    t->probs.resize(record + static_cast<size_t>(n_heads) * kMaxTokens, -1.f);
    for (int hi = 0; hi < n_heads; ++hi) {
      const int h = t->heads[hi];
      double* row = rows.data() + (static_cast<size_t>(q) * n_heads + hi) * n;  // [n]
      for (int g = 0; g < kGroup; ++g) {
        const float* qv = in.query(position, h * kGroup + g);
        double max_logit = -std::numeric_limits<double>::infinity(), sum = 0.0;
        for (int32_t i = 0; i < visible; ++i) {
          double dot = 0.0;
          for (int d = 0; d < kHeadDim; ++d) dot += static_cast<double>(qv[d]) * in.key(t->live[i], h)[d];
          logits[i] = dot / std::sqrt(static_cast<double>(kHeadDim));
          max_logit = std::max(max_logit, logits[i]);
        }
        for (int32_t i = 0; i < visible; ++i) sum += logits[i] = std::exp(logits[i] - max_logit);
        for (int32_t i = 0; i < visible; ++i) row[i] += logits[i] / sum / kGroup;  // mean over the group
      }
      for (int32_t i = 0; i < visible; ++i)
        t->probs[record + static_cast<size_t>(hi) * kMaxTokens + t->live[i]] = static_cast<float>(row[i]);
    }
  }

  // The fields the policy asks for (kv_policy.h): [n_heads, n] each; window_rows [n_window, n_heads, n].
  const uint32_t needed = t->policy->NeededObservations();
  const int32_t n_window = std::min(t->policy->ObservationWindow(), n_q);
  const size_t plane = static_cast<size_t>(n_heads) * n;
  std::vector<int32_t> query_positions(n_q);
  for (int32_t q = 0; q < n_q; ++q) query_positions[q] = first + q;
  std::vector<float> sum_all, sum_window, last, window_rows;
  if (needed & kObserveSumAll) {
    std::vector<double> sum(plane, 0.0);
    for (int32_t q = 0; q < n_q; ++q)
      for (size_t e = 0; e < plane; ++e) sum[e] += rows[q * plane + e];
    sum_all.assign(sum.begin(), sum.end());
  }
  if ((needed & kObserveSumWindow) && n_window > 0) {
    std::vector<double> sum(plane, 0.0);
    for (int32_t q = n_q - n_window; q < n_q; ++q)
      for (size_t e = 0; e < plane; ++e) sum[e] += rows[q * plane + e];
    sum_window.assign(sum.begin(), sum.end());
  }
  if (needed & kObserveLast) last.assign(rows.end() - plane, rows.end());
  if ((needed & kObserveWindowRows) && n_window > 0) window_rows.assign(rows.end() - n_window * plane, rows.end());

  AttentionObservation obs;
  obs.n_queries = n_q;
  obs.n_tokens = n;
  obs.n_kv_heads = n_heads;
  obs.query_positions = query_positions.data();
  obs.sum_all = sum_all.empty() ? nullptr : sum_all.data();
  obs.sum_window = sum_window.empty() ? nullptr : sum_window.data();
  obs.last = last.empty() ? nullptr : last.data();
  if (!window_rows.empty()) {
    obs.n_window = n_window;
    obs.window_rows = window_rows.data();
  }
  t->policy->Observe(obs);
}

struct RunResult {
  bool ok = true;
  int evictions = 0;  // selections compared with the reference
  // [table][after the prompt, after each decode step] the live positions.
  std::vector<std::vector<std::vector<int32_t>>> checkpoints;
};

const char* PointName(EvictionPoint point) {
  switch (point) {
    case EvictionPoint::kPrefillChunk: return "prefill chunk";
    case EvictionPoint::kPromptEnd: return "prompt end";
    case EvictionPoint::kDecodeStep: return "decode step";
  }
  return "?";
}

// Step 3 of the call order on one table, checked against the reference. False on a mismatch.
bool EvictAndCheck(const Case& c, const Inputs& in, EvictionPoint point, int32_t n_seen, Table* t, RunResult* result) {
  const int32_t n_live = static_cast<int32_t>(t->live.size());
  const int32_t target = t->policy->EvictionTarget(n_live, n_seen, point, /*evict_interval=*/1);
  auto where = [&] {
    return fmt::format("{}\n  kv heads [{}], {} after {} tokens seen, {} live, target {}", Describe(c),
                       fmt::join(t->heads, ","), PointName(point), n_seen, n_live, target);
  };
  const int32_t expected_target = ReferenceTarget(c, n_live, n_seen, point);
  if (target != expected_target) {
    ADD_FAILURE() << where() << ": expected target " << expected_target;
    return false;
  }
  if (target >= n_live) return true;

  // Keys of the live tokens in live order (KNorm reads them), split into two spans as pages would be.
  std::vector<float> keys;  // [n_live, n_heads, kHeadDim]
  for (int32_t pos : t->live)
    for (int h : t->heads) keys.insert(keys.end(), in.key(pos, h), in.key(pos, h) + kHeadDim);
  const size_t row = t->heads.size() * kHeadDim;
  const int32_t split = n_live / 2;
  KvSpan spans[2];
  spans[0].k = spans[0].v = keys.data();
  spans[0].positions = t->live.data();
  spans[0].n = split;
  spans[1].k = spans[1].v = keys.data() + split * row;
  spans[1].positions = t->live.data() + split;
  spans[1].n = n_live - split;

  SelectionContext ctx;
  ctx.layer = c.layer;
  ctx.n_live = n_live;
  ctx.target = target;
  ctx.positions = t->live.data();
  ctx.current_position = t->live.back();
  ctx.in_prefill = point != EvictionPoint::kDecodeStep;
  ctx.spans = spans;
  ctx.n_spans = 2;
  ctx.storage = KvStorage::kF32;
  ctx.n_kv_heads = static_cast<int>(t->heads.size());
  ctx.head_dim = kHeadDim;
  std::vector<uint8_t> keep;
  t->policy->SelectKeep(ctx, &keep);
  if (keep.size() != static_cast<size_t>(n_live)) {
    ADD_FAILURE() << where() << ": keep mask of size " << keep.size();
    return false;
  }
  std::vector<int32_t> got;
  for (int32_t i = 0; i < n_live; ++i)
    if (keep[i]) got.push_back(t->live[i]);
  const std::vector<int32_t> want = ReferenceKeep(c, *t, in, target);
  ++result->evictions;
  if (got != want) {
    ADD_FAILURE() << where() << "\n  expected [" << fmt::format("{}", fmt::join(want, ",")) << "]\n  got      ["
                  << fmt::format("{}", fmt::join(got, ",")) << "]";
    return false;
  }
  t->live = got;
  t->policy->OnEvict(keep);
  return true;
}

// Drives one policy per table through the prompt's chunks and the decode steps as the engine does.
RunResult Run(const Case& c) {
  RunResult result;
  int32_t n_prompt = 0;
  for (int32_t chunk : c.chunks) n_prompt += chunk;
  const int32_t n_total = n_prompt + c.n_decode;
  if (n_total > kMaxTokens) {
    ADD_FAILURE() << Describe(c) << ": more than " << kMaxTokens << " tokens";
    result.ok = false;
    return result;
  }
  const Inputs& in = SeedInputs(c.seed);

  std::vector<Table> tables(c.config.per_head ? kKvHeads : 1);
  for (size_t i = 0; i < tables.size(); ++i) {
    if (c.config.per_head) {
      tables[i].heads = {static_cast<int>(i)};
    } else {
      for (int h = 0; h < kKvHeads; ++h) tables[i].heads.push_back(h);
    }
    auto created = CreatePolicy(c.config, c.layer, c.n_layers, c.seed);
    if (!created.ok()) {
      ADD_FAILURE() << Describe(c) << ": " << created.status().ToString();
      result.ok = false;
      return result;
    }
    tables[i].policy = std::move(created).value();
    tables[i].n_visible.reserve(n_total);
    tables[i].probs.reserve(static_cast<size_t>(n_total) * tables[i].heads.size() * kMaxTokens);
  }
  result.checkpoints.resize(tables.size());

  std::vector<int32_t> calls = c.chunks;  // tokens per forward call: the chunks, then decode steps
  calls.insert(calls.end(), c.n_decode, 1);
  int32_t n_seen = 0;
  for (size_t k = 0; k < calls.size(); ++k) {
    const bool decode = k >= c.chunks.size();
    const EvictionPoint point = decode                       ? EvictionPoint::kDecodeStep
                                : k + 1 == c.chunks.size() ? EvictionPoint::kPromptEnd
                                                           : EvictionPoint::kPrefillChunk;
    const int32_t first = n_seen, n_q = calls[k];
    n_seen += n_q;
    for (Table& t : tables) {
      for (int32_t pos = first; pos < n_seen; ++pos) t.live.push_back(pos);  // 1. append
      t.policy->OnAppend(n_q);
      if (t.policy->NeedsAttention() && (!decode || t.policy->ObservesDecode()))  // 2. attention
        ObserveCall(in, first, n_q, &t);
      if (point == EvictionPoint::kPrefillChunk && c.prompt_end) continue;  // 3. eviction
      if (!EvictAndCheck(c, in, point, n_seen, &t, &result)) {
        result.ok = false;
        return result;
      }
    }
    if (k + 1 >= c.chunks.size())
      for (size_t i = 0; i < tables.size(); ++i) result.checkpoints[i].push_back(tables[i].live);
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// The sweep shared by the methods.

// Two prompts, each in several ragged chunkings.
const std::vector<std::vector<std::vector<int32_t>>> kPrompts = {
    {{40}, {17, 23}, {5, 30, 5}, {39, 1}, {8, 8, 8, 8, 8}},
    {{23}, {1, 22}, {7, 7, 9}, {22, 1}},
};
const uint32_t kSeeds[] = {101, 202};

struct Tally {
  int runs = 0, evictions = 0;
};

// Runs `base` for both layouts, every seed, prompt, chunking and prefill mode: the policy must keep
// the reference's set at every eviction point, and with prompt-end eviction the same sets (after
// the prompt and after each decode step) for every chunking of a prompt.
void Sweep(Case base, Tally* tally, bool both_layouts = true) {
  std::vector<bool> layouts = {base.config.per_head};
  if (both_layouts) layouts = {false, true};
  for (bool per_head : layouts) {
    base.config.per_head = per_head;
    for (uint32_t seed : kSeeds)
      for (const auto& chunkings : kPrompts) {
        std::vector<std::vector<std::vector<int32_t>>> first_kept;  // prompt-end checkpoints of `first_chunks`
        std::vector<int32_t> first_chunks;
        for (const auto& chunks : chunkings)
          for (bool prompt_end : {false, true}) {
            Case c = base;
            c.seed = seed;
            c.chunks = chunks;
            c.prompt_end = prompt_end;
            const RunResult r = Run(c);
            ++tally->runs;
            tally->evictions += r.evictions;
            if (!r.ok || !prompt_end) continue;
            if (first_kept.empty()) {
              first_kept = r.checkpoints;
              first_chunks = chunks;
            } else if (r.checkpoints != first_kept) {
              ADD_FAILURE() << Describe(c) << "\n  kept sets depend on the chunking: differ from chunks ["
                            << fmt::format("{}", fmt::join(first_chunks, ",")) << "]";
            }
          }
      }
  }
}

Case Base(KvMethod method, KvBudget budget) {
  Case c;
  c.config.method = method;
  c.config.budget = budget;
  c.config.params = DefaultMethodParams(method);
  c.config.per_head = DefaultPerHead(method);
  return c;
}

void Report(const char* what, const Tally& tally) {
  std::printf("[ conformance ] %s: %d runs, %d selections compared\n", what, tally.runs, tally.evictions);
  EXPECT_GT(tally.evictions, 0);
}

// Budgets around the recent windows and small prompts: 1 (the newest only), tiny, middle, most of
// the prompt, and fractions of the tokens seen.
const KvBudget kBudgets[] = {KvBudget::Tokens(1), KvBudget::Tokens(3), KvBudget::Tokens(8), KvBudget::Tokens(17),
                             KvBudget::Fraction(0.2), KvBudget::Fraction(0.5)};

// ---------------------------------------------------------------------------------------------

TEST(ConformanceTest, H2O) {
  Tally tally;
  for (const KvBudget& budget : kBudgets) {
    Sweep(Base(KvMethod::kH2O, budget), &tally);
    Case sinks = Base(KvMethod::kH2O, budget);  // sinks and a fixed window
    sinks.config.params.n_sink = std::min(2, std::max(budget.tokens - 2, 0));
    sinks.config.params.recent = budget.is_fraction() ? 2 : std::min(2, budget.tokens - sinks.config.params.n_sink);
    Sweep(sinks, &tally);
  }
  Case max = Base(KvMethod::kH2O, KvBudget::Tokens(9));
  max.config.params.head_reduce = HeadReduce::kMax;
  max.config.per_head = false;
  Sweep(max, &tally, /*both_layouts=*/false);
  Report("h2o", tally);
}

TEST(ConformanceTest, Tova) {
  Tally tally;
  for (const KvBudget& budget : kBudgets) Sweep(Base(KvMethod::kTova, budget), &tally);
  Case window = Base(KvMethod::kTova, KvBudget::Tokens(10));
  window.config.params.n_sink = 1;
  window.config.params.recent = 3;
  Sweep(window, &tally);
  Case max = Base(KvMethod::kTova, KvBudget::Fraction(0.3));
  max.config.params.head_reduce = HeadReduce::kMax;
  Sweep(max, &tally, false);
  Report("tova", tally);
}

TEST(ConformanceTest, Scissorhands) {
  Tally tally;
  for (const KvBudget& budget : kBudgets)
    for (int32_t history : {6, 32}) {
      Case c = Base(KvMethod::kScissorhands, budget);
      c.config.params.history_window = history;
      Sweep(c, &tally);
    }
  Case sinks = Base(KvMethod::kScissorhands, KvBudget::Tokens(12));
  sinks.config.params.history_window = 5;
  sinks.config.params.n_sink = 2;
  sinks.config.params.recent_ratio = 0.3;
  Sweep(sinks, &tally);
  Case max = Base(KvMethod::kScissorhands, KvBudget::Tokens(9));
  max.config.params.history_window = 7;
  max.config.params.head_reduce = HeadReduce::kMax;
  Sweep(max, &tally, false);
  Report("scissorhands", tally);
}

TEST(ConformanceTest, SnapKv) {
  Tally tally;
  // Window 8: token budgets just above it; fractions 0.175 / 0.2 / 0.225 of 40 tokens give 7 / 8 / 9
  // (below, equal to, just above the window; of 23 tokens: 4 / 4 / 5).
  const KvBudget budgets[] = {KvBudget::Tokens(9),      KvBudget::Tokens(10),    KvBudget::Tokens(16),
                              KvBudget::Fraction(0.175), KvBudget::Fraction(0.2), KvBudget::Fraction(0.225),
                              KvBudget::Fraction(0.5)};
  for (const KvBudget& budget : budgets)
    for (bool decode_evict : {false, true}) {
      Case c = Base(KvMethod::kSnapKv, budget);
      c.config.params.obs_window = 8;
      c.config.params.decode_evict = decode_evict;
      Sweep(c, &tally);
    }
  for (int kernel : {1, 3})
    for (VotePooling pooling : {VotePooling::kMax, VotePooling::kAvg}) {
      Case c = Base(KvMethod::kSnapKv, KvBudget::Tokens(11));
      c.config.params.obs_window = 5;
      c.config.params.kernel = kernel;
      c.config.params.pooling = pooling;
      c.config.params.decode_evict = true;
      Sweep(c, &tally);
    }
  Case defaults = Base(KvMethod::kSnapKv, KvBudget::Tokens(34));  // window 32, kernel 7
  Sweep(defaults, &tally);
  Case max = Base(KvMethod::kSnapKv, KvBudget::Tokens(12));
  max.config.params.obs_window = 4;
  max.config.params.head_reduce = HeadReduce::kMax;
  max.config.per_head = false;
  Sweep(max, &tally, false);
  Report("snapkv", tally);
}

TEST(ConformanceTest, PyramidKv) {
  Tally tally;
  // Window 8 (the default): layer budgets of 4 layers with C = 16 over 40 tokens are 24, 19, 13, 8
  // (the last equal to the window), with C = 12: 16, 13, 10, 9 (uniform 12 for the 23-token prompt).
  for (const KvBudget& budget : {KvBudget::Tokens(12), KvBudget::Tokens(16), KvBudget::Fraction(0.4)})
    for (int layer = 0; layer < 4; ++layer) {
      Case c = Base(KvMethod::kPyramidKv, budget);
      c.layer = layer;
      c.n_layers = 4;
      Sweep(c, &tally);
    }
  for (int layer : {0, 2, 4}) {
    Case c = Base(KvMethod::kPyramidKv, KvBudget::Tokens(10));
    c.config.params.obs_window = 4;
    c.config.params.beta = 5.0;
    c.config.params.decode_evict = true;
    c.layer = layer;
    c.n_layers = 5;
    Sweep(c, &tally);
  }
  Report("pyramidkv", tally);
}

TEST(ConformanceTest, PyramidBudgetsFollowTheFormula) {
  int checked = 0, failures = 0, whole = 0;
  for (int n_layers : {1, 2, 3, 4, 5, 8, 24})
    for (int32_t window : {1, 4, 8, 16})
      for (int32_t average = 1; average <= 48; ++average)
        for (double beta : {1.0, 1.5, 3.0, 20.0})
          for (int32_t n_seen : {1, 2, 5, 10, 15, 16, 17, 20, 24, 31, 32, 33, 40, 47, 48, 50, 64, 80, 96, 100, 200,
                                 INT32_MAX}) {
            bool whole_share = false;
            const std::vector<int32_t> want =
                ReferencePyramidBudgets(n_layers, average, window, beta, n_seen, &whole_share);
            // The description's promises: the mean is kept, budgets never grow with depth.
            int64_t sum = 0;
            for (int32_t b : want) sum += b;
            EXPECT_EQ(sum, static_cast<int64_t>(average) * n_layers);
            EXPECT_TRUE(std::is_sorted(want.rbegin(), want.rend()));
            whole += whole_share;
            std::vector<int32_t> got(n_layers);
            for (int l = 0; l < n_layers; ++l) got[l] = PyramidLayerBudget(l, n_layers, average, window, beta, n_seen);
            ++checked;
            if ((got != want || PyramidBudgets(n_layers, average, window, beta, n_seen) != got) && ++failures <= 10)
              ADD_FAILURE() << fmt::format("PyramidLayerBudget(l, n_layers {}, average {}, window {}, beta {}, n_seen {}) "
                                           "over l: expected [{}], got [{}]",
                                           n_layers, average, window, beta, n_seen, fmt::join(want, ","),
                                           fmt::join(got, ","));
          }
  EXPECT_EQ(failures, 0) << "of " << checked;
  EXPECT_GT(checked, 100000);
  std::printf("[ conformance ] pyramid budgets: %d configurations compared, %d with whole shares\n", checked, whole);
}

// Layers whose exact share is a whole number keep it: C = 8, W = 1, beta 1.5, 8 layers: S = 7,
// shares 28/3 - 2l/3 for l = 0..7, i.e. 9.33 8.67 8 7.33 6.67 6 5.33 4.67; floors 9 8 8 7 6 6 5 4
// (53), remainder 3 to layers 0-2 -> budgets 11 10 10 8 7 7 6 5 (flooring largest - l * step
// once lost layer 2's token to rounding).
TEST(ConformanceTest, PyramidBudgetsFloorWholeShares) {
  EXPECT_EQ(ReferencePyramidBudgets(8, 8, 1, 1.5, 40), (std::vector<int32_t>{11, 10, 10, 8, 7, 7, 6, 5}));
  EXPECT_EQ(PyramidBudgets(8, 8, 1, 1.5, 40), (std::vector<int32_t>{11, 10, 10, 8, 7, 7, 6, 5}));
  EXPECT_EQ(PyramidBudgets(8, 15, 1, 1.5, 40), ReferencePyramidBudgets(8, 15, 1, 1.5, 40));
  EXPECT_EQ(PyramidBudgets(24, 24, 1, 1.5, 100), ReferencePyramidBudgets(24, 24, 1, 1.5, 100));
}

TEST(ConformanceTest, KNorm) {
  Tally tally;
  for (const KvBudget& budget : {KvBudget::Tokens(1), KvBudget::Tokens(5), KvBudget::Tokens(12),
                                 KvBudget::Fraction(0.2), KvBudget::Fraction(0.5)})
    for (bool decode_evict : {false, true}) {
      Case c = Base(KvMethod::kKNorm, budget);
      c.config.params.dense_layers = 0;
      c.config.params.decode_evict = decode_evict;
      Sweep(c, &tally);
    }
  Case deep = Base(KvMethod::kKNorm, KvBudget::Tokens(7));  // the default dense_layers 2: layer 2 compresses
  deep.layer = 2;
  deep.n_layers = 4;
  Sweep(deep, &tally);
  Case window = Base(KvMethod::kKNorm, KvBudget::Tokens(9));
  window.config.params.dense_layers = 0;
  window.config.params.n_sink = 2;
  window.config.params.recent = 3;
  window.config.params.decode_evict = true;
  Sweep(window, &tally);
  Case max = Base(KvMethod::kKNorm, KvBudget::Fraction(0.3));
  max.config.params.dense_layers = 0;
  max.config.params.head_reduce = HeadReduce::kMax;
  max.config.per_head = false;
  Sweep(max, &tally, false);
  Report("knorm", tally);
  // A dense layer is not compressed at all.
  auto dense = CreatePolicy(Base(KvMethod::kKNorm, KvBudget::Tokens(7)).config, 1, 4, 1);
  ASSERT_TRUE(dense.ok());
  EXPECT_EQ(dense.value()->EvictionTarget(40, 40, EvictionPoint::kPromptEnd, 1), 40);
}

TEST(ConformanceTest, StreamingLlm) {
  Tally tally;
  // n_sink 4: budgets below n_sink + 1 (2, 4; fraction 0.05 of 40 is 2, of 23 is 1) and above.
  for (const KvBudget& budget : {KvBudget::Tokens(1), KvBudget::Tokens(2), KvBudget::Tokens(4), KvBudget::Tokens(5),
                                 KvBudget::Tokens(12), KvBudget::Fraction(0.05), KvBudget::Fraction(0.2)})
    for (int32_t n_sink : {4, 0, 1}) {
      if (!budget.is_fraction() && n_sink > budget.tokens) continue;  // rejected by validation
      Case c = Base(KvMethod::kStreamingLlm, budget);
      c.config.params.n_sink = n_sink;
      Sweep(c, &tally);
    }
  Report("streaming_llm", tally);
}

}  // namespace
}  // namespace kvsparse
