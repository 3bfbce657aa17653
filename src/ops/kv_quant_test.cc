#include "ops/kv_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <random>
#include <vector>

#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

// Every test runs once per kernel family.
class KvQuantTest : public testing::PerIsaTest {};

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

TEST_P(KvQuantTest, FastMatchesScalarTwinBitForBit) {
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

TEST_P(KvQuantTest, RoundTripErrorIsAtMostHalfAStep) {
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

TEST_P(KvQuantTest, ZeroRowHasZeroScaleAndZeroCodes) {
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

// ---- per-channel (int8_kivi keys) ----

// Rows whose columns have very different magnitudes (a few "outlier channels", as in keys).
std::vector<float> RandomColumns(int64_t n_rows, int row_len, std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_real_distribution<float> magnitude(0.01f, 50.f);
  std::vector<float> column_magnitude(row_len);
  for (float& m : column_magnitude) m = magnitude(rng);
  std::vector<float> x(static_cast<size_t>(n_rows) * row_len);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int i = 0; i < row_len; ++i) {
      float v;
      do v = unit(rng); while (v == 0.f);
      x[r * row_len + i] = v * column_magnitude[i];
    }
  }
  return x;
}

TEST_P(KvQuantTest, ColumnsFastMatchesScalarTwinBitForBit) {
  std::mt19937 rng(4321);
  for (int row_len : kRowLens) {
    for (int64_t n_rows : {1, 2, 5, 16, 17}) {
      const std::vector<float> x = RandomColumns(n_rows, row_len, rng);
      std::vector<int8_t> q_fast(x.size(), 99), q_ref(x.size(), -99);
      std::vector<float> s_fast(row_len, -1.f), s_ref(row_len, -2.f);
      ops::QuantizeKvColumnsInt8(x.data(), n_rows, row_len, q_fast.data(), s_fast.data());
      ref::QuantizeKvColumnsInt8(x.data(), n_rows, row_len, q_ref.data(), s_ref.data());
      ASSERT_EQ(q_fast, q_ref) << "row_len " << row_len << " n_rows " << n_rows;
      ASSERT_EQ(0, std::memcmp(s_fast.data(), s_ref.data(), row_len * sizeof(float))) << "row_len " << row_len;

      std::vector<float> d_fast(x.size(), 7.f), d_ref(x.size(), -7.f);
      ops::DequantizeKvColumnsInt8(q_ref.data(), s_ref.data(), n_rows, row_len, d_fast.data());
      ref::DequantizeKvColumnsInt8(q_ref.data(), s_ref.data(), n_rows, row_len, d_ref.data());
      ASSERT_EQ(0, std::memcmp(d_fast.data(), d_ref.data(), x.size() * sizeof(float))) << "row_len " << row_len;
    }
  }
}

TEST_P(KvQuantTest, ColumnsRoundTripErrorIsAtMostHalfAChannelStep) {
  std::mt19937 rng(98);
  for (int row_len : kRowLens) {
    const int64_t n_rows = 16;
    const std::vector<float> x = RandomColumns(n_rows, row_len, rng);
    std::vector<int8_t> q(x.size());
    std::vector<float> scales(row_len), back(x.size());
    ops::QuantizeKvColumnsInt8(x.data(), n_rows, row_len, q.data(), scales.data());
    ops::DequantizeKvColumnsInt8(q.data(), scales.data(), n_rows, row_len, back.data());
    for (int c = 0; c < row_len; ++c) {
      float amax = 0.f;
      for (int64_t r = 0; r < n_rows; ++r) amax = std::max(amax, std::fabs(x[r * row_len + c]));
      EXPECT_EQ(scales[c], amax / 127.f);
      const float bound = scales[c] * 0.5f + amax * 4e-7f;  // half a step + float rounding
      int max_abs_q = 0;
      for (int64_t r = 0; r < n_rows; ++r) {
        const size_t idx = r * row_len + c;
        EXPECT_LE(std::fabs(x[idx] - back[idx]), bound) << "row_len " << row_len << " column " << c;
        EXPECT_GE(q[idx], -127);
        max_abs_q = std::max(max_abs_q, std::abs(static_cast<int>(q[idx])));
      }
      EXPECT_EQ(max_abs_q, 127) << "the column's largest magnitude maps to ±127";
    }
  }
}

// A column of zeros gets scale 0 and codes 0 (no 0/0), its neighbours are unaffected.
TEST_P(KvQuantTest, ColumnsZeroColumnIsExact) {
  for (int row_len : kRowLens) {
    std::mt19937 rng(row_len);
    std::vector<float> x = RandomColumns(3, row_len, rng);
    for (int r = 0; r < 3; ++r) x[r * row_len + row_len / 2] = 0.f;
    std::vector<int8_t> q_fast(x.size(), 5), q_ref(x.size(), 5);
    std::vector<float> s_fast(row_len, 1.f), s_ref(row_len, 1.f);
    ops::QuantizeKvColumnsInt8(x.data(), 3, row_len, q_fast.data(), s_fast.data());
    ref::QuantizeKvColumnsInt8(x.data(), 3, row_len, q_ref.data(), s_ref.data());
    EXPECT_EQ(s_fast[row_len / 2], 0.f);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(q_fast[r * row_len + row_len / 2], 0);
    EXPECT_EQ(q_fast, q_ref);
  }
}

// Compaction regroups already quantized keys: dequantize, requantize with the new group's
// scales. Each regrouping adds at most half a step of the new scale, so after one the error
// is at most (old scale + new scale) / 2 per element; the new scale is at most the largest
// old scale of the tokens gathered (dequantized values never exceed max|x|).
TEST_P(KvQuantTest, ColumnsRequantizationAddsAtMostHalfANewStep) {
  std::mt19937 rng(77);
  const int row_len = 96;
  const int64_t group = 16;
  const std::vector<float> a = RandomColumns(group, row_len, rng), b = RandomColumns(group, row_len, rng);
  std::vector<int8_t> qa(a.size()), qb(b.size()), q_new(a.size());
  std::vector<float> sa(row_len), sb(row_len), s_new(row_len);
  ops::QuantizeKvColumnsInt8(a.data(), group, row_len, qa.data(), sa.data());
  ops::QuantizeKvColumnsInt8(b.data(), group, row_len, qb.data(), sb.data());
  std::vector<float> da(a.size()), db(b.size());
  ops::DequantizeKvColumnsInt8(qa.data(), sa.data(), group, row_len, da.data());
  ops::DequantizeKvColumnsInt8(qb.data(), sb.data(), group, row_len, db.data());
  // The new group: the even rows of a (survivors) then the odd rows of b (moved in).
  std::vector<float> merged, original;
  std::vector<const float*> old_scale;
  for (int64_t r = 0; r < group; ++r) {
    const bool from_a = r < group / 2;
    const int64_t src = from_a ? 2 * r : 2 * (r - group / 2) + 1;
    const std::vector<float>& d = from_a ? da : db;
    const std::vector<float>& x = from_a ? a : b;
    merged.insert(merged.end(), d.begin() + src * row_len, d.begin() + (src + 1) * row_len);
    original.insert(original.end(), x.begin() + src * row_len, x.begin() + (src + 1) * row_len);
    old_scale.push_back(from_a ? sa.data() : sb.data());
  }
  std::vector<float> back(merged.size());
  ops::QuantizeKvColumnsInt8(merged.data(), group, row_len, q_new.data(), s_new.data());
  ops::DequantizeKvColumnsInt8(q_new.data(), s_new.data(), group, row_len, back.data());
  float worst_extra = 0.f;
  for (int c = 0; c < row_len; ++c) {
    EXPECT_LE(s_new[c], std::max(sa[c], sb[c]) * (1 + 1e-6f));
    for (int64_t r = 0; r < group; ++r) {
      const size_t idx = r * row_len + c;
      const float bound = (old_scale[r][c] + s_new[c]) * 0.5f * (1 + 1e-5f);
      EXPECT_LE(std::fabs(back[idx] - original[idx]), bound) << "row " << r << " column " << c;
      worst_extra = std::max(worst_extra, std::fabs(back[idx] - merged[idx]) / s_new[c]);
    }
  }
  EXPECT_LE(worst_extra, 0.5f + 1e-5f);
}

KVS_INSTANTIATE_PER_ISA(KvQuantTest);

// fp8 codes (scalar on every family, so plain tests). Each format's parameters, from its definition.
struct Fp8Format {
  KvStorage storage;
  int mantissa_bits, bias;
  uint8_t max_code;  // the largest finite positive code
};
constexpr Fp8Format kFp8Formats[] = {{KvStorage::kFp8E4M3, 3, 7, 0x7E}, {KvStorage::kFp8E5M2, 2, 15, 0x7B}};

// The value of a finite code, straight from the format's definition.
double Fp8Value(const Fp8Format& f, uint8_t code) {
  const int exponent = (code & 0x7F) >> f.mantissa_bits;
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, 1 - f.bias - f.mantissa_bits)
                                         : std::ldexp(1.0 + std::ldexp(mantissa, -f.mantissa_bits), exponent - f.bias);
  return (code & 0x80) ? -magnitude : magnitude;
}

// Finite codes: e4m3 has no infinities and one NaN per sign (0x7F); e5m2's top exponent is inf/NaN.
bool IsFiniteCode(const Fp8Format& f, uint8_t code) { return (code & 0x7F) <= f.max_code; }

TEST(Fp8Codec, DecodeFollowsTheFormatDefinition) {
  for (const Fp8Format& f : kFp8Formats) {
    for (int code = 0; code < 256; ++code) {
      if (!IsFiniteCode(f, static_cast<uint8_t>(code))) continue;
      EXPECT_EQ(ops::DecodeFp8(f.storage, static_cast<uint8_t>(code)), Fp8Value(f, static_cast<uint8_t>(code)))
          << KvStorageName(f.storage) << " code " << code;
    }
    EXPECT_EQ(ops::DecodeFp8(f.storage, f.max_code), ops::Fp8Max(f.storage));
  }
}

TEST(Fp8Codec, EncodeRoundsToNearestTiesToEvenAndSaturates) {
  std::mt19937 rng(77);
  for (const Fp8Format& f : kFp8Formats) {
    // Every finite code decodes and encodes back to itself.
    for (int code = 0; code < 256; ++code) {
      if (!IsFiniteCode(f, static_cast<uint8_t>(code))) continue;
      const float value = ops::DecodeFp8(f.storage, static_cast<uint8_t>(code));
      EXPECT_EQ(ops::EncodeFp8(f.storage, value), code) << KvStorageName(f.storage);
    }
    // Midpoints between neighbouring positive codes go to the even code, and points just off a
    // midpoint to the nearer code.
    for (uint8_t code = 0; code < f.max_code; ++code) {
      const double lo = Fp8Value(f, code), hi = Fp8Value(f, code + 1);
      const double mid = (lo + hi) / 2;
      const uint8_t even = code % 2 == 0 ? code : code + 1;
      EXPECT_EQ(ops::EncodeFp8(f.storage, static_cast<float>(mid)), even) << KvStorageName(f.storage) << " " << mid;
      EXPECT_EQ(ops::EncodeFp8(f.storage, static_cast<float>(-mid)), 0x80 | even);
      EXPECT_EQ(ops::EncodeFp8(f.storage, std::nextafter(static_cast<float>(mid), 0.f)), code);
      EXPECT_EQ(ops::EncodeFp8(f.storage, std::nextafter(static_cast<float>(mid), 1e30f)), code + 1);
    }
    // Random values: the code is the nearest finite one.
    std::uniform_real_distribution<float> log_magnitude(-24.f, 18.f);
    for (int i = 0; i < 5000; ++i) {
      const float y = (rng() % 2 ? -1.f : 1.f) * std::exp2(log_magnitude(rng));
      const uint8_t code = ops::EncodeFp8(f.storage, y);
      ASSERT_TRUE(IsFiniteCode(f, code));
      const double err = std::fabs(Fp8Value(f, code) - y);
      const float clamped = std::clamp(y, -ops::Fp8Max(f.storage), ops::Fp8Max(f.storage));
      for (int other = 0; other < 256; ++other) {
        if (!IsFiniteCode(f, static_cast<uint8_t>(other))) continue;
        ASSERT_LE(err, std::fabs(Fp8Value(f, static_cast<uint8_t>(other)) - clamped) + std::fabs(y - clamped))
            << KvStorageName(f.storage) << " y " << y << " code " << int{code} << " other " << other;
      }
    }
    EXPECT_EQ(ops::EncodeFp8(f.storage, 1e30f), f.max_code);
    EXPECT_EQ(ops::EncodeFp8(f.storage, -1e30f), 0x80 | f.max_code);
    EXPECT_EQ(ops::EncodeFp8(f.storage, std::numeric_limits<float>::infinity()), f.max_code);
    EXPECT_EQ(ops::EncodeFp8(f.storage, std::nanf("")), 0);
  }
}

// The documented bound: |x - scale * fp8(code)| <= max(|x| 2^-(M+1), scale 2^-(bias+M)).
TEST(Fp8Codec, RowQuantizationStaysWithinTheStatedBound) {
  std::mt19937 rng(5);
  for (const Fp8Format& f : kFp8Formats) {
    for (int row_len : kRowLens) {
      for (int64_t n_rows : kRowCounts) {
        std::vector<float> x = RandomRows(n_rows, row_len, rng);
        // Values near zero too, into the subnormal range.
        for (size_t i = 0; i < x.size(); i += 5) x[i] *= 1e-5f;
        std::vector<uint8_t> codes(x.size());
        std::vector<float> scales(n_rows), back(x.size());
        ops::QuantizeKvRowsFp8(f.storage, x.data(), n_rows, row_len, codes.data(), scales.data());
        ops::DequantizeKvRowsFp8(f.storage, codes.data(), scales.data(), n_rows, row_len, back.data());
        for (int64_t r = 0; r < n_rows; ++r) {
          float amax = 0.f;
          for (int i = 0; i < row_len; ++i) amax = std::max(amax, std::fabs(x[r * row_len + i]));
          ASSERT_EQ(scales[r], amax / ops::Fp8Max(f.storage));
          for (int i = 0; i < row_len; ++i) {
            const size_t e = static_cast<size_t>(r) * row_len + i;
            const double bound = std::max<double>(std::ldexp(std::fabs(x[e]), -(f.mantissa_bits + 1)),
                                          std::ldexp(static_cast<double>(scales[r]), -(f.bias + f.mantissa_bits)));
            // Slack: the division x / scale and the product scale * fp8 round once each.
            ASSERT_LE(std::fabs(back[e] - x[e]), bound * (1 + 1e-6) + 1e-6 * std::fabs(x[e]))
                << KvStorageName(f.storage) << " row_len " << row_len << " element " << e;
          }
        }
      }
    }
    const std::vector<float> zeros(16, 0.f);
    std::vector<uint8_t> codes(16, 0xAB);
    float scale = -1.f;
    ops::QuantizeKvRowsFp8(f.storage, zeros.data(), 1, 16, codes.data(), &scale);
    EXPECT_EQ(scale, 0.f);
    EXPECT_EQ(codes, std::vector<uint8_t>(16, 0));
  }
}

// Low-bit KIVI codes (scalar on every family): |x - (min + scale * code)| <= scale / 2 per group
// plus the f16 rounding of scale and min, the group's min and max coded at the ends, a constant
// group exact up to min's f16 rounding, packing and unpacking agree.
float AsymBound(float scale, int max_code, float lo, float x) {
  return scale / 2 + (max_code * scale + std::fabs(lo) + std::fabs(x)) * 1e-3f;  // f16 rounding: 2^-11
}

TEST(KiviLowBitCodec, RowsAndColumnsStayWithinHalfAStep) {
  std::mt19937 rng(21);
  for (int bits : {4, 2}) {
    const int max_code = (1 << bits) - 1;
    for (int row_len : {4, 8, 12, 16, 20, 64, 128}) {
      for (int group : {4, 8, 16, 32, row_len}) {
        if (row_len % group != 0) continue;
        const int groups = row_len / group;
        for (int64_t n_rows : {1, 2, 5, 16}) {
          const std::vector<float> x = RandomRows(n_rows, row_len, rng);
          const size_t row_bytes = static_cast<size_t>(row_len) * bits / 8;
          std::vector<uint8_t> packed(n_rows * row_bytes);
          std::vector<float> back(x.size());
          // Rows: one f16 scale and min per group of channels.
          std::vector<f16_bits> scales(n_rows * groups), mins(n_rows * groups);
          ops::QuantizeKvRowsAsym(bits, x.data(), n_rows, row_len, group, packed.data(), scales.data(), mins.data());
          ops::DequantizeKvRowsAsym(bits, packed.data(), scales.data(), mins.data(), n_rows, row_len, group,
                                    back.data());
          std::vector<uint8_t> codes(row_len);
          for (int64_t r = 0; r < n_rows; ++r) {
            ops::UnpackCodes(bits, packed.data() + r * row_bytes, row_len, codes.data());
            for (int g = 0; g < groups; ++g) {
              const float* xg = x.data() + r * row_len + g * group;
              const auto [lo, hi] = std::minmax_element(xg, xg + group);
              const float min = F16ToF32(mins[r * groups + g]), scale = F16ToF32(scales[r * groups + g]);
              ASSERT_EQ(mins[r * groups + g], F32ToF16(*lo));
              ASSERT_NEAR(scale, (*hi - min) / max_code, (*hi - min) / max_code * 1e-3f);
              for (int i = 0; i < group; ++i) {
                const int c = g * group + i;
                ASSERT_LE(codes[c], max_code);
                if (xg[i] == *hi) ASSERT_GE(codes[c], max_code - 1);
                const float err = std::fabs(back[r * row_len + c] - xg[i]);
                ASSERT_LE(err, AsymBound(scale, max_code, *lo, xg[i])) << bits << " bits, row " << r << ", group " << g;
              }
            }
          }
        }
      }
      // Columns: one scale and min per column over the rows (KIVI's keys over a page).
      for (int64_t n_rows : {1, 2, 5, 16, 32}) {
        const std::vector<float> x = RandomRows(n_rows, row_len, rng);
        std::vector<uint8_t> packed(n_rows * static_cast<size_t>(row_len) * bits / 8);
        std::vector<float> back(x.size());
        std::vector<f16_bits> col_scales(row_len), col_mins(row_len);
        ops::QuantizeKvColumnsAsym(bits, x.data(), n_rows, row_len, packed.data(), col_scales.data(), col_mins.data());
        ops::DequantizeKvColumnsAsym(bits, packed.data(), col_scales.data(), col_mins.data(), n_rows, row_len,
                                     back.data());
        for (int64_t r = 0; r < n_rows; ++r) {
          for (int c = 0; c < row_len; ++c) {
            const size_t e = static_cast<size_t>(r) * row_len + c;
            ASSERT_LE(std::fabs(back[e] - x[e]), AsymBound(F16ToF32(col_scales[c]), max_code,
                                                           F16ToF32(col_mins[c]), x[e]))
                << bits << " bits, column " << c;
          }
        }
      }
    }
    // A constant row is exact up to min's f16 rounding (scale 0, codes 0).
    const std::vector<float> constant(8, -1.25f);
    std::vector<uint8_t> packed(8 * bits / 8, 0xFF);
    f16_bits scale = 0x7C00, min = 0;
    std::vector<float> back(8);
    ops::QuantizeKvRowsAsym(bits, constant.data(), 1, 8, 8, packed.data(), &scale, &min);
    ops::DequantizeKvRowsAsym(bits, packed.data(), &scale, &min, 1, 8, 8, back.data());
    EXPECT_EQ(F16ToF32(scale), 0.f);
    EXPECT_EQ(back, constant);  // -1.25 is exact in f16
  }
}

// KIVI's V groups (issue 28): a row with 32 large and 96 small channels. Per-32 groups give the
// small channels their own scale and reconstruct them; one group per row spends every code on
// the large range and loses them.
TEST(KiviLowBitCodec, VGroupsOf32ReconstructSmallChannels) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> large(-100.f, 100.f), small(-0.01f, 0.01f);
  std::vector<float> row(128);
  for (int c = 0; c < 128; ++c) row[c] = c < 32 ? large(rng) : small(rng);
  for (int bits : {4, 2}) {
    std::vector<uint8_t> packed(128 * bits / 8);
    std::vector<float> back(128);
    double grouped_err = 0, whole_err = 0;  // worst error over the 96 small channels
    std::vector<f16_bits> scales(4), mins(4);
    ops::QuantizeKvRowsAsym(bits, row.data(), 1, 128, 32, packed.data(), scales.data(), mins.data());
    ops::DequantizeKvRowsAsym(bits, packed.data(), scales.data(), mins.data(), 1, 128, 32, back.data());
    for (int c = 32; c < 128; ++c) grouped_err = std::max(grouped_err, std::fabs(double{back[c]} - row[c]));
    ops::QuantizeKvRowsAsym(bits, row.data(), 1, 128, 128, packed.data(), scales.data(), mins.data());
    ops::DequantizeKvRowsAsym(bits, packed.data(), scales.data(), mins.data(), 1, 128, 128, back.data());
    for (int c = 32; c < 128; ++c) whole_err = std::max(whole_err, std::fabs(double{back[c]} - row[c]));
    EXPECT_LT(grouped_err, 0.02 / ((1 << bits) - 1)) << bits << " bits";  // half a step of a 0.02 range, and f16
    EXPECT_GT(whole_err, 1.0) << bits << " bits";  // the small channels round to a step of ~200 / max_code
  }
}

// Values beyond f16's range (a hostile or broken model) are stored at its ends: the scales,
// mins and decoded values stay finite, never inf or NaN.
TEST(KiviLowBitCodec, ValuesPastF16RangeStayFinite) {
  const std::vector<float> x = {-1e5f, 3.f, 7e4f, 1e5f, -2.f, 0.f, 1.f, 2e9f,
                                -3e38f, 0.5f, 65504.f, -65504.f, 9.f, -9.f, 1e6f, 4.f};  // 2 rows of 8
  for (int bits : {4, 2}) {
    std::vector<uint8_t> packed(16 * bits / 8);
    std::vector<float> back(16);
    std::vector<f16_bits> scales(2), mins(2);
    ops::QuantizeKvRowsAsym(bits, x.data(), 2, 8, 8, packed.data(), scales.data(), mins.data());
    ops::DequantizeKvRowsAsym(bits, packed.data(), scales.data(), mins.data(), 2, 8, 8, back.data());
    for (float b : back) EXPECT_TRUE(std::isfinite(b)) << bits << " bits, rows";
    std::vector<f16_bits> col_scales(8), col_mins(8);
    ops::QuantizeKvColumnsAsym(bits, x.data(), 2, 8, packed.data(), col_scales.data(), col_mins.data());
    ops::DequantizeKvColumnsAsym(bits, packed.data(), col_scales.data(), col_mins.data(), 2, 8, back.data());
    for (float b : back) EXPECT_TRUE(std::isfinite(b)) << bits << " bits, columns";
    EXPECT_NEAR(back[1], 3.f, 1e-3f);  // column 1 holds 3 and 0.5: its own small range
  }
}

// Packing puts value i at bit (i * bits) % 8 of byte i * bits / 8 (low bits first).
TEST(KiviLowBitCodec, PackingIsLowBitsFirst) {
  const std::vector<float> x = {0.f, 1.f, 2.f, 3.f, 3.f, 2.f, 1.f, 0.f};  // codes = values with 2 bits
  std::vector<uint8_t> packed(2);
  f16_bits scale, min;
  ops::QuantizeKvRowsAsym(2, x.data(), 1, 8, 8, packed.data(), &scale, &min);
  ASSERT_EQ(F16ToF32(scale), 1.f);
  EXPECT_EQ(packed[0], 0b11100100);
  EXPECT_EQ(packed[1], 0b00011011);
  std::vector<uint8_t> codes(8);
  ops::UnpackCodes(2, packed.data(), 8, codes.data());
  EXPECT_EQ(codes, (std::vector<uint8_t>{0, 1, 2, 3, 3, 2, 1, 0}));
  const std::vector<float> y = {0.f, 15.f, 7.f, 8.f};
  ops::QuantizeKvRowsAsym(4, y.data(), 1, 4, 4, packed.data(), &scale, &min);
  EXPECT_EQ(packed[0], 0xF0);
  EXPECT_EQ(packed[1], 0x87);
}

}  // namespace
}  // namespace kvsparse
