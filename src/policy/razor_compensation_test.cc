// razor's local heads (razor_compensation.cc): StreamingLLM's selection, and the compensation
// token: after each eviction it is the exact mean of every key and value dropped so far and
// counts them; an eviction the cache deferred (no OnEvict for its mask) or a trim the policy did
// not select adds nothing; clones carry it; "compensation": false is StreamingLLM.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "policy/policy_base.h"
#include "policy/policy_test_util.h"

namespace kvsparse::policy_test {
namespace {

constexpr int kHeadDim = 8;

// A one-head table's tokens as one f32 span: k, v [n, 1, head_dim].
struct Table {
  std::vector<float> k, v;
  std::vector<int32_t> positions;
  void Append(int32_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> value(-2.f, 2.f);
    for (int32_t i = 0; i < n; ++i) {
      positions.push_back(positions.empty() ? 0 : positions.back() + 1);
      for (int c = 0; c < kHeadDim; ++c) {
        k.push_back(value(rng));
        v.push_back(value(rng));
      }
    }
  }
  int32_t n() const { return static_cast<int32_t>(positions.size()); }
  KvSpan Span() const {
    KvSpan s;
    s.k = k.data();
    s.v = v.data();
    s.positions = positions.data();
    s.n = n();
    return s;
  }
  SelectionContext Context(int32_t target, const KvSpan* span) const {
    SelectionContext ctx;
    ctx.n_live = n();
    ctx.target = target;
    ctx.positions = positions.data();
    ctx.current_position = positions.back();
    ctx.spans = span;
    ctx.n_spans = 1;
    ctx.storage = KvStorage::kF32;
    ctx.n_kv_heads = 1;
    ctx.head_dim = kHeadDim;
    return ctx;
  }
  // Keeps the masked tokens; adds the dropped ones' rows to *dropped_k / *dropped_v.
  void Apply(const std::vector<uint8_t>& keep, std::vector<double>* dropped_k, std::vector<double>* dropped_v,
             int64_t* dropped) {
    Table kept;
    for (int32_t t = 0; t < n(); ++t) {
      const auto row = [&](const std::vector<float>& x) { return x.begin() + static_cast<size_t>(t) * kHeadDim; };
      if (keep[t]) {
        kept.positions.push_back(positions[t]);
        kept.k.insert(kept.k.end(), row(k), row(k) + kHeadDim);
        kept.v.insert(kept.v.end(), row(v), row(v) + kHeadDim);
      } else if (dropped_k != nullptr) {
        for (int c = 0; c < kHeadDim; ++c) {
          (*dropped_k)[c] += row(k)[c];
          (*dropped_v)[c] += row(v)[c];
        }
        ++*dropped;
      }
    }
    *this = std::move(kept);
  }
};

TEST(RazorLocalTest, CompensationIsTheMeanOfEveryDroppedToken) {
  KvMethodParams params = DefaultMethodParams(KvMethod::kRazor);
  ASSERT_TRUE(params.compensation);
  auto policy = policy::MakeRazorLocalPolicy(KvBudget::Tokens(8), params);  // 4 sinks + 4 recent
  std::mt19937 rng(5);
  Table table;
  std::vector<double> sum_k(kHeadDim, 0.0), sum_v(kHeadDim, 0.0);
  int64_t dropped = 0;
  std::vector<uint8_t> keep;
  auto expect_mean = [&](const char* when) {
    const KvCompensation c = policy->Compensation();
    ASSERT_EQ(c.count, dropped) << when;
    for (int i = 0; i < kHeadDim; ++i) {
      EXPECT_NEAR(c.k[i], sum_k[i] / dropped, 1e-6) << when;
      EXPECT_NEAR(c.v[i], sum_v[i] / dropped, 1e-6) << when;
    }
  };
  EXPECT_EQ(policy->Compensation().count, 0);
  for (int round = 0; round < 3; ++round) {
    const int32_t n_new = 13 + 7 * round;
    table.Append(n_new, rng);
    policy->OnAppend(n_new);
    const KvSpan span = table.Span();
    policy->SelectKeep(table.Context(8, &span), &keep);
    EXPECT_EQ(std::accumulate(keep.begin(), keep.end(), 0), 8);
    for (int t = 0; t < 4; ++t) EXPECT_TRUE(keep[t]) << "sink " << t;
    EXPECT_TRUE(keep.back());
    if (round == 1) {
      // The cache deferred this eviction: no OnEvict for its mask. A trim of the first
      // dropped token alone (another mask) is applied instead and is not compensated.
      std::vector<uint8_t> trim(keep.size(), 1);
      trim[4] = 0;
      const int64_t before = policy->Compensation().count;
      table.Apply(trim, nullptr, nullptr, nullptr);
      policy->OnEvict(trim);
      EXPECT_EQ(policy->Compensation().count, before);
      continue;
    }
    table.Apply(keep, &sum_k, &sum_v, &dropped);
    policy->OnEvict(keep);
    expect_mean("after an eviction");
  }
  const std::unique_ptr<KvPolicy> clone = policy->Clone();
  EXPECT_EQ(clone->Compensation().count, dropped);
  EXPECT_EQ(clone->Compensation().k[0], policy->Compensation().k[0]);
  EXPECT_GE(policy->StateBytes(), 4 * kHeadDim * sizeof(float));
}

}  // namespace
}  // namespace kvsparse::policy_test
