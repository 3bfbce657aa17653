// Reports of `kvsparse bench` from its result rows: a Markdown summary (accuracy per task,
// protocol, method, budget and length; fidelity; latency and memory; the method ordering
// per budget) and PNG plots drawn by python3-matplotlib from the JSON lines.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvsparse/status.h"

namespace kvsparse {

std::string BenchReportMarkdown(const std::vector<nlohmann::json>& rows);

// Writes plot_bench.py into out_dir and runs it on results_path: accuracy vs KV memory with
// the Pareto frontier per task and protocol, latency vs context length per method, kept
// tokens per layer. Returns the PNG paths written. Unavailable (python3 or matplotlib
// missing) → FailedPrecondition with what to install; the Markdown report does not need it.
StatusOr<std::vector<std::string>> WriteBenchPlots(const std::string& results_path, const std::string& out_dir);

// Writes `script_text` to out_dir/script_name and runs it with Debian's python3 as
// `script INPUT OUT_DIR`; the script prints the paths of the files it wrote, one per line.
StatusOr<std::vector<std::string>> RunPlotScript(std::string_view script_text, const std::string& script_name,
                                                 const std::string& input_path, const std::string& out_dir);

}  // namespace kvsparse
