// bf16 dots (AVX512_BF16, vdpbf16ps) on bf16 and fp8 KV: the avx512 family's scores against
// their scalar twin (Bf16DotTwin) score by score, and every family's attention against the float64
// reference on the same stored values within the bound the bf16 rounding of the query and the
// probabilities allows (docs/DESIGN.md, "bf16 dots").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/dtype.h"
#include "kvsparse/isa.h"
#include "ops/attention_kernels.h"
#include "ops/attention_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::LastPosition;
using testing::MakeSpans;
using testing::RandomQueries;
using testing::SpanSet;

class AttentionBf16Test : public testing::PerIsaTest {};

// Turns bf16 dots on or off for a scope, restoring the previous setting.
class Bf16DotsGuard {
 public:
  explicit Bf16DotsGuard(bool enabled) : previous_(Bf16DotsEnabled()) { SetBf16Dots(enabled); }
  Bf16DotsGuard(const Bf16DotsGuard&) = delete;
  Bf16DotsGuard& operator=(const Bf16DotsGuard&) = delete;
  ~Bf16DotsGuard() { SetBf16Dots(previous_); }

 private:
  bool previous_;
};

constexpr KvStorage kServed[] = {KvStorage::kBf16, KvStorage::kFp8E4M3, KvStorage::kFp8E5M2};

struct Problem {
  KvStorage storage = KvStorage::kBf16;
  AttentionShape shape;
  SpanSet set;
  std::vector<int32_t> q_pos;
  std::vector<float> q;  // [n_q, n_heads, head_dim]
  int n_q() const { return static_cast<int>(q_pos.size()); }
};

// Ragged spans (page-sized, short and long ones) and queries at, and before, the end.
Problem MakeProblem(KvStorage storage, int head_dim, int group, int n_q, std::mt19937& rng) {
  Problem p;
  p.storage = storage;
  p.shape = AttentionShape{2 * group, 2, head_dim, 1.f / std::sqrt(static_cast<float>(head_dim))};
  p.shape.integer_dots = true;  // as the engine runs it
  p.set = MakeSpans(storage, {37, 16, 5, 211, 16, 90}, p.shape.n_kv_heads, head_dim, rng);
  const int32_t last = LastPosition(p.set);
  for (int i = 0; i < n_q; ++i) p.q_pos.push_back(last - (n_q - 1 - i) * 7);
  p.q = RandomQueries(static_cast<size_t>(n_q) * p.shape.n_heads * head_dim, rng, 2.f);
  return p;
}

// Each stored token's K row per kv head as the dots see it: bf16 values (fp8: the unscaled code
// widened, exactly) and the factor that scales its dot (fp8: its K scale; 1 for bf16).
struct KeyRow {
  std::vector<bf16_bits> values;  // [head_dim]
  double scale = 1.0;
};
std::vector<KeyRow> KeyRows(const Problem& p) {  // [tokens][kv head]
  std::vector<KeyRow> rows;
  const int d = p.shape.head_dim, heads = p.shape.n_kv_heads;
  for (const KvSpan& s : p.set.spans) {
    for (int t = 0; t < s.n; ++t) {
      for (int h = 0; h < heads; ++h) {
        const size_t row = static_cast<size_t>(t) * heads + h;
        KeyRow& key = rows.emplace_back();
        key.values.resize(d);
        if (p.storage == KvStorage::kBf16) {
          std::copy_n(static_cast<const bf16_bits*>(s.k) + row * d, d, key.values.begin());
        } else {
          const uint8_t* codes = static_cast<const uint8_t*>(s.k) + row * d;
          for (int c = 0; c < d; ++c) key.values[c] = F32ToBF16(ops::attn_detail::CodeToF32(p.storage, codes[c]));
          key.scale = static_cast<double>(s.k_scale[row]) * ops::attn_detail::CodeScaleFactor(p.storage);
        }
      }
    }
  }
  return rows;
}

std::vector<float> RunOps(const Problem& p, int n_threads, std::vector<float>* raw = nullptr) {
  std::vector<float> out(p.q.size());
  AttentionJob job{p.set.spans.data(), static_cast<int32_t>(p.set.spans.size()), 0, p.q.data(), out.data()};
  if (raw != nullptr) {
    int64_t n_tokens = 0;
    for (const KvSpan& s : p.set.spans) n_tokens += s.n;
    raw->assign(p.q.size() / p.shape.head_dim * n_tokens, 0.f);
    job.raw_scores = raw->data();
  }
  ops::AttentionBatch(p.shape, p.shape.n_kv_heads, p.storage, p.q_pos.data(), p.n_q(), &job, 1, n_threads);
  return out;
}

// The kernel's scores (log2 domain) against the twin's, each within 2^-16 of sum |q k|: f32
// sums of up to 128 products (the kernel) against exact ones; a misplaced dim, token or scale is
// off by about sum |q k| itself.
TEST_P(AttentionBf16Test, DotScoresMatchScalarTwin) {
  if (GetParam() != Isa::kAvx512) GTEST_SKIP() << "bf16 dots are an avx512 family path";
  if (!CpuHasBf16Dots()) GTEST_SKIP() << "this CPU lacks AVX512_BF16 (bf16 and fp8 KV take the f32 path)";
  Bf16DotsGuard dots(true);
  std::mt19937 rng(31);
  for (KvStorage storage : kServed) {
    for (int head_dim : {64, 128, 40, 20}) {
      for (int group : {1, 4, 8}) {
        const Problem p = MakeProblem(storage, head_dim, group, 3, rng);
        std::vector<float> raw;
        RunOps(p, 2, &raw);
        const std::vector<KeyRow> keys = KeyRows(p);
        const int n_kv = p.shape.n_kv_heads;
        const int64_t n_tokens = static_cast<int64_t>(keys.size()) / n_kv;
        const float q_scale = p.shape.scale * ops::attn_detail::kLog2e;  // as the kernel pre-scales
        std::vector<float> q_row(head_dim);
        for (int i = 0; i < p.n_q(); ++i) {
          for (int h = 0; h < p.shape.n_heads; ++h) {
            const size_t row = static_cast<size_t>(i) * p.shape.n_heads + h;
            ops::attn_detail::LoadQueryRow(p.q.data() + row * head_dim, head_dim, head_dim, q_scale, q_row.data());
            int64_t t = 0;
            for (const KvSpan& s : p.set.spans) {
              for (int j = 0; j < s.n; ++j, ++t) {
                const float got = raw[row * n_tokens + t];
                if (s.positions[j] > p.q_pos[i]) {
                  ASSERT_TRUE(std::isinf(got)) << "a later token's score is -inf";
                  continue;
                }
                const KeyRow& key = keys[static_cast<size_t>(t) * n_kv + h / group];
                const double twin = key.scale * ops::attn_detail::Bf16DotTwin(q_row.data(), key.values.data(), head_dim);
                double magnitude = 0.0;  // sum |q k|, q rounded as the twin rounds it
                for (int c = 0; c < head_dim; ++c) {
                  magnitude += std::fabs(static_cast<double>(BF16ToF32(F32ToBF16(q_row[c]))) * BF16ToF32(key.values[c]));
                }
                ASSERT_NEAR(got, twin, std::ldexp(magnitude * key.scale, -16) + 1e-30)
                    << KvStorageName(storage) << " d" << head_dim << " g" << group << " query " << i << " head " << h
                    << " token " << t;
              }
            }
          }
        }
      }
    }
  }
}

// Every family (bf16 dots where the CPU has them, the f32 path elsewhere) against the float64
// attention over the same bf16 values. Rounding q to bf16 moves each pre-scaled query dim by at
// most 2^-9 of itself, so a score (natural-log domain) by at most delta_t = 2^-9 scale sum |q k_t|;
// the probabilities then move by a factor within e^(+-2 delta), the output by at most
// expm1(2 max delta) max|v|. Rounding the probabilities to bf16 (head_dim % 32 == 0) moves each
// by 2^-9 of itself: the output by at most 2^-9 max|v| more. Plus f32 rounding, 2e-5 of max|v|.
TEST_P(AttentionBf16Test, WithinBoundOfExactReference) {
  std::mt19937 rng(2028);
  for (KvStorage storage : kServed) {
    for (int head_dim : {64, 128, 40}) {
      for (int group : {1, 4, 8}) {
        for (int n_q : {1, 5}) {
          const Problem p = MakeProblem(storage, head_dim, group, n_q, rng);
          std::vector<float> exact(p.q.size());
          ref::Attention(p.shape, storage, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                         static_cast<int32_t>(p.set.spans.size()), exact.data());
          // max|v| of the stored values: the originals' bounds them up to fp8's rounding (2^-3 of each).
          double max_v = 0.0, max_delta = 0.0;
          for (const std::vector<float>& v : p.set.v_f32)
            for (float x : v) max_v = std::max(max_v, 1.125 * std::fabs(static_cast<double>(x)));
          const std::vector<KeyRow> keys = KeyRows(p);
          for (int i = 0; i < p.n_q(); ++i) {
            for (int h = 0; h < p.shape.n_heads; ++h) {
              const float* q = p.q.data() + (static_cast<size_t>(i) * p.shape.n_heads + h) * head_dim;
              for (size_t t = h / group; t < keys.size(); t += p.shape.n_kv_heads) {
                double sum = 0.0;
                for (int c = 0; c < head_dim; ++c) {
                  sum += std::fabs(static_cast<double>(q[c]) * BF16ToF32(keys[t].values[c]));
                }
                max_delta = std::max(max_delta, std::ldexp(p.shape.scale * sum * keys[t].scale, -9));
              }
            }
          }
          const double bound = std::expm1(2 * max_delta) * max_v + std::ldexp(max_v, -9) + 2e-5 * max_v;
          for (int n_threads : {1, 2}) {
            const std::vector<float> got = RunOps(p, n_threads);
            for (size_t e = 0; e < got.size(); ++e) {
              ASSERT_NEAR(got[e], exact[e], bound) << KvStorageName(storage) << " d" << head_dim << " g" << group
                                                   << " q" << n_q << " t" << n_threads << " element " << e;
            }
          }
        }
      }
    }
  }
}

// Off (SetBf16Dots(false), or AttentionShape::integer_dots off), bf16 and fp8 KV take the f32
// path: exact up to f32 rounding. On, where the CPU has the instructions, the results differ from it.
TEST_P(AttentionBf16Test, OffKeepsF32Path) {
  std::mt19937 rng(5);
  for (KvStorage storage : kServed) {
    Problem p = MakeProblem(storage, 64, 4, 3, rng);
    std::vector<float> exact(p.q.size());
    ref::Attention(p.shape, storage, p.q.data(), p.q_pos.data(), p.n_q(), p.set.spans.data(),
                   static_cast<int32_t>(p.set.spans.size()), exact.data());
    std::vector<float> off;
    {
      Bf16DotsGuard dots(false);
      EXPECT_FALSE(ops::UsesBf16Dots(storage));
      off = RunOps(p, 2);
    }
    for (size_t e = 0; e < off.size(); ++e) ASSERT_NEAR(off[e], exact[e], 2e-5f + 2e-4f * std::fabs(exact[e]));
    p.shape.integer_dots = false;
    const std::vector<float> flag_off = RunOps(p, 2);
    EXPECT_EQ(flag_off, off) << KvStorageName(storage);
    p.shape.integer_dots = true;
    if (GetParam() == Isa::kAvx512 && CpuHasBf16Dots()) {
      Bf16DotsGuard dots(true);
      EXPECT_TRUE(ops::UsesBf16Dots(storage));
      EXPECT_NE(RunOps(p, 2), off) << KvStorageName(storage) << ": bf16 dots should round the query";
    } else {
      EXPECT_FALSE(ops::UsesBf16Dots(storage));
    }
  }
}

KVS_INSTANTIATE_PER_ISA(AttentionBf16Test);

}  // namespace
}  // namespace kvsparse
