// razor's local heads — H. Tang et al., "RazorAttention: Efficient KV Cache Compression Through
// Retrieval Heads", ICLR 2025, arXiv:2407.15891.
//
// A non-retrieval head keeps its first n_sink (4) tokens and a recent window (StreamingLLM's
// selection, KeepSinksAndRecent) and folds every token it drops into one compensation token:
// k^ = mean of the dropped keys, v^ = mean of the dropped values (Eq. 4), attended as if each of
// the N_d dropped tokens were (k^, v^): N_d exp(q.k^) joins the softmax's sum and N_d exp(q.k^) v^
// its numerator (Eq. 5; the engine merges it with ops::MergeWeightedToken). The keys are averaged
// as cached, after RoPE, as the paper's Algorithm 1 does. The token lives here, in f32, not in the
// KV pages: 2 x head_dim floats per head (StateBytes counts them). Defaults: on
// ("compensation": true); false drops the tokens outright (the StreamingLLM policy).
// Only this policy's own evictions are folded in: a sliding window's trim or a removed range
// (RemoveRange) is not, and a removed range leaves the token as it was (it may still count
// tokens dropped before from that range).
#include <algorithm>
#include <vector>

#include "kvsparse/kv_types.h"
#include "policy/policy_base.h"

namespace kvsparse::policy {
namespace {

class RazorLocalPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "razor_local"; }
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<RazorLocalPolicy>(*this); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }
  size_t StateBytes() const override {
    return (k_sum_.capacity() + v_sum_.capacity() + pending_k_.capacity() + pending_v_.capacity()) * sizeof(double) +
           (k_mean_.capacity() + v_mean_.capacity() + row_.capacity()) * sizeof(float) + pending_keep_.capacity();
  }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, n_live_);
    KeepSinksAndRecent(ctx, params_.n_sink, keep);
    // The dropped tokens' sums wait for OnEvict: an eviction the cache defers (its budget is
    // exhausted) is selected again later and must not count twice.
    const size_t d = static_cast<size_t>(ctx.n_kv_heads) * ctx.head_dim;  // one table row: [n_kv_heads, head_dim]
    pending_k_.assign(d, 0.0);
    pending_v_.assign(d, 0.0);
    pending_count_ = 0;
    row_.resize(d);
    int32_t index = 0;
    for (int32_t s = 0; s < ctx.n_spans; ++s) {
      const KvSpan& span = ctx.spans[s];
      const KvStorage type = SpanStorage(ctx.storage, span);
      for (int32_t i = 0; i < span.n; ++i, ++index) {
        if ((*keep)[index]) continue;
        LoadSpanKeyRow(type, span, i, ctx.n_kv_heads, ctx.head_dim, row_.data());
        for (size_t c = 0; c < d; ++c) pending_k_[c] += row_[c];
        LoadSpanValueRow(type, span, i, ctx.n_kv_heads, ctx.head_dim, row_.data());
        for (size_t c = 0; c < d; ++c) pending_v_[c] += row_[c];
        ++pending_count_;
      }
    }
    KVS_CHECK(index == ctx.n_live);
    pending_keep_ = *keep;
  }

  void OnEvict(const std::vector<uint8_t>& keep) override {
    KVS_CHECK(keep.size() == static_cast<size_t>(n_live_));
    int32_t kept = 0;
    for (uint8_t k : keep) kept += k != 0;
    n_live_ = kept;
    // Only the eviction this policy selected is compensated (a sliding window's trim or a
    // removed range is not: those tokens are out of the attention's reach, not summarized).
    if (pending_count_ > 0 && keep == pending_keep_) {
      if (k_sum_.empty()) {
        k_sum_.assign(pending_k_.size(), 0.0);
        v_sum_.assign(pending_v_.size(), 0.0);
      }
      for (size_t c = 0; c < k_sum_.size(); ++c) {
        k_sum_[c] += pending_k_[c];
        v_sum_[c] += pending_v_[c];
      }
      count_ += pending_count_;
      k_mean_.resize(k_sum_.size());
      v_mean_.resize(v_sum_.size());
      for (size_t c = 0; c < k_sum_.size(); ++c) {
        k_mean_[c] = static_cast<float>(k_sum_[c] / static_cast<double>(count_));
        v_mean_[c] = static_cast<float>(v_sum_[c] / static_cast<double>(count_));
      }
    }
    pending_count_ = 0;
    pending_keep_.clear();
  }

  KvCompensation Compensation() const override {
    if (count_ == 0) return {};
    return KvCompensation{k_mean_.data(), v_mean_.data(), count_};
  }

 private:
  int32_t n_live_ = 0;
  // Sums in double: a long context adds hundreds of thousands of rows.
  std::vector<double> k_sum_, v_sum_;    // [head_dim] every compensated token's K and V
  std::vector<float> k_mean_, v_mean_;   // [head_dim] the compensation token
  int64_t count_ = 0;                    // tokens it stands for
  std::vector<double> pending_k_, pending_v_;  // [head_dim] the last selection's dropped tokens
  int64_t pending_count_ = 0;
  std::vector<uint8_t> pending_keep_;  // the mask they belong to
  std::vector<float> row_;             // scratch
};

}  // namespace

std::unique_ptr<KvPolicy> MakeRazorLocalPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<RazorLocalPolicy>(budget, params);
}

}  // namespace kvsparse::policy
