// Scalar reference attention: per query head, materializes every score, then a
// two-pass softmax in double. Slow and obviously correct; ops::Attention is tested against it.
// Sliding windows and softcapping (AttentionShape) apply token by token: the mask in
// AttendsPosition, the cap in CapScore (attention_ref_util.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvsparse/attention.h"
#include "kvsparse/dtype.h"
#include "ops/attention_ref_util.h"

namespace kvsparse::ref {
namespace {

// Attention whose kv heads are heads first_kv_head .. of span rows holding row_heads heads.
void AttentionOverHeads(const AttentionShape& shape, int row_heads, int first_kv_head, KvStorage storage,
                        const float* q, const int32_t* q_pos, int32_t n_q, const KvSpan* spans, int32_t n_spans,
                        float* out, float* row_max_sum, float* raw_scores, const KeySelection* selection,
                        const float* sinks) {
  KVS_CHECK(shape.n_heads > 0 && shape.n_kv_heads > 0 && shape.head_dim > 0);
  KVS_CHECK(shape.n_heads % shape.n_kv_heads == 0);
  KVS_CHECK(first_kv_head >= 0 && first_kv_head + shape.n_kv_heads <= row_heads);
  const int group = shape.n_heads / shape.n_kv_heads;
  const int d = shape.head_dim;
  const KvElementReader reader{storage, row_heads, d};
  int64_t n_tokens = 0;
  for (int32_t s = 0; s < n_spans; ++s) n_tokens += spans[s].n;
  std::vector<double> scores;  // [attended tokens]
  std::vector<double> acc(d);  // [head_dim]
  std::vector<char> selected(static_cast<size_t>(n_tokens), 1);  // [n_tokens] the query block's tokens
  for (int32_t i = 0; i < n_q; ++i) {
    if (selection != nullptr) {
      KVS_CHECK(raw_scores == nullptr);
      const int block = i / selection->query_block;
      std::fill(selected.begin(), selected.end(), 0);
      for (int64_t r = selection->range_offsets[block]; r < selection->range_offsets[block + 1]; ++r) {
        for (int64_t t = selection->ranges[2 * r]; t < std::min(n_tokens, selection->ranges[2 * r + 1]); ++t) {
          selected[t] = 1;
        }
      }
    }
    // Whether query i attends to the token at span-order index `index` and position `pos`.
    auto attends = [&](int64_t index, int32_t pos) {
      return AttendsPosition(q_pos[i], pos, shape.window) && selected[index];
    };
    for (int h = 0; h < shape.n_heads; ++h) {
      const int kv_head = first_kv_head + h / group;
      const size_t row_index = static_cast<size_t>(i) * shape.n_heads + h;
      const float* q_row = q + row_index * d;
      // Scores for every attended token, in span order.
      scores.clear();
      float* raw_row = raw_scores != nullptr ? raw_scores + row_index * n_tokens : nullptr;  // [n_tokens]
      int64_t index = 0;
      for (int32_t s = 0; s < n_spans; ++s) {
        const KvSpan& span = spans[s];
        for (int32_t t = 0; t < span.n; ++t, ++index) {
          if (!attends(index, span.positions[t])) {
            if (raw_row != nullptr) *raw_row++ = -std::numeric_limits<float>::infinity();
            continue;
          }
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q_row[c]) * reader.K(span, t, kv_head, c);
          scores.push_back(CapScore(dot * shape.scale, shape.softcap));
          if (raw_row != nullptr) *raw_row++ = static_cast<float>(scores.back() / std::log(2.0));  // log2 domain
        }
      }
      float* out_row = out + row_index * d;
      if (scores.empty()) {
        for (int c = 0; c < d; ++c) out_row[c] = 0.f;
        if (row_max_sum != nullptr) {
          row_max_sum[2 * row_index] = -std::numeric_limits<float>::infinity();
          row_max_sum[2 * row_index + 1] = 0.f;
        }
        continue;
      }
      double max_score = -std::numeric_limits<double>::infinity();
      for (double sc : scores) max_score = std::max(max_score, sc);
      // A sink is one more logit in the denominator, with no value.
      if (sinks != nullptr) max_score = std::max(max_score, static_cast<double>(sinks[h]));
      double sum = sinks != nullptr ? std::exp(sinks[h] - max_score) : 0.0;
      for (double& sc : scores) {
        sc = std::exp(sc - max_score);
        sum += sc;
      }
      if (row_max_sum != nullptr) {
        row_max_sum[2 * row_index] = static_cast<float>(max_score);
        row_max_sum[2 * row_index + 1] = static_cast<float>(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      size_t j = 0;
      index = 0;
      for (int32_t s = 0; s < n_spans; ++s) {
        const KvSpan& span = spans[s];
        for (int32_t t = 0; t < span.n; ++t, ++index) {
          if (!attends(index, span.positions[t])) continue;
          const double p = scores[j++] / sum;
          for (int c = 0; c < d; ++c) acc[c] += p * reader.V(span, t, kv_head, c);
        }
      }
      for (int c = 0; c < d; ++c) out_row[c] = static_cast<float>(acc[c]);
    }
  }
}

}  // namespace

void Attention(const AttentionShape& shape, KvStorage storage, const float* q, const int32_t* q_pos, int32_t n_q,
               const KvSpan* spans, int32_t n_spans, float* out, float* row_max_sum, float* raw_scores) {
  AttentionOverHeads(shape, shape.n_kv_heads, 0, storage, q, q_pos, n_q, spans, n_spans, out, row_max_sum, raw_scores,
                     /*selection=*/nullptr, shape.sinks);
}

void AttentionBatch(const AttentionShape& shape, int row_heads, KvStorage storage, const int32_t* q_pos, int32_t n_q,
                    const AttentionJob* jobs, int32_t n_jobs) {
  KVS_CHECK_MSG(shape.sinks == nullptr, "AttentionBatch: attention sinks go in each job (AttentionJob::sinks)");
  for (int32_t j = 0; j < n_jobs; ++j) {
    const AttentionJob& job = jobs[j];
    AttentionOverHeads(shape, row_heads, job.first_kv_head, storage, job.q, job.q_pos != nullptr ? job.q_pos : q_pos,
                       n_q, job.spans, job.n_spans, job.out, job.row_max_sum, job.raw_scores, job.selection, job.sinks);
  }
}

}  // namespace kvsparse::ref
