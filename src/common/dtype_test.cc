// DType metadata and f16/bf16 conversions (round-to-nearest-even, subnormals, inf, nan).
#include "kvsparse/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <immintrin.h>
#include <cpuid.h>

namespace kvsparse {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DTypeTest, Metadata) {
  EXPECT_EQ(DTypeBlockSize(DType::kQ8_0), 32);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ8_0), 34u);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ4_0), 18u);
  EXPECT_EQ(DTypeBlockSize(DType::kQ4_K), 256);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ4_K), 144u);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ8_K), 292u);
  EXPECT_EQ(DTypeRowBytes(DType::kF16, 7), 14u);
  EXPECT_EQ(DTypeRowBytes(DType::kBF16, 3), 6u);
  EXPECT_EQ(DTypeRowBytes(DType::kF32, 5), 20u);
  EXPECT_EQ(DTypeRowBytes(DType::kQ8_0, 2048), 64u * 34u);
  EXPECT_EQ(DTypeName(DType::kQ4_K), "q4_K");
  EXPECT_EQ(DTypeFromId(8), DType::kQ8_0);
  EXPECT_EQ(DTypeFromId(30), DType::kBF16);
  EXPECT_EQ(DTypeFromId(3), DType::kQ4_1);
  EXPECT_EQ(DTypeFromId(14), DType::kQ6_K);
  EXPECT_EQ(DTypeFromId(23), DType::kIQ4_XS);
  EXPECT_EQ(DTypeFromId(16), std::nullopt);  // iq2_xxs: not supported
  EXPECT_EQ(DTypeBlockBytes(DType::kQ6_K), 210u);
  EXPECT_EQ(DTypeBlockSize(DType::kIQ4_NL), 32);
  EXPECT_EQ(DTypeFromId(1000), std::nullopt);
  EXPECT_EQ(DTypeFromName("Q8_0"), DType::kQ8_0);
  EXPECT_EQ(DTypeFromName("q4_k"), DType::kQ4_K);
  EXPECT_EQ(DTypeFromName("bf16"), DType::kBF16);
  EXPECT_EQ(DTypeFromName("q5_0"), DType::kQ5_0);
  EXPECT_EQ(DTypeFromName("IQ4_XS"), DType::kIQ4_XS);
  EXPECT_EQ(DTypeFromName("iq2_xxs"), std::nullopt);
  EXPECT_EQ(DTypeFromName(""), std::nullopt);
}

TEST(DTypeTest, F16EdgeCases) {
  EXPECT_EQ(F32ToF16(0.f), 0x0000);
  EXPECT_EQ(F32ToF16(-0.f), 0x8000);
  EXPECT_EQ(F32ToF16(1.f), 0x3C00);
  EXPECT_EQ(F32ToF16(-2.f), 0xC000);
  EXPECT_EQ(F32ToF16(65504.f), 0x7BFF);    // max finite
  EXPECT_EQ(F32ToF16(65519.99f), 0x7BFF);  // below the half-way point to 65536
  EXPECT_EQ(F32ToF16(65520.f), 0x7C00);    // ties to even -> inf
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(F32ToF16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(F32ToF16(1e10f), 0x7C00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.f, -14)), 0x0400);  // min normal
  EXPECT_EQ(F32ToF16(std::ldexp(1.f, -24)), 0x0001);  // min subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(F32ToF16(std::ldexp(3.f, -25)), 0x0002);  // tie -> even (2)
  EXPECT_EQ(F32ToF16(std::ldexp(1.f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1023.f, -24)), 0x03FF);     // max subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(2047.f, -25)), 0x0400);     // rounds up into the normals
  EXPECT_EQ(F32ToF16(1.f + std::ldexp(1.f, -11)), 0x3C00);  // tie -> even
  EXPECT_EQ(F32ToF16(1.f + std::ldexp(3.f, -11)), 0x3C02);  // tie -> even (up)
  EXPECT_EQ(F32ToF16(1e-10f), 0x0000);
  const f16_bits nan = F32ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
  EXPECT_NE(F32ToF16(FromBits(0x7F800001)) & 0x03FF, 0);  // nan with a low payload stays nan

  EXPECT_EQ(F16ToF32(0x3C00), 1.f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(F16ToF32(0x03FF), std::ldexp(1023.f, -24));
  EXPECT_EQ(F16ToF32(0x7BFF), 65504.f);
  EXPECT_EQ(F16ToF32(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToF32(0x7E00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7C01)));
  EXPECT_EQ(Bits(F16ToF32(0x8000)), 0x80000000u);
}

TEST(DTypeTest, F16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F16ToF32(static_cast<f16_bits>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f)))) << h;
    } else {
      EXPECT_EQ(F32ToF16(f), h) << h;
    }
  }
}

// The hardware converter (F16C) is the ground truth for IEEE round-to-nearest-even; the build
// targets baseline x86-64, so only this function is compiled for F16C.
__attribute__((target("f16c"))) void ExpectF16MatchesHardwareConversion() {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    ASSERT_EQ(Bits(F16ToF32(static_cast<f16_bits>(h))), Bits(_cvtsh_ss(static_cast<unsigned short>(h)))) << h;
  }
  std::mt19937 rng(1);
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns concentrated around the f16 range (exponents 100..150).
    uint32_t u = rng();
    if (i % 2) u = (u & 0x807FFFFF) | ((100 + u % 51) << 23);
    const float f = FromBits(u);
    ASSERT_EQ(F32ToF16(f), _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) << std::hex << u;
  }
}

TEST(DTypeTest, F16MatchesHardwareConversion) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // CPUID.1:ECX bit 29 (clang 14's builtin lacks "f16c")
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || ((ecx >> 29) & 1u) == 0) GTEST_SKIP() << "this CPU has no F16C to compare with";
  ExpectF16MatchesHardwareConversion();
}

TEST(DTypeTest, BF16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBF16(1.f), 0x3F80);
  EXPECT_EQ(F32ToBF16(-1.f), 0xBF80);
  EXPECT_EQ(F32ToBF16(1.f + std::ldexp(1.f, -8)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(F32ToBF16(1.f + std::ldexp(3.f, -8)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(F32ToBF16(1.f + std::ldexp(1.f, -8) * 1.01f), 0x3F81);
  EXPECT_EQ(F32ToBF16(FromBits(0x7F7FFFFF)), 0x7F80);  // max float rounds to inf
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(F32ToBF16(FromBits(0x00008000)), 0x0000);  // subnormal tie -> even
  EXPECT_EQ(F32ToBF16(FromBits(0x00018000)), 0x0002);
  EXPECT_EQ(F32ToBF16(FromBits(0x00010001)), 0x0001);
  const bf16_bits nan = F32ToBF16(FromBits(0x7F800001));  // signalling nan with low payload
  EXPECT_TRUE(std::isnan(BF16ToF32(nan)));
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(BF16ToF32(0x4049), 3.140625f);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = BF16ToF32(static_cast<bf16_bits>(h));
    if (!std::isnan(f)) {
      ASSERT_EQ(F32ToBF16(f), h) << h;
    }
  }
}

}  // namespace
}  // namespace kvsparse
