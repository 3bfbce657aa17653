// Tests of src/server/metrics.h (named apart from src/bench/metrics_test.cc: test executables are
// named after their file).
#include "server/metrics.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvsparse::server {
namespace {

// A strict reader of the text exposition format 0.0.4, enough to check what Render writes the way
// a Prometheus scraper reads it. Format violations are test failures.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Family {
  std::string name;
  std::string help;
  std::string type;
  std::vector<Sample> samples;
};

std::string UnescapeHelp(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size()) {
      const char next = text[++i];
      out += next == 'n' ? '\n' : next;
    } else {
      out += text[i];
    }
  }
  return out;
}

bool IsMetricNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }

Sample ParseSample(const std::string& line) {
  Sample sample;
  size_t i = 0;
  while (i < line.size() && IsMetricNameChar(line[i])) sample.name += line[i++];
  EXPECT_FALSE(sample.name.empty()) << line;
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      std::string label;
      while (i < line.size() && line[i] != '=') label += line[i++];
      EXPECT_TRUE(i + 1 < line.size() && line[i + 1] == '"') << "label value must be quoted: " << line;
      i += 2;
      std::string value;
      while (i < line.size() && line[i] != '"') {
        if (line[i] == '\\') {
          ++i;
          EXPECT_TRUE(line[i] == '\\' || line[i] == '"' || line[i] == 'n') << "bad escape: " << line;
          value += line[i] == 'n' ? '\n' : line[i];
        } else {
          value += line[i];
        }
        ++i;
      }
      ++i;  // closing quote
      EXPECT_TRUE(sample.labels.emplace(label, value).second) << "duplicate label " << label << ": " << line;
      if (i < line.size() && line[i] == ',') ++i;
    }
    EXPECT_LT(i, line.size()) << "unterminated labels: " << line;
    ++i;  // '}'
  }
  EXPECT_TRUE(i < line.size() && line[i] == ' ') << "one space before the value: " << line;
  const std::string value_text = line.substr(i + 1);
  char* end = nullptr;
  sample.value = std::strtod(value_text.c_str(), &end);
  EXPECT_TRUE(!value_text.empty() && *end == '\0') << "bad value '" << value_text << "': " << line;
  return sample;
}

std::vector<Family> ParseExposition(const std::string& text) {
  std::vector<Family> families;
  std::set<std::string> seen;
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the last line must end with a newline";
  std::istringstream lines(text);
  std::string line;
  bool expect_type = false;
  while (std::getline(lines, line)) {
    EXPECT_FALSE(line.empty()) << "no blank lines";
    if (line.rfind("# HELP ", 0) == 0) {
      EXPECT_FALSE(expect_type) << "HELP without TYPE before: " << line;
      const std::string rest = line.substr(7);
      const size_t space = rest.find(' ');
      Family family;
      family.name = rest.substr(0, space);
      family.help = space == std::string::npos ? "" : UnescapeHelp(rest.substr(space + 1));
      EXPECT_TRUE(seen.insert(family.name).second) << "family appears twice: " << family.name;
      families.push_back(family);
      expect_type = true;
    } else if (line.rfind("# TYPE ", 0) == 0) {
      EXPECT_TRUE(expect_type) << "TYPE must follow its HELP: " << line;
      std::istringstream words(line.substr(7));
      std::string name, type;
      words >> name >> type;
      EXPECT_EQ(name, families.back().name) << line;
      EXPECT_TRUE(type == "counter" || type == "gauge" || type == "histogram") << line;
      families.back().type = type;
      expect_type = false;
    } else {
      EXPECT_FALSE(expect_type) << "sample before TYPE: " << line;
      EXPECT_NE(line[0], '#') << "unexpected comment: " << line;
      if (families.empty()) {
        ADD_FAILURE() << "sample outside a family: " << line;
        continue;
      }
      Family& family = families.back();
      Sample sample = ParseSample(line);
      if (family.type == "histogram") {
        EXPECT_TRUE(sample.name == family.name + "_bucket" || sample.name == family.name + "_sum" ||
                    sample.name == family.name + "_count")
            << line;
        EXPECT_EQ(sample.labels.count("le"), sample.name == family.name + "_bucket" ? 1u : 0u) << line;
      } else {
        EXPECT_EQ(sample.name, family.name) << line;
      }
      family.samples.push_back(std::move(sample));
    }
  }
  return families;
}

const Family* Find(const std::vector<Family>& families, const std::string& name) {
  for (const Family& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// Histogram invariants for one series: cumulative, ordered buckets ending in +Inf == _count.
void ExpectWellFormedHistogram(const Family& family, const std::map<std::string, std::string>& series_labels) {
  std::vector<std::pair<double, double>> buckets;  // (le, count)
  double count = -1, sum = NAN;
  for (const Sample& s : family.samples) {
    std::map<std::string, std::string> labels = s.labels;
    labels.erase("le");
    if (labels != series_labels) continue;
    if (s.name == family.name + "_bucket") {
      buckets.emplace_back(std::strtod(s.labels.at("le").c_str(), nullptr), s.value);
    }
    if (s.name == family.name + "_count") count = s.value;
    if (s.name == family.name + "_sum") sum = s.value;
  }
  ASSERT_FALSE(buckets.empty());
  EXPECT_TRUE(std::isinf(buckets.back().first)) << "the last bucket is +Inf";
  for (size_t i = 1; i < buckets.size(); ++i) {
    EXPECT_LT(buckets[i - 1].first, buckets[i].first) << "le increases";
    EXPECT_LE(buckets[i - 1].second, buckets[i].second) << "counts are cumulative";
  }
  EXPECT_EQ(buckets.back().second, count);
  EXPECT_FALSE(std::isnan(sum));
}

TEST(Metrics, RendersEveryKindInTextFormat) {
  Registry registry;
  registry.GetCounter("kvsparse_requests_total", "HTTP requests by status.", {{"status", "200"}}).Inc();
  registry.GetCounter("kvsparse_requests_total", "ignored: help comes from the first call", {{"status", "200"}}).Inc(2);
  registry.GetCounter("kvsparse_requests_total", "", {{"status", "400"}}).Inc();
  Gauge& active = registry.GetGauge("kvsparse_active_requests", "Requests being generated.");
  active.Set(5);
  active.Add(-2);
  registry.GetGauge("kvsparse_kv_used_fraction", "Fraction of KV pages in use.").Set(0.25);
  Histogram& latency = registry.GetHistogram("kvsparse_request_seconds", "End-to-end latency.", {0.1, 0.5, 1});
  for (double v : {0.05, 0.1, 0.3, 2.0, 7.0}) latency.Observe(v);

  const std::string text = registry.Render();
  EXPECT_EQ(text,
            "# HELP kvsparse_requests_total HTTP requests by status.\n"
            "# TYPE kvsparse_requests_total counter\n"
            "kvsparse_requests_total{status=\"200\"} 3\n"
            "kvsparse_requests_total{status=\"400\"} 1\n"
            "# HELP kvsparse_active_requests Requests being generated.\n"
            "# TYPE kvsparse_active_requests gauge\n"
            "kvsparse_active_requests 3\n"
            "# HELP kvsparse_kv_used_fraction Fraction of KV pages in use.\n"
            "# TYPE kvsparse_kv_used_fraction gauge\n"
            "kvsparse_kv_used_fraction 0.25\n"
            "# HELP kvsparse_request_seconds End-to-end latency.\n"
            "# TYPE kvsparse_request_seconds histogram\n"
            "kvsparse_request_seconds_bucket{le=\"0.1\"} 2\n"  // 0.1 itself counts as <= 0.1
            "kvsparse_request_seconds_bucket{le=\"0.5\"} 3\n"
            "kvsparse_request_seconds_bucket{le=\"1\"} 3\n"
            "kvsparse_request_seconds_bucket{le=\"+Inf\"} 5\n"
            "kvsparse_request_seconds_sum 9.45\n"
            "kvsparse_request_seconds_count 5\n");

  const std::vector<Family> families = ParseExposition(text);
  ASSERT_EQ(families.size(), 4u);
  const Family* requests = Find(families, "kvsparse_requests_total");
  ASSERT_NE(requests, nullptr);
  EXPECT_EQ(requests->type, "counter");
  EXPECT_EQ(requests->help, "HTTP requests by status.");
  ASSERT_EQ(requests->samples.size(), 2u);
  EXPECT_EQ(requests->samples[0].labels.at("status"), "200");
  EXPECT_EQ(requests->samples[0].value, 3);
  EXPECT_EQ(requests->samples[1].labels.at("status"), "400");
  EXPECT_EQ(requests->samples[1].value, 1);
  const Family* active_family = Find(families, "kvsparse_active_requests");
  ASSERT_NE(active_family, nullptr);
  EXPECT_EQ(active_family->type, "gauge");
  ASSERT_EQ(active_family->samples.size(), 1u);
  EXPECT_TRUE(active_family->samples[0].labels.empty());
  EXPECT_EQ(active_family->samples[0].value, 3);
  const Family* seconds = Find(families, "kvsparse_request_seconds");
  ASSERT_NE(seconds, nullptr);
  EXPECT_EQ(seconds->type, "histogram");
  ExpectWellFormedHistogram(*seconds, {});
}

TEST(Metrics, LabelledHistogramSeriesAreSeparate) {
  Registry registry;
  const std::vector<double> bounds = ExponentialBuckets(0.001, 10, 4);  // 0.001 .. 1
  Histogram& prefill = registry.GetHistogram("kvsparse_step_seconds", "Step time.", bounds, {{"phase", "prefill"}});
  Histogram& decode = registry.GetHistogram("kvsparse_step_seconds", "Step time.", bounds, {{"phase", "decode"}});
  EXPECT_NE(&prefill, &decode);
  prefill.Observe(0.5);
  decode.Observe(0.0005);
  decode.Observe(0.02);
  const std::string text = registry.Render();
  EXPECT_NE(text.find("kvsparse_step_seconds_bucket{phase=\"prefill\",le=\"0.001\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvsparse_step_seconds_bucket{phase=\"decode\",le=\"0.001\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvsparse_step_seconds_count{phase=\"decode\"} 2\n"), std::string::npos) << text;
  const std::vector<Family> families = ParseExposition(text);
  ASSERT_EQ(families.size(), 1u);
  EXPECT_EQ(families[0].samples.size(), 2u * (4 + 1 + 2));  // per series: 4 bounds + +Inf, _sum, _count
  ExpectWellFormedHistogram(families[0], {{"phase", "prefill"}});
  ExpectWellFormedHistogram(families[0], {{"phase", "decode"}});
}

TEST(Metrics, SameNameAndLabelsIsTheSameSeries) {
  Registry registry;
  Counter& a = registry.GetCounter("c_total", "help", {{"x", "1"}, {"y", "2"}});
  EXPECT_EQ(&a, &registry.GetCounter("c_total", "help", {{"x", "1"}, {"y", "2"}}));
  EXPECT_NE(&a, &registry.GetCounter("c_total", "help", {{"x", "1"}, {"y", "3"}}));
  EXPECT_NE(&a, &registry.GetCounter("c_total", "help"));
  Gauge& g = registry.GetGauge("g", "help");
  EXPECT_EQ(&g, &registry.GetGauge("g", "other help"));
}

TEST(Metrics, EscapesLabelValuesAndHelp) {
  Registry registry;
  const std::string tricky = "a\"b\\c\nd";
  registry.GetCounter("escaped_total", "line one\nback\\slash \"quoted\"", {{"path", tricky}}).Inc();
  const std::string text = registry.Render();
  EXPECT_NE(text.find("# HELP escaped_total line one\\nback\\\\slash \"quoted\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("escaped_total{path=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos) << text;
  const std::vector<Family> families = ParseExposition(text);
  ASSERT_EQ(families.size(), 1u);
  EXPECT_EQ(families[0].help, "line one\nback\\slash \"quoted\"");
  ASSERT_EQ(families[0].samples.size(), 1u);
  EXPECT_EQ(families[0].samples[0].labels.at("path"), tricky);
}

TEST(Metrics, ValueFormatting) {
  Registry registry;
  registry.GetGauge("big", "h").Set(1e21);
  registry.GetGauge("negative", "h").Set(-3.5);
  registry.GetGauge("infinite", "h").Set(INFINITY);
  registry.GetGauge("minus_infinite", "h").Set(-INFINITY);
  registry.GetGauge("not_a_number", "h").Set(NAN);
  registry.GetCounter("bytes_total", "h").Inc(123456789);
  const std::string text = registry.Render();
  for (const char* line : {"big 1e+21\n", "negative -3.5\n", "infinite +Inf\n", "minus_infinite -Inf\n",
                           "not_a_number NaN\n", "bytes_total 123456789\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  ParseExposition(text);
}

TEST(Metrics, HistogramDropsNaNAndCountsBoundsInclusively) {
  Histogram h({1, 2});
  h.Observe(NAN);
  h.Observe(1);
  h.Observe(2);
  h.Observe(-5);
  h.Observe(INFINITY);
  const Histogram::Snapshot s = h.Read();
  EXPECT_EQ(s.cumulative_counts, (std::vector<uint64_t>{2, 3, 4}));
  EXPECT_EQ(s.count, 4u);
  EXPECT_TRUE(std::isinf(s.sum));
}

TEST(Metrics, EmptyRegistryRendersNothing) {
  Registry registry;
  EXPECT_EQ(registry.Render(), "");
}

TEST(Metrics, ExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(ExponentialBuckets(0.5, 3, 1), (std::vector<double>{0.5}));
}

TEST(Metrics, ConcurrentUpdatesAreCounted) {
  Registry registry;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20000;
  Counter& shared = registry.GetCounter("shared_total", "h");
  Histogram& hist = registry.GetHistogram("shared_seconds", "h", {0.5});
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter& mine = registry.GetCounter("per_thread_total", "h", {{"thread", std::to_string(t)}});
      Gauge& gauge = registry.GetGauge("level", "h");
      for (int i = 0; i < kPerThread; ++i) {
        shared.Inc();
        mine.Inc(0.5);
        gauge.Add(1);
        hist.Observe(i % 2 == 0 ? 0.25 : 1.0);
        if (i % 5000 == 0) ParseExposition(registry.Render());  // renders while others write
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(shared.Value(), kThreads * kPerThread);
  EXPECT_EQ(registry.GetGauge("level", "h").Value(), kThreads * kPerThread);
  const Histogram::Snapshot s = hist.Read();
  EXPECT_EQ(s.count, static_cast<uint64_t>(kThreads * kPerThread));
  EXPECT_EQ(s.cumulative_counts[0], static_cast<uint64_t>(kThreads * kPerThread / 2));
  EXPECT_DOUBLE_EQ(s.sum, kThreads * kPerThread / 2 * 1.25);
  const std::vector<Family> families = ParseExposition(registry.Render());
  const Family* per_thread = Find(families, "per_thread_total");
  ASSERT_NE(per_thread, nullptr);
  ASSERT_EQ(per_thread->samples.size(), static_cast<size_t>(kThreads));
  for (const Sample& sample : per_thread->samples) EXPECT_EQ(sample.value, kPerThread * 0.5);
}

TEST(MetricsDeathTest, ProgrammerErrorsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ Registry r; r.GetCounter("bad name", "h"); }, "invalid metric name");
  EXPECT_DEATH({ Registry r; r.GetCounter("x_total", "h", {{"__reserved", "v"}}); }, "invalid label name");
  EXPECT_DEATH({ Registry r; r.GetHistogram("h", "h", {1}, {{"le", "v"}}); }, "reserved");
  EXPECT_DEATH({ Registry r; r.GetCounter("x", "h"); r.GetGauge("x", "h"); }, "registered as a counter");
  EXPECT_DEATH({ Registry r; r.GetHistogram("h", "h", {1}); r.GetHistogram("h", "h", {2}); }, "other buckets");
  EXPECT_DEATH({ Registry r; r.GetHistogram("h", "h", {2, 1}); }, "increase");
  EXPECT_DEATH({ Counter c; c.Inc(-1); }, "only go up");
}

}  // namespace
}  // namespace kvsparse::server
