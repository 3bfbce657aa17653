#include "kvsparse/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/dtype.h"

namespace kvsparse {
namespace {

// Owns the K/V/position buffers behind a list of spans, in the given storage type.
struct SpanSet {
  KvStorage storage;
  std::vector<std::vector<float>> k_f32, v_f32;   // each [n, n_kv_heads, head_dim]
  std::vector<std::vector<f16_bits>> k_f16, v_f16;
  std::vector<std::vector<int32_t>> positions;
  std::vector<KvSpan> spans;
};

// Spans of the given lengths; positions increase with random gaps (as after eviction).
SpanSet MakeSpans(KvStorage storage, const std::vector<int>& lengths, int n_kv_heads, int head_dim,
                  std::mt19937& rng, int32_t first_position = 0) {
  std::uniform_real_distribution<float> value(-1.5f, 1.5f);
  std::uniform_int_distribution<int> gap(1, 4);
  SpanSet set;
  set.storage = storage;
  int32_t pos = first_position;
  for (int n : lengths) {
    const size_t elems = static_cast<size_t>(n) * n_kv_heads * head_dim;
    std::vector<float> k(elems), v(elems);
    for (float& x : k) do x = value(rng); while (x == 0.f);
    for (float& x : v) do x = value(rng); while (x == 0.f);
    std::vector<int32_t> p(n);
    for (int t = 0; t < n; ++t) {
      p[t] = pos;
      pos += gap(rng) == 1 ? 3 : 1;  // mostly consecutive, sometimes a hole
    }
    set.positions.push_back(std::move(p));
    if (storage == KvStorage::kF16) {
      std::vector<f16_bits> kh(elems), vh(elems);
      for (size_t i = 0; i < elems; ++i) {
        kh[i] = F32ToF16(k[i]);
        vh[i] = F32ToF16(v[i]);
      }
      set.k_f16.push_back(std::move(kh));
      set.v_f16.push_back(std::move(vh));
    } else {
      set.k_f32.push_back(std::move(k));
      set.v_f32.push_back(std::move(v));
    }
  }
  for (size_t s = 0; s < lengths.size(); ++s) {
    KvSpan span;
    span.k = storage == KvStorage::kF16 ? static_cast<const void*>(set.k_f16[s].data()) : set.k_f32[s].data();
    span.v = storage == KvStorage::kF16 ? static_cast<const void*>(set.v_f16[s].data()) : set.v_f32[s].data();
    span.positions = set.positions[s].data();
    span.n = lengths[s];
    set.spans.push_back(span);
  }
  return set;
}

std::vector<float> RandomQueries(size_t n, std::mt19937& rng, float amplitude) {
  std::uniform_real_distribution<float> value(-amplitude, amplitude);
  std::vector<float> q(n);
  for (float& x : q) do x = value(rng); while (x == 0.f);
  return q;
}

int32_t LastPosition(const SpanSet& set) {
  int32_t last = -1;
  for (const KvSpan& s : set.spans)
    if (s.n > 0) last = s.positions[s.n - 1];
  return last;
}

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

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::ostringstream name;  // (operator+ chains trip a GCC 12 -Wrestrict false positive)
  name << "q" << c.n_q << "_d" << c.head_dim << "_g" << c.group << (c.storage == KvStorage::kF16 ? "_f16" : "_f32")
       << "_t" << c.n_threads;
  return name.str();
}

class AttentionVsRefTest : public ::testing::TestWithParam<Case> {};

// Ragged spans with gaps; queries at, before and after the cached positions.
TEST_P(AttentionVsRefTest, MatchesReference) {
  const Case c = GetParam();
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

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int n_q : {1, 3, 17})
    for (int head_dim : {64, 128, 32})
      for (int group : {1, 2, 8})
        for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16})
          for (int n_threads : {1, 2}) cases.push_back({n_q, head_dim, group, storage, n_threads});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Ragged, AttentionVsRefTest, ::testing::ValuesIn(AllCases()), CaseName);

// Head sizes that are not a multiple of the SIMD width, and odd head counts.
TEST(AttentionTest, OddHeadDimsMatchReference) {
  std::mt19937 rng(77);
  for (int head_dim : {1, 8, 20, 48, 80, 100, 256}) {
    for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16}) {
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
TEST(AttentionTest, LongContextDecodeAndPrefillMatchReference) {
  std::mt19937 rng(5);
  for (KvStorage storage : {KvStorage::kF32, KvStorage::kF16}) {
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
      for (int n_threads : {1, 2, 3}) {
        std::vector<float> got(q.size());
        ops::Attention(shape, storage, q.data(), q_pos.data(), n_q, set.spans.data(), 3, got.data(), n_threads);
        ExpectClose(got, want, "n_q " + std::to_string(n_q) + " threads " + std::to_string(n_threads));
      }
    }
  }
}

// Causal boundaries: a query exactly at a cached position sees it; one just below does not.
TEST(AttentionTest, CausalBoundaryIsInclusive) {
  AttentionShape shape{1, 1, 4, 1.f};
  // Two tokens at positions 10 and 20 with distinct values.
  std::vector<float> k = {0.1f, 0.2f, 0.3f, 0.4f, -0.2f, 0.5f, 0.1f, 0.3f};
  std::vector<float> v = {1.f, 2.f, 3.f, 4.f, -5.f, 6.f, -7.f, 8.f};
  std::vector<int32_t> pos = {10, 20};
  KvSpan span{k.data(), v.data(), pos.data(), 2};
  std::vector<float> q = {0.3f, -0.1f, 0.7f, 0.2f, 0.3f, -0.1f, 0.7f, 0.2f, 0.3f, -0.1f, 0.7f, 0.2f};
  std::vector<int32_t> q_pos = {9, 10, 19};
  std::vector<float> out(12, -1.f);
  ops::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 3, &span, 1, out.data(), 1);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(out[c], 0.f);          // position 9 sees nothing
  for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[4 + c], v[c]);  // position 10 sees only token 0
  for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[8 + c], v[c]);  // position 19 still only token 0
}

// Hand-computed: two tokens, softmax weights from explicit scores.
TEST(AttentionTest, ReferenceMatchesHandComputedSoftmax) {
  AttentionShape shape{2, 1, 2, 0.5f};
  std::vector<float> k = {1.f, 0.f, 0.f, 1.f};  // token 0 = e0, token 1 = e1
  std::vector<float> v = {1.f, 10.f, 3.f, -2.f};
  std::vector<int32_t> pos = {0, 1};
  KvSpan span{k.data(), v.data(), pos.data(), 2};
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
TEST(AttentionTest, EmptyInputsGiveZeros) {
  std::mt19937 rng(3);
  AttentionShape shape{4, 2, 16, 0.25f};
  std::vector<float> q = RandomQueries(2 * 4 * 16, rng, 1.f);
  std::vector<int32_t> q_pos = {5, 6};
  std::vector<float> out(q.size(), 9.f);
  ops::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), 2, nullptr, 0, out.data(), 2);
  for (float x : out) EXPECT_EQ(x, 0.f);

  SpanSet set = MakeSpans(KvStorage::kF16, {0, 4, 0, 3, 0}, 2, 16, rng);
  std::vector<float> want(q.size()), got(q.size());
  ref::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), 2, set.spans.data(), 5, want.data());
  ops::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), 2, set.spans.data(), 5, got.data(), 2);
  ExpectClose(got, want, "empty spans");
  ops::Attention(shape, KvStorage::kF16, q.data(), q_pos.data(), 0, set.spans.data(), 5, got.data(), 2);  // no-op
}

// Through the real cache: attention over ContiguousKvCache spans equals attention over the raw rows.
TEST(AttentionTest, WorksOverContiguousKvCache) {
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
    KvSpan raw{k.data(), v.data(), pos.data(), n};
    ref::Attention(shape, KvStorage::kF32, q.data(), q_pos.data(), 1, &raw, 1, want.data());
    ops::Attention(shape, storage, q.data(), q_pos.data(), 1, spans.data(), static_cast<int32_t>(spans.size()),
                   got.data(), 2);
    ExpectClose(got, want, "cache");
  }
}

}  // namespace
}  // namespace kvsparse
