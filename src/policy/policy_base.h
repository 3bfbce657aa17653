// What the concrete policies share: a resolved budget, their parameters, checks of the
// engine's calls against the policy's own token count, and the per-method constructors
// the factory (policy_factory.cc) calls.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "kvsparse/kv_budget.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"

namespace kvsparse::policy {

class BudgetedPolicy : public KvPolicy {
 public:
  BudgetedPolicy(const KvBudget& budget, const KvMethodParams& params) : budget_(budget), params_(params) {}
  int32_t BudgetTokens(int32_t n_seen) const override { return ResolveBudget(budget_, n_seen); }

 protected:
  // Aborts when the engine's live count disagrees with the policy's (a missed OnAppend or
  // OnEvict would silently misalign every per-token score).
  static void CheckSelection(const SelectionContext& ctx, int32_t n_tracked);
  static void CheckObservation(const AttentionObservation& obs, int32_t n_tracked, const float* field,
                               const char* field_name);

  KvBudget budget_;
  KvMethodParams params_;
};

// A read-sparsity policy (Quest, the oracle): it keeps every token and never evicts; the
// budget bounds the tokens a decode step reads (SelectSpans / SelectQueryHeadSpans).
class ReadSparsePolicy : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  int32_t BudgetTokens(int32_t) const override { return std::numeric_limits<int32_t>::max(); }
  void OnAppend(int32_t n_new) override { n_live_ += n_new; }
  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override;
  void OnEvict(const std::vector<uint8_t>& keep) override;
  bool SelectsSpans() const override { return true; }

 protected:
  // Aborts unless the spans hold the tokens appended; returns their count.
  int32_t CheckedLiveTokens(const std::vector<KvSpan>& spans) const;

  int32_t n_live_ = 0;
};

// The cross-layer linkers LinkSequencePolicies runs (cumulative.cc, oracle.cc).
void LinkCumulativeLayers(std::span<KvPolicy* const> all_policies);
void LinkReuseLayers(std::span<KvPolicy* const> layer_policies);
void LinkCakeLayers(std::span<KvPolicy* const> all_policies);  // every policy of the sequence

// StreamingLLM's selection: the first n_sink tokens and the newest ctx.target - n_sink.
void KeepSinksAndRecent(const SelectionContext& ctx, int32_t n_sink, std::vector<uint8_t>* keep);

std::unique_ptr<KvPolicy> MakeFullPolicy();
std::unique_ptr<KvPolicy> MakeStreamingLlmPolicy(const KvBudget& budget, const KvMethodParams& params);
// razor's local (non-retrieval) heads: StreamingLLM's selection plus the compensation token.
std::unique_ptr<KvPolicy> MakeRazorLocalPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeH2OPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeTovaPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeScissorhandsPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeSnapKvPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakePyramidKvPolicy(const KvBudget& average_budget, const KvMethodParams& params,
                                              int layer, int n_layers);
std::unique_ptr<KvPolicy> MakeKNormPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeRandomPolicy(const KvBudget& budget, const KvMethodParams& params, uint64_t seed);
std::unique_ptr<KvPolicy> MakeQuestPolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeOraclePolicy(const KvBudget& budget, const KvMethodParams& params);
std::unique_ptr<KvPolicy> MakeReusePolicy(const KvBudget& budget, const KvMethodParams& params);
// The re-selection layer of `reuse` (params.reselect_layer, or 13/32 of n_layers).
int32_t ReuseReselectLayer(const KvMethodParams& params, int n_layers);
std::unique_ptr<KvPolicy> MakeCakePolicy(const KvBudget& budget, const KvMethodParams& params, int layer);
// kv_head: the table's KV head in a per-head layer (per-head cumulative ranks per head index).
std::unique_ptr<KvPolicy> MakeCumulativePolicy(const KvBudget& mean_budget, const KvMethodParams& params, int layer,
                                               int n_layers, int kv_head);

}  // namespace kvsparse::policy
