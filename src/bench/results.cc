#include "kvsparse/bench_results.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
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

// Crash safety: rows are appended one line at a time, so a run killed at any moment (SIGKILL
// included) leaves complete rows plus at most one partial last line. Open drops that line, ends
// the file on a newline (a row written without one would otherwise fuse with the next append),
// and keeps the first of any repeated key; such repairs rewrite the file through a temporary
// file and a rename, so a second crash during the repair loses nothing either.
StatusOr<BenchResultStore> BenchResultStore::Open(const std::string& path) {
  BenchResultStore store;
  store.path_ = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) return store;  // a new file
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::string> lines;
  for (size_t start = 0; start < text.size();) {
    const size_t end = std::min(text.find('\n', start), text.size());
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  bool repaired = !text.empty() && text.back() != '\n';
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    nlohmann::json row = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object() || !row.contains("key") || !row["key"].is_string()) {
      if (i + 1 == lines.size()) {
        std::fprintf(stderr, "warning: %s:%zu: dropping an incomplete last line (an interrupted run); it will be redone\n",
                     path.c_str(), i + 1);
        repaired = true;
        continue;
      }
      return InvalidArgumentError(
          fmt::format("{}:{}: not a result row (expected a JSON object with a string \"key\")", path, i + 1));
    }
    if (!store.keys_.insert(row["key"].get<std::string>()).second) {
      std::fprintf(stderr, "warning: %s:%zu: configuration %s appears twice; keeping the first row\n", path.c_str(),
                   i + 1, row["key"].get<std::string>().c_str());
      repaired = true;
      continue;
    }
    store.rows_.push_back(std::move(row));
  }
  if (repaired) {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      for (const nlohmann::json& row : store.rows_) out << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      out.flush();
      if (!out) return InvalidArgumentError(fmt::format("cannot write {} to repair {}", tmp, path));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) return InvalidArgumentError(fmt::format("cannot rename {} to {}: {}", tmp, path, ec.message()));
  }
  return store;
}

Status BenchResultStore::Append(const nlohmann::json& row) {
  KVS_CHECK_MSG(row.contains("key") && row["key"].is_string(), "a result row needs a string key");
  std::ofstream out(path_, std::ios::app);
  out << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
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
    for (const auto& [key, row] : merged) out << row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    if (!out) return InvalidArgumentError(fmt::format("cannot write {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, out_path, ec);
  if (ec) return InvalidArgumentError(fmt::format("cannot rename {} to {}: {}", tmp, out_path, ec.message()));
  return Status::Ok();
}

}  // namespace kvsparse
