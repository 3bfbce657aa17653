#include "kvsparse/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/dtype.h"
#include "ops/attention_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::LastPosition;
using testing::MakeSpans;
using testing::RandomQueries;
using testing::SpanSet;

// int8_kivi span sets end with a full-precision residual span (see MakeSpans).
constexpr KvStorage kAllStorage[] = {KvStorage::kF32,      KvStorage::kF16,     KvStorage::kInt8,
                                     KvStorage::kInt8Kivi, KvStorage::kFp8E4M3, KvStorage::kFp8E5M2, KvStorage::kBf16,
                                     KvStorage::kInt4Kivi, KvStorage::kInt2Kivi};

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-5f + 2e-4f * std::fabs(want[i])) << what << " element " << i;
  }
}

struct Case {
  int n_q;
  int head_dim;
  int group;
  KvStorage storage;
  int n_threads;
};

std::string CaseName(const Case& c) {
  std::ostringstream name;  // (operator+ chains trip a GCC 12 -Wrestrict false positive)
  name << "q" << c.n_q << "_d" << c.head_dim << "_g" << c.group << "_" << KvStorageName(c.storage)
       << "_t" << c.n_threads;
  return name.str();
}

// Every storage type meets every query count and group; the head dims and thread counts rotate
// through those cases (each type still sees every head dim and both thread counts), which keeps
// the sanitizer run short without losing a (type, shape) pairing that has its own code path.
std::vector<Case> AllCases() {
  constexpr int kHeadDims[] = {64, 128, 32, 20};
  std::vector<Case> cases;
  int rotation = 0;
  for (KvStorage storage : kAllStorage) {
    for (int n_q : {1, 3, 17}) {
      for (int group : {1, 2, 8}) {
        cases.push_back({n_q, kHeadDims[rotation % 4], group, storage, 1 + (rotation / 4) % 2});
        ++rotation;
      }
    }
    ++rotation;  // so the next type starts its rotation elsewhere
  }
  return cases;
}

// Every test runs once per kernel family (scalar, avx2, avx512) the CPU can run.
class AttentionTest : public testing::PerIsaTest {};
KVS_INSTANTIATE_PER_ISA(AttentionTest);

// Ragged spans with gaps; queries at, before and after the cached positions.
void CheckRaggedCase(const Case& c) {
  std::mt19937 rng(1000 + c.n_q * 131 + c.head_dim * 7 + c.group * 3 + c.n_threads);
  const int n_kv_heads = c.group == 8 ? 1 : 2;
  AttentionShape shape{n_kv_heads * c.group, n_kv_heads, c.head_dim, 1.f / std::sqrt(static_cast<float>(c.head_dim))};
  const std::vector<int> lengths = {1, 5, 16, 31, 2, 17, 1, 40};
  SpanSet set = MakeSpans(c.storage, lengths, n_kv_heads, c.head_dim, rng, /*first_position=*/3);
  const int32_t last = LastPosition(set);

  std::vector<int32_t> q_pos(c.n_q);
  std::uniform_int_distribution<int32_t> any_pos(0, last + 2);
  for (int i = 0; i < c.n_q; ++i) q_pos[i] = any_pos(rng);
  q_pos[c.n_q - 1] = last;  // the usual decode case: sees everything
  if (c.n_q > 2) q_pos[0] = 1;  // before the first cached position: sees nothing -> zeros

  // Larger amplitude makes scores peaky, exercising the running-max rescale.
  for (float amplitude : {0.5f, 4.f}) {
    std::vector<float> q = RandomQueries(static_cast<size_t>(c.n_q) * shape.n_heads * c.head_dim, rng, amplitude);
    std::vector<float> want(q.size()), got(q.size(), 12345.f);
    ref::Attention(shape, c.storage, q.data(), q_pos.data(), c.n_q, set.spans.data(),
                   static_cast<int32_t>(set.spans.size()), want.data());
    ops::Attention(shape, c.storage, q.data(), q_pos.data(), c.n_q, set.spans.data(),
                   static_cast<int32_t>(set.spans.size()), got.data(), c.n_threads);
    ExpectClose(got, want, "amplitude " + std::to_string(amplitude));
    if (c.n_q > 2) {
      for (int j = 0; j < shape.n_heads * c.head_dim; ++j) ASSERT_EQ(got[j], 0.f) << "query that sees nothing";
    }
  }
}

TEST_P(AttentionTest, RaggedCasesMatchReference) {
  for (const Case& c : AllCases()) {
    SCOPED_TRACE(CaseName(c));
    CheckRaggedCase(c);
    if (HasFatalFailure()) return;
  }
}

// Head sizes that are not a multiple of the SIMD width (nor of 4), and odd head counts.
TEST_P(AttentionTest, OddHeadDimsMatchReference) {
  std::mt19937 rng(77);
  for (int head_dim : {1, 6, 8, 20, 37, 48, 80, 100, 256}) {
    for (KvStorage storage : kAllStorage) {
      if (!KvStorageFits(storage, head_dim)) continue;
      AttentionShape shape{6, 3, head_dim, 0.37f};
      SpanSet set = MakeSpans(storage, {3, 19, 7}, shape.n_kv_heads, head_dim, rng);
      const int n_q = 5;
      std::vector<int32_t> q_pos = {0, 5, 12, 20, LastPosition(set)};
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * head_dim, rng, 1.f);
      std::vector<float> want(q.size()), got(q.size());
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, want.data());
      ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, got.data(), 2);
      ExpectClose(got, want, "head_dim " + std::to_string(head_dim));
    }
  }
}

// Long context: many blocks per query and the split-over-tokens path with a merge.
TEST_P(AttentionTest, LongContextDecodeAndPrefillMatchReference) {
  std::mt19937 rng(5);
  for (KvStorage storage : kAllStorage) {
    AttentionShape shape{8, 1, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {700, 3, 1500}, 1, 64, rng);
    const int32_t last = LastPosition(set);
    for (int n_q : {1, 3, 40}) {
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 37;
      // One tile split over token chunks: a query that sees nothing, one that sees only the first chunk.
      if (n_q == 3) q_pos = {-1, last / 5, last};
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * 64, rng, 3.f);
      std::vector<float> want(q.size());
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, want.data());
      for (int n_threads : {1, 3}) {
        std::vector<float> got(q.size());
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, got.data(), n_threads);
        ExpectClose(got, want, "n_q " + std::to_string(n_q) + " threads " + std::to_string(n_threads));
      }
    }
  }
}

// Causal boundaries: a query exactly at a cached position sees it; one just below does not.
TEST_P(AttentionTest, CausalBoundaryIsInclusive) {
  AttentionShape shape{1, 1, 4, 1.f};
  // Two tokens at positions 10 and 20 with distinct values.
  std::vector<float> k = {0.1f, 0.2f, 0.3f, 0.4f, -0.2f, 0.5f, 0.1f, 0.3f};
  std::vector<float> v = {1.f, 2.f, 3.f, 4.f, -5.f, 6.f, -7.f, 8.f};
  std::vector<int32_t> pos = {10, 20};
  const KvSpan span{.k = k.data(), .v = v.data(), .positions = pos.data(), .n = 2};
  std::vector<float> q = {0.3f, -0.1f, 0.7f, 0.2f, 0.3f, -0.1f, 0.7f, 0.2f, 0.3f, -0.1f, 0.7f, 0.2f};
  std::vector<int32_t> q_pos = {9, 10, 19};
  std::vector<float> out(12, -1.f);
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 3, &span, 1, out.data(), 1);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(out[c], 0.f);          // position 9 sees nothing
  for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[4 + c], v[c]);  // position 10 sees only token 0
  for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[8 + c], v[c]);  // position 19 still only token 0
}

// Hand-computed: two tokens, softmax weights from explicit scores.
TEST_P(AttentionTest, ReferenceMatchesHandComputedSoftmax) {
  AttentionShape shape{2, 1, 2, 0.5f};
  std::vector<float> k = {1.f, 0.f, 0.f, 1.f};  // token 0 = e0, token 1 = e1
  std::vector<float> v = {1.f, 10.f, 3.f, -2.f};
  std::vector<int32_t> pos = {0, 1};
  const KvSpan span{.k = k.data(), .v = v.data(), .positions = pos.data(), .n = 2};
  std::vector<float> q = {2.f, 0.f, 0.f, 4.f};  // head 0 scores (1, 0); head 1 scores (0, 2)
  std::vector<int32_t> q_pos = {1};
  std::vector<float> want(4), got(4);
  ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, &span, 1, want.data());
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, &span, 1, got.data(), 2);
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0);
  const double w1 = 1.0 / (1.0 + std::exp(2.0));
  const std::vector<double> expected = {w0 * 1 + (1 - w0) * 3, w0 * 10 + (1 - w0) * -2, w1 * 1 + (1 - w1) * 3,
                                        w1 * 10 + (1 - w1) * -2};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(want[i], expected[i], 1e-6);
    EXPECT_NEAR(got[i], expected[i], 1e-5);
  }
}

// No spans at all (empty cache) and empty spans inside the list.
TEST_P(AttentionTest, EmptyInputsGiveZeros) {
  std::mt19937 rng(3);
  AttentionShape shape{4, 2, 16, 0.25f};
  std::vector<float> q = RandomQueries(2 * 4 * 16, rng, 1.f);
  std::vector<int32_t> q_pos = {5, 6};
  for (KvStorage storage : kAllStorage) {
    std::vector<float> out(q.size(), 9.f);
    ops::Attention(shape, storage, q.data(), q_pos.data(), 2, nullptr, 0, out.data(), 2);
    for (float x : out) EXPECT_EQ(x, 0.f);

    SpanSet set = MakeSpans(storage, {0, 4, 0, 3, 0}, 2, 16, rng);
    std::vector<float> want(q.size()), got(q.size());
    ref::Attention(shape, storage, q.data(), q_pos.data(), 2, set.spans.data(), 5, want.data());
    ops::Attention(shape, storage, q.data(), q_pos.data(), 2, set.spans.data(), 5, got.data(), 2);
    ExpectClose(got, want, std::string("empty spans ") + KvStorageName(storage));
    ops::Attention(shape, storage, q.data(), q_pos.data(), 0, set.spans.data(), 5, got.data(), 2);  // no-op
  }
}

// Through the real cache: attention over ContiguousKvCache spans equals attention over the raw rows.
TEST_P(AttentionTest, WorksOverContiguousKvCache) {
  std::mt19937 rng(21);
  const KvGeometry geo{1, 2, 32};
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16}) {
    ContiguousKvCache cache(geo, storage, 1, 64);
    const int n = 23;
    std::vector<float> k = RandomQueries(n * 64, rng, 1.f), v = RandomQueries(n * 64, rng, 1.f);
    std::vector<int32_t> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = 2 * i;
    ASSERT_TRUE(cache.Append(0, 0, n, k.data(), v.data(), pos.data()).ok());
    std::vector<KvSpan> spans;
    cache.Spans(0, 0, &spans);
    AttentionShape shape{4, 2, 32, 0.2f};
    std::vector<float> q = RandomQueries(4 * 32, rng, 1.f);
    std::vector<int32_t> q_pos = {2 * n};
    std::vector<float> want(q.size()), got(q.size());
    // Reference over f32 rows rounded like the cache stores them.
    if (storage == KvStorage::kF16) {
      for (float& x : k) x = F16ToF32(F32ToF16(x));
      for (float& x : v) x = F16ToF32(F32ToF16(x));
    }
    const KvSpan raw{.k = k.data(), .v = v.data(), .positions = pos.data(), .n = n};
    ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, &raw, 1, want.data());
    ops::Attention(shape, storage, q.data(), q_pos.data(), 1, spans.data(), static_cast<int32_t>(spans.size()),
                   got.data(), 2);
    ExpectClose(got, want, "cache");
  }
}

// The largest K and V errors a span set's storage allows (per element), from its stated bounds.
struct ElementErrors {
  double k = 0, v = 0;
};
ElementErrors MaxElementErrors(const SpanSet& set) {
  ElementErrors e;
  for (size_t s = 0; s < set.spans.size(); ++s) {
    if (set.storage == KvStorage::kInt8) {  // half a step
      for (float x : set.k_scale[s]) e.k = std::max(e.k, x / 2.0);
      for (float x : set.v_scale[s]) e.v = std::max(e.v, x / 2.0);
      continue;
    }
    // fp8: max(|x| 2^-(M+1), scale 2^-(bias+M)) (ops/kv_quant.h).
    const bool e4m3 = set.storage == KvStorage::kFp8E4M3;
    const int m = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const int row = set.head_dim;
    for (size_t i = 0; i < set.k_f32[s].size(); ++i) {
      const double k_bound = std::max<double>(std::ldexp(std::fabs(set.k_f32[s][i]), -(m + 1)),
                                      std::ldexp(static_cast<double>(set.k_scale[s][i / row]), -(bias + m)));
      const double v_bound = std::max<double>(std::ldexp(std::fabs(set.v_f32[s][i]), -(m + 1)),
                                      std::ldexp(static_cast<double>(set.v_scale[s][i / row]), -(bias + m)));
      e.k = std::max(e.k, k_bound);
      e.v = std::max(e.v, v_bound);
    }
  }
  return e;
}

// int8 and fp8 against f32 on the same values. With every K element off by at most kerr, a
// score moves by at most
//   delta = scale * sum_c |q_c| * kerr,
// so every probability changes by a factor within [e^-2delta, e^2delta] and
//   |out_quantized - out_f32| <= verr + (e^(2 delta) - 1) * max |v|.
// Both the fast kernel and the reference must stay inside that bound. fp8's relative error
// (2^-4, 2^-3) is coarser than int8's, so its queries are smaller to keep the bound meaningful.
TEST_P(AttentionTest, Int8AndFp8StayWithinQuantizationBoundOfF32) {
  std::mt19937 rng(404);
  for (KvStorage storage : {KvStorage::kInt8, KvStorage::kFp8E4M3, KvStorage::kFp8E5M2}) {
    const float q_amplitude = storage == KvStorage::kInt8 ? 1.f : storage == KvStorage::kFp8E4M3 ? 0.1f : 0.04f;
    for (int head_dim : {64, 20, 128}) {
      AttentionShape shape{8, 2, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
      SpanSet set = MakeSpans(storage, {33, 16, 5, 70}, shape.n_kv_heads, head_dim, rng);
      const std::vector<KvSpan> f32_spans = set.F32Spans();
      const ElementErrors err = MaxElementErrors(set);
      float max_v = 0.f;
      for (size_t s = 0; s < set.spans.size(); ++s) {
        for (float x : set.v_f32[s]) max_v = std::max(max_v, std::fabs(x));
      }
      const int n_q = 6;
      const int32_t last = LastPosition(set);
      std::vector<int32_t> q_pos = {2, 20, 40, last - 30, last - 1, last};
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * head_dim, rng, q_amplitude);
      std::vector<float> want(q.size()), got_ops(q.size()), got_ref(q.size());
      ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, f32_spans.data(),
                     static_cast<int32_t>(f32_spans.size()), want.data());
      ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(),
                     static_cast<int32_t>(set.spans.size()), got_ops.data(), 2);
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(),
                     static_cast<int32_t>(set.spans.size()), got_ref.data());
      float worst = 0.f;
      for (int row = 0; row < n_q * shape.n_heads; ++row) {
        double q_abs = 0;
        for (int c = 0; c < head_dim; ++c) q_abs += std::fabs(q[static_cast<size_t>(row) * head_dim + c]);
        const double delta = shape.scale * q_abs * err.k;
        const double bound = err.v + std::expm1(2 * delta) * max_v + 1e-5;
        ASSERT_LT(bound, 0.35) << "test data too coarse for a meaningful bound";
        for (int c = 0; c < head_dim; ++c) {
          const size_t e = static_cast<size_t>(row) * head_dim + c;
          ASSERT_LE(std::fabs(got_ops[e] - want[e]), bound)
              << KvStorageName(storage) << " ops, head_dim " << head_dim << " row " << row;
          ASSERT_LE(std::fabs(got_ref[e] - want[e]), bound)
              << KvStorageName(storage) << " ref, head_dim " << head_dim << " row " << row;
          worst = std::max(worst, std::fabs(got_ops[e] - want[e]));
        }
      }
      EXPECT_GT(worst, 0.f) << KvStorageName(storage) << " should not be exact";
    }
  }
}

// An int8 span's scales really are per (token, kv head): scaling one token's K/V codes and
// dividing its scales by the same factor leaves attention unchanged.
TEST_P(AttentionTest, Int8ScalesArePerTokenAndHead) {
  std::mt19937 rng(9);
  AttentionShape shape{4, 2, 32, 0.2f};
  SpanSet set = MakeSpans(KvStorage::kInt8, {40}, 2, 32, rng);
  std::vector<float> q = RandomQueries(4 * 32, rng, 1.f);
  const int32_t q_pos = LastPosition(set);
  // Even codes, so that halving them below is exact.
  for (int8_t& x : set.k_i8[0]) x = static_cast<int8_t>(x / 2 * 2);
  for (int8_t& x : set.v_i8[0]) x = static_cast<int8_t>(x / 2 * 2);
  std::vector<float> before(q.size()), after(q.size());
  ops::Attention(shape, KvStorage::kInt8, q.data(), &q_pos, 1, set.spans.data(), 1, before.data(), 1);
  // Token 7, kv head 1: halve the codes and double the scales; the values are unchanged.
  const size_t row = (7 * 2 + 1) * 32;
  for (int c = 0; c < 32; ++c) {
    set.k_i8[0][row + c] = static_cast<int8_t>(set.k_i8[0][row + c] / 2);
    set.v_i8[0][row + c] = static_cast<int8_t>(set.v_i8[0][row + c] / 2);
  }
  set.k_scale[0][7 * 2 + 1] *= 2;
  set.v_scale[0][7 * 2 + 1] *= 2;
  ops::Attention(shape, KvStorage::kInt8, q.data(), &q_pos, 1, set.spans.data(), 1, after.data(), 1);
  EXPECT_EQ(after, before);
}

// int8_kivi against f32 on the same values. A quantized page's K element moves by at most half
// its (page, head, channel) scale, a residual (f16) element by at most |x| 2^-11; V as int8 or
// f16. With kerr_c the largest K error of channel c, a score moves by at most
//   delta = scale * sum_c |q_c| kerr_c,
// and, as for int8, |out_kivi - out_f32| <= max V error + (e^(2 delta) - 1) * max |v|.
TEST_P(AttentionTest, Int8KiviStaysWithinQuantizationBoundOfF32) {
  std::mt19937 rng(405);
  for (int head_dim : {64, 20, 128}) {
    AttentionShape shape{8, 2, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
    SpanSet set = MakeSpans(KvStorage::kInt8Kivi, {16, 16, 16, 16, 9}, shape.n_kv_heads, head_dim, rng);
    // One channel per head with a large magnitude in every token, as in real keys: per-channel
    // scales keep the other channels fine. Codes are rebuilt in place (the spans' pointers stay).
    for (size_t s = 0; s < set.spans.size(); ++s) {
      std::vector<float>& k = set.k_f32[s];
      for (size_t row = 0; row < k.size() / head_dim; ++row) k[row * head_dim + 3] *= 8.f;
      testing::QuantizeColumnsInt8(k, shape.n_kv_heads * head_dim, &set.k_i8[s], &set.k_channel_scale[s]);
      for (size_t e = 0; e < k.size(); ++e) set.k_f16[s][e] = F32ToF16(k[e]);
    }
    const std::vector<KvSpan> f32_spans = set.F32Spans();
    const size_t row_len = static_cast<size_t>(shape.n_kv_heads) * head_dim;
    std::vector<float> k_err(row_len, 0.f);  // [n_kv_heads, head_dim] largest K error per channel
    float max_v_err = 0.f, max_v = 0.f;
    for (size_t s = 0; s < set.spans.size(); ++s) {
      const bool residual = set.spans[s].k_channel_scale == nullptr;
      for (size_t e = 0; e < set.k_f32[s].size(); ++e) {
        const float err = residual ? std::fabs(set.k_f32[s][e]) * 0x1p-11f : set.k_channel_scale[s][e % row_len] / 2;
        k_err[e % row_len] = std::max(k_err[e % row_len], err);
      }
      for (size_t e = 0; e < set.v_f32[s].size(); ++e) {
        const float v = std::fabs(set.v_f32[s][e]);
        max_v = std::max(max_v, v);
        max_v_err = std::max(max_v_err, residual ? v * 0x1p-11f : set.v_scale[s][e / head_dim] / 2);
      }
    }
    const int n_q = 6;
    const int32_t last = LastPosition(set);
    std::vector<int32_t> q_pos = {2, 20, 40, last - 30, last - 1, last};
    std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * head_dim, rng, 1.f);
    std::vector<float> want(q.size()), got_ops(q.size()), got_ref(q.size());
    ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, f32_spans.data(),
                   static_cast<int32_t>(f32_spans.size()), want.data());
    ops::Attention(shape, KvStorage::kInt8Kivi, q.data(), q_pos.data(), n_q, set.spans.data(),
                   static_cast<int32_t>(set.spans.size()), got_ops.data(), 2);
    ref::Attention(shape, KvStorage::kInt8Kivi, q.data(), q_pos.data(), n_q, set.spans.data(),
                   static_cast<int32_t>(set.spans.size()), got_ref.data());
    float worst = 0.f;
    for (int row = 0; row < n_q * shape.n_heads; ++row) {
      const int kv_head = (row % shape.n_heads) / (shape.n_heads / shape.n_kv_heads);
      double delta = 0;
      for (int c = 0; c < head_dim; ++c) {
        delta += std::fabs(q[static_cast<size_t>(row) * head_dim + c]) * k_err[kv_head * head_dim + c];
      }
      delta *= shape.scale;
      const double bound = max_v_err + std::expm1(2 * delta) * max_v + 1e-5;
      ASSERT_LT(bound, 0.25) << "test data too coarse for a meaningful bound";
      for (int c = 0; c < head_dim; ++c) {
        const size_t e = static_cast<size_t>(row) * head_dim + c;
        ASSERT_LE(std::fabs(got_ops[e] - want[e]), bound) << "ops, head_dim " << head_dim << " row " << row;
        ASSERT_LE(std::fabs(got_ref[e] - want[e]), bound) << "ref, head_dim " << head_dim << " row " << row;
        worst = std::max(worst, std::fabs(got_ops[e] - want[e]));
      }
    }
    EXPECT_GT(worst, 0.f) << "int8_kivi should not be exact";
  }
}

// int8_kivi K scales really are per (page, kv head, channel): halving one channel's codes in
// one page and doubling that page's channel scale leaves attention unchanged; the same change
// with the scale of another page (or channel) does not.
TEST_P(AttentionTest, Int8KiviScalesArePerPageHeadAndChannel) {
  std::mt19937 rng(10);
  AttentionShape shape{4, 2, 32, 0.2f};
  SpanSet set = MakeSpans(KvStorage::kInt8Kivi, {16, 16, 16, 5}, 2, 32, rng);
  std::vector<float> q = RandomQueries(4 * 32, rng, 1.f);
  const int32_t q_pos = LastPosition(set);
  for (auto& codes : set.k_i8)
    for (int8_t& x : codes) x = static_cast<int8_t>(x / 2 * 2);  // even, so halving is exact
  std::vector<float> before(q.size()), after(q.size()), wrong(q.size());
  ops::Attention(shape, KvStorage::kInt8Kivi, q.data(), &q_pos, 1, set.spans.data(), 4, before.data(), 2);
  const int page = 1, kv_head = 1, channel = 7;
  const size_t column = static_cast<size_t>(kv_head) * 32 + channel;
  for (int t = 0; t < 16; ++t) {
    int8_t& x = set.k_i8[page][static_cast<size_t>(t) * 64 + column];
    x = static_cast<int8_t>(x / 2);
  }
  set.k_channel_scale[page][column] *= 2;
  ops::Attention(shape, KvStorage::kInt8Kivi, q.data(), &q_pos, 1, set.spans.data(), 4, after.data(), 2);
  EXPECT_EQ(after, before);
  set.k_channel_scale[page][column] /= 2;
  set.k_channel_scale[page + 1][column] *= 2;
  ops::Attention(shape, KvStorage::kInt8Kivi, q.data(), &q_pos, 1, set.spans.data(), 4, wrong.data(), 2);
  EXPECT_NE(wrong, before);
}

// Segments: full-precision spans anywhere in an int8_kivi list (and empty spans at segment
// edges) give the reference's result, for decode, a prefill chunk, and the split-K path.
TEST_P(AttentionTest, Int8KiviMixedSegmentsMatchReference) {
  std::mt19937 rng(11);
  AttentionShape shape{6, 3, 48, 0.15f};
  SpanSet set = MakeSpans(KvStorage::kInt8Kivi, {0, 16, 16, 0, 5, 16, 0, 300, 200, 7, 0}, 3, 48, rng);
  set.MakeResidual(0);
  set.MakeResidual(4);
  set.MakeResidual(8);
  set.MakeResidual(9);
  const int32_t last = LastPosition(set);
  for (int n_q : {1, 4, 33}) {
    std::vector<int32_t> q_pos(n_q);
    for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 17;
    if (n_q == 4) q_pos = {-2, 20, last / 2, last};
    std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * 48, rng, 2.f);
    std::vector<float> want(q.size()), want_stats(static_cast<size_t>(n_q) * shape.n_heads * 2);
    ref::Attention(shape, KvStorage::kInt8Kivi, q.data(), q_pos.data(), n_q, set.spans.data(), 11, want.data(),
                   want_stats.data());
    for (int n_threads : {1, 2, 3}) {
      std::vector<float> got(q.size()), got_stats(want_stats.size());
      ops::Attention(shape, KvStorage::kInt8Kivi, q.data(), q_pos.data(), n_q, set.spans.data(), 11, got.data(),
                     n_threads, got_stats.data());
      ExpectClose(got, want, "n_q " + std::to_string(n_q) + " threads " + std::to_string(n_threads));
      for (size_t r = 0; r < want_stats.size() / 2; ++r) {
        if (std::isinf(want_stats[2 * r])) {
          EXPECT_TRUE(std::isinf(got_stats[2 * r]) && got_stats[2 * r + 1] == 0.f) << "row " << r;
          continue;
        }
        const double got_z = std::log(got_stats[2 * r + 1]) + got_stats[2 * r];
        const double want_z = std::log(want_stats[2 * r + 1]) + want_stats[2 * r];
        EXPECT_NEAR(got_z, want_z, 1e-4) << "row " << r;
      }
    }
  }
}

// The optional softmax statistics match the reference's, for the single-pass and split-K paths.
TEST_P(AttentionTest, RowMaxSumMatchesReference) {
  std::mt19937 rng(31);
  for (KvStorage storage : kAllStorage) {
    AttentionShape shape{8, 2, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {300, 7, 400}, 2, 64, rng);
    const int32_t last = LastPosition(set);
    for (int n_q : {1, 5}) {
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 90;
      if (n_q == 5) q_pos[0] = -3;  // sees nothing
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 64, rng, 2.f);
      std::vector<float> out(q.size()), want_stats(static_cast<size_t>(n_q) * 8 * 2);
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, out.data(), want_stats.data());
      for (int n_threads : {1, 3}) {
        std::vector<float> got_stats(want_stats.size(), 7.f);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, out.data(), n_threads,
                       got_stats.data());
        for (size_t r = 0; r < want_stats.size() / 2; ++r) {
          if (std::isinf(want_stats[2 * r])) {
            EXPECT_TRUE(std::isinf(got_stats[2 * r]) && got_stats[2 * r] < 0) << "row " << r;
            EXPECT_EQ(got_stats[2 * r + 1], 0.f) << "row " << r;
            continue;
          }
          // The max may come from a different (but tied within rounding) token; compare the
          // normalizer exp(max) * sum, which is what the probabilities depend on.
          EXPECT_NEAR(got_stats[2 * r], want_stats[2 * r], 1e-4 + 1e-5 * std::fabs(want_stats[2 * r])) << "row " << r;
          const double got_z = std::log(got_stats[2 * r + 1]) + got_stats[2 * r];
          const double want_z = std::log(want_stats[2 * r + 1]) + want_stats[2 * r];
          EXPECT_NEAR(got_z, want_z, 1e-4) << KvStorageName(storage) << " row " << r << " threads " << n_threads;
        }
      }
    }
  }
}

// The optional raw scores (log2 domain, -inf where the query does not see the token) match
// the reference's, over ragged spans, every storage type (int8_kivi with residual spans inside
// the list), decode and a chunk, the single-pass and split-K paths; asking for them changes
// neither the output nor the statistics.
TEST_P(AttentionTest, RawScoresMatchReference) {
  std::mt19937 rng(41);
  for (KvStorage storage : kAllStorage) {
    AttentionShape shape{8, 2, 40, 0.15f};
    SpanSet set = MakeSpans(storage, {3, 16, 0, 16, 250, 7, 16, 400, 5}, 2, 40, rng);
    if (storage == KvStorage::kInt8Kivi) {
      set.MakeResidual(1);
      set.MakeResidual(4);
    }
    const int32_t last = LastPosition(set);
    int64_t n_tokens = 0;
    for (const KvSpan& s : set.spans) n_tokens += s.n;
    for (int n_q : {1, 6}) {
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 70;
      if (n_q == 6) q_pos[0] = -3;  // sees nothing
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 40, rng, 2.f);
      const size_t n_raw = static_cast<size_t>(n_q) * 8 * n_tokens;
      std::vector<float> want_out(q.size()), want_raw(n_raw);
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, want_out.data(), nullptr,
                     want_raw.data());
      for (int n_threads : {1, 3}) {
        std::vector<float> plain_out(q.size()), plain_stats(static_cast<size_t>(n_q) * 8 * 2);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, plain_out.data(), n_threads,
                       plain_stats.data());
        std::vector<float> out(q.size()), stats(plain_stats.size()), raw(n_raw, 99.f);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, out.data(), n_threads,
                       stats.data(), raw.data());
        EXPECT_EQ(out, plain_out);
        EXPECT_EQ(stats, plain_stats);
        for (size_t e = 0; e < n_raw; ++e) {
          if (std::isinf(want_raw[e])) {
            ASSERT_TRUE(std::isinf(raw[e]) && raw[e] < 0) << KvStorageName(storage) << " element " << e;
            continue;
          }
          ASSERT_NEAR(raw[e], want_raw[e], 1e-4f + 1e-5f * std::fabs(want_raw[e]))
              << KvStorageName(storage) << " n_q " << n_q << " threads " << n_threads << " element " << e;
        }
      }
    }
  }
}

// ---- AttentionBatch ----

// Compares one batch's outputs, statistics (as normalizers) and raw scores with the reference's.
void ExpectBatchClose(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& got_stats,
                      const std::vector<float>& want_stats, const std::vector<float>& got_raw,
                      const std::vector<float>& want_raw, const std::string& what) {
  ExpectClose(got, want, what + " out");
  for (size_t r = 0; r < want_stats.size() / 2; ++r) {
    if (std::isinf(want_stats[2 * r])) {
      ASSERT_TRUE(std::isinf(got_stats[2 * r]) && got_stats[2 * r + 1] == 0.f) << what << " row " << r;
      continue;
    }
    const double got_z = std::log(got_stats[2 * r + 1]) + got_stats[2 * r];
    const double want_z = std::log(want_stats[2 * r + 1]) + want_stats[2 * r];
    ASSERT_NEAR(got_z, want_z, 1e-4) << what << " row " << r;
  }
  ASSERT_EQ(got_raw.size(), want_raw.size());
  for (size_t e = 0; e < want_raw.size(); ++e) {
    if (std::isinf(want_raw[e])) {
      ASSERT_TRUE(std::isinf(got_raw[e]) && got_raw[e] < 0) << what << " raw " << e;
      continue;
    }
    ASSERT_NEAR(got_raw[e], want_raw[e], 1e-4f + 1e-5f * std::fabs(want_raw[e])) << what << " raw " << e;
  }
}

// The outputs of a batch's jobs, all in one buffer each: out [jobs, n_q, heads, d], stats
// [jobs, n_q, heads, 2], raw [Σ jobs' n_q * heads * tokens].
struct BatchBuffers {
  std::vector<float> out, stats, raw;
  std::vector<AttentionJob> jobs;
  BatchBuffers(const AttentionShape& shape, int32_t n_q, const std::vector<std::vector<KvSpan>>& job_spans,
               const std::vector<int>& first_kv_head, const std::vector<float>& q) {
    const size_t rows = static_cast<size_t>(n_q) * shape.n_heads;
    const size_t n_jobs = job_spans.size();
    size_t raw_total = 0;
    std::vector<size_t> raw_at;
    for (const std::vector<KvSpan>& spans : job_spans) {
      raw_at.push_back(raw_total);
      for (const KvSpan& span : spans) raw_total += rows * span.n;
    }
    out.assign(n_jobs * rows * shape.head_dim, 12345.f);
    stats.assign(n_jobs * rows * 2, 7.f);
    raw.assign(raw_total, 99.f);
    for (size_t j = 0; j < n_jobs; ++j) {
      AttentionJob job;
      job.spans = job_spans[j].data();
      job.n_spans = static_cast<int32_t>(job_spans[j].size());
      job.first_kv_head = first_kv_head[j];
      job.q = q.data() + j * rows * shape.head_dim;  // [jobs, n_q, heads, d]
      job.out = out.data() + j * rows * shape.head_dim;
      job.row_max_sum = stats.data() + j * rows * 2;
      job.raw_scores = raw.data() + raw_at[j];
      jobs.push_back(job);
    }
  }
};

// Attention sinks (gpt-oss): each head's logit joins the denominator. Against the reference over
// every storage type, decode and a chunk (a row that sees nothing stays zero), one thread and
// three (the split-K merge folds the sink once); the statistics include the sink; a batch's jobs
// take their own heads' sinks; sinks change the result.
TEST_P(AttentionTest, SinksMatchReference) {
  std::mt19937 rng(57);
  const std::vector<float> sinks = {-1.5f, 0.3f, 2.5f, -0.2f, 1.1f, 4.0f, -3.0f, 0.9f};  // [8 heads]
  for (KvStorage storage : kAllStorage) {
    AttentionShape shape{8, 2, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {300, 7, 400}, 2, 64, rng);
    const int32_t last = LastPosition(set);
    for (int n_q : {1, 5}) {
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 90;
      if (n_q == 5) q_pos[0] = -3;  // sees nothing
      std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 64, rng, 2.f);
      std::vector<float> plain(q.size()), want(q.size()), want_stats(static_cast<size_t>(n_q) * 8 * 2);
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, plain.data());
      shape.sinks = sinks.data();
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, want.data(), want_stats.data());
      double moved = 0;
      for (size_t i = 0; i < want.size(); ++i) moved = std::max(moved, static_cast<double>(std::fabs(want[i] - plain[i])));
      EXPECT_GT(moved, 1e-3) << "the sinks change the output";
      for (int n_threads : {1, 3}) {
        std::vector<float> got(q.size(), 5.f), got_stats(want_stats.size(), 7.f);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, got.data(), n_threads,
                       got_stats.data());
        const std::string what = std::string(KvStorageName(storage)) + " n_q " + std::to_string(n_q) + " threads " +
                                 std::to_string(n_threads);
        ExpectBatchClose(got, want, got_stats, want_stats, {}, {}, what);
        if (HasFatalFailure()) return;
        // The same rows as two batch jobs of 4 query heads each (one kv head each), with their own sinks.
        std::vector<float> q_jobs(q.size()), got_jobs(q.size(), 5.f), stats_jobs(want_stats.size(), 7.f);
        AttentionJob jobs[2];
        for (int j = 0; j < 2; ++j) {
          for (int i = 0; i < n_q; ++i) {
            std::copy_n(&q[(static_cast<size_t>(i) * 8 + 4 * j) * 64], 4 * 64, &q_jobs[(j * n_q + i) * 4 * 64]);
          }
          jobs[j].spans = set.spans.data();
          jobs[j].n_spans = 3;
          jobs[j].first_kv_head = j;
          jobs[j].q = &q_jobs[static_cast<size_t>(j) * n_q * 4 * 64];
          jobs[j].out = &got_jobs[static_cast<size_t>(j) * n_q * 4 * 64];
          jobs[j].row_max_sum = &stats_jobs[static_cast<size_t>(j) * n_q * 4 * 2];
          jobs[j].sinks = sinks.data() + 4 * j;
        }
        ops::AttentionBatch(AttentionShape{4, 1, 64, 0.125f}, 2, storage, q_pos.data(), n_q, jobs, 2, n_threads);
        std::vector<float> ungrouped(q.size()), ungrouped_stats(want_stats.size());
        for (int j = 0; j < 2; ++j) {
          for (int i = 0; i < n_q; ++i) {
            std::copy_n(&got_jobs[(j * n_q + i) * 4 * 64], 4 * 64, &ungrouped[(static_cast<size_t>(i) * 8 + 4 * j) * 64]);
            std::copy_n(&stats_jobs[(j * n_q + i) * 4 * 2], 4 * 2, &ungrouped_stats[(static_cast<size_t>(i) * 8 + 4 * j) * 2]);
          }
        }
        ExpectBatchClose(ungrouped, want, ungrouped_stats, want_stats, {}, {}, what + " as jobs");
        if (HasFatalFailure()) return;
      }
      shape.sinks = nullptr;
    }
  }
}

// Jobs over their own ragged spans (a per-head layer's heads: rows of one head; Quest's query
// heads: runs of shared rows, each reading its own kv head) against the scalar twin, on every
// storage type, decode and a few queries, one thread and several.
TEST_P(AttentionTest, BatchMatchesReferenceOverRaggedJobs) {
  std::mt19937 rng(2024);
  for (KvStorage storage : kAllStorage) {
    for (int head_dim : {64, 20}) {
      // Per-head style: every job its own single-head spans, of different lengths.
      std::vector<SpanSet> sets;
      const std::vector<std::vector<int>> lengths = {{16, 16, 5}, {3}, {16, 200, 16, 9}, {0, 0}, {40, 1}};
      for (const std::vector<int>& l : lengths) sets.push_back(MakeSpans(storage, l, 1, head_dim, rng));
      // Quest style: runs of one set of shared rows (3 kv heads), each job a subset of spans.
      SpanSet shared = MakeSpans(storage, {16, 16, 16, 16, 160, 16, 7}, 3, head_dim, rng);
      int32_t last = LastPosition(shared);
      for (const SpanSet& set : sets) last = std::max(last, LastPosition(set));
      for (int n_q : {1, 3}) {
        std::vector<int32_t> q_pos(n_q, last);
        if (n_q == 3) q_pos = {-1, last / 3, last};
        for (int mode = 0; mode < 2; ++mode) {
          const bool per_head = mode == 0;
          const AttentionShape shape = per_head ? AttentionShape{4, 1, head_dim, 0.17f}
                                                : AttentionShape{1, 1, head_dim, 0.17f};
          const int row_heads = per_head ? 1 : 3;
          std::vector<std::vector<KvSpan>> job_spans;
          std::vector<int> first;
          if (per_head) {
            for (const SpanSet& set : sets) {
              job_spans.push_back(set.spans);
              first.push_back(0);
            }
          } else {
            for (int j = 0; j < 6; ++j) {  // query head j reads kv head j / 2, its own runs
              std::vector<KvSpan> runs;
              for (size_t t = 0; t < shared.spans.size(); ++t)
                if ((t + j) % 3 != 0 || t + 1 == shared.spans.size()) runs.push_back(shared.spans[t]);
              job_spans.push_back(runs);
              first.push_back(j / 2);
            }
          }
          const size_t n_jobs = job_spans.size();
          const std::vector<float> q =
              RandomQueries(n_jobs * n_q * shape.n_heads * head_dim, rng, 2.f);  // [jobs, n_q, heads, d]
          BatchBuffers want(shape, n_q, job_spans, first, q);
          ref::AttentionBatch(shape, row_heads, storage, q_pos.data(), n_q, want.jobs.data(),
                              static_cast<int32_t>(n_jobs));
          for (int n_threads : {1, 2, 3}) {
            BatchBuffers got(shape, n_q, job_spans, first, q);
            ops::AttentionBatch(shape, row_heads, storage, q_pos.data(), n_q, got.jobs.data(),
                                static_cast<int32_t>(n_jobs), n_threads);
            ExpectBatchClose(got.out, want.out, got.stats, want.stats, got.raw, want.raw,
                             std::string(KvStorageName(storage)) + (per_head ? " per-head" : " shared rows") + " d" +
                                 std::to_string(head_dim) + " n_q " + std::to_string(n_q) + " threads " +
                                 std::to_string(n_threads));
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Decode rows of several sequences in one call (AttentionJob::q_pos): each job, at its own
// position, is bit-identical to its own ops::Attention call; int8 jobs with integer dots too.
TEST_P(AttentionTest, JobsWithOwnPositionsMatchLoneCalls) {
  std::mt19937 rng(31);
  for (KvStorage storage : {KvStorage::kF16, KvStorage::kInt8}) {
    AttentionShape shape{8, 2, 64, 0.125f};
    shape.integer_dots = true;
    std::vector<SpanSet> sets;
    for (const std::vector<int>& l : std::vector<std::vector<int>>{{16, 16, 7}, {300, 16}, {1}, {16, 16, 16, 16, 40}}) {
      sets.push_back(MakeSpans(storage, l, shape.n_kv_heads, 64, rng));
    }
    std::vector<int32_t> positions;
    for (const SpanSet& set : sets) positions.push_back(LastPosition(set) - static_cast<int32_t>(positions.size()));
    const size_t row = static_cast<size_t>(shape.n_heads) * 64;
    const std::vector<float> q = RandomQueries(sets.size() * row, rng, 2.f);
    std::vector<float> batched(q.size()), alone(q.size());
    std::vector<AttentionJob> jobs;
    for (size_t j = 0; j < sets.size(); ++j) {
      AttentionJob job{sets[j].spans.data(), static_cast<int32_t>(sets[j].spans.size()), 0, q.data() + j * row,
                       batched.data() + j * row};
      job.q_pos = &positions[j];
      jobs.push_back(job);
      ops::Attention(shape, storage, q.data() + j * row, &positions[j], 1, sets[j].spans.data(),
                     static_cast<int32_t>(sets[j].spans.size()), alone.data() + j * row, 2);
    }
    const int32_t unused_position = 0;  // every job brings its own
    ops::AttentionBatch(shape, shape.n_kv_heads, storage, &unused_position, 1, jobs.data(),
                        static_cast<int32_t>(jobs.size()), 2);
    for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(batched[i], alone[i]) << KvStorageName(storage) << " element " << i;
  }
}

// A job is computed exactly as a lone call: bit-identical to ops::Attention over its spans
// (same chunks, same merge), and a job reading kv head h of shared rows is bit-identical to
// that head's rows of one call over every head (what makes per-head layers equal shared ones
// when their heads keep the same tokens).
TEST_P(AttentionTest, BatchJobsAreBitIdenticalToLoneCalls) {
  std::mt19937 rng(77);
  for (KvStorage storage : kAllStorage) {
    const int d = 64, group = 4;
    const AttentionShape head_shape{group, 1, d, 0.125f};
    std::vector<SpanSet> sets;
    for (const std::vector<int>& l : std::vector<std::vector<int>>{{16, 16, 900, 5}, {2000, 16}, {3}, {16, 7}})
      sets.push_back(MakeSpans(storage, l, 1, d, rng));
    int32_t last = 0;
    for (const SpanSet& set : sets) last = std::max(last, LastPosition(set));
    for (int n_q : {1, 2}) {
      std::vector<int32_t> q_pos(n_q, last);
      if (n_q == 2) q_pos[0] = last / 2;
      for (int n_threads : {1, 2, 3}) {
        std::vector<std::vector<KvSpan>> job_spans;
        for (const SpanSet& set : sets) job_spans.push_back(set.spans);
        const std::vector<float> q = RandomQueries(sets.size() * n_q * group * d, rng, 2.f);
        BatchBuffers got(head_shape, n_q, job_spans, std::vector<int>(sets.size(), 0), q);
        ops::AttentionBatch(head_shape, 1, storage, q_pos.data(), n_q, got.jobs.data(),
                            static_cast<int32_t>(sets.size()), n_threads);
        for (size_t j = 0; j < sets.size(); ++j) {
          const size_t rows = static_cast<size_t>(n_q) * group;
          std::vector<float> out(rows * d), stats(rows * 2);
          int64_t n_tokens = 0;
          for (const KvSpan& span : sets[j].spans) n_tokens += span.n;
          std::vector<float> raw(rows * n_tokens);
          ops::Attention(head_shape, storage, q.data() + j * rows * d, q_pos.data(), n_q, sets[j].spans.data(),
                         static_cast<int32_t>(sets[j].spans.size()), out.data(), n_threads, stats.data(), raw.data());
          ASSERT_EQ(std::vector<float>(got.jobs[j].out, got.jobs[j].out + out.size()), out)
              << KvStorageName(storage) << " job " << j << " threads " << n_threads;
          ASSERT_EQ(std::vector<float>(got.jobs[j].row_max_sum, got.jobs[j].row_max_sum + stats.size()), stats);
          ASSERT_EQ(std::vector<float>(got.jobs[j].raw_scores, got.jobs[j].raw_scores + raw.size()), raw);
        }
      }
    }

    // Kv head h of shared rows: the same bits as the rows of kv head h in one call over all heads.
    const int n_kv = 3;
    const AttentionShape shape{n_kv * group, n_kv, d, 0.125f};
    SpanSet shared = MakeSpans(storage, {16, 700, 16, 3}, n_kv, d, rng);
    const int32_t q_pos = LastPosition(shared);
    const std::vector<float> q = RandomQueries(static_cast<size_t>(shape.n_heads) * d, rng, 2.f);  // [1, heads, d]
    for (int n_threads : {1, 2}) {
      std::vector<float> all(q.size());
      ops::Attention(shape, storage, q.data(), &q_pos, 1, shared.spans.data(),
                     static_cast<int32_t>(shared.spans.size()), all.data(), n_threads);
      std::vector<float> by_head(q.size(), 9.f);
      std::vector<AttentionJob> jobs(n_kv);
      for (int h = 0; h < n_kv; ++h) {
        jobs[h].spans = shared.spans.data();
        jobs[h].n_spans = static_cast<int32_t>(shared.spans.size());
        jobs[h].first_kv_head = h;
        jobs[h].q = q.data() + static_cast<size_t>(h) * group * d;
        jobs[h].out = by_head.data() + static_cast<size_t>(h) * group * d;
      }
      ops::AttentionBatch(head_shape, n_kv, storage, &q_pos, 1, jobs.data(), n_kv, n_threads);
      EXPECT_EQ(by_head, all) << KvStorageName(storage) << " threads " << n_threads;
    }
  }
}

// No jobs, jobs without tokens and jobs whose tokens no query sees: zeros (and -inf / 0
// statistics), next to a job that sees tokens.
TEST_P(AttentionTest, BatchEmptyJobsGiveZeros) {
  std::mt19937 rng(8);
  const AttentionShape shape{2, 1, 16, 0.25f};
  ops::AttentionBatch(shape, 1, KvStorage::kF32, nullptr, 1, nullptr, 0, 2);  // no-op
  for (KvStorage storage : kAllStorage) {
    SpanSet seen = MakeSpans(storage, {5, 16}, 1, 16, rng, /*first_position=*/0);
    SpanSet later = MakeSpans(storage, {4}, 1, 16, rng, /*first_position=*/1000);
    const int32_t q_pos = LastPosition(seen);
    const std::vector<std::vector<KvSpan>> job_spans = {{}, later.spans, seen.spans};
    const std::vector<float> q = RandomQueries(3 * 2 * 16, rng, 1.f);
    BatchBuffers got(shape, 1, job_spans, {0, 0, 0}, q);
    ops::AttentionBatch(shape, 1, storage, &q_pos, 1, got.jobs.data(), 3, 2);
    for (int j = 0; j < 2; ++j) {
      for (int e = 0; e < 2 * 16; ++e) ASSERT_EQ(got.jobs[j].out[e], 0.f) << "job " << j;
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(std::isinf(got.jobs[j].row_max_sum[2 * r]) && got.jobs[j].row_max_sum[2 * r] < 0);
        EXPECT_EQ(got.jobs[j].row_max_sum[2 * r + 1], 0.f);
      }
    }
    for (int e = 0; e < 4 * 2; ++e) EXPECT_TRUE(std::isinf(got.jobs[1].raw_scores[e])) << "unseen tokens: -inf";
    BatchBuffers want(shape, 1, job_spans, {0, 0, 0}, q);
    ref::AttentionBatch(shape, 1, storage, &q_pos, 1, want.jobs.data(), 3);
    ExpectBatchClose(got.out, want.out, got.stats, want.stats, got.raw, want.raw, KvStorageName(storage));
  }
}

// ---- sparse prefill: a key selection per block of queries (KeySelection) ----

// A prompt chunk's queries over ragged spans: n_q ascending positions ending at the last one.
std::vector<int32_t> ChunkPositions(const SpanSet& set, int32_t n_q) {
  std::vector<int32_t> positions;
  for (const KvSpan& span : set.spans) positions.insert(positions.end(), span.positions, span.positions + span.n);
  std::vector<int32_t> q_pos(positions.end() - n_q, positions.end());
  q_pos[0] = positions[0] - 1;  // one query that sees nothing
  return q_pos;
}

// Random ascending, disjoint ranges per query block: bands, single tokens, and gaps.
struct RandomSelection {
  std::vector<int64_t> offsets{0}, ranges;
  KeySelection view;
  RandomSelection(int query_block, int32_t n_q, int64_t n_tokens, std::mt19937& rng) {
    std::uniform_int_distribution<int64_t> step(0, 40), width(1, 50);
    for (int32_t b = 0; b * query_block < n_q; ++b) {
      for (int64_t t = step(rng); t < n_tokens; t += step(rng) + 1) {
        const int64_t end = std::min(n_tokens, t + (rng() % 3 == 0 ? 1 : width(rng)));
        ranges.push_back(t);
        ranges.push_back(end);
        t = end;
      }
      offsets.push_back(static_cast<int64_t>(ranges.size() / 2));
    }
    view = KeySelection{query_block, offsets.data(), ranges.data()};
  }
};

// Each kv head of a shared layer as a job over the shared rows, with its own selection.
TEST_P(AttentionTest, KeySelectionMatchesMaskedReference) {
  std::mt19937 rng(31);
  for (KvStorage storage : kAllStorage) {
    for (int head_dim : {64, 20}) {
      if (!KvStorageFits(storage, head_dim)) continue;
      const int n_kv = 2, group = head_dim == 64 ? 2 : 3;
      const AttentionShape head_shape{group, 1, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
      SpanSet set = MakeSpans(storage, {70, 16, 3, 200, 40}, n_kv, head_dim, rng);
      int64_t n_tokens = 0;
      for (const KvSpan& span : set.spans) n_tokens += span.n;
      const int32_t n_q = 150;
      const std::vector<int32_t> q_pos = ChunkPositions(set, n_q);
      std::vector<RandomSelection> selections;
      for (int h = 0; h < n_kv; ++h) selections.emplace_back(64, n_q, n_tokens, rng);
      std::vector<std::vector<float>> q(n_kv);
      for (auto& rows : q) rows = RandomQueries(static_cast<size_t>(n_q) * group * head_dim, rng, 3.f);
      std::vector<std::vector<float>> want(n_kv, std::vector<float>(q[0].size())), stats_want(n_kv);
      std::vector<AttentionJob> jobs(n_kv);
      for (int h = 0; h < n_kv; ++h) {
        stats_want[h].resize(static_cast<size_t>(n_q) * group * 2);
        jobs[h] =
            AttentionJob{set.spans.data(),    static_cast<int32_t>(set.spans.size()), h, q[h].data(), want[h].data(),
                         stats_want[h].data()};
        jobs[h].selection = &selections[h].view;
      }
      ref::AttentionBatch(head_shape, n_kv, storage, q_pos.data(), n_q, jobs.data(), n_kv);
      for (int n_threads : {1, 3}) {
        std::vector<std::vector<float>> got(n_kv, std::vector<float>(q[0].size(), 7.f)), stats(n_kv);
        for (int h = 0; h < n_kv; ++h) {
          stats[h].resize(stats_want[h].size());
          jobs[h].out = got[h].data();
          jobs[h].row_max_sum = stats[h].data();
        }
        ops::AttentionBatch(head_shape, n_kv, storage, q_pos.data(), n_q, jobs.data(), n_kv, n_threads);
        for (int h = 0; h < n_kv; ++h) {
          const std::string what = std::string(KvStorageName(storage)) + " d" + std::to_string(head_dim) + " head " +
                                   std::to_string(h) + " threads " + std::to_string(n_threads);
          ExpectClose(got[h], want[h], what);
          for (size_t e = 0; e < stats[h].size(); ++e) {  // (-inf for the query that sees nothing)
            if (std::isinf(stats_want[h][e])) {
              ASSERT_EQ(stats[h][e], stats_want[h][e]) << what << " row_max_sum " << e;
            } else {
              ASSERT_NEAR(stats[h][e], stats_want[h][e], 2e-5f + 2e-4f * std::fabs(stats_want[h][e])) << what;
            }
          }
          for (int e = 0; e < group * head_dim; ++e) ASSERT_EQ(got[h][e], 0.f) << what << ": a query that sees nothing";
        }
      }
    }
  }
}

// Selecting every token gives exactly the dense result: the same blocks in the same order.
TEST_P(AttentionTest, KeySelectionOfEveryTokenIsBitIdenticalToDense) {
  std::mt19937 rng(32);
  for (KvStorage storage : kAllStorage) {
    const AttentionShape head_shape{2, 1, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {300, 5, 100}, 1, 64, rng);
    int64_t n_tokens = 0;
    for (const KvSpan& span : set.spans) n_tokens += span.n;
    const int32_t n_q = 200;
    const std::vector<int32_t> q_pos = ChunkPositions(set, n_q);
    std::vector<int64_t> offsets, ranges;
    for (int32_t b = 0; b * 64 < n_q; ++b) {
      offsets.push_back(b);
      ranges.insert(ranges.end(), {0, n_tokens});
    }
    offsets.push_back(static_cast<int64_t>(offsets.size()));
    const KeySelection every{64, offsets.data(), ranges.data()};
    const std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 2 * 64, rng, 3.f);
    for (int n_threads : {1, 2}) {  // enough query tiles that dense does not split the tokens
      std::vector<float> dense(q.size()), sparse(q.size());
      AttentionJob job{set.spans.data(), static_cast<int32_t>(set.spans.size()), 0, q.data(), dense.data()};
      ops::AttentionBatch(head_shape, 1, storage, q_pos.data(), n_q, &job, 1, n_threads);
      job.out = sparse.data();
      job.selection = &every;
      ops::AttentionBatch(head_shape, 1, storage, q_pos.data(), n_q, &job, 1, n_threads);
      for (size_t e = 0; e < q.size(); ++e)
        ASSERT_EQ(sparse[e], dense[e]) << KvStorageName(storage) << " element " << e;
    }
  }
}

// ---- sliding windows and softcapping (AttentionShape::window, ::softcap) ----

constexpr int32_t kHugeWindow = 1 << 30;  // larger than any context: the same as no window

// Compares row_max_sum (exact -inf / 0 for rows that see nothing; otherwise the max and the
// normalizer max + log(sum)) and raw scores with the reference's.
void ExpectStatsAndRawClose(const std::vector<float>& got_stats, const std::vector<float>& want_stats,
                            const std::vector<float>& got_raw, const std::vector<float>& want_raw,
                            const std::string& what) {
  ASSERT_EQ(got_stats.size(), want_stats.size());
  for (size_t r = 0; r < want_stats.size() / 2; ++r) {
    if (std::isinf(want_stats[2 * r])) {
      ASSERT_TRUE(std::isinf(got_stats[2 * r]) && got_stats[2 * r] < 0) << what << " row " << r;
      ASSERT_EQ(got_stats[2 * r + 1], 0.f) << what << " row " << r;
      continue;
    }
    ASSERT_NEAR(got_stats[2 * r], want_stats[2 * r], 1e-4 + 1e-5 * std::fabs(want_stats[2 * r]))
        << what << " row " << r;
    const double got_z = std::log(got_stats[2 * r + 1]) + got_stats[2 * r];
    const double want_z = std::log(want_stats[2 * r + 1]) + want_stats[2 * r];
    ASSERT_NEAR(got_z, want_z, 1e-4) << what << " row " << r;
  }
  ASSERT_EQ(got_raw.size(), want_raw.size());
  for (size_t e = 0; e < want_raw.size(); ++e) {
    if (std::isinf(want_raw[e])) {
      ASSERT_TRUE(std::isinf(got_raw[e]) && got_raw[e] < 0) << what << " raw " << e;
      continue;
    }
    ASSERT_NEAR(got_raw[e], want_raw[e], 1e-4f + 1e-5f * std::fabs(want_raw[e])) << what << " raw " << e;
  }
}

// A position inside a hole of the set's positions (the token before it is at position - 1 and
// the next one at position + 2), or -1 when there is none.
int32_t PositionInHole(const SpanSet& set) {
  std::vector<int32_t> positions;
  for (const KvSpan& span : set.spans) positions.insert(positions.end(), span.positions, span.positions + span.n);
  for (size_t t = 0; t + 1 < positions.size(); ++t) {
    if (positions[t + 1] - positions[t] >= 3) return positions[t] + 1;
  }
  return -1;
}

struct WindowCase {
  KvStorage storage;
  int32_t window;
  float softcap;
  int n_q;
  int head_dim;
  int group;
  int n_threads;
};

std::string WindowCaseName(const WindowCase& c) {
  std::ostringstream name;
  name << KvStorageName(c.storage) << "_w" << c.window << "_cap" << c.softcap << "_q" << c.n_q << "_d" << c.head_dim
       << "_g" << c.group << "_t" << c.n_threads;
  return name.str();
}

// Every storage type meets every window and softcap; query counts (one, a few, more than one
// tile), head dims (ragged ones included), groups and thread counts rotate through the cases.
std::vector<WindowCase> AllWindowCases() {
  std::vector<WindowCase> cases;
  int rotation = 0;
  for (KvStorage storage : kAllStorage) {
    for (int32_t window : {1, 3, 17, 40, kHugeWindow}) {
      for (float softcap : {0.f, 5.f, 50.f}) {
        constexpr int kQueries[] = {1, 5, 40};
        constexpr int kHeadDims[] = {20, 64, 37};
        constexpr int kGroups[] = {1, 2, 4, 8};
        cases.push_back({storage, window, softcap, kQueries[rotation % 3], kHeadDims[(rotation / 3) % 3],
                         kGroups[rotation % 4], 1 + 2 * (rotation % 2)});
        ++rotation;
      }
    }
  }
  return cases;
}

// Ragged spans with gaps in the positions; queries anywhere (one before the cache, one inside
// a hole, the last position), against the scalar twin: outputs, statistics and raw scores.
// The scores are large (scale 0.3, queries up to 3), so a softcap of 5 changes them a lot.
void CheckWindowCase(const WindowCase& c) {
  // Unsigned: the widest window (2^30) times 31 overflows an int.
  std::mt19937 rng(3000u + static_cast<uint32_t>(c.storage) * 977u + static_cast<uint32_t>(c.window) * 31u +
                   static_cast<uint32_t>(c.softcap) * 7u + static_cast<uint32_t>(c.n_q));
  if (!KvStorageFits(c.storage, c.head_dim)) return;
  const int n_kv_heads = c.group == 8 ? 1 : 2;
  AttentionShape shape{n_kv_heads * c.group, n_kv_heads, c.head_dim, 0.3f};
  shape.window = c.window;
  shape.softcap = c.softcap;
  SpanSet set = MakeSpans(c.storage, {1, 5, 16, 31, 2, 17, 1, 40, 0, 23}, n_kv_heads, c.head_dim, rng,
                          /*first_position=*/3);
  const int32_t n_spans = static_cast<int32_t>(set.spans.size());
  const int32_t last = LastPosition(set);
  int64_t n_tokens = 0;
  for (const KvSpan& span : set.spans) n_tokens += span.n;
  std::vector<int32_t> q_pos(c.n_q);
  std::uniform_int_distribution<int32_t> any_pos(0, last + 2);
  for (int i = 0; i < c.n_q; ++i) q_pos[i] = any_pos(rng);
  q_pos[c.n_q - 1] = last;
  if (c.n_q > 2) q_pos[0] = 1;  // before the first cached position: sees nothing
  if (c.n_q > 3) q_pos[1] = PositionInHole(set);  // window 1 sees nothing there
  const std::vector<float> q = RandomQueries(static_cast<size_t>(c.n_q) * shape.n_heads * c.head_dim, rng, 3.f);
  const size_t rows = static_cast<size_t>(c.n_q) * shape.n_heads;
  std::vector<float> want(q.size()), want_stats(rows * 2), want_raw(rows * n_tokens);
  ref::Attention(shape, c.storage, q.data(), q_pos.data(), c.n_q, set.spans.data(), n_spans, want.data(),
                 want_stats.data(), want_raw.data());
  std::vector<float> got(q.size(), 12345.f), got_stats(rows * 2, 7.f), got_raw(rows * n_tokens, 99.f);
  ops::Attention(shape, c.storage, q.data(), q_pos.data(), c.n_q, set.spans.data(), n_spans, got.data(), c.n_threads,
                 got_stats.data(), got_raw.data());
  ExpectClose(got, want, "out");
  ExpectStatsAndRawClose(got_stats, want_stats, got_raw, want_raw, "stats / raw");
  // Without the optional outputs: the same output, bit for bit.
  std::vector<float> plain(q.size(), 12345.f);
  ops::Attention(shape, c.storage, q.data(), q_pos.data(), c.n_q, set.spans.data(), n_spans, plain.data(),
                 c.n_threads);
  ASSERT_EQ(plain, got);
  if (c.n_q > 2) {
    for (int e = 0; e < shape.n_heads * c.head_dim; ++e) ASSERT_EQ(got[e], 0.f) << "query before the cache";
  }
  if (c.n_q > 3 && c.window == 1) {
    for (int e = 0; e < shape.n_heads * c.head_dim; ++e) {
      ASSERT_EQ(got[shape.n_heads * c.head_dim + e], 0.f) << "query whose window holds no token";
    }
  }
}

TEST_P(AttentionTest, WindowAndSoftcapMatchReference) {
  for (const WindowCase& c : AllWindowCases()) {
    SCOPED_TRACE(WindowCaseName(c));
    CheckWindowCase(c);
    if (HasFatalFailure()) return;
  }
}

// The test data really exercises both features: a window and a softcap of 5 change the
// reference's output, and a window larger than the context does not.
TEST_P(AttentionTest, WindowAndSoftcapChangeTheResult) {
  std::mt19937 rng(51);
  AttentionShape shape{4, 2, 32, 0.3f};
  SpanSet set = MakeSpans(KvStorage::kF32, {40, 30}, 2, 32, rng);
  const int32_t q_pos = LastPosition(set);
  const std::vector<float> q = RandomQueries(4 * 32, rng, 3.f);
  auto run = [&](int32_t window, float softcap) {
    AttentionShape s = shape;
    s.window = window;
    s.softcap = softcap;
    std::vector<float> out(q.size());
    ref::Attention(s, KvStorage::kF32, q.data(), &q_pos, 1, set.spans.data(), 2, out.data());
    return out;
  };
  auto max_diff = [](const std::vector<float>& a, const std::vector<float>& b) {
    float d = 0.f;
    for (size_t e = 0; e < a.size(); ++e) d = std::max(d, std::fabs(a[e] - b[e]));
    return d;
  };
  const std::vector<float> plain = run(0, 0.f);
  EXPECT_GT(max_diff(run(0, 5.f), plain), 0.05f);
  EXPECT_GT(max_diff(run(17, 0.f), plain), 0.05f);
  EXPECT_EQ(max_diff(run(kHugeWindow, 0.f), plain), 0.f);
}

// Long context: many blocks, the split-over-tokens path (decode) and several tiles (prefill),
// windows narrower and wider than a chunk, on every storage type.
TEST_P(AttentionTest, WindowAndSoftcapLongContextMatchReference) {
  std::mt19937 rng(52);
  int rotation = 0;
  for (KvStorage storage : kAllStorage) {
    AttentionShape shape{8, 1, 64, 0.125f};
    SpanSet set = MakeSpans(storage, {700, 3, 1500}, 1, 64, rng);
    const int32_t last = LastPosition(set);
    int64_t n_tokens = 0;
    for (const KvSpan& span : set.spans) n_tokens += span.n;
    for (int n_q : {1, 3, 40}) {
      constexpr int32_t kWindows[] = {17, 200, 1000, 512};
      shape.window = kWindows[rotation % 4];
      shape.softcap = rotation % 3 == 0 ? 0.f : rotation % 3 == 1 ? 5.f : 30.f;
      ++rotation;
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 37;
      if (n_q == 3) q_pos = {-1, last / 5, last};
      const std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * shape.n_heads * 64, rng, 3.f);
      const size_t rows = static_cast<size_t>(n_q) * shape.n_heads;
      std::vector<float> want(q.size()), want_stats(rows * 2), want_raw(rows * n_tokens);
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, want.data(), want_stats.data(),
                     want_raw.data());
      for (int n_threads : {1, 3}) {
        const std::string what = std::string(KvStorageName(storage)) + " n_q " + std::to_string(n_q) + " window " +
                                 std::to_string(shape.window) + " threads " + std::to_string(n_threads);
        std::vector<float> got(q.size()), got_stats(rows * 2), got_raw(rows * n_tokens, 99.f);
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, got.data(), n_threads,
                       got_stats.data(), got_raw.data());
        ExpectClose(got, want, what);
        ExpectStatsAndRawClose(got_stats, want_stats, got_raw, want_raw, what);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// window 0 and softcap 0 are the defaults of the four-field aggregate, and a window wider than
// the context takes the window path yet gives the same bits as none, through Attention (with
// statistics and raw scores) and AttentionBatch.
TEST_P(AttentionTest, DefaultWindowAndSoftcapAreBitIdentical) {
  std::mt19937 rng(53);
  for (KvStorage storage : kAllStorage) {
    const AttentionShape plain{8, 2, 40, 0.15f};
    AttentionShape explicit_defaults{8, 2, 40, 0.15f, 0, 0.f};
    ASSERT_EQ(explicit_defaults.window, plain.window);
    ASSERT_EQ(explicit_defaults.softcap, plain.softcap);
    AttentionShape huge = plain;
    huge.window = kHugeWindow;
    SpanSet set = MakeSpans(storage, {3, 16, 0, 16, 250, 7, 16, 400, 5}, 2, 40, rng);
    const int32_t last = LastPosition(set);
    int64_t n_tokens = 0;
    for (const KvSpan& span : set.spans) n_tokens += span.n;
    for (int n_q : {1, 6, 40}) {
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = last - (n_q - 1 - i) * 17;
      q_pos[0] = n_q > 1 ? -3 : q_pos[0];
      const std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 8 * 40, rng, 2.f);
      const size_t rows = static_cast<size_t>(n_q) * 8;
      for (int n_threads : {1, 3}) {
        std::vector<std::vector<float>> outs, stats, raws;
        for (const AttentionShape* shape : std::vector<const AttentionShape*>{&plain, &explicit_defaults, &huge}) {
          std::vector<float> out(q.size()), st(rows * 2), raw(rows * n_tokens);
          ops::Attention(*shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 9, out.data(), n_threads,
                         st.data(), raw.data());
          outs.push_back(out);
          stats.push_back(st);
          raws.push_back(raw);
          AttentionJob job{set.spans.data(), 9, 0, q.data(), out.data()};
          std::fill(out.begin(), out.end(), 5.f);
          ops::AttentionBatch(*shape, 2, storage, q_pos.data(), n_q, &job, 1, n_threads);
          outs.push_back(out);
        }
        const std::string what = std::string(KvStorageName(storage)) + " n_q " + std::to_string(n_q);
        for (size_t k = 1; k < outs.size(); ++k) ASSERT_EQ(outs[k], outs[0]) << what << " variant " << k;
        for (size_t k = 1; k < stats.size(); ++k) {
          ASSERT_EQ(stats[k], stats[0]) << what << " variant " << k;
          ASSERT_EQ(raws[k], raws[0]) << what << " variant " << k;
        }
      }
    }
  }
}

// Hand-checkable semantics, in double: one head, head_dim 2, five tokens at positions
// 0, 1, 2, 5, 6 (a hole at 3 and 4). The expected outputs are computed here from the
// definitions (window: p - window < pos <= p; softcap: c tanh(s / c)), not by the reference.
TEST_P(AttentionTest, WindowAndSoftcapHandComputed) {
  const std::vector<float> k = {1.f, 0.f, 0.5f, 1.f, -1.f, 2.f, 2.f, -1.f, 0.f, 3.f};
  const std::vector<float> v = {1.f, -1.f, 2.f, 4.f, -3.f, 0.5f, 6.f, 1.f, -2.f, 8.f};
  const std::vector<int32_t> pos = {0, 1, 2, 5, 6};
  const KvSpan span{.k = k.data(), .v = v.data(), .positions = pos.data(), .n = 5};
  const std::vector<float> q_row = {2.f, 1.5f};
  for (int32_t window : {0, 1, 2, 3, 5}) {
    for (float softcap : {0.f, 2.f}) {
      AttentionShape shape{1, 1, 2, 0.7f};
      shape.window = window;
      shape.softcap = softcap;
      const std::vector<int32_t> q_pos = {-1, 0, 2, 3, 4, 5, 6, 9};
      const int n_q = static_cast<int>(q_pos.size());
      std::vector<float> q;
      for (int i = 0; i < n_q; ++i) q.insert(q.end(), q_row.begin(), q_row.end());
      std::vector<double> expected(2 * n_q, 0.0), expected_max(n_q, -INFINITY), expected_sum(n_q, 0.0);
      for (int i = 0; i < n_q; ++i) {
        std::vector<double> w(5, 0.0);
        double max_s = -INFINITY;
        std::vector<double> s(5);
        for (int t = 0; t < 5; ++t) {
          const bool seen = pos[t] <= q_pos[i] && (window == 0 || q_pos[i] - pos[t] < window);
          if (!seen) {
            s[t] = -INFINITY;
            continue;
          }
          s[t] = 0.7 * (2.0 * k[2 * t] + 1.5 * k[2 * t + 1]);
          if (softcap > 0) s[t] = softcap * std::tanh(s[t] / softcap);
          max_s = std::max(max_s, s[t]);
        }
        if (max_s == -INFINITY) continue;  // sees nothing: zeros
        double sum = 0;
        for (int t = 0; t < 5; ++t) {
          w[t] = std::isinf(s[t]) ? 0.0 : std::exp(s[t] - max_s);
          sum += w[t];
        }
        for (int t = 0; t < 5; ++t) {
          expected[2 * i] += w[t] / sum * v[2 * t];
          expected[2 * i + 1] += w[t] / sum * v[2 * t + 1];
        }
        expected_max[i] = max_s;
        expected_sum[i] = sum;
      }
      // The cases the table above must contain: a window of 2 at position 4 holds no token
      // (the hole), and at 3 only the token at 2.
      if (window == 2) {
        EXPECT_EQ(expected[2 * 4], 0.0);
        EXPECT_NEAR(expected[2 * 3], v[4], 1e-12);
      }
      std::vector<float> want(q.size()), want_stats(2 * n_q), got(q.size()), got_stats(2 * n_q);
      ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, &span, 1, want.data(), want_stats.data());
      ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), n_q, &span, 1, got.data(), 2, got_stats.data());
      const std::string what = "window " + std::to_string(window) + " softcap " + std::to_string(softcap);
      for (int i = 0; i < n_q; ++i) {
        for (int c = 0; c < 2; ++c) {
          EXPECT_NEAR(want[2 * i + c], expected[2 * i + c], 1e-6) << what << " query " << i;
          EXPECT_NEAR(got[2 * i + c], expected[2 * i + c], 1e-5) << what << " query " << i;
        }
        if (std::isinf(expected_max[i])) {
          EXPECT_TRUE(std::isinf(got_stats[2 * i]) && got_stats[2 * i + 1] == 0.f) << what << " query " << i;
          EXPECT_TRUE(std::isinf(want_stats[2 * i]) && want_stats[2 * i + 1] == 0.f) << what << " query " << i;
          continue;
        }
        EXPECT_NEAR(want_stats[2 * i], expected_max[i], 1e-6) << what << " query " << i;
        EXPECT_NEAR(want_stats[2 * i + 1], expected_sum[i], 1e-6) << what << " query " << i;
        EXPECT_NEAR(got_stats[2 * i], expected_max[i], 1e-5) << what << " query " << i;
        EXPECT_NEAR(got_stats[2 * i + 1], expected_sum[i], 1e-5) << what << " query " << i;
      }
    }
  }
}

// AttentionBatch with windows and softcaps: per-head jobs over their own ragged spans (and
// shared rows read per query head) against the scalar twin, with statistics and raw scores;
// each job bit-identical to a lone Attention call.
TEST_P(AttentionTest, BatchWithWindowAndSoftcapMatchesReference) {
  std::mt19937 rng(54);
  int rotation = 0;
  for (KvStorage storage : kAllStorage) {
    for (int head_dim : {64, 20}) {
      std::vector<SpanSet> sets;
      const std::vector<std::vector<int>> lengths = {{16, 16, 5}, {3}, {16, 200, 16, 9}, {0, 0}, {40, 1}};
      for (const std::vector<int>& l : lengths) sets.push_back(MakeSpans(storage, l, 1, head_dim, rng));
      SpanSet shared = MakeSpans(storage, {16, 16, 16, 16, 160, 16, 7}, 3, head_dim, rng);
      int32_t last = LastPosition(shared);
      for (const SpanSet& set : sets) last = std::max(last, LastPosition(set));
      for (int n_q : {1, 3}) {
        std::vector<int32_t> q_pos(n_q, last);
        if (n_q == 3) q_pos = {-1, last / 3, last};
        for (int mode = 0; mode < 2; ++mode) {
          const bool per_head = mode == 0;
          AttentionShape shape = per_head ? AttentionShape{4, 1, head_dim, 0.3f} : AttentionShape{1, 1, head_dim, 0.3f};
          constexpr int32_t kWindows[] = {1, 3, 17, 40, 150, kHugeWindow};
          constexpr float kCaps[] = {0.f, 5.f, 50.f};
          shape.window = kWindows[rotation % 6];
          shape.softcap = kCaps[rotation % 3 == 0 ? 1 : (rotation / 6) % 3];
          ++rotation;
          const int row_heads = per_head ? 1 : 3;
          std::vector<std::vector<KvSpan>> job_spans;
          std::vector<int> first;
          if (per_head) {
            for (const SpanSet& set : sets) {
              job_spans.push_back(set.spans);
              first.push_back(0);
            }
          } else {
            for (int j = 0; j < 6; ++j) {
              std::vector<KvSpan> runs;
              for (size_t t = 0; t < shared.spans.size(); ++t)
                if ((t + j) % 3 != 0 || t + 1 == shared.spans.size()) runs.push_back(shared.spans[t]);
              job_spans.push_back(runs);
              first.push_back(j / 2);
            }
          }
          const size_t n_jobs = job_spans.size();
          const std::vector<float> q = RandomQueries(n_jobs * n_q * shape.n_heads * head_dim, rng, 3.f);
          BatchBuffers want(shape, n_q, job_spans, first, q);
          ref::AttentionBatch(shape, row_heads, storage, q_pos.data(), n_q, want.jobs.data(),
                              static_cast<int32_t>(n_jobs));
          for (int n_threads : {1, 3}) {
            const std::string what = std::string(KvStorageName(storage)) + (per_head ? " per-head" : " shared rows") +
                                     " d" + std::to_string(head_dim) + " n_q " + std::to_string(n_q) + " window " +
                                     std::to_string(shape.window) + " softcap " + std::to_string(shape.softcap) +
                                     " threads " + std::to_string(n_threads);
            BatchBuffers got(shape, n_q, job_spans, first, q);
            ops::AttentionBatch(shape, row_heads, storage, q_pos.data(), n_q, got.jobs.data(),
                                static_cast<int32_t>(n_jobs), n_threads);
            ExpectBatchClose(got.out, want.out, got.stats, want.stats, got.raw, want.raw, what);
            if (HasFatalFailure()) return;
            if (!per_head) continue;
            // Job j alone: the same bits.
            const size_t rows = static_cast<size_t>(n_q) * shape.n_heads;
            for (size_t j = 0; j < n_jobs; ++j) {
              std::vector<float> out(rows * head_dim);
              ops::Attention(shape, storage, q.data() + j * rows * head_dim, q_pos.data(), n_q, job_spans[j].data(),
                             static_cast<int32_t>(job_spans[j].size()), out.data(), n_threads);
              ASSERT_EQ(std::vector<float>(got.jobs[j].out, got.jobs[j].out + out.size()), out) << what << " job " << j;
            }
          }
        }
      }
    }
  }
}

// Sparse prefill with windows: a selected token outside a query's window is not attended.
TEST_P(AttentionTest, KeySelectionWithWindowMatchesMaskedReference) {
  std::mt19937 rng(55);
  int rotation = 0;
  for (KvStorage storage : kAllStorage) {
    for (int head_dim : {64, 20}) {
      if (!KvStorageFits(storage, head_dim)) continue;
      const int n_kv = 2, group = head_dim == 64 ? 2 : 3;
      AttentionShape head_shape{group, 1, head_dim, 0.3f};
      constexpr int32_t kWindows[] = {3, 40, 100, 17};
      head_shape.window = kWindows[rotation % 4];
      head_shape.softcap = rotation % 2 == 0 ? 5.f : 0.f;
      ++rotation;
      SpanSet set = MakeSpans(storage, {70, 16, 3, 200, 40}, n_kv, head_dim, rng);
      int64_t n_tokens = 0;
      for (const KvSpan& span : set.spans) n_tokens += span.n;
      const int32_t n_q = 150;
      const std::vector<int32_t> q_pos = ChunkPositions(set, n_q);
      std::vector<RandomSelection> selections;
      for (int h = 0; h < n_kv; ++h) selections.emplace_back(64, n_q, n_tokens, rng);
      std::vector<std::vector<float>> q(n_kv);
      for (auto& rows : q) rows = RandomQueries(static_cast<size_t>(n_q) * group * head_dim, rng, 3.f);
      std::vector<std::vector<float>> want(n_kv, std::vector<float>(q[0].size())), stats_want(n_kv);
      std::vector<AttentionJob> jobs(n_kv);
      for (int h = 0; h < n_kv; ++h) {
        stats_want[h].resize(static_cast<size_t>(n_q) * group * 2);
        jobs[h] = AttentionJob{set.spans.data(), static_cast<int32_t>(set.spans.size()), h, q[h].data(),
                               want[h].data(),   stats_want[h].data()};
        jobs[h].selection = &selections[h].view;
      }
      ref::AttentionBatch(head_shape, n_kv, storage, q_pos.data(), n_q, jobs.data(), n_kv);
      for (int n_threads : {1, 3}) {
        std::vector<std::vector<float>> got(n_kv, std::vector<float>(q[0].size(), 7.f)), stats(n_kv);
        for (int h = 0; h < n_kv; ++h) {
          stats[h].resize(stats_want[h].size());
          jobs[h].out = got[h].data();
          jobs[h].row_max_sum = stats[h].data();
        }
        ops::AttentionBatch(head_shape, n_kv, storage, q_pos.data(), n_q, jobs.data(), n_kv, n_threads);
        for (int h = 0; h < n_kv; ++h) {
          const std::string what = std::string(KvStorageName(storage)) + " d" + std::to_string(head_dim) +
                                   " window " + std::to_string(head_shape.window) + " head " + std::to_string(h) +
                                   " threads " + std::to_string(n_threads);
          ExpectClose(got[h], want[h], what);
          ExpectStatsAndRawClose(stats[h], stats_want[h], {}, {}, what);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// With a window the kernel may skip what no query of a tile sees: a prefill chunk over a long
// dense cache, whose queries' windows cover only its end, gives the reference's result, and so
// does a tile whose queries lie far apart (blocks between their windows seen by none).
TEST_P(AttentionTest, WindowSkipsUnseenBlocks) {
  std::mt19937 rng(56);
  for (KvStorage storage : {KvStorage::kF16, KvStorage::kInt8}) {
    AttentionShape shape{4, 1, 64, 0.125f};
    shape.window = 50;
    SpanSet set = MakeSpans(storage, {1200, 16, 16, 300}, 1, 64, rng);
    const int32_t last = LastPosition(set);
    for (int variant = 0; variant < 2; ++variant) {
      const int n_q = 24;
      std::vector<int32_t> q_pos(n_q);
      for (int i = 0; i < n_q; ++i) q_pos[i] = variant == 0 ? last - (n_q - 1 - i) : 40 + i * (last - 40) / (n_q - 1);
      const std::vector<float> q = RandomQueries(static_cast<size_t>(n_q) * 4 * 64, rng, 2.f);
      std::vector<float> want(q.size());
      ref::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 4, want.data());
      for (int n_threads : {1, 2}) {
        std::vector<float> got(q.size());
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 4, got.data(), n_threads);
        ExpectClose(got, want, std::string(KvStorageName(storage)) + " variant " + std::to_string(variant));
      }
    }
  }
}

}  // namespace
}  // namespace kvsparse
