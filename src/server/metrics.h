// A small thread-safe Prometheus registry for the server's /metrics endpoint: counters, gauges and
// fixed-bucket histograms, each family with optional labelled series, rendered in the Prometheus
// text exposition format 0.0.4.
//
//   Registry registry;
//   Counter& ok = registry.GetCounter("kvsparse_requests_total", "HTTP requests by status", {{"status", "200"}});
//   ok.Inc();
//   Histogram& ttft = registry.GetHistogram("kvsparse_ttft_seconds", "Time to first token",
//                                           ExponentialBuckets(0.01, 2, 12));
//   ttft.Observe(0.137);
//   std::string body = registry.Render();  // served with kPrometheusContentType
//
// Get* return references that stay valid as long as the registry; callers on a hot path keep them
// instead of looking the series up each time. Invalid names, a name reused with another type or other
// histogram buckets, and a negative counter increment are programmer errors (KVS_CHECK).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvsparse::server {

inline constexpr std::string_view kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

// Label name/value pairs naming one series of a family, in the order they are rendered.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Inc(double delta = 1.0);  // delta >= 0: counters only go up
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // Finite, strictly increasing upper bounds; the +Inf bucket is implicit.
  explicit Histogram(std::vector<double> upper_bounds);

  // Counts `value` in the first bucket whose bound is >= value. NaN is dropped: it would turn _sum
  // into NaN for good.
  void Observe(double value);

  struct Snapshot {
    std::vector<double> upper_bounds;
    std::vector<uint64_t> cumulative_counts;  // one per bound, then +Inf (== count)
    double sum = 0.0;
    uint64_t count = 0;
  };
  // A consistent view: the buckets, sum and count of the same set of observations.
  Snapshot Read() const;

  const std::vector<double>& upper_bounds() const { return upper_bounds_; }

 private:
  const std::vector<double> upper_bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> bucket_counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

// `count` bounds start, start*factor, start*factor^2, ... (start > 0, factor > 1, count >= 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The series of family `name` with `labels`, created (at zero) on first use. `help` is taken from
  // the first call for a family.
  Counter& GetCounter(std::string_view name, std::string_view help, const MetricLabels& labels = {});
  Gauge& GetGauge(std::string_view name, std::string_view help, const MetricLabels& labels = {});
  Histogram& GetHistogram(std::string_view name, std::string_view help, const std::vector<double>& upper_bounds,
                          const MetricLabels& labels = {});

  // Every family with at least one series, in registration order: "# HELP", "# TYPE", then the
  // samples of each series in creation order (histograms: cumulative _bucket lines with le
  // including "+Inf", _sum, _count).
  std::string Render() const;

 private:
  enum class Kind;
  static std::string_view KindName(Kind kind);  // the TYPE line's word
  struct Family;
  struct Series;
  // Callers hold mutex_. upper_bounds: histograms only.
  Family& FamilyFor(std::string_view name, std::string_view help, Kind kind, const std::vector<double>* upper_bounds);
  Series& SeriesFor(Family& family, const MetricLabels& labels);

  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Family>> families_;  // registration order
  std::map<std::string, Family*, std::less<>> families_by_name_;
};

}  // namespace kvsparse::server
