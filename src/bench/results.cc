#include "kvsparse/bench_results.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

namespace kvsparse {

StatusOr<BenchShard> ParseBenchShard(std::string_view text) {
  const size_t slash = text.find('/');
  auto bad = [&] {
    return InvalidArgumentError(fmt::format("--shard: expected i/N with 0 <= i < N (e.g. 0/4), found '{}'", text));
  };
  if (slash == std::string_view::npos) return bad();
  BenchShard shard;
  const std::string_view a = text.substr(0, slash), b = text.substr(slash + 1);
  if (std::from_chars(a.data(), a.data() + a.size(), shard.index).ptr != a.data() + a.size() || a.empty()) return bad();
  if (std::from_chars(b.data(), b.data() + b.size(), shard.count).ptr != b.data() + b.size() || b.empty()) return bad();
  if (shard.count < 1 || shard.index < 0 || shard.index >= shard.count) return bad();
  return shard;
}

StatusOr<BenchResultStore> BenchResultStore::Open(const std::string& path) {
  BenchResultStore store;
  store.path_ = path;
  std::ifstream in(path);
  if (!in) return store;  // a new file
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  bool dropped = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    nlohmann::json row = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object() || !row.contains("key") || !row["key"].is_string()) {
      if (i + 1 == lines.size()) {
        std::fprintf(stderr, "warning: %s:%zu: dropping an incomplete last line (an interrupted run); it will be redone\n",
                     path.c_str(), i + 1);
        dropped = true;
        continue;
      }
      return InvalidArgumentError(
          fmt::format("{}:{}: not a result row (expected a JSON object with a string \"key\")", path, i + 1));
    }
    store.keys_.insert(row["key"].get<std::string>());
    store.rows_.push_back(std::move(row));
  }
  if (dropped) {
    // Rewrite without the dropped line so appends start on a clean line.
    std::ofstream out(path, std::ios::trunc);
    for (const nlohmann::json& row : store.rows_) out << row.dump() << '\n';
    if (!out) return InvalidArgumentError(fmt::format("cannot rewrite results file {}", path));
  }
  return store;
}

Status BenchResultStore::Append(const nlohmann::json& row) {
  KVS_CHECK_MSG(row.contains("key") && row["key"].is_string(), "a result row needs a string key");
  std::ofstream out(path_, std::ios::app);
  out << row.dump() << '\n';
  out.flush();
  if (!out) return InvalidArgumentError(fmt::format("cannot append to results file {}", path_));
  keys_.insert(row["key"].get<std::string>());
  rows_.push_back(row);
  return Status::Ok();
}

StatusOr<std::vector<nlohmann::json>> ReadBenchResultsSorted(const std::string& path) {
  if (!std::filesystem::exists(path)) return NotFoundError(fmt::format("results file {} does not exist", path));
  KVS_ASSIGN_OR_RETURN(BenchResultStore store, BenchResultStore::Open(path));
  std::vector<nlohmann::json> rows = store.rows();
  std::sort(rows.begin(), rows.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a["key"].get<std::string>() < b["key"].get<std::string>();
  });
  return rows;
}

Status MergeBenchResults(const std::vector<std::string>& inputs, const std::string& out_path) {
  std::map<std::string, nlohmann::json> merged;
  for (const std::string& path : inputs) {
    KVS_ASSIGN_OR_RETURN(std::vector<nlohmann::json> rows, ReadBenchResultsSorted(path));
    for (nlohmann::json& row : rows) {
      const std::string key = row["key"].get<std::string>();
      auto [it, inserted] = merged.emplace(key, row);
      if (!inserted && it->second != row) {
        // Timings differ between machines; only the configuration must agree.
        std::fprintf(stderr, "warning: %s: configuration %s was run twice; keeping the first row\n", path.c_str(),
                     key.c_str());
      }
    }
  }
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& [key, row] : merged) out << row.dump() << '\n';
    if (!out) return InvalidArgumentError(fmt::format("cannot write {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, out_path, ec);
  if (ec) return InvalidArgumentError(fmt::format("cannot rename {} to {}: {}", tmp, out_path, ec.message()));
  return Status::Ok();
}

}  // namespace kvsparse
