// CAKE — Z. Qin, Y. Cao, M. Lin, W. Hu, S. Fan, K. Cheng, W. Lin, J. Li, "CAKE: Cascading and
// Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025, arXiv:2503.12491; reference code
// github.com/antgroup/cakekv.
//
// Layer budgets follow each layer's attention (CakeAllocatedPolicy, which any evicting method can
// take with "layer_budgets": "cake"; the `cake` method is SnapKV's machinery with CAKE's indicator
// under it). After a prompt (chunk), a layer's preference is
//   P = H^(1/tau1) * V^(1/tau2),
// H = the entropy of its observation window's attention over the keys before the window (spatial
// dispersion, summed over heads and queries), V = the variance of that attention over the window's
// queries (temporal shift, summed over heads and keys). The layers' total budget (the sum of
// their configured budgets) is split over them in proportion to P, each keeping its window on top
// of its share and at most the tokens seen (the excess goes to the others). The split is
// cascading: while a prompt is processed, a layer's preference re-divides the whole total among
// the layers observed so far, and the controller trims the earlier ones to their new shares
// (KvPolicy::CascadesBudget), so memory never holds more than the total.
// Inside a layer a token's score is mean + gamma * variance of the attention the window's queries
// gave it (the eviction indicator; variance marks tokens whose importance shifts), smoothed by
// average pooling (kernel 5) and ranked per KV head; the window is kept. While decoding, the
// reference (cake_cache.py, CakeDecodingKVCache_LayerWise) evicts at every step back to the
// layer's budget (its share plus the window), scored by the step's query alone: so does
// `cake` ("decode_evict" true; `bench` evicts every step, a server every evict_interval steps;
// "decode_evict": false keeps every generated token instead). The reference evicts before the
// step's attention, kvsparse after it (the step reads one token more).
// Budget a layer cannot hold (a share above the tokens seen) goes equally to the others, as in
// the reference's adjust_budgets ("excess": "equal"); "preference" splits it by preference.
// Defaults (the reference's): window 32, gamma 200, tau1 = tau2 = 1 (its per-model tuned values
// are in model2tau.json), kernel 5 average pooling, per KV head, decode eviction.
// GQA: as the reference (after repeat_kv), the indicator is computed per query head, pooled per
// query head and averaged over each KV head's group, and the preference sums the entropy and
// variance of every query head ("query_head_scores" true; the policy then keeps group x window
// floats per token and KV head). "query_head_scores": false scores the group's mean attention
// instead (kvsparse's cheaper form, 1/group of the state). Under "layer_budgets": "cake" the
// wrapped method's observations are its own (folded per KV head), and so is the preference.
// Differences: layers that have not yet been measured on the current prompt call are left out of
// the split (the reference's cascade runs once, over one prompt).
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <utility>

#include "policy/cake.h"
#include "policy/snapkv.h"

namespace kvsparse {

namespace {

// The reference's adjust_budgets on the shares above the windows: shares[k] truncated, each
// layer's room room[k]; `total` the tokens to split. Returns the final shares.
std::vector<int64_t> EqualExcessShares(std::span<const double> prefs, std::span<const int64_t> room, int64_t total) {
  const size_t n = prefs.size();
  double weight = 0;
  for (double p : prefs) weight += std::max(p, 0.0);
  const bool proportional = weight > 0 && std::isfinite(weight);
  std::vector<int64_t> share(n);
  for (size_t k = 0; k < n; ++k) {
    const double w = proportional ? std::max(prefs[k], 0.0) / weight : 1.0 / static_cast<double>(n);
    share[k] = static_cast<int64_t>(w * static_cast<double>(total));  // numpy's int(): truncation
  }
  // Hands `amount` out one equal part per selected layer, the remainder to the first of them.
  auto spread = [&](int64_t amount, int sign, auto&& selected) {
    std::vector<size_t> picked;
    for (size_t k = 0; k < n; ++k)
      if (selected(k)) picked.push_back(k);
    if (picked.empty() || amount <= 0) return;
    const int64_t each = amount / static_cast<int64_t>(picked.size());
    const int64_t remainder = amount % static_cast<int64_t>(picked.size());
    for (size_t i = 0; i < picked.size(); ++i) share[picked[i]] += sign * (each + (static_cast<int64_t>(i) < remainder));
  };
  int64_t excess = 0;
  for (size_t k = 0; k < n; ++k) {
    excess += std::max<int64_t>(share[k] - room[k], 0);
    share[k] = std::min(share[k], room[k]);
  }
  spread(excess, +1, [&](size_t k) { return share[k] < room[k]; });
  const int64_t diff = total - std::accumulate(share.begin(), share.end(), int64_t{0});
  if (diff > 0) spread(diff, +1, [&](size_t k) { return share[k] < room[k]; });
  if (diff < 0) spread(-diff, -1, [&](size_t k) { return share[k] > 1; });
  for (size_t k = 0; k < n; ++k) share[k] = std::clamp<int64_t>(share[k], 0, room[k]);
  return share;
}

}  // namespace

std::vector<int64_t> CakeLayerBudgets(std::span<const double> prefs, std::span<const int32_t> windows, int64_t room,
                                      int64_t total, CakeExcess excess) {
  const size_t n = prefs.size();
  KVS_CHECK(windows.size() == n && room >= 0 && total >= 0);
  std::vector<int64_t> budgets(n, 0);
  if (n == 0) return budgets;
  // Windows first (each capped by the room), then the rest in proportion to the preferences.
  int64_t left = total;
  for (size_t k = 0; k < n; ++k) {
    budgets[k] = std::min<int64_t>({windows[k], room, left / static_cast<int64_t>(n - k)});
    left -= budgets[k];
  }
  if (excess == CakeExcess::kEqual) {
    std::vector<int64_t> share_room(n);
    for (size_t k = 0; k < n; ++k) share_room[k] = room - budgets[k];
    const std::vector<int64_t> shares = EqualExcessShares(prefs, share_room, left);
    for (size_t k = 0; k < n; ++k) budgets[k] += shares[k];
    return budgets;
  }
  // Water-filling: layers at the room drop out and their excess goes to the rest.
  std::vector<uint8_t> open(n, 1);
  for (size_t k = 0; k < n; ++k) open[k] = budgets[k] < room;
  std::vector<double> share(n, 0.0);
  while (left > 0) {
    double weight = 0;
    size_t n_open = 0;
    for (size_t k = 0; k < n; ++k) {
      if (!open[k]) continue;
      weight += std::max(prefs[k], 0.0);
      ++n_open;
    }
    if (n_open == 0) break;
    bool capped = false;
    int64_t given = 0;
    for (size_t k = 0; k < n; ++k) {
      if (!open[k]) continue;
      // Preferences of 0 everywhere (or not finite): an equal split.
      const double w = weight > 0 && std::isfinite(weight) ? std::max(prefs[k], 0.0) / weight : 1.0 / n_open;
      share[k] = w * static_cast<double>(left);
      if (static_cast<double>(budgets[k]) + share[k] >= static_cast<double>(room)) {
        given += room - budgets[k];
        budgets[k] = room;
        open[k] = 0;
        capped = true;
      }
    }
    if (capped) {
      left -= given;
      continue;  // redistribute what the capped layers could not take
    }
    // No layer capped: floor each share and hand the remainder out by largest fraction.
    std::vector<size_t> order;
    for (size_t k = 0; k < n; ++k) {
      if (!open[k]) continue;
      const int64_t whole = static_cast<int64_t>(std::floor(share[k]));
      budgets[k] += whole;
      given += whole;
      share[k] -= static_cast<double>(whole);
      order.push_back(k);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return share[a] > share[b]; });
    int64_t remainder = left - given;
    for (size_t i = 0; remainder > 0 && i < order.size(); ++i) {
      if (budgets[order[i]] >= room) continue;
      ++budgets[order[i]];
      --remainder;
    }
    break;
  }
  return budgets;
}

namespace policy {

struct CakeGroup {
  // [n_layers] the sequence's CAKE-allocated policies of each layer (every KV head of a per-head
  // layer); empty for layers without the allocation.
  std::vector<std::vector<const CakeAllocatedPolicy*>> layers;
  // The last split, which every table of the sequence asks for at each eviction point: it
  // changes only with the tokens seen and with the layers measured on the current prompt call
  // (their measurement position and count), so it is computed once per change.
  mutable int32_t split_n_seen = -1, split_at = -1, split_fresh = -1;
  mutable std::vector<int64_t> split;  // [layers.size()] tokens each measured layer keeps
  mutable std::vector<double> prefs;   // scratch: the measured layers' preferences
  mutable std::vector<int32_t> windows;
  mutable std::vector<size_t> measured;  // the measured layers' indices
};

namespace {

// Mean and unbiased variance (torch.var's) of x[0], x[stride], ... x[(n - 1) * stride]; n >= 1.
std::pair<double, double> MeanVariance(const float* x, int32_t n, size_t stride) {
  double sum = 0, sq = 0;
  for (int32_t i = 0; i < n; ++i) sum += x[i * stride];
  const double mean = sum / n;
  for (int32_t i = 0; i < n; ++i) sq += (x[i * stride] - mean) * (x[i * stride] - mean);
  return {mean, n > 1 ? sq / (n - 1) : 0.0};
}

// The `cake` method's scoring: SnapKV's machinery with CAKE's eviction indicator.
class CakeScoringPolicy final : public SnapKvPolicy {
 public:
  using SnapKvPolicy::SnapKvPolicy;
  std::string_view name() const override { return "cake"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<CakeScoringPolicy>(*this); }
  // The indicator per query head, pooled per query head, then the heads' mean (SnapKV's fold).
  uint32_t NeededObservations() const override {
    return SnapKvPolicy::NeededObservations() | (params_.query_head_scores ? kObserveQueryHeads : 0u);
  }

 protected:
  float WindowVote(const float* ring, int32_t window, int32_t observed, bool in_prefill) const override {
    // A decode step's eviction scores by that step's query alone (cake_cache.py's decoding
    // cache: its attention, pooled, no variance).
    if (!in_prefill) return ring[0];
    // mean + gamma * variance over the queries of the window that exist (the reference's window
    // is always full: it compresses prompts longer than the window).
    const auto [mean, var] = MeanVariance(ring, std::max<int32_t>(1, std::min(window, observed)), 1);
    return static_cast<float>(mean + params_.gamma * var);
  }
};

}  // namespace

CakeAllocatedPolicy::CakeAllocatedPolicy(std::unique_ptr<KvPolicy> inner, const KvMethodParams& params, int layer)
    : inner_(std::move(inner)), params_(params), layer_(layer) {
  // The window whose attention measures the layer: the method's own, else the reference's 32.
  window_ = inner_->ObservationWindow() > 0 ? inner_->ObservationWindow() : 32;
}

CakeAllocatedPolicy::CakeAllocatedPolicy(const CakeAllocatedPolicy& other)
    : KvPolicy(other),
      inner_(other.inner_->Clone()),
      params_(other.params_),
      layer_(other.layer_),
      window_(other.window_),
      entropy_(other.entropy_),
      variance_(other.variance_),
      observed_(other.observed_),
      measured_at_(other.measured_at_),
      group_(other.group_) {}

std::unique_ptr<KvPolicy> CakeAllocatedPolicy::Clone() const { return std::make_unique<CakeAllocatedPolicy>(*this); }

bool CakeAllocatedPolicy::ObservesDecode() const {
  // A method that needs no attention of its own gets prompts observed (to measure them) only.
  return inner_->NeedsAttention() && inner_->ObservesDecode();
}

void CakeAllocatedPolicy::Observe(const AttentionObservation& obs) {
  if (inner_->NeedsAttention()) inner_->Observe(obs);
  // Preferences come from prompts only (the reference measures them once, after the prompt): the
  // spatial dispersion (entropy) and the temporal shift (variance over the window's queries) of
  // the attention the call's last queries gave the keys before them, summed over heads and keys.
  if (obs.n_queries <= 1 || obs.n_tokens == 0 || obs.window_rows == nullptr || obs.n_window < 1) return;
  const int32_t window = obs.n_window, before = obs.n_tokens - window;  // keys before the window: [0, before)
  // Over query heads when the observation has them (the reference's sums), else over KV heads' folds.
  const size_t plane = static_cast<size_t>(obs.heads()) * obs.n_tokens;  // one query's rows
  double entropy = 0, variance = 0;
  for (int h = 0; h < obs.heads(); ++h) {
    for (int32_t t = 0; t < before; ++t) {
      const float* column = obs.window_rows + static_cast<size_t>(h) * obs.n_tokens + t;  // stride: plane
      for (int32_t w = 0; w < window; ++w) {
        const double p = column[w * plane];
        entropy -= p * std::log(p + 1e-10);
      }
      variance += MeanVariance(column, window, plane).second;
    }
  }
  entropy_ = entropy;
  variance_ = variance;
  observed_ = true;
  measured_at_ = obs.query_positions[obs.n_queries - 1];
}

int32_t CakeAllocatedPolicy::BudgetTokens(int32_t n_seen) const {
  // Unlinked (the controller's templates, which size a sequence's reservation as the sum over its
  // layers): twice the layer's own budget. Shares move between layers but sum to the total, and
  // mid-cascade the layers measured so far share the total while the others still hold their
  // previous shares, so the sequence never holds more than twice the total (plus the chunk,
  // which ChunkReserveBytes adds).
  if (!group_) return static_cast<int32_t>(std::min<int64_t>(n_seen, 2 * int64_t{inner_->BudgetTokens(n_seen)}));
  if (!observed_) return n_seen;  // never measured: keep everything (the cascade has not reached it)
  const CakeGroup& g = *group_;
  // Only layers measured on the same prompt call count: the later layers of this call have not
  // measured it yet, and dividing by their previous chunk's preferences could trim this layer
  // below the share it ends up with (a trimmed layer cannot grow back).
  auto fresh = [&](const std::vector<const CakeAllocatedPolicy*>& heads) {
    return !heads.empty() && heads.front()->observed_ && heads.front()->measured_at_ == measured_at_;
  };
  int32_t n_fresh = 0;
  for (const auto& heads : g.layers) n_fresh += fresh(heads);
  if (g.split_n_seen != n_seen || g.split_at != measured_at_ || g.split_fresh != n_fresh) {
    int64_t total = 0;
    g.prefs.clear();
    g.windows.clear();
    g.measured.clear();
    for (size_t l = 0; l < g.layers.size(); ++l) {
      const auto& heads = g.layers[l];
      if (heads.empty()) continue;
      total += heads.front()->inner_->BudgetTokens(n_seen);
      if (!fresh(heads)) continue;
      double entropy = 0, variance = 0;
      for (const CakeAllocatedPolicy* p : heads) {
        entropy += p->entropy_;
        variance += p->variance_;
      }
      g.prefs.push_back(std::pow(std::max(entropy, 0.0), 1.0 / params_.tau1) *
                        std::pow(std::max(variance, 0.0), 1.0 / params_.tau2));
      g.windows.push_back(heads.front()->window_);
      g.measured.push_back(l);
    }
    const std::vector<int64_t> budgets = CakeLayerBudgets(g.prefs, g.windows, n_seen, total, params_.excess);
    g.split.assign(g.layers.size(), 0);
    for (size_t k = 0; k < budgets.size(); ++k) g.split[g.measured[k]] = budgets[k];
    g.split_n_seen = n_seen;
    g.split_at = measured_at_;
    g.split_fresh = n_fresh;
  }
  return static_cast<int32_t>(std::max<int64_t>(1, g.split[static_cast<size_t>(layer_)]));
}

void LinkCakeLayers(std::span<KvPolicy* const> all_policies) {
  std::shared_ptr<CakeGroup> group;
  for (KvPolicy* p : all_policies) {
    auto* cake = dynamic_cast<CakeAllocatedPolicy*>(p);
    if (cake == nullptr) continue;
    if (!group) group = std::make_shared<CakeGroup>();
    if (group->layers.size() <= static_cast<size_t>(cake->layer())) group->layers.resize(cake->layer() + 1);
    group->layers[cake->layer()].push_back(cake);
  }
  for (KvPolicy* p : all_policies) {
    if (auto* cake = dynamic_cast<CakeAllocatedPolicy*>(p)) cake->group_ = group;
  }
}

std::unique_ptr<KvPolicy> WrapCakeAllocation(std::unique_ptr<KvPolicy> inner, const KvMethodParams& params, int layer) {
  return std::make_unique<CakeAllocatedPolicy>(std::move(inner), params, layer);
}

std::unique_ptr<KvPolicy> MakeCakePolicy(const KvBudget& budget, const KvMethodParams& params, int layer) {
  return WrapCakeAllocation(std::make_unique<CakeScoringPolicy>(budget, params), params, layer);
}

}  // namespace policy
}  // namespace kvsparse
