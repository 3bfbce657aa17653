// Quantizer / dequantizer tests: ggml block layouts and rounding, round-trip error bounds,
// and the fast (ops::) entry points against the scalar references, byte for byte, once per
// kernel family (include/kvsparse/isa.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "ops/ops_test_util.h"
#include "ops/quant_internal.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::RandomFloats;

std::vector<uint8_t> Quantize(DType type, const std::vector<float>& x) {
  std::vector<uint8_t> out(DTypeRowBytes(type, static_cast<int64_t>(x.size())));
  ref::QuantizeRow(type, x.data(), out.data(), static_cast<int64_t>(x.size()));
  return out;
}

std::vector<float> Dequantize(DType type, const std::vector<uint8_t>& data, int64_t n) {
  std::vector<float> out(n);
  ref::DequantizeRow(type, data.data(), out.data(), n);
  return out;
}

TEST(QuantizeTest, Q8_0FollowsGgmlReference) {
  // amax = 127 gives d = 1 exactly, so x * id hits .5 ties: ggml's roundf rounds them away from 0.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(i) - 15.5f;  // -15.5 .. 15.5
  x[0] = 127.f;
  const auto q = Quantize(DType::kQ8_0, x);
  BlockQ8_0 block;
  std::memcpy(&block, q.data(), sizeof(block));
  EXPECT_EQ(F16ToF32(block.d), 1.f);
  EXPECT_EQ(block.qs[0], 127);
  EXPECT_EQ(block.qs[1], -15);  // -14.5 -> -15
  EXPECT_EQ(block.qs[15], -1);  // -0.5 -> -1
  EXPECT_EQ(block.qs[16], 1);   // 0.5 -> 1
  EXPECT_EQ(block.qs[31], 16);  // 15.5 -> 16
}

TEST(QuantizeTest, Q4_0FollowsGgmlReference) {
  // Values -16..15: the extreme -16 maps to -8, so d = 2 and q = min(15, (int8)(x/2 + 8.5)).
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(i - 16);
  const auto q = Quantize(DType::kQ4_0, x);
  BlockQ4_0 block;
  std::memcpy(&block, q.data(), sizeof(block));
  EXPECT_EQ(F16ToF32(block.d), 2.f);
  for (int i = 0; i < 32; ++i) {
    const int nibble = i < 16 ? (block.qs[i] & 0xF) : (block.qs[i - 16] >> 4);
    EXPECT_EQ(nibble, std::min(15, (i + 1) / 2)) << "element " << i;
  }
  const auto y = Dequantize(DType::kQ4_0, q, 32);
  EXPECT_EQ(y[0], -16.f);
  EXPECT_EQ(y[31], 14.f);  // clamped at nibble 15
}

TEST(QuantizeTest, Q8_KFollowsGgmlReference) {
  std::vector<float> x = RandomFloats(256, 3, 0.3f);  // |x| <= 2.4 even for outliers
  x[7] = -3.f;                                        // the signed extreme: iscale = -127 / -3
  const auto q = Quantize(DType::kQ8_K, x);
  BlockQ8_K block;
  std::memcpy(&block, q.data(), sizeof(block));
  EXPECT_FLOAT_EQ(block.d, 1.f / (-127.f / -3.f));
  EXPECT_EQ(block.qs[7], -127);
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += block.qs[16 * g + i];
    EXPECT_EQ(block.bsums[g], sum);
  }
  // All-zero block: zero scale, zero quants, zero sums.
  const auto zq = Quantize(DType::kQ8_K, std::vector<float>(256, 0.f));
  EXPECT_TRUE(std::all_of(zq.begin(), zq.end(), [](uint8_t b) { return b == 0; }));
}

TEST(QuantizeTest, Q4_KScaleMinPackingRoundTrips) {
  for (int seed = 0; seed < 200; ++seed) {
    uint8_t scale[8], min[8];
    for (int j = 0; j < 8; ++j) {
      scale[j] = static_cast<uint8_t>((seed * 7 + j * 13) % 64);
      min[j] = static_cast<uint8_t>((seed * 11 + j * 5 + 63) % 64);
    }
    uint8_t packed[kKScaleBytes] = {};
    quant::PackScaleMinK4(scale, min, packed);
    for (int j = 0; j < 8; ++j) {
      uint8_t s, m;
      quant::GetScaleMinK4(j, packed, &s, &m);
      EXPECT_EQ(s, scale[j]);
      EXPECT_EQ(m, min[j]);
    }
  }
}

TEST(QuantizeTest, Q4_KDequantizesGgmlLayout) {
  // Hand-built block: byte layout per ggml's get_scale_min_k4.
  BlockQ4_K block{};
  block.d = F32ToF16(0.5f);
  block.dmin = F32ToF16(0.25f);
  block.scales[0] = 0x40 | 3;  // sub 0 scale 3 (+ top bits 01 of sub 4's scale)
  block.scales[4] = 0x80 | 5;  // sub 0 min 5 (+ top bits 10 of sub 4's min)
  block.scales[8] = 0x72;      // sub 4: scale low 4 bits 2, min low 4 bits 7
  block.qs[0] = 0x9A;          // element 0 -> 0xA (sub 0), element 32 -> 0x9 (sub 1)
  block.qs[64] = 0x0F;         // element 128 -> 0xF (sub 4)
  std::vector<float> y(256);
  ref::DequantizeRow(DType::kQ4_K, &block, y.data(), 256);
  EXPECT_FLOAT_EQ(y[0], 0.5f * 3 * 10 - 0.25f * 5);
  EXPECT_FLOAT_EQ(y[1], -0.25f * 5);
  // sub 4: scale = 2 | (1 << 4) = 18, min = 7 | (2 << 4) = 39
  EXPECT_FLOAT_EQ(y[128], 0.5f * 18 * 15 - 0.25f * 39);
  EXPECT_FLOAT_EQ(y[129], -0.25f * 39);
  EXPECT_FLOAT_EQ(y[32], 0.f);  // sub 1 has scale 0 and min 0
}

// Round trip error per element, relative to the block's scale.
TEST(QuantizeTest, RoundTripErrorBounds) {
  for (int64_t n : {256, 768, 2816}) {
    const std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n), 3.f);
    {  // Q8_0: |err| <= d/2 plus the f16 rounding of d (|q| <= 127).
      const auto q = Quantize(DType::kQ8_0, x);
      const auto y = Dequantize(DType::kQ8_0, q, n);
      for (int64_t i = 0; i < n; ++i) {
        float amax = 0;
        for (int64_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        ASSERT_LE(std::fabs(y[i] - x[i]), amax / 127.f * (0.5f + 127.f / 2048.f) + 1e-6f) << i;
      }
    }
    {  // Q4_0: |err| <= |d| (the side opposite the extreme clamps at +7), plus f16 rounding of d.
      const auto q = Quantize(DType::kQ4_0, x);
      const auto y = Dequantize(DType::kQ4_0, q, n);
      for (int64_t i = 0; i < n; ++i) {
        const float d = std::fabs(F16ToF32(reinterpret_cast<const BlockQ4_0*>(q.data())[i / 32].d));
        ASSERT_LE(std::fabs(y[i] - x[i]), d * (1.f + 8.f / 1024.f) + 1e-6f) << i;
      }
    }
    {  // Q8_K: f32 scale, |err| <= d/2.
      const auto q = Quantize(DType::kQ8_K, x);
      const auto y = Dequantize(DType::kQ8_K, q, n);
      for (int64_t i = 0; i < n; ++i) {
        const float d = std::fabs(reinterpret_cast<const BlockQ8_K*>(q.data())[i / 256].d);
        ASSERT_LE(std::fabs(y[i] - x[i]), d * 0.5f * 1.0001f) << i;
      }
    }
    {  // Q4_K: within a sub-block step (or the min granularity), and small RMS error overall.
      const auto q = Quantize(DType::kQ4_K, x);
      const auto y = Dequantize(DType::kQ4_K, q, n);
      double err2 = 0, x2 = 0;
      for (int64_t i = 0; i < n; ++i) {
        const BlockQ4_K& b = reinterpret_cast<const BlockQ4_K*>(q.data())[i / 256];
        uint8_t sc, m;
        quant::GetScaleMinK4(static_cast<int>(i % 256 / 32), b.scales, &sc, &m);
        const float step = F16ToF32(b.d) * sc;
        ASSERT_LE(std::fabs(y[i] - x[i]), std::max(step * 0.51f, F16ToF32(b.dmin) * 1.01f) + 1e-6f) << i;
        err2 += (y[i] - x[i]) * (y[i] - x[i]);
        x2 += x[i] * x[i];
      }
      EXPECT_LT(std::sqrt(err2 / x2), 0.12);
    }
    for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
      const auto q = Quantize(t, x);
      const auto y = Dequantize(t, q, n);
      const float rel = t == DType::kF16 ? 1.f / 2048 : t == DType::kBF16 ? 1.f / 256 : 0.f;
      for (int64_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) * rel) << i;
    }
  }
}

TEST(QuantizeTest, ZeroBlocksStayZero) {
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ8_K}) {
    const std::vector<float> x(256, 0.f);
    const auto y = Dequantize(t, Quantize(t, x), 256);
    for (float v : y) ASSERT_EQ(v, 0.f) << DTypeName(t);
  }
}

class FastQuantizeTest : public testing::PerIsaTest {};

// ops:: entry points (SIMD where implemented) must produce the reference's exact bytes/values.
TEST_P(FastQuantizeTest, FastPathsMatchReferenceExactly) {
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ8_K, DType::kF16, DType::kBF16, DType::kF32}) {
    // One block and odd block counts, besides the usual row lengths.
    for (int64_t n : {256, 512, 768, 2816, 4096, 5632}) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n));
      std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n) + 9, 4.f);
      // Exact .5 ties for Q8_0: a block whose amax is 127 has d = 1.
      for (int i = 0; i < 32; ++i) x[i] = i == 0 ? 127.f : (i - 16) + 0.5f;
      std::vector<uint8_t> want(DTypeRowBytes(t, n)), got(DTypeRowBytes(t, n), 0xAB);
      ref::QuantizeRow(t, x.data(), want.data(), n);
      ops::QuantizeRow(t, x.data(), got.data(), n);
      ASSERT_EQ(want, got);
      std::vector<float> y_want(n), y_got(n);
      ref::DequantizeRow(t, want.data(), y_want.data(), n);
      ops::DequantizeRow(t, want.data(), y_got.data(), n);
      ASSERT_EQ(0, std::memcmp(y_want.data(), y_got.data(), n * sizeof(float)));
    }
  }
}

// Many random rows: rounding ties and sign-of-extreme choices must agree with the reference.
TEST_P(FastQuantizeTest, FastActivationQuantizersMatchReferenceOnManyRows) {
  for (uint32_t seed = 0; seed < 300; ++seed) {
    const int64_t n = seed % 3 == 0 ? 2816 : 256 * (1 + seed % 7);  // 1..7 super-blocks, odd Q8_0 counts
    const std::vector<float> x = RandomFloats(n, seed, seed % 2 ? 2.f : 0.01f);
    for (DType t : {DType::kQ8_0, DType::kQ8_K}) {
      std::vector<uint8_t> want(DTypeRowBytes(t, n)), got(DTypeRowBytes(t, n));
      ref::QuantizeRow(t, x.data(), want.data(), n);
      ops::QuantizeRow(t, x.data(), got.data(), n);
      ASSERT_EQ(want, got) << DTypeName(t) << " seed " << seed;
    }
  }
}

// Hand-built rows for the activation quantizers' rounding and sign rules, one 256-element
// super-block per case (each also 8 Q8_0 blocks):
//  - every Q8_0 block holds a +-127 (d = 1) or +-254 (d = 2) extreme, so x * id lands exactly on
//    .5 ties for every other element (Q8_0 rounds them away from zero), and Q8_K's iscale is +-1
//    or +-0.5, so its products tie too (Q8_K rounds them to even);
//  - the first element reaching amax is positive in some super-blocks and negative in others,
//    with an equal-magnitude element of the opposite sign later on (Q8_K takes the first one's
//    sign);
//  - all-zero and all-negative-zero blocks, and zero Q8_0 blocks inside a non-zero super-block.
std::vector<float> ActivationEdgeCaseRow() {
  std::vector<float> x;
  auto add_ties = [&](float extreme, float step, bool negative_first) {
    for (int j = 0; j < 256; ++j) x.push_back(step * (static_cast<float>(j % 50) - 24.5f));  // +-k.5 * step
    float* sb = x.data() + x.size() - 256;
    for (int k = 0; k < 8; ++k) {
      const bool negative = (k % 2 == 1) != negative_first;
      sb[32 * k + (k * 5) % 32] = negative ? -extreme : extreme;  // one extreme per Q8_0 block, varying lanes
    }
  };
  add_ties(127.f, 1.f, false);  // d = 1: ties at k.5; the super-block's first extreme is +127
  add_ties(127.f, 1.f, true);   // same, first extreme -127
  add_ties(254.f, 2.f, true);   // d = 2 (id = 0.5): odd integers tie; first extreme -254
  add_ties(254.f, 2.f, false);
  x.insert(x.end(), 256, 0.f);
  x.insert(x.end(), 256, -0.f);
  {  // Random, with zero Q8_0 blocks, -0.f entries and an extreme at the very last element.
    std::vector<float> r = RandomFloats(256, 5, 1.f);
    std::fill(r.begin() + 64, r.begin() + 96, 0.f);
    std::fill(r.begin() + 160, r.begin() + 192, -0.f);
    r[3] = -0.f;
    r[255] = -9.f;
    x.insert(x.end(), r.begin(), r.end());
    r[100] = 9.f;  // an equal positive extreme earlier: it wins
    x.insert(x.end(), r.begin(), r.end());
    r[100] = -9.f;  // two negative extremes
    r[255] = 9.f;
    x.insert(x.end(), r.begin(), r.end());
    r[100] = r[255] = 1.f;  // opposite-sign extremes within one 8- and 16-lane vector
    r[201] = -9.f;
    r[206] = 9.f;
    x.insert(x.end(), r.begin(), r.end());
    std::swap(r[201], r[206]);
    x.insert(x.end(), r.begin(), r.end());
  }
  {  // Tiny magnitudes (scales far from 1) and a lone extreme in lane 7 of the last vector.
    std::vector<float> r = RandomFloats(256, 6, 1e-6f);
    r[247] = -3e-5f;
    x.insert(x.end(), r.begin(), r.end());
  }
  return x;
}

TEST_P(FastQuantizeTest, FastActivationQuantizersMatchReferenceOnEdgeCases) {
  const std::vector<float> x = ActivationEdgeCaseRow();
  // Each super-block alone, then the whole row (blocks quantized independently must not interfere).
  for (int64_t start = 0; start <= static_cast<int64_t>(x.size()); start += 256) {
    const bool whole = start == static_cast<int64_t>(x.size());
    const float* src = x.data() + (whole ? 0 : start);
    const int64_t n = whole ? start : 256;
    for (DType t : {DType::kQ8_0, DType::kQ8_K}) {
      std::vector<uint8_t> want(DTypeRowBytes(t, n)), got(DTypeRowBytes(t, n), 0xAB);
      ref::QuantizeRow(t, src, want.data(), n);
      ops::QuantizeRow(t, src, got.data(), n);
      ASSERT_EQ(want, got) << DTypeName(t) << " start " << start << " n " << n;
    }
  }
  // Spot checks that the row does exercise both tie rules and both signs.
  BlockQ8_0 q8_0[8];
  ops::QuantizeRow(DType::kQ8_0, x.data(), q8_0, 256);
  EXPECT_EQ(F16ToF32(q8_0[0].d), 1.f);
  EXPECT_EQ(q8_0[0].qs[1], -24);  // -23.5 -> -24 (away from zero)
  EXPECT_EQ(q8_0[0].qs[2], -23);  // -22.5 -> -23
  BlockQ8_K q8_k[2];
  ops::QuantizeRow(DType::kQ8_K, x.data(), q8_k, 512);
  EXPECT_EQ(q8_k[0].d, -1.f);     // first extreme +127: iscale = -1
  EXPECT_EQ(q8_k[0].qs[1], 24);   // 23.5 -> 24 (even)
  EXPECT_EQ(q8_k[0].qs[2], 22);   // 22.5 -> 22 (even)
  EXPECT_EQ(q8_k[1].d, 1.f);      // first extreme -127: iscale = 1
  EXPECT_EQ(q8_k[1].qs[1], -24);  // -23.5 -> -24
  EXPECT_EQ(q8_k[1].qs[2], -22);  // -22.5 -> -22
}

// Q8_0 rows that are not whole super-blocks (the packers quantize one 32-element block at a time).
TEST_P(FastQuantizeTest, FastQ8_0MatchesReferenceOnShortRows) {
  for (int64_t n : {32, 64, 96, 160, 224, 288}) {
    const std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n), 3.f);
    std::vector<uint8_t> want(DTypeRowBytes(DType::kQ8_0, n)), got(DTypeRowBytes(DType::kQ8_0, n), 0xAB);
    ref::QuantizeRow(DType::kQ8_0, x.data(), want.data(), n);
    ops::QuantizeRow(DType::kQ8_0, x.data(), got.data(), n);
    ASSERT_EQ(want, got) << "n " << n;
  }
}

TEST_P(FastQuantizeTest, F16DequantizeOddLengthsMatchReference) {
  for (int64_t n : {1, 7, 9, 15, 16, 17, 33}) {
    std::vector<f16_bits> h(n);
    for (int64_t i = 0; i < n; ++i) h[i] = static_cast<f16_bits>(0x3C00 + i * 37);
    std::vector<float> a(n), b(n);
    ref::DequantizeRow(DType::kF16, h.data(), a.data(), n);
    ops::DequantizeRow(DType::kF16, h.data(), b.data(), n);
    EXPECT_EQ(a, b);
  }
}

std::vector<uint32_t> FloatBits(const std::vector<float>& v) {
  std::vector<uint32_t> bits(v.size());
  std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  return bits;
}

// All 65536 f16 patterns: ops::DequantizeRow matches F16ToF32 bit for bit (NaNs included), and
// ops::QuantizeRow brings every value back to F32ToF16's pattern -- the original one except that
// signaling NaNs come back quiet.
TEST_P(FastQuantizeTest, F16ConversionRoundTripsAllPatterns) {
  const int64_t n = 1 << 16;
  std::vector<f16_bits> h(n);
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<f16_bits>(i);
  std::vector<float> wide(n), wide_want(n);
  ops::DequantizeRow(DType::kF16, h.data(), wide.data(), n);
  for (int64_t i = 0; i < n; ++i) wide_want[i] = F16ToF32(h[i]);
  ASSERT_EQ(FloatBits(wide_want), FloatBits(wide));
  std::vector<f16_bits> back(n, 0xABCD);
  ops::QuantizeRow(DType::kF16, wide.data(), back.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const bool nan = (h[i] & 0x7C00) == 0x7C00 && (h[i] & 0x03FF) != 0;
    const f16_bits want = nan ? static_cast<f16_bits>(h[i] | 0x0200) : h[i];
    ASSERT_EQ(want, back[i]) << "pattern " << i;
    ASSERT_EQ(F32ToF16(wide[i]), back[i]) << "pattern " << i;
  }
}

// F32 -> F16 (F16C in the avx2 / avx512 families) is bit-identical to F32ToF16: random floats of
// every magnitude (f16 normals, subnormals, underflow, overflow), rounding ties, infinities and
// NaNs (F16C, like F32ToF16, keeps the sign and top payload bits and sets the quiet bit), at
// lengths that exercise the vector tails.
TEST_P(FastQuantizeTest, F16QuantizeMatchesScalarConversion) {
  std::mt19937 rng(11);
  std::vector<float> x;
  for (int i = 0; i < 200000; ++i) {
    // Exponents 2^-30 .. 2^20 around the f16 range, random mantissa and sign.
    const uint32_t exponent = static_cast<uint32_t>(127 - 30 + rng() % 51);
    const uint32_t sign = static_cast<uint32_t>(rng()) & 0x80000000u;
    x.push_back(std::bit_cast<float>(sign | (exponent << 23) | (static_cast<uint32_t>(rng()) & 0x7FFFFFu)));
  }
  for (int i = 0; i < 20000; ++i) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));  // any pattern
  // A sweep across all 2^32 patterns (every exponent, NaN payloads of both signs).
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4099) {
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
  }
  // Halfway points between neighbouring f16 values (ties to even), and the overflow threshold.
  for (uint32_t h = 0; h < 0x7C00; h += 7) {
    const float lo = F16ToF32(static_cast<f16_bits>(h)), hi = F16ToF32(static_cast<f16_bits>(h + 1));
    x.push_back(lo + (hi - lo) / 2);
    x.push_back(-(lo + (hi - lo) / 2));
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {65504.f, 65519.99f, 65520.f, 1e10f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::signaling_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                  std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0xFFFFFFFFu), std::ldexp(1.f, -25),
                  std::ldexp(3.f, -25), std::numeric_limits<float>::denorm_min(), 0.f, -0.f}) {
    x.push_back(v);
  }
  for (int64_t n : {static_cast<int64_t>(x.size()), int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{15},
                    int64_t{17}, int64_t{31}, int64_t{33}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<f16_bits> got(n, 0xABCD);
    ops::QuantizeRow(DType::kF16, x.data() + x.size() - n, got.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[x.size() - n + i];
      ASSERT_EQ(F32ToF16(v), got[i]) << "x = " << v << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(v) << ")";
    }
  }
}

KVS_INSTANTIATE_PER_ISA(FastQuantizeTest);

}  // namespace
}  // namespace kvsparse
