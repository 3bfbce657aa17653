// Dequantization of every block weight type against a plain transcription of ggml's published
// block layout (ggml-common.h / ggml-quants.c: which bits of which byte hold each code, scale
// and min), written loop by loop as the format is documented, on blocks of random bits; and the
// reference quantizers' round trip. The dequantizers under test go through kquant_blocks.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "ops/ops_test_util.h"

namespace kvsparse {
namespace {

float H(f16_bits h) { return F16ToF32(h); }

// The published layouts, one super-block (or block) at a time, in ggml's loop order.
std::vector<float> PlainQ2_K(const BlockQ2_K& b) {
  std::vector<float> y;
  const uint8_t* q = b.qs;
  int is = 0;
  for (int half = 0; half < 2; ++half, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int part = 0; part < 2; ++part) {
        const uint8_t sc = b.scales[is++];
        for (int l = 0; l < 16; ++l) {
          const int code = (q[16 * part + l] >> shift) & 3;
          y.push_back(H(b.d) * (sc & 0xF) * code - H(b.dmin) * (sc >> 4));
        }
      }
    }
  }
  return y;
}

std::vector<float> PlainQ3_K(const BlockQ3_K& b) {
  // Scales: 16 six-bit values; low nibbles of bytes 0-7 are scales 0-7, high nibbles scales 8-15;
  // bytes 8-11 hold the top 2 bits, byte 8+k bits 2m..2m+1 for scale 4m+k.
  int scale[16];
  for (int s = 0; s < 16; ++s) {
    const int low = s < 8 ? b.scales[s] & 0xF : b.scales[s - 8] >> 4;
    const int top = (b.scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    scale[s] = (low | (top << 4)) - 32;
  }
  std::vector<float> y;
  const uint8_t* q = b.qs;
  int is = 0, bit = 0;
  for (int half = 0; half < 2; ++half, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, ++bit) {
      for (int part = 0; part < 2; ++part) {
        const int sc = scale[is++];
        for (int l = 0; l < 16; ++l) {
          const int idx = 16 * part + l;
          const int code = ((q[idx] >> shift) & 3) - ((b.hmask[idx] >> bit) & 1 ? 0 : 4);
          y.push_back(H(b.d) * sc * code);
        }
      }
    }
  }
  return y;
}

void ScaleMinK4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

std::vector<float> PlainQ5_K(const BlockQ5_K& b) {
  std::vector<float> y;
  for (int pair = 0; pair < 4; ++pair) {
    for (int nib = 0; nib < 2; ++nib) {
      int sc, m;
      ScaleMinK4(2 * pair + nib, b.scales, &sc, &m);
      for (int l = 0; l < 32; ++l) {
        const int low = (b.qs[32 * pair + l] >> (4 * nib)) & 0xF;
        const int high = (b.qh[l] >> (2 * pair + nib)) & 1;
        y.push_back(H(b.d) * sc * (low + 16 * high) - H(b.dmin) * m);
      }
    }
  }
  return y;
}

std::vector<float> PlainQ6_K(const BlockQ6_K& b) {
  std::vector<float> y(256);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    const int8_t* sc = b.scales + 8 * half;
    for (int l = 0; l < 32; ++l) {
      const int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[128 * half + l] = H(b.d) * sc[l / 16] * q1;
      y[128 * half + l + 32] = H(b.d) * sc[l / 16 + 2] * q2;
      y[128 * half + l + 64] = H(b.d) * sc[l / 16 + 4] * q3;
      y[128 * half + l + 96] = H(b.d) * sc[l / 16 + 6] * q4;
    }
  }
  return y;
}

std::vector<float> PlainIQ4_XS(const BlockIQ4_XS& b) {
  std::vector<float> y(256);
  for (int j = 0; j < 8; ++j) {
    const int ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b.scales_h >> (2 * j)) & 3) << 4);
    for (int e = 0; e < 16; ++e) {
      y[32 * j + e] = H(b.d) * (ls - 32) * kIq4NlValues[b.qs[16 * j + e] & 0xF];
      y[32 * j + e + 16] = H(b.d) * (ls - 32) * kIq4NlValues[b.qs[16 * j + e] >> 4];
    }
  }
  return y;
}

// 32-element blocks: element e < 16 in the low nibble of qs[e], e >= 16 in the high nibble of
// qs[e - 16]; Q5's fifth bit is bit e of the little-endian qh word.
template <class Block>
int Nibble(const Block& b, int e) {
  return e < 16 ? b.qs[e] & 0xF : b.qs[e - 16] >> 4;
}
template <class Block>
int FifthBit(const Block& b, int e) {
  uint32_t qh;
  std::memcpy(&qh, b.qh, 4);
  return (qh >> e) & 1;
}
std::vector<float> PlainQ4_1(const BlockQ4_1& b) {
  std::vector<float> y;
  for (int e = 0; e < 32; ++e) y.push_back(Nibble(b, e) * H(b.d) + H(b.m));
  return y;
}
std::vector<float> PlainQ5_0(const BlockQ5_0& b) {
  std::vector<float> y;
  for (int e = 0; e < 32; ++e) y.push_back((Nibble(b, e) + 16 * FifthBit(b, e) - 16) * H(b.d));
  return y;
}
std::vector<float> PlainQ5_1(const BlockQ5_1& b) {
  std::vector<float> y;
  for (int e = 0; e < 32; ++e) y.push_back((Nibble(b, e) + 16 * FifthBit(b, e)) * H(b.d) + H(b.m));
  return y;
}
std::vector<float> PlainIQ4_NL(const BlockIQ4_NL& b) {
  std::vector<float> y;
  for (int e = 0; e < 32; ++e) y.push_back(H(b.d) * kIq4NlValues[Nibble(b, e)]);
  return y;
}

std::vector<float> PlainMXFP4(const BlockMXFP4& b) {
  std::vector<float> y;
  // E2M1 (1 sign, 2 exponent, 1 mantissa bits) times 2^(e - 127), from the OCP format's definition.
  for (int e = 0; e < 32; ++e) {
    const int code = Nibble(b, e);
    const int magnitude = code & 7, exponent = magnitude >> 1, mantissa = magnitude & 1;
    const double e2m1 = exponent == 0 ? 0.5 * mantissa : std::ldexp(1.0 + 0.5 * mantissa, exponent - 1);
    y.push_back(static_cast<float>((code & 8 ? -1 : 1) * e2m1 * std::ldexp(1.0, b.e - 127)));
  }
  return y;
}

template <class Block>
void CheckLayout(DType type, std::vector<float> (*plain)(const Block&)) {
  SCOPED_TRACE(std::string(DTypeName(type)));
  static_assert(sizeof(Block) > 0);
  ASSERT_EQ(DTypeBlockBytes(type), sizeof(Block));
  const int64_t block_elems = DTypeBlockSize(type);
  const int64_t n_blocks = 24;
  const std::vector<uint8_t> bits = testing::RandomBitsMatrix(type, 1, block_elems * n_blocks, 17);
  std::vector<float> got(block_elems * n_blocks), fast(got.size());
  ref::DequantizeRow(type, bits.data(), got.data(), block_elems * n_blocks);
  ops::DequantizeRow(type, bits.data(), fast.data(), block_elems * n_blocks);
  EXPECT_EQ(got, fast);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const std::vector<float> want = plain(reinterpret_cast<const Block*>(bits.data())[b]);
    ASSERT_EQ(static_cast<int64_t>(want.size()), block_elems);
    for (int64_t i = 0; i < block_elems; ++i) {
      // Same products; only the association of d * scale * q may differ (1 ulp).
      ASSERT_NEAR(got[b * block_elems + i], want[i], 2e-7f * std::fabs(want[i]) + 1e-30f) << "block " << b << " " << i;
    }
  }
}

TEST(QuantizeLayoutTest, DequantizationFollowsGgmlLayout) {
  CheckLayout<BlockQ4_1>(DType::kQ4_1, PlainQ4_1);
  CheckLayout<BlockQ5_0>(DType::kQ5_0, PlainQ5_0);
  CheckLayout<BlockQ5_1>(DType::kQ5_1, PlainQ5_1);
  CheckLayout<BlockIQ4_NL>(DType::kIQ4_NL, PlainIQ4_NL);
  CheckLayout<BlockQ2_K>(DType::kQ2_K, PlainQ2_K);
  CheckLayout<BlockQ3_K>(DType::kQ3_K, PlainQ3_K);
  CheckLayout<BlockQ5_K>(DType::kQ5_K, PlainQ5_K);
  CheckLayout<BlockQ6_K>(DType::kQ6_K, PlainQ6_K);
  CheckLayout<BlockIQ4_XS>(DType::kIQ4_XS, PlainIQ4_XS);
  CheckLayout<BlockMXFP4>(DType::kMXFP4, PlainMXFP4);
}

// The reference quantizers: the round trip stays close (relative RMS per row) and a zero row
// stays exactly zero.
TEST(QuantizeLayoutTest, QuantizersRoundTrip) {
  struct Bound {
    DType type;
    double max_rel_rms;
  };
  for (const Bound& bound : {Bound{DType::kQ4_1, 0.12}, Bound{DType::kQ5_0, 0.08}, Bound{DType::kQ5_1, 0.06},
                             Bound{DType::kIQ4_NL, 0.15}, Bound{DType::kQ2_K, 0.45}, Bound{DType::kQ3_K, 0.25},
                             Bound{DType::kQ5_K, 0.06}, Bound{DType::kQ6_K, 0.04}, Bound{DType::kIQ4_XS, 0.15},
                             Bound{DType::kMXFP4, 0.2}}) {
    SCOPED_TRACE(std::string(DTypeName(bound.type)));
    for (int64_t n : {256, 768, 2816}) {
      const std::vector<float> x = testing::RandomFloats(n, static_cast<uint32_t>(n) + 3, 2.f);
      std::vector<uint8_t> q(DTypeRowBytes(bound.type, n));
      std::vector<float> y(n);
      ref::QuantizeRow(bound.type, x.data(), q.data(), n);
      ref::DequantizeRow(bound.type, q.data(), y.data(), n);
      double err2 = 0, x2 = 0;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(y[i])) << i;
        err2 += (y[i] - x[i]) * (y[i] - x[i]);
        x2 += x[i] * x[i];
      }
      EXPECT_LT(std::sqrt(err2 / x2), bound.max_rel_rms) << "n " << n;
      const std::vector<float> zeros(n, 0.f);
      ref::QuantizeRow(bound.type, zeros.data(), q.data(), n);
      ref::DequantizeRow(bound.type, q.data(), y.data(), n);
      for (float v : y) ASSERT_EQ(v, 0.f);
    }
  }
}

}  // namespace
}  // namespace kvsparse
