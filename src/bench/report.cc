#include "kvsparse/bench_report.h"

#include <fmt/format.h>
#include <sys/wait.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace kvsparse {
namespace {

using Json = nlohmann::json;

std::string Str(const Json& row, const char* key) {
  auto it = row.find(key);
  return it != row.end() && it->is_string() ? it->get<std::string>() : std::string();
}
double Num(const Json& row, const char* key, double fallback = 0) {
  auto it = row.find(key);
  return it != row.end() && it->is_number() ? it->get<double>() : fallback;
}
double Nested(const Json& row, const char* key, const char* field) {
  auto it = row.find(key);
  if (it == row.end() || !it->is_object()) return 0;
  auto f = it->find(field);
  return f != it->end() && f->is_number() ? f->get<double>() : 0;
}
// Budgets sort numerically (fractions before token counts), "" (full) first.
bool BudgetLess(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a.empty() && !b.empty();
  double x = 0, y = 0;
  const bool x_ok = std::from_chars(a.data(), a.data() + a.size(), x).ec == std::errc();
  const bool y_ok = std::from_chars(b.data(), b.data() + b.size(), y).ec == std::errc();
  return x_ok && y_ok ? x < y : a < b;  // a hand-edited row may hold anything
}
// The decode eviction interval a row ran with; "—" for full (it never evicts) and for rows
// written before the interval was recorded.
std::string IntervalText(const Json& row) {
  const double interval = Num(row, "evict_interval");
  return Str(row, "method") == "full" || interval <= 0 ? "—" : fmt::format("{}", static_cast<int>(interval));
}
// "lo–hi" of a row's [low, high] accuracy interval, "?" when the row has none.
std::string CiText(const Json& row) {
  auto it = row.find("accuracy_ci");
  if (it == row.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_number() || !(*it)[1].is_number()) {
    return "?";
  }
  return fmt::format("{:.0f}–{:.0f}", 100 * (*it)[0].get<double>(), 100 * (*it)[1].get<double>());
}

// Rows grouped by a key, keeping first-seen order of methods. A method run at two eviction
// intervals (two runs into one results file) gets two table rows.
struct Table {
  std::vector<int> lengths;
  std::vector<std::tuple<std::string, std::string, std::string, std::string>> methods;  // (method, budget, kv, evict)
  std::map<std::tuple<std::string, std::string, std::string, std::string, int>, const Json*> cells;
};

void AddToTable(Table& t, const Json& row) {
  const int length = static_cast<int>(Num(row, "length"));
  if (std::find(t.lengths.begin(), t.lengths.end(), length) == t.lengths.end()) t.lengths.push_back(length);
  auto m = std::make_tuple(Str(row, "method"), Str(row, "budget"), Str(row, "kv_type"), IntervalText(row));
  if (std::find(t.methods.begin(), t.methods.end(), m) == t.methods.end()) t.methods.push_back(m);
  t.cells[std::tuple_cat(m, std::make_tuple(length))] = &row;
}

void SortTable(Table& t) {
  std::sort(t.lengths.begin(), t.lengths.end());
  std::stable_sort(t.methods.begin(), t.methods.end(), [](const auto& a, const auto& b) {
    if (std::get<1>(a) != std::get<1>(b)) return BudgetLess(std::get<1>(a), std::get<1>(b));
    return false;
  });
}

std::string AccuracyTables(const std::vector<Json>& rows) {
  // (model, task, protocol) -> table
  std::map<std::tuple<std::string, std::string, std::string>, Table> tables;
  for (const Json& row : rows) {
    if (!row.contains("accuracy")) continue;
    AddToTable(tables[{Str(row, "model"), Str(row, "task"), Str(row, "protocol")}], row);
  }
  std::string out;
  for (auto& [key, t] : tables) {
    SortTable(t);
    const auto& [model, task, protocol] = key;
    out += fmt::format("\n### {} — {} ({})\n\nAccuracy % [95% CI] (n samples); evict = decode eviction interval in tokens; KV = allocated bytes / dense f16 at the longest length.\n\n",
                       task, protocol, model);
    out += "| method | budget | kv | evict |";
    for (int l : t.lengths) out += fmt::format(" {} tok |", l);
    out += " KV % |\n|---|---|---|---:|";
    for (size_t i = 0; i < t.lengths.size(); ++i) out += "---:|";
    out += "---:|\n";
    for (const auto& m : t.methods) {
      const Json* last = nullptr;
      out += fmt::format("| {} | {} | {} | {} |", std::get<0>(m), std::get<1>(m).empty() ? "—" : std::get<1>(m),
                         std::get<2>(m), std::get<3>(m));
      for (int l : t.lengths) {
        auto it = t.cells.find(std::tuple_cat(m, std::make_tuple(l)));
        if (it == t.cells.end()) {
          out += " |";
          continue;
        }
        const Json& r = *it->second;
        last = &r;
        out += fmt::format(" {:.0f} [{}] ({}) |", 100 * Num(r, "accuracy"), CiText(r),
                           static_cast<int>(Num(r, "samples")));
      }
      out += last ? fmt::format(" {:.1f} |\n", 100 * Num(*last, "kv_ratio")) : " |\n";
    }
  }
  return out;
}

// Methods ordered by mean accuracy over lengths, per (model, task, protocol, budget).
std::string OrderingSection(const std::vector<Json>& rows) {
  std::map<std::tuple<std::string, std::string, std::string, std::string>, std::map<std::string, std::vector<double>>> acc;
  std::map<std::tuple<std::string, std::string, std::string>, std::vector<double>> full;
  for (const Json& row : rows) {
    if (!row.contains("accuracy")) continue;
    const std::string budget = Str(row, "budget");
    const std::string method = Str(row, "method") + (Str(row, "kv_type").empty() ? "" : "/" + Str(row, "kv_type"));
    if (budget.empty()) {
      full[{Str(row, "model"), Str(row, "task"), Str(row, "protocol")}].push_back(Num(row, "accuracy"));
      continue;
    }
    acc[{Str(row, "model"), Str(row, "task"), Str(row, "protocol"), budget}][method].push_back(Num(row, "accuracy"));
  }
  if (acc.empty()) return "";
  std::string out = "\n## Method ordering by accuracy (mean over lengths)\n\n| model | task | protocol | budget | full | ordering |\n|---|---|---|---|---:|---|\n";
  for (const auto& [key, methods] : acc) {
    const auto& [model, task, protocol, budget] = key;
    std::vector<std::pair<double, std::string>> order;
    for (const auto& [m, v] : methods) {
      double s = 0;
      for (double x : v) s += x;
      order.push_back({s / v.size(), m});
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::string line;
    for (size_t i = 0; i < order.size(); ++i) {
      line += fmt::format("{}{} {:.0f}", i ? " > " : "", order[i].second, 100 * order[i].first);
    }
    std::string full_acc;
    if (auto it = full.find({model, task, protocol}); it != full.end()) {
      double s = 0;
      for (double x : it->second) s += x;
      full_acc = fmt::format("{:.0f}", 100 * s / it->second.size());
    }
    out += fmt::format("| {} | {} | {} | {} | {} | {} |\n", model, task, protocol, budget, full_acc, line);
  }
  return out;
}

std::string FidelityTable(const std::vector<Json>& rows) {
  std::string out;
  for (const Json& row : rows) {
    if (Str(row, "task") != "fidelity") continue;
    if (out.empty()) {
      out = "\n### fidelity (label-free, against the full cache)\n\nstream: the teacher-forced tokens (sampled from the model with the full cache, or the user's file); evict = decode eviction interval in tokens.\n\n| model | stream | method | budget | kv | evict | length | KL nats | top-1 agreement | perplexity change | KV % |\n|---|---|---|---|---|---:|---:|---:|---:|---:|---:|\n";
    }
    // Rows written before streams were recorded measured the multi-key haystacks.
    const std::string stream = Str(row, "stream").empty() ? "haystack" : Str(row, "stream");
    out += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {:.4f} | {:.1f}% | {:+.2f}% | {:.1f} |\n", Str(row, "model"),
                       stream, Str(row, "method"), Str(row, "budget").empty() ? "—" : Str(row, "budget"),
                       Str(row, "kv_type"), IntervalText(row), static_cast<int>(Num(row, "length")), Num(row, "kl"),
                       100 * Num(row, "top1_agreement"), 100 * Num(row, "ppl_change"), 100 * Num(row, "kv_ratio"));
  }
  return out;
}

std::string LatencyTable(const std::vector<Json>& all_rows) {
  // Latency rows by model, method, budget, kv type, then length (numerically).
  std::vector<const Json*> rows;
  for (const Json& row : all_rows) {
    if (Str(row, "task") == "latency") rows.push_back(&row);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Json* a, const Json* b) {
    auto key = [](const Json* r) {
      return std::make_tuple(Str(*r, "model"), Str(*r, "method"), Str(*r, "budget"), Str(*r, "kv_type"),
                             Num(*r, "length"));
    };
    return key(a) < key(b);
  });
  std::string out;
  for (const Json* row_ptr : rows) {
    const Json& row = *row_ptr;
    if (out.empty()) {
      out = "\n### latency and memory\n\n| model | method | budget | kv | evict | length | TTFT ms | decode ms p50 | p90 | tokens/s | KV MiB | % of dense f16 | peak KV MiB | policy state MiB | peak RSS MiB | policy share |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    }
    out += fmt::format("| {} | {} | {} | {} | {} | {} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.1f} | {:.2f} | {:.2f} | {:.0f} | {:.1f}% |\n",
                       Str(row, "model"), Str(row, "method"), Str(row, "budget").empty() ? "—" : Str(row, "budget"),
                       Str(row, "kv_type"), IntervalText(row), static_cast<int>(Num(row, "length")),
                       Nested(row, "ttft_ms", "median"),
                       Nested(row, "decode_ms", "median"), Nested(row, "decode_ms", "p90"),
                       Num(row, "decode_tokens_per_s"), Num(row, "kv_allocated_bytes") / 1048576.0,
                       100 * Num(row, "kv_ratio"), Num(row, "kv_peak_allocated_bytes") / 1048576.0,
                       Num(row, "policy_state_bytes") / 1048576.0, Num(row, "peak_rss_bytes") / 1048576.0,
                       100 * Num(row, "policy_share"));
  }
  return out;
}

// The plotting script, written next to the results so a user can rerun or edit it.
constexpr const char* kPlotScript = R"PY(#!/usr/bin/env python3
# Plots of a kvsparse bench results file (JSON lines). Usage: plot_bench.py results.jsonl OUT_DIR
import json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = sys.argv[2]
written = []

def label(r):
    return r["method"] + (" " + r["budget"] if r["budget"] else "") + (" " + r["kv_type"] if r["kv_type"] else "")

# Accuracy vs KV memory, one figure per (model, task, protocol); the Pareto frontier is the
# upper-left envelope: no other point has less memory and more accuracy.
groups = {}
for r in rows:
    if "accuracy" in r:
        groups.setdefault((r["model"], r["task"], r["protocol"]), []).append(r)
for (model, task, protocol), rs in sorted(groups.items()):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    methods = sorted({r["method"] for r in rs})
    for m in methods:
        pts = [(100 * r["kv_ratio"], 100 * r["accuracy"]) for r in rs if r["method"] == m]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=m, s=28)
    pts = sorted((100 * r["kv_ratio"], 100 * r["accuracy"]) for r in rs)
    frontier, best = [], -1.0
    for x, y in pts:
        if y > best:
            frontier.append((x, y))
            best = y
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "k--", lw=1, drawstyle="steps-post",
            label="Pareto frontier")
    ax.set_xlabel("KV memory, % of dense f16")
    ax.set_ylabel("accuracy %")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{task} ({protocol}), {model}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    name = re.sub(r"[^\w.-]", "_", f"{task}_{protocol}" + (f"_{model}" if len({r["model"] for r in rows if "accuracy" in r}) > 1 else ""))
    path = os.path.join(out, f"accuracy_vs_kv_{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

# Latency vs context length per method configuration.
lat = [r for r in rows if r["task"] == "latency" and r.get("decode_ms")]
if lat:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for lab in sorted({label(r) for r in lat}):
        rs = sorted((r for r in lat if label(r) == lab), key=lambda r: r["length"])
        a1.plot([r["length"] for r in rs], [r["decode_ms"]["median"] for r in rs], marker="o", label=lab)
        a2.plot([r["length"] for r in rs], [r["ttft_ms"]["median"] for r in rs], marker="o", label=lab)
    a1.set_xlabel("context tokens"); a1.set_ylabel("decode ms / token (median)"); a1.set_xscale("log", base=2)
    a2.set_xlabel("context tokens"); a2.set_ylabel("time to first token, ms"); a2.set_xscale("log", base=2)
    a1.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "latency_vs_length.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

# Kept tokens per layer (after the prompt), longest length, first question task or latency rows.
per_layer = [r for r in rows if r.get("layer_live_tokens")]
if per_layer:
    longest = max(r["length"] for r in per_layer)
    task = next((r["task"] for r in per_layer if "accuracy" in r), per_layer[0]["task"])
    rs = [r for r in per_layer if r["length"] == longest and r["task"] == task and r["protocol"] in ("question_last", "-")]
    if rs:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for r in rs:
            ax.plot(range(len(r["layer_live_tokens"])), r["layer_live_tokens"], marker=".", label=label(r))
        ax.set_xlabel("layer"); ax.set_ylabel("live tokens after the prompt")
        ax.set_title(f"kept tokens per layer: {task}, {longest} tokens", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = os.path.join(out, "layer_kept_tokens.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

for p in written:
    print(p)
)PY";

}  // namespace

std::string BenchReportMarkdown(const std::vector<Json>& rows) {
  std::string out = "# kvsparse bench report\n";
  std::set<std::string> models;
  for (const Json& row : rows) models.insert(Str(row, "model"));
  for (const std::string& m : models) out += fmt::format("\nmodel: {}", m);
  out += fmt::format("\n\n{} configurations.\n", rows.size());
  out += OrderingSection(rows);
  const std::string acc = AccuracyTables(rows);
  if (!acc.empty()) out += "\n## Accuracy\n" + acc;
  out += FidelityTable(rows);
  out += LatencyTable(rows);
  return out;
}

StatusOr<std::vector<std::string>> RunPlotScript(std::string_view script_text, const std::string& script_name,
                                                 const std::string& input_path, const std::string& out_dir) {
  const std::string script = (std::filesystem::path(out_dir) / script_name).string();
  {
    std::ofstream f(script, std::ios::trunc);
    f << script_text;
    if (!f) return InvalidArgumentError(fmt::format("cannot write {}", script));
  }
  // Debian's interpreter first: a python3 earlier on PATH (pyenv, venv) may lack matplotlib.
  std::string python;
  for (const char* candidate : {"/usr/bin/python3", "python3"}) {
    if (std::system(fmt::format("{} -c 'import matplotlib' >/dev/null 2>&1", candidate).c_str()) == 0) {
      python = candidate;
      break;
    }
  }
  if (python.empty()) {
    return UnimplementedError(
        "plots need python3 with matplotlib (Debian: apt-get install python3-matplotlib); the Markdown report is complete without them");
  }
  const std::string list = (std::filesystem::path(out_dir) / "plots.txt").string();
  const std::string cmd = fmt::format("{} '{}' '{}' '{}' > '{}'", python, script, input_path, out_dir, list);
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    return InternalError(fmt::format("plot script failed (exit {}): run `{}` to see why", WEXITSTATUS(rc), cmd));
  }
  std::vector<std::string> paths;
  std::ifstream in(list);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) paths.push_back(line);
  }
  return paths;
}

StatusOr<std::vector<std::string>> WriteBenchPlots(const std::string& results_path, const std::string& out_dir) {
  return RunPlotScript(kPlotScript, "plot_bench.py", results_path, out_dir);
}

}  // namespace kvsparse
