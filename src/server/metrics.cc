#include "server/metrics.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kvsparse/status.h"

namespace kvsparse::server {

enum class Registry::Kind { kCounter, kGauge, kHistogram };

struct Registry::Series {
  MetricLabels labels;
  std::unique_ptr<Counter> counter;
  std::unique_ptr<Gauge> gauge;
  std::unique_ptr<Histogram> histogram;
};

struct Registry::Family {
  std::string name;
  std::string help;
  Kind kind;
  std::vector<double> upper_bounds;  // histograms
  std::vector<Series> series;        // creation order
};

namespace {

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(std::string_view name) {
  if (name.empty() || !(IsNameStart(name[0]) || name[0] == ':')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return IsNameStart(c) || IsDigit(c) || c == ':'; });
}

// [a-zA-Z_][a-zA-Z0-9_]*, and the "__" prefix is Prometheus's own.
bool IsValidLabelName(std::string_view name) {
  if (name.empty() || !IsNameStart(name[0]) || name.starts_with("__")) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return IsNameStart(c) || IsDigit(c); });
}

void CheckLabels(std::string_view metric, const MetricLabels& labels, bool histogram) {
  for (size_t i = 0; i < labels.size(); ++i) {
    const std::string& label = labels[i].first;
    KVS_CHECK_MSG(IsValidLabelName(label), fmt::format("metric {}: invalid label name '{}'", metric, label));
    KVS_CHECK_MSG(!(histogram && label == "le"), fmt::format("histogram {}: 'le' is reserved for buckets", metric));
    for (size_t j = 0; j < i; ++j) {
      KVS_CHECK_MSG(labels[j].first != label, fmt::format("metric {}: label '{}' given twice", metric, label));
    }
  }
}

// Text format escapes: HELP text escapes \ and newline; label values also escape ".
std::string Escape(std::string_view text, bool escape_quote) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && escape_quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", value);  // shortest text that reads back as the same double
}

// {a="x",b="y"} plus an optional trailing le label; empty when there are no labels at all.
std::string LabelBlock(const MetricLabels& labels, std::string_view le = {}) {
  if (labels.empty() && le.empty()) return {};
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ',';
    out += labels[i].first;
    out += "=\"";
    out += Escape(labels[i].second, /*escape_quote=*/true);
    out += '"';
  }
  if (!le.empty()) {
    if (!labels.empty()) out += ',';
    out += "le=\"";
    out += le;
    out += '"';
  }
  out += '}';
  return out;
}

void CheckHistogramBounds(const std::vector<double>& upper_bounds) {
  for (size_t i = 0; i < upper_bounds.size(); ++i) {
    KVS_CHECK_MSG(std::isfinite(upper_bounds[i]), "histogram bounds must be finite (+Inf is implicit)");
    KVS_CHECK_MSG(i == 0 || upper_bounds[i - 1] < upper_bounds[i], "histogram bounds must increase strictly");
  }
}

}  // namespace

void Counter::Inc(double delta) {
  KVS_CHECK_MSG(delta >= 0.0, fmt::format("Counter::Inc({}): counters only go up", delta));
  value_.fetch_add(delta, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), bucket_counts_(upper_bounds_.size() + 1, 0) {
  CheckHistogramBounds(upper_bounds_);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // Prometheus buckets are "le": a value equal to a bound belongs to that bound's bucket.
  const size_t bucket = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  std::lock_guard lock(mutex_);
  ++bucket_counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  snapshot.upper_bounds = upper_bounds_;
  snapshot.cumulative_counts.reserve(bucket_counts_.size());
  std::lock_guard lock(mutex_);
  uint64_t running = 0;
  for (uint64_t n : bucket_counts_) snapshot.cumulative_counts.push_back(running += n);
  snapshot.sum = sum_;
  snapshot.count = count_;
  return snapshot;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  KVS_CHECK_MSG(start > 0 && factor > 1 && count >= 1, "ExponentialBuckets: need start > 0, factor > 1, count >= 1");
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

std::string_view Registry::KindName(Kind kind) {
  switch (kind) {
    case Kind::kCounter: return "counter";
    case Kind::kGauge: return "gauge";
    case Kind::kHistogram: return "histogram";
  }
  return "untyped";
}

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Family& Registry::FamilyFor(std::string_view name, std::string_view help, Kind kind,
                                      const std::vector<double>* upper_bounds) {
  auto it = families_by_name_.find(name);
  if (it != families_by_name_.end()) {
    Family& family = *it->second;
    KVS_CHECK_MSG(family.kind == kind, fmt::format("metric {} registered as a {}, used as a {}", name,
                                                   KindName(family.kind), KindName(kind)));
    KVS_CHECK_MSG(upper_bounds == nullptr || family.upper_bounds == *upper_bounds,
                  fmt::format("histogram {} used with other buckets than it was registered with", name));
    return family;
  }
  KVS_CHECK_MSG(IsValidMetricName(name), fmt::format("invalid metric name '{}'", name));
  if (upper_bounds != nullptr) CheckHistogramBounds(*upper_bounds);
  auto family = std::make_unique<Family>();
  family->name = std::string(name);
  family->help = std::string(help);
  family->kind = kind;
  if (upper_bounds != nullptr) family->upper_bounds = *upper_bounds;
  Family& added = *family;
  families_by_name_.emplace(family->name, family.get());
  families_.push_back(std::move(family));
  return added;
}

Registry::Series& Registry::SeriesFor(Family& family, const MetricLabels& labels) {
  for (Series& s : family.series) {
    if (s.labels == labels) return s;
  }
  CheckLabels(family.name, labels, family.kind == Kind::kHistogram);
  Series& s = family.series.emplace_back();
  s.labels = labels;
  switch (family.kind) {
    case Kind::kCounter: s.counter = std::make_unique<Counter>(); break;
    case Kind::kGauge: s.gauge = std::make_unique<Gauge>(); break;
    case Kind::kHistogram: s.histogram = std::make_unique<Histogram>(family.upper_bounds); break;
  }
  return s;
}

Counter& Registry::GetCounter(std::string_view name, std::string_view help, const MetricLabels& labels) {
  std::lock_guard lock(mutex_);
  return *SeriesFor(FamilyFor(name, help, Kind::kCounter, nullptr), labels).counter;
}

Gauge& Registry::GetGauge(std::string_view name, std::string_view help, const MetricLabels& labels) {
  std::lock_guard lock(mutex_);
  return *SeriesFor(FamilyFor(name, help, Kind::kGauge, nullptr), labels).gauge;
}

Histogram& Registry::GetHistogram(std::string_view name, std::string_view help, const std::vector<double>& upper_bounds,
                                  const MetricLabels& labels) {
  std::lock_guard lock(mutex_);
  return *SeriesFor(FamilyFor(name, help, Kind::kHistogram, &upper_bounds), labels).histogram;
}

std::string Registry::Render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  for (const auto& family : families_) {
    if (family->series.empty()) continue;
    const std::string& name = family->name;
    out += fmt::format("# HELP {} {}\n", name, Escape(family->help, /*escape_quote=*/false));
    out += fmt::format("# TYPE {} {}\n", name, KindName(family->kind));
    for (const Series& s : family->series) {
      switch (family->kind) {
        case Kind::kCounter:
          out += fmt::format("{}{} {}\n", name, LabelBlock(s.labels), FormatValue(s.counter->Value()));
          break;
        case Kind::kGauge:
          out += fmt::format("{}{} {}\n", name, LabelBlock(s.labels), FormatValue(s.gauge->Value()));
          break;
        case Kind::kHistogram: {
          const Histogram::Snapshot snapshot = s.histogram->Read();
          for (size_t i = 0; i < snapshot.upper_bounds.size(); ++i) {
            out += fmt::format("{}_bucket{} {}\n", name, LabelBlock(s.labels, FormatValue(snapshot.upper_bounds[i])),
                               snapshot.cumulative_counts[i]);
          }
          out += fmt::format("{}_bucket{} {}\n", name, LabelBlock(s.labels, "+Inf"), snapshot.count);
          out += fmt::format("{}_sum{} {}\n", name, LabelBlock(s.labels), FormatValue(snapshot.sum));
          out += fmt::format("{}_count{} {}\n", name, LabelBlock(s.labels), snapshot.count);
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace kvsparse::server
