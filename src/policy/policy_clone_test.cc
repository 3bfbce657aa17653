// KvPolicy::Clone for every method: a policy forked mid-sequence (copy-on-write prefix sharing)
// continues exactly as the original would, and the original is unaffected by what is done to,
// or by the destruction of, its clone (and vice versa).
//
// Each (sequence, layer) is driven like the engine does (kv_policy.h, "Call order"): append,
// Quest's span selection on decode steps, attention observation, eviction to the target, with a
// stand-in for the cache that keeps the live positions and f32 keys (read by KNorm and Quest).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvsparse/kv_policies.h"
#include "kvsparse/kv_policy.h"
#include "policy/policy_test_util.h"
#include "support/random_data.h"

namespace kvsparse::policy_test {
namespace {

constexpr int kHeads = 2;        // kv heads
constexpr int kQHeads = 4;       // query heads (GQA group of 2)
constexpr int kHeadDim = 4;
constexpr int32_t kSpanTokens = 4;  // the stand-in cache's page size
constexpr int32_t kBudget = 12;
constexpr int kEvictInterval = 2;
constexpr uint64_t kSeed = 12345;

constexpr KvMethod kAllMethods[] = {KvMethod::kFull,         KvMethod::kStreamingLlm, KvMethod::kH2O,
                                    KvMethod::kTova,         KvMethod::kScissorhands, KvMethod::kSnapKv,
                                    KvMethod::kPyramidKv,    KvMethod::kKNorm,        KvMethod::kRandom,
                                    KvMethod::kQuest,        KvMethod::kCumulative,   KvMethod::kReuse,
                                    KvMethod::kCake};

// A budget small enough to evict, and parameters that exercise each method's state: sinks,
// a short Scissorhands history (bits shift out during the run), a SnapKV/PyramidKV window
// below the budget, and decode-time compression so they evict on decode steps too.
LayerKvConfig ConfigFor(KvMethod method) {
  LayerKvConfig config = Layer(method, KvBudget::Tokens(kBudget));
  KvMethodParams& p = config.params;
  switch (method) {
    case KvMethod::kH2O:
    case KvMethod::kTova:
    case KvMethod::kRandom: p.n_sink = 1; break;
    case KvMethod::kKNorm:
      p.n_sink = 1;
      p.decode_evict = true;
      p.dense_layers = 0;  // the test's layer 1 would otherwise run Full
      break;
    case KvMethod::kQuest:
    case KvMethod::kReuse: p.dense_layers = 0; break;
    case KvMethod::kScissorhands:
      p.n_sink = 1;
      p.history_window = 8;
      break;
    case KvMethod::kSnapKv:
    case KvMethod::kPyramidKv:
    case KvMethod::kCake:
      p.obs_window = 4;
      p.kernel = 3;
      p.decode_evict = true;
      break;
    default: break;
  }
  return config;
}

// Methods that keep every token (Quest and reuse narrow their reads instead).
bool NeverEvicts(KvMethod method) {
  return method == KvMethod::kFull || method == KvMethod::kQuest || method == KvMethod::kReuse;
}

// What one forward call feeds a (sequence, layer): new keys, then (after the append) the
// attention observation and, on Quest decode steps, the query.
struct StepInput {
  int32_t n_new = 0;
  EvictionPoint point = EvictionPoint::kPrefillChunk;
  std::vector<float> keys;  // [n_new, kHeads, kHeadDim]
  Observation obs;          // over the live tokens after the append
  std::vector<float> q;     // [kQHeads, kHeadDim]
};

// What one forward call produced: everything a policy decides.
struct StepRecord {
  std::vector<std::pair<int32_t, int32_t>> spans;  // Quest: (first position, tokens) of each run read
  bool observed = false;
  int32_t target = 0;
  bool selected = false;
  std::vector<uint8_t> keep;  // SelectKeep's mask (when selected)
  std::vector<int32_t> live;  // live positions after the call
  bool operator==(const StepRecord&) const = default;
};

template <typename T>
std::string Join(const std::vector<T>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? " " : "") << static_cast<int64_t>(v[i]);
  return s.str();
}

std::string ToString(const StepRecord& r) {
  std::ostringstream s;
  s << "spans [";
  for (const auto& [first, n] : r.spans) s << " " << first << "+" << n;
  s << " ] observed " << r.observed << " target " << r.target << " selected " << r.selected << " keep ["
    << Join(r.keep) << "] live [" << Join(r.live) << "]";
  return s.str();
}

// How gtest prints a record in a failed comparison.
void PrintTo(const StepRecord& r, std::ostream* os) { *os << ToString(r); }

// One (sequence, layer): a policy and the cache reduced to live positions and keys.
class Driver {
 public:
  Driver(KvMethod method, int layer, int n_layers) : method_(method) {
    auto created = CreatePolicy(ConfigFor(method), layer, n_layers, kSeed);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (created.ok()) policy_ = std::move(created).value();
    LinkAlone();
  }

  // The forked sequence: the same cache contents (copied, as copy-on-write would on the first
  // write) and a clone of the policy.
  Driver Fork() const {
    Driver copy(method_);
    copy.policy_ = policy_->Clone();
    copy.LinkAlone();
    copy.live_ = live_;
    copy.keys_ = keys_;
    copy.next_position_ = next_position_;
    copy.n_seen_ = n_seen_;
    return copy;
  }

  KvPolicy& policy() { return *policy_; }
  bool ok() const { return policy_ != nullptr; }
  int32_t n_live() const { return static_cast<int32_t>(live_.size()); }
  int32_t next_position() const { return next_position_; }

  StepRecord Step(const StepInput& in) {
    StepRecord r;
    // 1. Append.
    for (int32_t i = 0; i < in.n_new; ++i) live_.push_back(next_position_++);
    keys_.insert(keys_.end(), in.keys.begin(), in.keys.end());
    n_seen_ += in.n_new;
    policy_->OnAppend(in.n_new);
    const bool decode = in.point == EvictionPoint::kDecodeStep;
    if (decode && policy_->SelectsSpans()) {
      std::vector<KvSpan> spans = Spans();
      SpanSelectionContext ctx;
      ctx.q = in.q.data();
      ctx.n_q_heads = kQHeads;
      ctx.n_kv_heads = kHeads;
      ctx.head_dim = kHeadDim;
      ctx.storage = KvStorage::kF32;
      ctx.cache_page_size = kSpanTokens;
      policy_->SelectSpans(ctx, &spans);
      for (const KvSpan& s : spans) r.spans.emplace_back(s.positions[0], s.n);
    }
    // 2. Attention.
    if (policy_->NeedsAttention() && (decode ? policy_->ObservesDecode() : policy_->ObservesPrompt())) {
      EXPECT_EQ(in.obs.n_tokens, n_live());
      policy_->Observe(in.obs.view());
      r.observed = true;
    }
    // 3. Eviction. Full, Quest and reuse never evict; they are still asked for their (all-ones) mask.
    r.target = policy_->EvictionTarget(n_live(), n_seen_, in.point, kEvictInterval);
    const bool never_evicts = NeverEvicts(method_);
    if (r.target < n_live() || never_evicts) {
      const std::vector<KvSpan> spans = Spans();
      SelectionContext ctx;
      ctx.n_live = n_live();
      ctx.target = r.target;
      ctx.positions = live_.data();
      ctx.current_position = live_.back();
      ctx.in_prefill = !decode;
      ctx.spans = spans.data();
      ctx.n_spans = static_cast<int32_t>(spans.size());
      ctx.storage = KvStorage::kF32;
      ctx.n_kv_heads = kHeads;
      ctx.head_dim = kHeadDim;
      policy_->SelectKeep(ctx, &keep_);
      r.selected = true;
      r.keep = keep_;
      EXPECT_EQ(keep_.size(), live_.size());
      EXPECT_EQ(std::accumulate(keep_.begin(), keep_.end(), 0), r.target);
      Compact();
      policy_->OnEvict(keep_);
    }
    r.live = live_;
    return r;
  }

 private:
  explicit Driver(KvMethod method) : method_(method) {}

  // CAKE splits its budget over the sequence's layers: here the one layer is the whole group
  // (unlinked, it would keep the bound the controller reserves for).
  void LinkAlone() {
    if (method_ != KvMethod::kCake || !policy_) return;
    KvPolicy* p = policy_.get();
    LinkSequencePolicies(std::span<KvPolicy* const>(&p, 1), std::span<KvPolicy* const>(&p, 1));
  }

  static constexpr size_t kRow = static_cast<size_t>(kHeads) * kHeadDim;

  // The live tokens as the paged cache returns them: runs of up to kSpanTokens, ascending.
  std::vector<KvSpan> Spans() const {
    std::vector<KvSpan> spans;
    for (int32_t t = 0; t < n_live(); t += kSpanTokens) {
      KvSpan s;
      s.k = keys_.data() + static_cast<size_t>(t) * kRow;
      s.v = s.k;  // never read by a policy
      s.positions = live_.data() + t;
      s.n = std::min(kSpanTokens, n_live() - t);
      spans.push_back(s);
    }
    return spans;
  }

  void Compact() {
    size_t write = 0;
    for (size_t t = 0; t < live_.size(); ++t) {
      if (!keep_[t]) continue;
      live_[write] = live_[t];
      std::copy(keys_.begin() + t * kRow, keys_.begin() + (t + 1) * kRow, keys_.begin() + write * kRow);
      ++write;
    }
    live_.resize(write);
    keys_.resize(write * kRow);
  }

  KvMethod method_;
  std::unique_ptr<KvPolicy> policy_;
  std::vector<int32_t> live_;
  std::vector<float> keys_;  // [n_live, kHeads, kHeadDim]
  int32_t next_position_ = 0;
  int32_t n_seen_ = 0;
  std::vector<uint8_t> keep_;
};

// `n` positive values, normalized to sum to `total` (attention probabilities summed over queries).
std::vector<float> AttentionRow(int32_t n, float total, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(0.01f, 1.f);
  std::vector<float> row(n);
  float sum = 0.f;
  for (float& x : row) sum += x = dist(rng);
  for (float& x : row) x *= total / sum;
  return row;
}

StepInput MakeStep(const Driver& d, int32_t n_new, EvictionPoint point, int32_t window, std::mt19937& rng) {
  StepInput in;
  in.n_new = n_new;
  in.point = point;
  in.keys = testing::RandomNonZeroFloats(static_cast<size_t>(n_new) * kHeads * kHeadDim, rng);
  in.q = testing::RandomNonZeroFloats(static_cast<size_t>(kQHeads) * kHeadDim, rng);
  Observation& o = in.obs;
  o.n_heads = kHeads;
  o.n_tokens = d.n_live() + n_new;
  o.n_queries = n_new;
  for (int32_t i = 0; i < n_new; ++i) o.query_positions.push_back(d.next_position() + i);
  const float n_window = static_cast<float>(std::min(window > 0 ? window : n_new, n_new));
  for (int h = 0; h < kHeads; ++h) {
    for (float x : AttentionRow(o.n_tokens, static_cast<float>(n_new), rng)) o.sum_all.push_back(x);
    for (float x : AttentionRow(o.n_tokens, n_window, rng)) o.sum_window.push_back(x);
    for (float x : AttentionRow(o.n_tokens, 1.f, rng)) o.last.push_back(x);
  }
  return in;
}

// Feeds the same call to every driver and expects the same decisions; returns the first's.
// After a mismatch the drivers disagree on their live counts, so callers stop (HasFailure).
StepRecord StepAll(const std::vector<Driver*>& drivers, int32_t n_new, EvictionPoint point, std::mt19937& rng,
                   const std::string& what) {
  const StepInput in = MakeStep(*drivers[0], n_new, point, drivers[0]->policy().ObservationWindow(), rng);
  const StepRecord first = drivers[0]->Step(in);
  for (size_t i = 1; i < drivers.size(); ++i) {
    const StepRecord other = drivers[i]->Step(in);
    EXPECT_EQ(other, first) << what << ": driver " << i << " differs from driver 0";
  }
  return first;
}

// The run every test follows: a prompt of three chunks of 8 (trimmed to the budget after each),
// then decode steps.
constexpr int kPromptChunks = 3;
constexpr int kSteps = kPromptChunks + 24;
std::pair<int32_t, EvictionPoint> Schedule(int step) {
  if (step < kPromptChunks - 1) return {8, EvictionPoint::kPrefillChunk};
  if (step == kPromptChunks - 1) return {8, EvictionPoint::kPromptEnd};
  return {1, EvictionPoint::kDecodeStep};
}

class PolicyCloneTest : public ::testing::TestWithParam<KvMethod> {};

TEST_P(PolicyCloneTest, CloneContinuesLikeTheOriginalAndIsIndependent) {
  const KvMethod method = GetParam();
  const bool never_evicts = NeverEvicts(method);
  constexpr int kLayer = 1, kLayers = 4;  // PyramidKV's budget depends on both
  // Fork before anything, after one prompt chunk, at the prompt's end, and mid-decode.
  for (int fork_at : {0, 1, kPromptChunks, kPromptChunks + 7}) {
    SCOPED_TRACE("fork after step " + std::to_string(fork_at));
    // `original` and its twin `reference` see the same calls; a clone that shared state with
    // its original would make them diverge.
    Driver original(method, kLayer, kLayers), reference(method, kLayer, kLayers);
    ASSERT_TRUE(original.ok() && reference.ok());
    std::mt19937 rng(1000 + fork_at);
    int step = 0;
    for (; step < fork_at; ++step) {
      const auto [n, point] = Schedule(step);
      StepAll({&original, &reference}, n, point, rng, "before the fork, step " + std::to_string(step));
      if (HasFailure()) return;
    }

    auto clone = std::make_unique<Driver>(original.Fork());
    ASSERT_NE(&clone->policy(), &original.policy());
    EXPECT_EQ(clone->policy().name(), original.policy().name());
    EXPECT_EQ(clone->policy().NeededObservations(), original.policy().NeededObservations());
    EXPECT_EQ(clone->policy().BudgetTokens(100), original.policy().BudgetTokens(100));

    {
      // A second clone, driven with other inputs (more tokens, other attention and keys, other
      // evictions), then destroyed: the original must not notice.
      Driver divergent = original.Fork();
      std::mt19937 other_rng(7 + fork_at);
      StepAll({&divergent}, 5, EvictionPoint::kPromptEnd, other_rng, "divergent clone");
      for (int i = 0; i < 6; ++i) StepAll({&divergent}, 1, EvictionPoint::kDecodeStep, other_rng, "divergent clone");
    }

    int evictions = 0, narrowed = 0;
    const int half = fork_at + (kSteps - fork_at) / 2;
    for (; step < half; ++step) {
      const auto [n, point] = Schedule(step);
      const StepRecord r =
          StepAll({&original, &reference, clone.get()}, n, point, rng, "after the fork, step " + std::to_string(step));
      if (HasFailure()) return;
      evictions += r.selected && r.target < static_cast<int32_t>(r.keep.size());
      int32_t read = 0;
      for (const auto& run : r.spans) read += run.second;
      narrowed += !r.spans.empty() && read < static_cast<int32_t>(r.live.size());
    }
    // The clone must not depend on its original either: drop the original, go on.
    original = Driver(method, kLayer, kLayers);
    for (; step < kSteps; ++step) {
      const auto [n, point] = Schedule(step);
      const StepRecord r = StepAll({&reference, clone.get()}, n, point, rng,
                                   "after the original was dropped, step " + std::to_string(step));
      if (HasFailure()) return;
      evictions += r.selected && r.target < static_cast<int32_t>(r.keep.size());
      int32_t read = 0;
      for (const auto& run : r.spans) read += run.second;
      narrowed += !r.spans.empty() && read < static_cast<int32_t>(r.live.size());
    }
    // The run after the fork must exercise the state: evictions (or Quest's narrowed reads).
    if (!never_evicts) {
      EXPECT_GT(evictions, 2);
    }
    if (method == KvMethod::kQuest) {
      EXPECT_GT(narrowed, 2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllMethods, PolicyCloneTest, ::testing::ValuesIn(kAllMethods),
                         [](const ::testing::TestParamInfo<KvMethod>& info) {
                           return std::string(KvMethodName(info.param));
                         });

// Random's clone carries the generator's state: a clone continues the original's draws rather
// than restarting from the seed (which a fresh policy with the same seed would do).
TEST(RandomPolicyCloneTest, CloneContinuesTheGeneratorNotTheSeed) {
  Driver original(KvMethod::kRandom, 0, 1);
  std::mt19937 rng(3);
  for (int step = 0; step < kPromptChunks + 4; ++step) {
    const auto [n, point] = Schedule(step);
    StepAll({&original}, n, point, rng, "warm-up");
  }
  Driver clone = original.Fork();
  // A policy built from the seed with the same live count: same state except the generator.
  Driver reseeded(KvMethod::kRandom, 0, 1);
  StepAll({&reseeded}, original.n_live(), EvictionPoint::kPrefillChunk, rng, "reseeded");
  ASSERT_EQ(reseeded.n_live(), original.n_live());
  bool differs = false;
  for (int i = 0; i < 8; ++i) {
    const StepInput in = MakeStep(original, 3, EvictionPoint::kPromptEnd, 0, rng);
    const StepRecord a = original.Step(in), b = clone.Step(in), c = reseeded.Step(in);
    ASSERT_EQ(a, b) << "step " << i;
    differs |= a.keep != c.keep;
  }
  EXPECT_TRUE(differs) << "the reseeded policy drew the same subsets: the test cannot tell the generators apart";
}

}  // namespace
}  // namespace kvsparse::policy_test
