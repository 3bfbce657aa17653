// KNorm — A. Devoto, Y. Zhao, S. Scardapane, P. Minervini, "A Simple and Effective L2
// Norm-Based Strategy for KV Cache Compression", EMNLP 2024, arXiv:2406.11430.
//
// Keys with a low L2 norm tend to receive high attention, so keep the tokens whose keys
// have the LOWEST norm (per KV head, averaged over heads by default; head_reduce "max"
// keeps a token if any head's key is short). No attention is needed. Keys are read
// through the cache spans in their storage type (f32, f16, int8 with per-(token, head)
// scales, or int8_kivi pages with per-channel scales and a full-precision residual). Each token's norms are computed once, at its first selection, and compacted
// with the cache afterwards.
// Defaults, as the paper and its reference (kvpress KnormPress): tokens chosen per KV head
// (per_head true; "per_head": false folds the heads' norms, head_reduce), no sinks and no
// recent window ("n_sink", "recent", "recent_ratio" add them), the first two layers kept whole
// ("dense_layers" 2), and only the prompt compressed: generated tokens are all kept unless
// "decode_evict" is set. Deliberate difference: the newest token is always kept.
#include <algorithm>
#include <cmath>

#include "kvsparse/dtype.h"
#include "ops/kv_quant.h"
#include "policy/per_token_heads.h"
#include "policy/policy_base.h"
#include "policy/selection.h"

namespace kvsparse::policy {
namespace {

constexpr int kMaxKnormHeadDim = 1024;

// L2 norm of one key head vector of `head_dim` values stored as `storage` (int8, fp8: times
// `scale`; int8_kivi: times channel_scale[d], the head's [head_dim] channel scales; int4 / int2
// KIVI: group_min[d] + group_scale[d] * code, f16). element_offset counts values.
float KeyNorm(KvStorage storage, const void* keys, size_t element_offset, int head_dim, float scale,
              const float* channel_scale, const f16_bits* group_scale, const f16_bits* group_min) {
  double sum = 0.0;
  switch (storage) {
    case KvStorage::kF32: {
      const float* k = static_cast<const float*>(keys) + element_offset;
      for (int d = 0; d < head_dim; ++d) sum += static_cast<double>(k[d]) * k[d];
      return static_cast<float>(std::sqrt(sum));
    }
    case KvStorage::kF16:
    case KvStorage::kBf16: {
      const uint16_t* k = static_cast<const uint16_t*>(keys) + element_offset;
      for (int d = 0; d < head_dim; ++d) {
        const double v = storage == KvStorage::kF16 ? F16ToF32(k[d]) : BF16ToF32(k[d]);
        sum += v * v;
      }
      return static_cast<float>(std::sqrt(sum));
    }
    case KvStorage::kInt8: {
      const int8_t* k = static_cast<const int8_t*>(keys) + element_offset;
      for (int d = 0; d < head_dim; ++d) sum += static_cast<double>(k[d]) * k[d];
      return std::fabs(scale) * static_cast<float>(std::sqrt(sum));
    }
    case KvStorage::kFp8E4M3:
    case KvStorage::kFp8E5M2: {
      const uint8_t* k = static_cast<const uint8_t*>(keys) + element_offset;
      for (int d = 0; d < head_dim; ++d) {
        const double v = ops::DecodeFp8(storage, k[d]);
        sum += v * v;
      }
      return std::fabs(scale) * static_cast<float>(std::sqrt(sum));
    }
    case KvStorage::kInt4Kivi:
    case KvStorage::kInt2Kivi: {
      float row[kMaxKnormHeadDim];
      KVS_CHECK_MSG(head_dim <= kMaxKnormHeadDim, "knorm: head_dim above 1024");
      ops::DequantizeKvColumnsAsym(KvStorageBits(storage),
                                   static_cast<const uint8_t*>(keys) + KvRowBytes(storage, element_offset),
                                   group_scale, group_min, 1, head_dim, row);
      for (int d = 0; d < head_dim; ++d) sum += static_cast<double>(row[d]) * row[d];
      return static_cast<float>(std::sqrt(sum));
    }
    case KvStorage::kInt8Kivi: {
      const int8_t* k = static_cast<const int8_t*>(keys) + element_offset;
      for (int d = 0; d < head_dim; ++d) {
        const double v = static_cast<double>(k[d]) * channel_scale[d];
        sum += v * v;
      }
      return static_cast<float>(std::sqrt(sum));
    }
  }
  return 0.f;
}

class KNormPolicy final : public BudgetedPolicy {
 public:
  using BudgetedPolicy::BudgetedPolicy;
  std::string_view name() const override { return "knorm"; }
  // Norms were computed from the keys at selection time and are stored by value, so the copy
  // holds no reference into the original's cache.
  std::unique_ptr<KvPolicy> Clone() const override { return std::make_unique<KNormPolicy>(*this); }
  bool EvictsDuringDecode() const override { return params_.decode_evict; }
  void OnAppend(int32_t n_new) override { neg_norms_.Append(n_new); }

  void SelectKeep(const SelectionContext& ctx, std::vector<uint8_t>* keep) override {
    CheckSelection(ctx, neg_norms_.size());
    KVS_CHECK_MSG(ctx.spans != nullptr || ctx.n_live == 0, "knorm needs the key spans in SelectionContext");
    KVS_CHECK_MSG(ctx.n_kv_heads > 0 && ctx.head_dim > 0, "knorm needs n_kv_heads and head_dim in SelectionContext");
    neg_norms_.SetHeads(ctx.n_kv_heads);
    ScoreNewTokens(ctx);
    scores_.resize(ctx.n_live);
    ReduceHeads(neg_norms_.data(), ctx.n_live, ctx.n_kv_heads, params_.head_reduce, scores_.data());
    KeepSinksRecentAndTop(scores_.data(), ctx.n_live, ctx.target, params_.n_sink,
                          RecentWindowTokens(params_, ctx.target), &scratch_, keep);
  }

  void OnEvict(const std::vector<uint8_t>& keep) override {
    int32_t still_scored = 0;
    for (int32_t t = 0; t < n_scored_; ++t) still_scored += keep[t] != 0;
    n_scored_ = still_scored;
    neg_norms_.Compact(keep);
  }
  size_t StateBytes() const override {
    return neg_norms_.bytes() + scores_.capacity() * sizeof(float) + scratch_.capacity() * sizeof(int32_t);
  }

 private:
  // Computes norms for live tokens [n_scored_, n_live), walking the spans in live order.
  void ScoreNewTokens(const SelectionContext& ctx) {
    const int heads = ctx.n_kv_heads, head_dim = ctx.head_dim;
    int32_t index = 0;
    for (int32_t s = 0; s < ctx.n_spans; ++s) {
      const KvSpan& span = ctx.spans[s];
      const KvStorage type = SpanStorage(ctx.storage, span);  // int8_kivi residual: full precision
      const int32_t first = std::max<int32_t>(0, n_scored_ - index);  // skip tokens scored before
      for (int32_t i = first; i < span.n; ++i) {
        float* row = neg_norms_.row(index + i);
        for (int h = 0; h < heads; ++h) {
          const size_t offset = (static_cast<size_t>(i) * heads + h) * head_dim;  // k: [n, heads, head_dim]
          const float scale = HasTokenScales(type) ? span.k_scale[static_cast<size_t>(i) * heads + h] : 1.f;
          const size_t channel = static_cast<size_t>(h) * head_dim;
          const bool low_bit = IsLowBitKivi(type);
          const float* channel_scale = type == KvStorage::kInt8Kivi ? span.k_channel_scale + channel : nullptr;
          const f16_bits* group_scale = low_bit ? span.k_group_scale + channel : nullptr;
          const f16_bits* group_min = low_bit ? span.k_group_min + channel : nullptr;
          row[h] = -KeyNorm(type, span.k, offset, head_dim, scale, channel_scale, group_scale, group_min);
        }
      }
      index += span.n;
    }
    KVS_CHECK_MSG(index == ctx.n_live, "the spans hold a different number of tokens than n_live");
    n_scored_ = ctx.n_live;
  }

  PerTokenHeads<float> neg_norms_{0.f};  // [n_live, n_kv_heads] minus the key L2 norm
  int32_t n_scored_ = 0;                 // live tokens [0, n_scored_) have norms
  std::vector<float> scores_;            // [n_live] scratch
  std::vector<int32_t> scratch_;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeKNormPolicy(const KvBudget& budget, const KvMethodParams& params) {
  return std::make_unique<KNormPolicy>(budget, params);
}

}  // namespace kvsparse::policy
