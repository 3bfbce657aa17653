// LoadSpanKeyRow and LoadSpanValueRow (kv_types.h): a token's K and V rows read back as f32
// equal the scalar reference reader (attention_ref_util.h) for every storage type, over spans
// of several lengths, shared rows and one-head rows, KIVI residual spans included.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvsparse/kv_types.h"
#include "ops/attention_ref_util.h"
#include "ops/attention_test_util.h"

namespace kvsparse {
namespace {

TEST(KvStorageRows, KeyAndValueRowsMatchTheReferenceReader) {
  std::mt19937 rng(3);
  for (int s = 0; s < kNumKvStorage; ++s) {
    const KvStorage storage = static_cast<KvStorage>(s);
    for (const auto& [n_kv_heads, head_dim] : {std::pair{2, 64}, std::pair{1, 40}, std::pair{3, 16}}) {
      if (!KvStorageFits(storage, head_dim)) continue;
      const testing::SpanSet set = testing::MakeSpans(storage, {5, 17, 1, 9}, n_kv_heads, head_dim, rng);
      const ref::KvElementReader reader{storage, n_kv_heads, head_dim};
      std::vector<float> k(static_cast<size_t>(n_kv_heads) * head_dim), v(k.size());
      for (const KvSpan& span : set.spans) {
        const KvStorage type = SpanStorage(storage, span);
        for (int32_t t = 0; t < span.n; ++t) {
          LoadSpanKeyRow(type, span, t, n_kv_heads, head_dim, k.data());
          LoadSpanValueRow(type, span, t, n_kv_heads, head_dim, v.data());
          for (int h = 0; h < n_kv_heads; ++h) {
            for (int c = 0; c < head_dim; ++c) {
              const size_t i = static_cast<size_t>(h) * head_dim + c;
              ASSERT_NEAR(k[i], reader.K(span, t, h, c), 1e-5 * (1 + std::abs(k[i]))) << KvStorageName(storage);
              ASSERT_NEAR(v[i], reader.V(span, t, h, c), 1e-5 * (1 + std::abs(v[i]))) << KvStorageName(storage);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvsparse
