// Vector kernels (Highway) against their scalar twins and hand-written formulas, ragged sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kvsparse/ops.h"
#include "ops/ops_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

// Every test runs once per kernel family.
class VectorOpsTest : public testing::PerIsaTest {};

using testing::RandomFloats;

const int64_t kSizes[] = {1, 3, 15, 16, 17, 33, 100, 2048, 5632};

TEST_P(VectorOpsTest, DotMatchesReference) {
  for (int64_t n : kSizes) {
    const auto a = RandomFloats(n, 1), b = RandomFloats(n, 2);
    double magnitude = 0;
    for (int64_t i = 0; i < n; ++i) magnitude += std::fabs(a[i] * b[i]);
    EXPECT_NEAR(ops::Dot(a.data(), b.data(), n), ref::Dot(a.data(), b.data(), n), 1e-6 * magnitude + 1e-7) << n;
  }
  EXPECT_EQ(ops::Dot(nullptr, nullptr, 0), 0.f);
}

TEST_P(VectorOpsTest, RmsNormMatchesReferenceAndFormula) {
  for (int64_t n : kSizes) {
    const auto x = RandomFloats(n, 3), w = RandomFloats(n, 4);
    std::vector<float> got(n), want(n);
    ops::RmsNorm(x.data(), w.data(), got.data(), n, 1e-5f);
    ref::RmsNorm(x.data(), w.data(), want.data(), n, 1e-5f);
    double ss = 0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double inv_rms = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7) << n << " " << i;
      ASSERT_NEAR(want[i], x[i] * inv_rms * w[i], 1e-5 * std::fabs(want[i]) + 1e-7);
    }
  }
}

TEST_P(VectorOpsTest, RmsNormInPlace) {
  auto x = RandomFloats(33, 5);
  const auto w = RandomFloats(33, 6);
  std::vector<float> want(33);
  ref::RmsNorm(x.data(), w.data(), want.data(), 33, 1e-6f);
  ops::RmsNorm(x.data(), w.data(), x.data(), 33, 1e-6f);
  for (int i = 0; i < 33; ++i) EXPECT_NEAR(x[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7);
}

// Hand-written RoPE for one head with double precision angles.
void RopeFormula(std::vector<double>& head, int32_t pos, const std::vector<float>& inv_freq, RopeStyle style) {
  const int half = static_cast<int>(head.size()) / 2;
  for (int i = 0; i < half; ++i) {
    const double theta = static_cast<double>(static_cast<float>(pos) * inv_freq[i]);
    const int i0 = style == RopeStyle::kNeox ? i : 2 * i;
    const int i1 = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    const double a = head[i0], b = head[i1];
    head[i0] = a * std::cos(theta) - b * std::sin(theta);
    head[i1] = a * std::sin(theta) + b * std::cos(theta);
  }
}

TEST_P(VectorOpsTest, RopeBothStylesMatchFormula) {
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kNeox}) {
    for (int head_dim : {2, 8, 64, 128}) {
      for (int n_heads : {1, 3, 32}) {
        for (int32_t pos : {0, 1, 7, 511, 4095}) {
          std::vector<float> inv_freq(head_dim / 2);
          for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(10000.f, -2.f * i / head_dim);
          auto x = RandomFloats(static_cast<int64_t>(n_heads) * head_dim, pos + head_dim);
          auto x_ref = x;
          ops::Rope(x.data(), n_heads, head_dim, pos, inv_freq.data(), style);
          ref::Rope(x_ref.data(), n_heads, head_dim, pos, inv_freq.data(), style);
          for (int h = 0; h < n_heads; ++h) {
            const auto input = RandomFloats(static_cast<int64_t>(n_heads) * head_dim, pos + head_dim);
            std::vector<double> head(input.begin() + h * head_dim, input.begin() + (h + 1) * head_dim);
            RopeFormula(head, pos, inv_freq, style);
            for (int i = 0; i < head_dim; ++i) {
              const float tol = 1e-5f * (1.f + std::fabs(x_ref[h * head_dim + i]));
              ASSERT_NEAR(x_ref[h * head_dim + i], head[i], 4 * tol) << "ref vs formula";
              ASSERT_NEAR(x[h * head_dim + i], x_ref[h * head_dim + i], tol) << "ops vs ref";
            }
          }
        }
      }
    }
  }
}

TEST_P(VectorOpsTest, RopeStylesPairDifferentElements) {
  // head_dim 4, pos 1, one frequency of pi/2 (pair 0) and 0 (pair 1).
  const float inv_freq[2] = {static_cast<float>(M_PI / 2), 0.f};
  float adjacent[4] = {1, 2, 3, 4};
  ops::Rope(adjacent, 1, 4, 1, inv_freq, RopeStyle::kAdjacentPairs);
  EXPECT_NEAR(adjacent[0], -2, 1e-6);  // (1, 2) rotated by 90 degrees
  EXPECT_NEAR(adjacent[1], 1, 1e-6);
  EXPECT_NEAR(adjacent[2], 3, 1e-6);
  EXPECT_NEAR(adjacent[3], 4, 1e-6);
  float neox[4] = {1, 2, 3, 4};
  ops::Rope(neox, 1, 4, 1, inv_freq, RopeStyle::kNeox);
  EXPECT_NEAR(neox[0], -3, 1e-6);  // (1, 3) rotated by 90 degrees
  EXPECT_NEAR(neox[2], 1, 1e-6);
  EXPECT_NEAR(neox[1], 2, 1e-6);
  EXPECT_NEAR(neox[3], 4, 1e-6);
}

TEST_P(VectorOpsTest, SiluMulMatchesReference) {
  for (int64_t n : kSizes) {
    auto g = RandomFloats(n, 7, 6.f);
    const auto up = RandomFloats(n, 8);
    if (n > 3) {
      g[0] = -200.f;  // exp(-g) would overflow
      g[1] = 200.f;
      g[2] = -90.f;
    }
    auto g_ref = g;
    ops::SiluMul(g.data(), up.data(), n);
    ref::SiluMul(g_ref.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(g[i], g_ref[i], 2e-6 * std::fabs(g_ref[i]) + 1e-30) << n << " " << i;
  }
}

TEST_P(VectorOpsTest, SwigluClampedMulMatchesReference) {
  for (int64_t n : kSizes) {
    auto g = RandomFloats(n, 27, 10.f);  // past the clamp at 7 both ways
    const auto up = RandomFloats(n, 28, 10.f);
    if (n > 3) {
      g[0] = -200.f;  // exp(-alpha g) would overflow
      g[1] = 200.f;
    }
    auto g_ref = g;
    ops::SwigluClampedMul(g.data(), up.data(), n);
    ref::SwigluClampedMul(g_ref.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(g[i], g_ref[i], 4e-6 * std::fabs(g_ref[i]) + 1e-30) << n << " " << i;
  }
}

TEST_P(VectorOpsTest, GeluMulMatchesReference) {
  for (int64_t n : kSizes) {
    auto g = RandomFloats(n, 17, 6.f);
    const auto up = RandomFloats(n, 18);
    if (n > 3) {
      g[0] = -40.f;  // tanh saturates both ways
      g[1] = 40.f;
    }
    auto g_ref = g;
    ops::GeluMul(g.data(), up.data(), n);
    ref::GeluMul(g_ref.data(), up.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(g[i], g_ref[i], 4e-6 * std::fabs(up[i]) * (1.f + std::fabs(g_ref[i]))) << n << " " << i;
    }
  }
}

TEST_P(VectorOpsTest, SoftcapMatchesReference) {
  for (int64_t n : kSizes) {
    auto x = RandomFloats(n, 19, 80.f);
    auto x_ref = x;
    ops::SoftcapInPlace(x.data(), n, 30.f);
    ref::SoftcapInPlace(x_ref.data(), n, 30.f);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(x[i], x_ref[i], 4e-6f * 30.f) << n << " " << i;
      ASSERT_LE(std::fabs(x[i]), 30.f);
    }
  }
}

TEST_P(VectorOpsTest, SoftmaxMatchesReference) {
  for (int64_t n : kSizes) {
    auto x = RandomFloats(n, 9, 10.f);
    if (n > 3) x[1] = -std::numeric_limits<float>::infinity();  // masked entry
    auto x_ref = x;
    ops::Softmax(x.data(), n);
    ref::Softmax(x_ref.data(), n);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(x[i], x_ref[i], 2e-6 * x_ref[i] + 1e-12) << n << " " << i;
      sum += x[i];
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
    if (n > 3) {
      EXPECT_EQ(x[1], 0.f);
    }
  }
}

TEST_P(VectorOpsTest, SoftmaxHandlesLargeValues) {
  std::vector<float> x = {1000.f, 1000.f, 999.f};
  ops::Softmax(x.data(), 3);
  EXPECT_NEAR(x[0], 0.4223188, 1e-6);
  EXPECT_NEAR(x[2], 0.1553624, 1e-6);
}

TEST_P(VectorOpsTest, AddMatchesReference) {
  for (int64_t n : kSizes) {
    auto y = RandomFloats(n, 10);
    const auto x = RandomFloats(n, 11);
    auto y_ref = y;
    ops::Add(y.data(), x.data(), n);
    ref::Add(y_ref.data(), x.data(), n);
    ASSERT_EQ(y, y_ref);
  }
}

KVS_INSTANTIATE_PER_ISA(VectorOpsTest);

}  // namespace
}  // namespace kvsparse
