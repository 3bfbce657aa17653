// Metrics for the method benchmark (`kvsparse bench`): answer scores (exact / contains /
// token F1, on token ids or on normalized text), confidence intervals, label-free fidelity of
// a sparse cache against the full cache (KL, top-1 agreement, perplexity), repetition of a
// generation, latency percentiles, and a small aggregator keyed by (task, subtask, metric).
// Everything here is pure arithmetic on numbers the runner hands in; nothing runs a model.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace kvsparse {

// ---------------------------------------------------------------------------------------
// Answer scores on token ids. `generated` is what the model produced (the runner cuts it at
// the first end-of-generation token); `answer` is one reference.

// generated == answer.
bool ExactMatchIds(std::span<const int32_t> generated, std::span<const int32_t> answer);
// `answer` occurs as a contiguous run inside `generated`. An empty answer is contained.
bool ContainsIds(std::span<const int32_t> generated, std::span<const int32_t> answer);
// SQuAD-style F1 over bags (multisets) of tokens: common = Σ_t min(count_gen(t), count_ans(t)),
// precision = common / |gen|, recall = common / |ans|, F1 = 2PR / (P + R); 0 when common == 0.
// Both empty: 1. One empty: 0.
double TokenF1Ids(std::span<const int32_t> generated, std::span<const int32_t> answer);

// ---------------------------------------------------------------------------------------
// Answer scores on text, after NormalizeAnswer (SQuAD / LongBench normalization).

// ASCII lowercase; ASCII punctuation removed; the whole words "a", "an", "the" removed;
// runs of whitespace collapsed to one space, none at either end. Bytes >= 0x80 (non-ASCII
// UTF-8) are kept as they are.
std::string NormalizeAnswer(std::string_view text);
// Whitespace-separated words of NormalizeAnswer(text).
std::vector<std::string> NormalizedWords(std::string_view text);

// NormalizeAnswer(generated) == NormalizeAnswer(answer).
bool ExactMatchText(std::string_view generated, std::string_view answer);
// The normalized answer's words occur as a contiguous run of whole words in the normalized
// generation ("12" is not contained in "123"; "new york" is in "i live in new york city").
// An answer that normalizes to nothing is contained.
bool ContainsText(std::string_view generated, std::string_view answer);
// TokenF1Ids over the normalized words (SQuAD F1).
double TokenF1Text(std::string_view generated, std::string_view answer);

// ---------------------------------------------------------------------------------------
// Confidence intervals (95%).

struct Interval {
  double low = 0;
  double high = 0;
};

// Wilson score interval for a binomial proportion successes / n at z (1.959964 = 95%):
// center = (p + z²/2n) / (1 + z²/n), half = z / (1 + z²/n) · sqrt(p(1-p)/n + z²/4n²).
// n == 0 gives [0, 1]. Requires 0 <= successes <= n.
Interval WilsonInterval(int64_t successes, int64_t n, double z = 1.959963984540054);

// Two-sided 97.5% quantile of Student's t with `df` degrees of freedom (the 95% CI factor):
// exact table for df <= 30, a Cornish-Fisher expansion above (error < 1e-4); df <= 0 → NaN.
double StudentT975(int64_t df);

struct MeanCi {
  int64_t n = 0;
  double mean = 0;
  double stddev = 0;  // sample standard deviation (n - 1); 0 when n < 2
  double low = 0;     // mean ∓ t_{0.975, n-1} · stddev / sqrt(n); equal to mean when n < 2
  double high = 0;
};
// Mean of `values` with a 95% Student-t interval (the t factor tends to the normal 1.96).
MeanCi MeanWithCi(std::span<const double> values);

// ---------------------------------------------------------------------------------------
// Label-free fidelity: the same token stream run with the full cache and with the sparse
// cache; the runner hands in the two logit rows [n_vocab] of each position.

// log-softmax of one logit row, in double, stable (max subtracted first). [n] → [n].
std::vector<double> LogSoftmax(std::span<const float> logits);
// KL(p_full || p_sparse) = Σ_i p_full(i) (log p_full(i) − log p_sparse(i)) in nats, ≥ 0.
// Rows must have the same non-zero length (checked).
double KlDivergenceFromLogits(std::span<const float> full_logits, std::span<const float> sparse_logits);
// Index of the largest logit; ties go to the lowest index. Non-empty row (checked).
int32_t ArgMax(std::span<const float> logits);
// ArgMax(full) == ArgMax(sparse).
bool Top1Agrees(std::span<const float> full_logits, std::span<const float> sparse_logits);
// log p(token) under softmax(logits) (teacher forcing: token is the next token of the stream).
double TokenLogProb(std::span<const float> logits, int32_t token);
// exp(−mean log p) over the per-token log-probs (natural log). Empty → NaN.
double Perplexity(std::span<const double> token_logprobs);

// Accumulates the fidelity of one or many streams, position by position.
class FidelityAccumulator {
 public:
  // One position: the two logit rows [n_vocab] and the stream's actual next token
  // (teacher forcing; pass -1 when there is none, e.g. the last position: then only KL and
  // top-1 are counted).
  void Add(std::span<const float> full_logits, std::span<const float> sparse_logits, int32_t next_token);

  int64_t positions() const { return static_cast<int64_t>(kl_.size()); }
  double mean_kl() const;             // nats; NaN when empty
  double top1_agreement() const;      // fraction of positions whose argmax agree; NaN when empty
  double perplexity_full() const;     // over positions with a next token; NaN when none
  double perplexity_sparse() const;
  // perplexity_sparse / perplexity_full − 1 (relative change; 0.05 = 5% worse).
  double perplexity_change() const;
  const std::vector<double>& kl_values() const { return kl_; }  // per position, nats

 private:
  std::vector<double> kl_;
  int64_t top1_agree_ = 0;
  std::vector<double> logp_full_;
  std::vector<double> logp_sparse_;
};

// ---------------------------------------------------------------------------------------
// Generation quality without labels.

// distinct-n = (number of distinct n-grams) / (number of n-grams) of one generation, in (0, 1].
// Fewer than n tokens (no n-gram) → 1. n >= 1 (checked).
double DistinctN(std::span<const int32_t> tokens, int n);
// Repetition rate = 1 − DistinctN: 0 when no n-gram repeats, → 1 for a degenerate loop.
double RepetitionRate(std::span<const int32_t> tokens, int n);

// ---------------------------------------------------------------------------------------
// Percentiles (latency).

// q-quantile, q in [0, 1], by linear interpolation between closest ranks (Hyndman-Fan type 7,
// NumPy's default): sort, h = (n − 1)·q, result = x[⌊h⌋] + (h − ⌊h⌋)(x[⌊h⌋+1] − x[⌊h⌋]).
// Empty → NaN.
double Percentile(std::span<const double> values, double q);

struct LatencySummary {
  int64_t n = 0;
  double mean = 0;
  double median = 0;  // Percentile(0.5)
  double p90 = 0;     // Percentile(0.9)
  double min = 0;
  double max = 0;
};
// All fields NaN except n when empty.
LatencySummary SummarizeLatency(std::span<const double> values);

// ---------------------------------------------------------------------------------------
// Aggregation of per-sample values keyed by (task, subtask, metric).

struct MetricSummary {
  int64_t n = 0;
  double mean = 0;
  // 95% interval of the mean: Wilson when every value is 0 or 1 (an accuracy), else Student t.
  double ci_low = 0;
  double ci_high = 0;
  bool binary = false;  // every value was 0 or 1 (the Wilson interval was used)
  double median = 0;
  double p90 = 0;
  double min = 0;
  double max = 0;
};
// Summary of one list of values, as the aggregator computes it. Empty → n = 0, rest NaN.
MetricSummary SummarizeValues(std::span<const double> values);

class BenchAggregator {
 public:
  // Records one value (a sample's score, a latency, a KL...). Keys are free-form strings;
  // a runner that wants a per-task total also adds each value under subtask "all".
  void Add(std::string_view task, std::string_view subtask, std::string_view metric, double value);

  struct Row {
    std::string task;
    std::string subtask;
    std::string metric;
    MetricSummary summary;
  };
  // One row per key, sorted by (task, subtask, metric).
  std::vector<Row> Rows() const;
  // nullopt when nothing was added under that key.
  std::optional<MetricSummary> Get(std::string_view task, std::string_view subtask, std::string_view metric) const;
  const std::vector<double>* Values(std::string_view task, std::string_view subtask, std::string_view metric) const;
  bool empty() const { return values_.empty(); }

 private:
  using Key = std::tuple<std::string, std::string, std::string>;
  std::map<Key, std::vector<double>> values_;
};

}  // namespace kvsparse
