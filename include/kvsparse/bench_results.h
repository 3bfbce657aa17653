// Result rows of `kvsparse bench`: one JSON object per line (JSONL), one line per
// configuration, keyed by the configuration so an interrupted sweep resumes where it
// stopped and shards of a sweep merge back into one file.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvsparse/status.h"

namespace kvsparse {

// "i/N": this process runs the configurations whose index % N == i (0 <= i < N).
struct BenchShard {
  int index = 0;
  int count = 1;
  bool Owns(size_t config_index) const { return static_cast<int>(config_index % count) == index; }
};
StatusOr<BenchShard> ParseBenchShard(std::string_view text);

// The rows of a results file, appended to as configurations finish.
class BenchResultStore {
 public:
  // Reads `path` if it exists. A truncated last line (the process died mid-write) is dropped
  // with a warning on stderr; any other malformed line is an error naming path:line.
  static StatusOr<BenchResultStore> Open(const std::string& path);

  bool Has(const std::string& key) const { return keys_.count(key) != 0; }
  const std::vector<nlohmann::json>& rows() const { return rows_; }
  // Appends one row (it must carry a string "key") and flushes it to disk at once.
  Status Append(const nlohmann::json& row);

 private:
  std::string path_;
  std::vector<nlohmann::json> rows_;
  std::set<std::string> keys_;
};

// Reads every results file (e.g. one per shard) and writes their union to `out_path`; a key
// present in several files keeps its first row (a warning names it).
// Rows are written in key order so a merge of shards equals an unsharded run's sorted rows.
Status MergeBenchResults(const std::vector<std::string>& inputs, const std::string& out_path);

// Rows of a file sorted by key (for comparing runs).
StatusOr<std::vector<nlohmann::json>> ReadBenchResultsSorted(const std::string& path);

}  // namespace kvsparse
