#include "kvsparse/bench_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "kvsparse/status.h"

namespace kvsparse {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool IsAsciiPunct(unsigned char c) {
  return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
}
bool IsAsciiSpace(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

template <typename T>
double BagF1(std::span<const T> gen, std::span<const T> ans) {
  if (gen.empty() && ans.empty()) return 1.0;
  if (gen.empty() || ans.empty()) return 0.0;
  std::unordered_map<T, int64_t> counts;
  for (const T& t : ans) ++counts[t];
  int64_t common = 0;
  for (const T& t : gen) {
    auto it = counts.find(t);
    if (it != counts.end() && it->second > 0) {
      --it->second;
      ++common;
    }
  }
  if (common == 0) return 0.0;
  const double precision = static_cast<double>(common) / static_cast<double>(gen.size());
  const double recall = static_cast<double>(common) / static_cast<double>(ans.size());
  return 2.0 * precision * recall / (precision + recall);
}

// Student t 97.5% quantiles, df = 1..30 (index df - 1).
constexpr double kT975[30] = {
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252, 2.306004135,
    2.262157163,  2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688, 2.131449546, 2.119905299,
    2.109815578,  2.100922040, 2.093024054, 2.085963447, 2.079613845, 2.073873068, 2.068657610, 2.063898562,
    2.059538553,  2.055529439, 2.051830516, 2.048407142, 2.045229642, 2.042272456};

}  // namespace

bool ExactMatchIds(std::span<const int32_t> generated, std::span<const int32_t> answer) {
  return std::equal(generated.begin(), generated.end(), answer.begin(), answer.end());
}

bool ContainsIds(std::span<const int32_t> generated, std::span<const int32_t> answer) {
  if (answer.empty()) return true;
  return std::search(generated.begin(), generated.end(), answer.begin(), answer.end()) != generated.end();
}

double TokenF1Ids(std::span<const int32_t> generated, std::span<const int32_t> answer) {
  return BagF1<int32_t>(generated, answer);
}

std::vector<std::string> NormalizedWords(std::string_view text) {
  // Lowercase and drop punctuation first, so "the," is recognised as an article.
  std::vector<std::string> words;
  std::string cur;
  auto flush = [&] {
    if (!cur.empty() && cur != "a" && cur != "an" && cur != "the") words.push_back(cur);
    cur.clear();
  };
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (IsAsciiSpace(c)) {
      flush();
    } else if (IsAsciiPunct(c)) {
      continue;
    } else if (c >= 'A' && c <= 'Z') {
      cur.push_back(static_cast<char>(c - 'A' + 'a'));
    } else {
      cur.push_back(ch);
    }
  }
  flush();
  return words;
}

std::string NormalizeAnswer(std::string_view text) {
  std::string out;
  for (const std::string& w : NormalizedWords(text)) {
    if (!out.empty()) out.push_back(' ');
    out += w;
  }
  return out;
}

bool ExactMatchText(std::string_view generated, std::string_view answer) {
  return NormalizeAnswer(generated) == NormalizeAnswer(answer);
}

bool ContainsText(std::string_view generated, std::string_view answer) {
  const std::vector<std::string> gen = NormalizedWords(generated);
  const std::vector<std::string> ans = NormalizedWords(answer);
  if (ans.empty()) return true;
  return std::search(gen.begin(), gen.end(), ans.begin(), ans.end()) != gen.end();
}

double TokenF1Text(std::string_view generated, std::string_view answer) {
  const std::vector<std::string> gen = NormalizedWords(generated);
  const std::vector<std::string> ans = NormalizedWords(answer);
  return BagF1<std::string>(gen, ans);
}

Interval WilsonInterval(int64_t successes, int64_t n, double z) {
  KVS_CHECK(successes >= 0 && successes <= n);
  if (n == 0) return {0.0, 1.0};
  const double nn = static_cast<double>(n);
  const double p = static_cast<double>(successes) / nn;
  const double z2 = z * z;
  const double denom = 1.0 + z2 / nn;
  const double center = (p + z2 / (2.0 * nn)) / denom;
  const double half = z / denom * std::sqrt(p * (1.0 - p) / nn + z2 / (4.0 * nn * nn));
  return {std::max(0.0, center - half), std::min(1.0, center + half)};
}

double StudentT975(int64_t df) {
  if (df <= 0) return kNaN;
  if (df <= 30) return kT975[df - 1];
  // Cornish-Fisher expansion of the t quantile around the normal quantile.
  const double z = 1.959963984540054;
  const double v = static_cast<double>(df);
  const double z3 = z * z * z, z5 = z3 * z * z, z7 = z5 * z * z, z9 = z7 * z * z;
  return z + (z3 + z) / (4 * v) + (5 * z5 + 16 * z3 + 3 * z) / (96 * v * v) +
         (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * v * v * v) +
         (79 * z9 + 776 * z7 + 1482 * z5 - 1920 * z3 - 945 * z) / (92160 * v * v * v * v);
}

MeanCi MeanWithCi(std::span<const double> values) {
  MeanCi r;
  r.n = static_cast<int64_t>(values.size());
  if (r.n == 0) {
    r.mean = r.stddev = r.low = r.high = kNaN;
    return r;
  }
  double sum = 0;
  for (double v : values) sum += v;
  r.mean = sum / static_cast<double>(r.n);
  if (r.n < 2) {
    r.low = r.high = r.mean;
    return r;
  }
  double ss = 0;
  for (double v : values) ss += (v - r.mean) * (v - r.mean);
  r.stddev = std::sqrt(ss / static_cast<double>(r.n - 1));
  const double half = StudentT975(r.n - 1) * r.stddev / std::sqrt(static_cast<double>(r.n));
  r.low = r.mean - half;
  r.high = r.mean + half;
  return r;
}

std::vector<double> LogSoftmax(std::span<const float> logits) {
  std::vector<double> out(logits.size());
  if (logits.empty()) return out;
  double mx = -std::numeric_limits<double>::infinity();
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double lse = mx + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

namespace {
// KL(p || q) from two log-softmax rows.
double KlFromLogProbs(const std::vector<double>& lp, const std::vector<double>& lq) {
  double kl = 0;
  for (size_t i = 0; i < lp.size(); ++i) {
    const double p = std::exp(lp[i]);
    if (p > 0) kl += p * (lp[i] - lq[i]);
  }
  return std::max(0.0, kl);  // rounding can leave a tiny negative for identical rows
}
}  // namespace

double KlDivergenceFromLogits(std::span<const float> full_logits, std::span<const float> sparse_logits) {
  KVS_CHECK_MSG(!full_logits.empty() && full_logits.size() == sparse_logits.size(),
                "KL needs two logit rows of the same non-zero length");
  return KlFromLogProbs(LogSoftmax(full_logits), LogSoftmax(sparse_logits));
}

int32_t ArgMax(std::span<const float> logits) {
  KVS_CHECK(!logits.empty());
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

bool Top1Agrees(std::span<const float> full_logits, std::span<const float> sparse_logits) {
  return ArgMax(full_logits) == ArgMax(sparse_logits);
}

double TokenLogProb(std::span<const float> logits, int32_t token) {
  KVS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  return static_cast<double>(logits[token]) - mx - std::log(sum);
}

double Perplexity(std::span<const double> token_logprobs) {
  if (token_logprobs.empty()) return kNaN;
  double sum = 0;
  for (double lp : token_logprobs) sum += lp;
  return std::exp(-sum / static_cast<double>(token_logprobs.size()));
}

void FidelityAccumulator::Add(std::span<const float> full_logits, std::span<const float> sparse_logits,
                              int32_t next_token) {
  KVS_CHECK_MSG(!full_logits.empty() && full_logits.size() == sparse_logits.size(),
                "KL needs two logit rows of the same non-zero length");
  // One log-softmax per row serves KL and the teacher-forced log-probabilities.
  const std::vector<double> lp = LogSoftmax(full_logits);
  const std::vector<double> lq = LogSoftmax(sparse_logits);
  kl_.push_back(KlFromLogProbs(lp, lq));
  if (Top1Agrees(full_logits, sparse_logits)) ++top1_agree_;
  if (next_token >= 0) {
    KVS_CHECK(static_cast<size_t>(next_token) < lp.size());
    logp_full_.push_back(lp[next_token]);
    logp_sparse_.push_back(lq[next_token]);
  }
}

double FidelityAccumulator::mean_kl() const {
  if (kl_.empty()) return kNaN;
  double s = 0;
  for (double v : kl_) s += v;
  return s / static_cast<double>(kl_.size());
}

double FidelityAccumulator::top1_agreement() const {
  if (kl_.empty()) return kNaN;
  return static_cast<double>(top1_agree_) / static_cast<double>(kl_.size());
}

double FidelityAccumulator::perplexity_full() const { return Perplexity(logp_full_); }
double FidelityAccumulator::perplexity_sparse() const { return Perplexity(logp_sparse_); }
double FidelityAccumulator::perplexity_change() const { return perplexity_sparse() / perplexity_full() - 1.0; }

double DistinctN(std::span<const int32_t> tokens, int n) {
  KVS_CHECK(n >= 1);
  if (tokens.size() < static_cast<size_t>(n)) return 1.0;
  const size_t count = tokens.size() - static_cast<size_t>(n) + 1;
  std::vector<std::vector<int32_t>> grams;
  grams.reserve(count);
  for (size_t i = 0; i < count; ++i) grams.emplace_back(tokens.begin() + i, tokens.begin() + i + n);
  std::sort(grams.begin(), grams.end());
  const size_t distinct = static_cast<size_t>(std::unique(grams.begin(), grams.end()) - grams.begin());
  return static_cast<double>(distinct) / static_cast<double>(count);
}

double RepetitionRate(std::span<const int32_t> tokens, int n) { return 1.0 - DistinctN(tokens, n); }

double Percentile(std::span<const double> values, double q) {
  KVS_CHECK(q >= 0.0 && q <= 1.0);
  if (values.empty()) return kNaN;
  std::vector<double> v(values.begin(), values.end());
  std::sort(v.begin(), v.end());
  const double h = static_cast<double>(v.size() - 1) * q;
  const size_t lo = static_cast<size_t>(std::floor(h));
  if (lo + 1 >= v.size()) return v.back();
  return v[lo] + (h - static_cast<double>(lo)) * (v[lo + 1] - v[lo]);
}

LatencySummary SummarizeLatency(std::span<const double> values) {
  LatencySummary s;
  s.n = static_cast<int64_t>(values.size());
  if (values.empty()) {
    s.mean = s.median = s.p90 = s.min = s.max = kNaN;
    return s;
  }
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  s.median = Percentile(values, 0.5);
  s.p90 = Percentile(values, 0.9);
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

MetricSummary SummarizeValues(std::span<const double> values) {
  MetricSummary s;
  s.n = static_cast<int64_t>(values.size());
  if (values.empty()) {
    s.mean = s.ci_low = s.ci_high = s.median = s.p90 = s.min = s.max = kNaN;
    return s;
  }
  const LatencySummary dist = SummarizeLatency(values);
  s.mean = dist.mean;
  s.median = dist.median;
  s.p90 = dist.p90;
  s.min = dist.min;
  s.max = dist.max;
  s.binary = std::all_of(values.begin(), values.end(), [](double v) { return v == 0.0 || v == 1.0; });
  if (s.binary) {
    const auto successes = static_cast<int64_t>(std::count(values.begin(), values.end(), 1.0));
    const Interval ci = WilsonInterval(successes, s.n);
    s.ci_low = ci.low;
    s.ci_high = ci.high;
  } else {
    const MeanCi ci = MeanWithCi(values);
    s.ci_low = ci.low;
    s.ci_high = ci.high;
  }
  return s;
}

void BenchAggregator::Add(std::string_view task, std::string_view subtask, std::string_view metric, double value) {
  values_[Key(std::string(task), std::string(subtask), std::string(metric))].push_back(value);
}

std::vector<BenchAggregator::Row> BenchAggregator::Rows() const {
  std::vector<Row> rows;
  rows.reserve(values_.size());
  for (const auto& [key, vals] : values_) {
    rows.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), SummarizeValues(vals)});
  }
  return rows;
}

const std::vector<double>* BenchAggregator::Values(std::string_view task, std::string_view subtask,
                                                   std::string_view metric) const {
  auto it = values_.find(Key(std::string(task), std::string(subtask), std::string(metric)));
  return it == values_.end() ? nullptr : &it->second;
}

std::optional<MetricSummary> BenchAggregator::Get(std::string_view task, std::string_view subtask,
                                                  std::string_view metric) const {
  const std::vector<double>* v = Values(task, subtask, metric);
  if (v == nullptr) return std::nullopt;
  return SummarizeValues(*v);
}

}  // namespace kvsparse
