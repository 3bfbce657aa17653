// Integer attention (AttentionShape::integer_dots, int8 KV): the AVX-512 family's VNNI kernel
// against its scalar twin (the scalar family), and every family against the float64 reference
// within the error bound the quantized query and probabilities allow (docs/DESIGN.md,
// "Integer attention").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/isa.h"
#include "ops/attention_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::LastPosition;
using testing::MakeSpans;
using testing::RandomQueries;
using testing::SpanSet;

class AttentionIntegerTest : public testing::PerIsaTest {};

struct Problem {
  AttentionShape shape;
  SpanSet set;
  std::vector<int32_t> q_pos;
  std::vector<float> q;  // [n_q, n_heads, head_dim]
  int n_q() const { return static_cast<int>(q_pos.size()); }
};

// Ragged spans (page-sized, short and long ones) and queries at, and before, the end: decode
// (n_q = 1) and a prefill tile.
Problem MakeProblem(int head_dim, int group, int n_q, std::mt19937& rng, float q_amplitude = 2.f) {
  Problem p;
  p.shape = AttentionShape{2 * group, 2, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
  p.shape.integer_dots = true;
  p.set = MakeSpans(KvStorage::kInt8, {37, 16, 5, 211, 16, 90}, p.shape.n_kv_heads, head_dim, rng);
  const int32_t last = LastPosition(p.set);
  for (int i = 0; i < n_q; ++i) p.q_pos.push_back(last - (n_q - 1 - i) * 7);
  p.q = RandomQueries(static_cast<size_t>(n_q) * p.shape.n_heads * head_dim, rng, q_amplitude);
  return p;
}

std::vector<float> RunOps(const Problem& p, int n_threads) {
  std::vector<float> out(p.q.size());
  ops::Attention(p.shape, KvStorage::kInt8, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                 static_cast<int32_t>(p.set.spans.size()), out.data(), n_threads);
  return out;
}

// Per output element, the most the integer kernel may differ from the exact attention:
// - q.k: each pre-scaled query dim is off by at most half its lo part's step (amax / 127 / 254 / 2),
//   so a score by at most delta_t = k_scale_t * sum_g step_g / 508 * sum_(d in g) |k_code_d|; the
//   probabilities then move by a factor within e^(+-2 delta), the output by expm1(2 delta) max|v|.
// - p.v: each probability times its V scale is off by at most half its lo step (max over the
//   block / 255 / 255), i.e. by M_t / (255 * 510) with M_t the largest P v_scale among the 31 tokens
//   around t (any 16-token block holding t lies among them); summed with |v_code|.
// - f32 rounding of the kernel's sums: 1e-6 relative to max|v|.
std::vector<double> ErrorBound(const Problem& p) {
  const AttentionShape& shape = p.shape;
  const int d = shape.head_dim, group = shape.n_heads / shape.n_kv_heads;
  const int dp = d;  // a multiple of 64 here
  const int n_groups = d / 32;
  // The tokens as one sequence: codes and scales per kv head.
  struct Token {
    const int8_t* k;
    const int8_t* v;
    const float* k_scale;
    const float* v_scale;
    int32_t pos;
  };
  std::vector<Token> tokens;
  for (const KvSpan& s : p.set.spans) {
    for (int t = 0; t < s.n; ++t) {
      const size_t row = static_cast<size_t>(t) * shape.n_kv_heads;
      tokens.push_back({static_cast<const int8_t*>(s.k) + row * d, static_cast<const int8_t*>(s.v) + row * d,
                        s.k_scale + row, s.v_scale + row, s.positions[t]});
    }
  }
  const int n = static_cast<int>(tokens.size());
  std::vector<double> bound(p.q.size());
  const double log2e = 1.4426950408889634;
  for (int i = 0; i < p.n_q(); ++i) {
    for (int h = 0; h < shape.n_heads; ++h) {
      const int kv = h / group;
      const float* q = p.q.data() + (static_cast<size_t>(i) * shape.n_heads + h) * d;
      // The kernel's pre-scaled row (log2 domain) and its group steps.
      std::vector<double> step(n_groups);
      for (int g = 0; g < n_groups; ++g) {
        float amax = 0.f;
        for (int c = 32 * g; c < 32 * g + 32; ++c) amax = std::max(amax, std::fabs(q[c] * (shape.scale * 1.4426950408889634f)));
        step[g] = amax / 127.0;
      }
      // Exact scores (natural log), probabilities, score error bound, V magnitude.
      std::vector<double> s(n, -INFINITY), score_err(n, 0.0);
      double max_s = -INFINITY, max_v = 0.0, delta = 0.0;
      for (int t = 0; t < n; ++t) {
        if (tokens[t].pos > p.q_pos[i]) continue;
        const int8_t* k = tokens[t].k + static_cast<size_t>(kv) * d;
        double dot = 0.0, err = 0.0;
        for (int c = 0; c < d; ++c) {
          dot += static_cast<double>(q[c]) * k[c];
          err += step[c / 32] / 508 * std::abs(k[c]);
        }
        s[t] = dot * tokens[t].k_scale[kv] * shape.scale;
        delta = std::max(delta, err * tokens[t].k_scale[kv] / log2e);
        max_s = std::max(max_s, s[t]);
        for (int c = 0; c < d; ++c) max_v = std::max(max_v, std::abs(tokens[t].v[kv * d + c] * double{tokens[t].v_scale[kv]}));
      }
      double sum = 0.0;
      for (int t = 0; t < n; ++t) sum += s[t] == -INFINITY ? 0.0 : std::exp(s[t] - max_s);
      const double spread = std::expm1(2 * delta);
      std::vector<double> pv(n, 0.0);  // P_t v_scale_t, widened by the score error
      for (int t = 0; t < n; ++t) {
        if (s[t] != -INFINITY) pv[t] = std::exp(s[t] - max_s) / sum * (1 + spread) * tokens[t].v_scale[kv];
      }
      std::vector<double> around(n, 0.0);  // M_t
      for (int t = 0; t < n; ++t) {
        if (pv[t] == 0.0) continue;
        for (int u = std::max(0, t - 15); u <= std::min(n - 1, t + 15); ++u) around[t] = std::max(around[t], pv[u]);
      }
      for (int c = 0; c < dp; ++c) {
        double pv_err = 0.0;
        for (int t = 0; t < n; ++t) pv_err += around[t] / (255.0 * 510) * std::abs(tokens[t].v[kv * d + c]);
        bound[(static_cast<size_t>(i) * shape.n_heads + h) * d + c] = spread * max_v + pv_err + 1e-6 * max_v;
      }
    }
  }
  return bound;
}

// Head sizes 64 and 128, GQA groups 1, 4 and 8, decode and a prefill tile, one and two threads
// (two split the tokens into chunks that are merged).
TEST_P(AttentionIntegerTest, WithinBoundOfExactReference) {
  std::mt19937 rng(2027);
  for (int head_dim : {64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int n_q : {1, 5}) {
        const Problem p = MakeProblem(head_dim, group, n_q, rng);
        std::vector<float> exact(p.q.size());
        ref::Attention(p.shape, KvStorage::kInt8, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                       static_cast<int32_t>(p.set.spans.size()), exact.data());
        const std::vector<double> bound = ErrorBound(p);
        // The format's own error: the exact attention over the values before int8 quantization.
        const std::vector<KvSpan> f32_spans = testing::OriginalSpans(p.set);
        std::vector<float> original(p.q.size());
        ref::Attention(p.shape, KvStorage::kF32, p.q.data(), p.q_pos.data(), p.n_q(), f32_spans.data(),
                       static_cast<int32_t>(f32_spans.size()), original.data());
        double format2 = 0;
        for (size_t e = 0; e < original.size(); ++e) format2 += (exact[e] - original[e]) * (exact[e] - original[e]);
        for (int n_threads : {1, 2}) {
          const std::vector<float> got = RunOps(p, n_threads);
          double worst = 0.0;  // the largest error as a share of its bound
          for (size_t e = 0; e < got.size(); ++e) {
            ASSERT_LE(std::fabs(got[e] - exact[e]), bound[e])
                << "d" << head_dim << " g" << group << " q" << n_q << " t" << n_threads << " element " << e;
            worst = std::max(worst, std::fabs(got[e] - exact[e]) / bound[e]);
          }
          RecordProperty("worst_share_d" + std::to_string(head_dim) + "_g" + std::to_string(group),
                         std::to_string(worst));
          // Next to the format's own error (the values' int8 rounding) the kernel's is negligible.
          double err2 = 0;
          for (size_t e = 0; e < got.size(); ++e) err2 += (got[e] - exact[e]) * (got[e] - exact[e]);
          EXPECT_LE(std::sqrt(err2), 0.02 * std::sqrt(format2)) << "d" << head_dim << " g" << group << " q" << n_q;
        }
      }
    }
  }
}

// The VNNI kernel against its scalar twin: the same codes and integer sums; only the softmax's
// exp2 differs (a polynomial against std::exp2, about 1 ulp), which moves a probability by about
// 1e-7 (a code flip between hi and lo keeps the value): measured up to 3.2e-7 of max|v| here.
TEST_P(AttentionIntegerTest, VnniKernelMatchesScalarTwin) {
  if (GetParam() != Isa::kAvx512) GTEST_SKIP() << "only the avx512 family has an integer kernel besides the twin";
  std::mt19937 rng(99);
  for (int head_dim : {64, 128}) {
    for (int group : {1, 4, 8}) {
      for (int n_q : {1, 5}) {
        const Problem p = MakeProblem(head_dim, group, n_q, rng);
        const std::vector<float> vnni = RunOps(p, 2);
        std::vector<float> twin;
        {
          testing::IsaGuard guard;
          ASSERT_TRUE(SetIsa(Isa::kScalar).ok());
          twin = RunOps(p, 2);
        }
        double max_v = 0.0;
        for (const std::vector<float>& v : p.set.v_f32)
          for (float x : v) max_v = std::max(max_v, static_cast<double>(std::fabs(x)));
        for (size_t e = 0; e < vnni.size(); ++e) {
          ASSERT_NEAR(vnni[e], twin[e], 4e-6 * max_v)
              << "d" << head_dim << " g" << group << " q" << n_q << " element " << e;
        }
      }
    }
  }
}

// The scores themselves, bit for bit: the AVX-512 family quantizes the query rows 16 dims at a
// time (QuantizeQueries) with the scalar QuantizeQueryRows' float operations, so its codes,
// steps and sums, hence its exact integer dots and their combination, equal the twin's.
TEST_P(AttentionIntegerTest, VnniScoresEqualScalarTwinBitForBit) {
  if (GetParam() != Isa::kAvx512) GTEST_SKIP() << "only the avx512 family has an integer kernel besides the twin";
  std::mt19937 rng(123);
  for (int head_dim : {64, 128}) {
    for (int group : {1, 4, 8}) {
      for (float amplitude : {0.01f, 2.f, 300.f}) {
        const Problem p = MakeProblem(head_dim, group, 3, rng, amplitude);
        int64_t n_tokens = 0;
        for (const KvSpan& s : p.set.spans) n_tokens += s.n;
        auto raw_scores = [&] {
          std::vector<float> out(p.q.size()), raw(p.q.size() / head_dim * n_tokens);
          AttentionJob job{p.set.spans.data(), static_cast<int32_t>(p.set.spans.size()), 0, p.q.data(), out.data()};
          job.raw_scores = raw.data();
          ops::AttentionBatch(p.shape, p.shape.n_kv_heads, KvStorage::kInt8, p.q_pos.data(), p.n_q(), &job, 1, 2);
          return raw;
        };
        const std::vector<float> vnni = raw_scores();
        std::vector<float> twin;
        {
          testing::IsaGuard guard;
          ASSERT_TRUE(SetIsa(Isa::kScalar).ok());
          twin = raw_scores();
        }
        for (size_t e = 0; e < vnni.size(); ++e) {
          ASSERT_EQ(vnni[e], twin[e]) << "d" << head_dim << " g" << group << " amplitude " << amplitude
                                      << " score " << e;
        }
      }
    }
  }
}

// Scores hundreds of nats apart: most blocks' probabilities fall below 2^-127 (times V scales
// of 0.01, below f32's normal range), where a block's step would overflow; they count as zero
// and the result stays finite and within the bound.
TEST_P(AttentionIntegerTest, ExtremeScoreGapsStayWithinBound) {
  std::mt19937 rng(7);
  const Problem p = MakeProblem(64, 4, 3, rng, /*q_amplitude=*/40.f);
  std::vector<float> exact(p.q.size());
  ref::Attention(p.shape, KvStorage::kInt8, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                 static_cast<int32_t>(p.set.spans.size()), exact.data());
  const std::vector<double> bound = ErrorBound(p);
  const std::vector<float> got = RunOps(p, 2);
  for (size_t e = 0; e < got.size(); ++e) {
    ASSERT_TRUE(std::isfinite(got[e])) << "element " << e;
    ASSERT_LE(std::fabs(got[e] - exact[e]), bound[e]) << "element " << e;
  }
}

// Off (the default), int8 attention stays the exact f32 path in every family.
TEST_P(AttentionIntegerTest, OffKeepsExactPath) {
  std::mt19937 rng(5);
  Problem p = MakeProblem(64, 4, 3, rng);
  p.shape.integer_dots = false;
  std::vector<float> exact(p.q.size());
  ref::Attention(p.shape, KvStorage::kInt8, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                 static_cast<int32_t>(p.set.spans.size()), exact.data());
  const std::vector<float> got = RunOps(p, 2);
  for (size_t e = 0; e < got.size(); ++e) ASSERT_NEAR(got[e], exact[e], 2e-5f + 2e-4f * std::fabs(exact[e]));
}

KVS_INSTANTIATE_PER_ISA(AttentionIntegerTest);

}  // namespace
}  // namespace kvsparse
