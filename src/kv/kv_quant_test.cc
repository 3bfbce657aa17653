#include "kv/kv_quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace kvsparse {
namespace {

// Random nonzero values with a per-row magnitude, so scales differ from row to row.
std::vector<float> RandomRows(int64_t n_rows, int row_len, std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_real_distribution<float> magnitude(0.01f, 50.f);
  std::vector<float> x(static_cast<size_t>(n_rows) * row_len);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float m = magnitude(rng);
    for (int i = 0; i < row_len; ++i) {
      float v;
      do v = unit(rng); while (v == 0.f);
      x[r * row_len + i] = v * m;
    }
  }
  return x;
}

const int kRowLens[] = {1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 128, 129};
const int64_t kRowCounts[] = {1, 2, 3, 7};

TEST(KvQuantTest, FastMatchesScalarTwinBitForBit) {
  std::mt19937 rng(1234);
  for (int row_len : kRowLens) {
    for (int64_t n_rows : kRowCounts) {
      const std::vector<float> x = RandomRows(n_rows, row_len, rng);
      std::vector<int8_t> q_fast(x.size(), 99), q_ref(x.size(), -99);
      std::vector<float> s_fast(n_rows, -1.f), s_ref(n_rows, -2.f);
      ops::QuantizeKvRowsInt8(x.data(), n_rows, row_len, q_fast.data(), s_fast.data());
      ref::QuantizeKvRowsInt8(x.data(), n_rows, row_len, q_ref.data(), s_ref.data());
      ASSERT_EQ(q_fast, q_ref) << "row_len " << row_len << " n_rows " << n_rows;
      ASSERT_EQ(0, std::memcmp(s_fast.data(), s_ref.data(), n_rows * sizeof(float))) << "row_len " << row_len;

      std::vector<float> d_fast(x.size(), 7.f), d_ref(x.size(), -7.f);
      ops::DequantizeKvRowsInt8(q_ref.data(), s_ref.data(), n_rows, row_len, d_fast.data());
      ref::DequantizeKvRowsInt8(q_ref.data(), s_ref.data(), n_rows, row_len, d_ref.data());
      ASSERT_EQ(0, std::memcmp(d_fast.data(), d_ref.data(), x.size() * sizeof(float))) << "row_len " << row_len;
    }
  }
}

TEST(KvQuantTest, RoundTripErrorIsAtMostHalfAStep) {
  std::mt19937 rng(99);
  for (int row_len : kRowLens) {
    const int64_t n_rows = 5;
    const std::vector<float> x = RandomRows(n_rows, row_len, rng);
    std::vector<int8_t> q(x.size());
    std::vector<float> scales(n_rows), back(x.size());
    ops::QuantizeKvRowsInt8(x.data(), n_rows, row_len, q.data(), scales.data());
    ops::DequantizeKvRowsInt8(q.data(), scales.data(), n_rows, row_len, back.data());
    for (int64_t r = 0; r < n_rows; ++r) {
      float amax = 0.f;
      for (int i = 0; i < row_len; ++i) amax = std::max(amax, std::fabs(x[r * row_len + i]));
      EXPECT_EQ(scales[r], amax / 127.f);
      // Half a step, plus float rounding in x / scale and q * scale (a few ulps of amax).
      const float bound = scales[r] * 0.5f + amax * 4e-7f;
      int max_abs_q = 0;
      for (int i = 0; i < row_len; ++i) {
        const size_t idx = r * row_len + i;
        EXPECT_LE(std::fabs(x[idx] - back[idx]), bound) << "row_len " << row_len << " row " << r << " i " << i;
        EXPECT_GE(q[idx], -127);
        max_abs_q = std::max(max_abs_q, std::abs(static_cast<int>(q[idx])));
      }
      EXPECT_EQ(max_abs_q, 127);  // the largest magnitude maps to ±127
    }
  }
}

TEST(KvQuantTest, ZeroRowHasZeroScaleAndZeroCodes) {
  for (int row_len : kRowLens) {
    std::vector<float> x(2 * row_len, 0.f);
    x[row_len] = -3.5f;  // second row is not all zero
    std::vector<int8_t> q_fast(x.size(), 5), q_ref(x.size(), 5);
    std::vector<float> s_fast(2, 1.f), s_ref(2, 1.f);
    ops::QuantizeKvRowsInt8(x.data(), 2, row_len, q_fast.data(), s_fast.data());
    ref::QuantizeKvRowsInt8(x.data(), 2, row_len, q_ref.data(), s_ref.data());
    EXPECT_EQ(s_fast[0], 0.f);
    EXPECT_EQ(s_ref[0], 0.f);
    for (int i = 0; i < row_len; ++i) {
      EXPECT_EQ(q_fast[i], 0);
      EXPECT_EQ(q_ref[i], 0);
    }
    EXPECT_EQ(q_fast[row_len], -127);
    EXPECT_EQ(q_fast, q_ref);
  }
}

}  // namespace
}  // namespace kvsparse
