// User tasks: JSONL records (context, question, answers, metric) and their encoding.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/tasks_internal.h"
#include "kvsparse/bench_tasks.h"

namespace kvsparse {

namespace {

using json = nlohmann::json;

constexpr std::string_view kFields[] = {"context", "question", "answers",         "answer", "metric", "task",
                                        "subtask", "id",       "max_new_tokens", "first_line_only", "meta"};

std::string Describe(const json& v) {
  if (v.is_array() && v.empty()) return "an empty array";
  if (v.is_string()) return "a string";
  if (v.is_number_integer()) return fmt::format("the integer {}", v.dump());
  if (v.is_number()) return fmt::format("the number {}", v.dump());
  if (v.is_boolean()) return fmt::format("the boolean {}", v.dump());
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

class LineError {
 public:
  LineError(std::string_view source, int32_t line) : source_(source), line_(line) {}
  Status operator()(std::string_view field, std::string_view what) const {
    return DataLossError(fmt::format("{}:{}: field '{}': {}", source_, line_, field, what));
  }
  Status Line(std::string_view what) const { return DataLossError(fmt::format("{}:{}: {}", source_, line_, what)); }

 private:
  std::string_view source_;
  int32_t line_;
};

StatusOr<UserTaskRecord> ParseRecord(std::string_view text, std::string_view source, int32_t line,
                                     std::string_view default_task) {
  const LineError err(source, line);
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    std::string detail = e.what();
    if (size_t at = detail.find("column "); at != std::string::npos)
      if (size_t colon = detail.find(": ", at); colon != std::string::npos) detail = detail.substr(colon + 2);
    return err.Line(fmt::format("malformed JSON at column {}: {}", e.byte, detail));
  } catch (const json::exception& e) {  // e.g. a number out of range ("1e999")
    return err.Line(fmt::format("malformed JSON: {}", e.what()));
  }
  if (!j.is_object()) return err.Line(fmt::format("expected a JSON object, found {}", Describe(j)));
  for (const auto& [key, value] : j.items()) {
    if (std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields)) {
      std::string known;
      for (std::string_view f : kFields) known += (known.empty() ? "" : ", ") + std::string(f);
      return err(key, fmt::format("unknown field (known: {}; put extra data under \"meta\")", known));
    }
  }
  UserTaskRecord r;
  r.line = line;
  auto get_string = [&](std::string_view field, std::string* out, bool required) -> Status {
    auto it = j.find(field);
    if (it == j.end()) return required ? err(field, "missing (a string is required)") : Status::Ok();
    if (!it->is_string()) return err(field, fmt::format("expected a string, found {}", Describe(*it)));
    *out = it->get<std::string>();
    return Status::Ok();
  };
  KVS_RETURN_IF_ERROR(get_string("context", &r.context, true));
  KVS_RETURN_IF_ERROR(get_string("question", &r.question, true));

  const bool has_answers = j.contains("answers");
  const bool has_answer = j.contains("answer");
  if (has_answers && has_answer) return err("answer", "give either \"answer\" or \"answers\", not both");
  if (!has_answers && !has_answer) {
    return err("answers", "missing (an array of reference strings, or \"answer\" with one string)");
  }
  if (has_answer) {
    std::string a;
    KVS_RETURN_IF_ERROR(get_string("answer", &a, true));
    r.answers.push_back(std::move(a));
  } else {
    const json& arr = j["answers"];
    if (!arr.is_array() || arr.empty()) {
      return err("answers", fmt::format("expected a non-empty array of strings, found {}", Describe(arr)));
    }
    for (size_t i = 0; i < arr.size(); ++i) {
      if (!arr[i].is_string()) {
        return err("answers", fmt::format("element {} is {}, expected a string", i, Describe(arr[i])));
      }
      r.answers.push_back(arr[i].get<std::string>());
    }
  }

  std::string metric = "contains";
  KVS_RETURN_IF_ERROR(get_string("metric", &metric, false));
  auto parsed = ParseAnswerMetric(metric);
  if (!parsed.ok()) return err("metric", parsed.status().message());
  r.metric = *parsed;
  r.first_line_only = r.metric == AnswerMetric::kExact;

  r.task = std::string(default_task);
  KVS_RETURN_IF_ERROR(get_string("task", &r.task, false));
  if (r.task.empty()) return err("task", "must not be empty");
  KVS_RETURN_IF_ERROR(get_string("subtask", &r.subtask, false));

  if (auto it = j.find("id"); it != j.end()) {
    if (it->is_string()) {
      r.id = it->get<std::string>();
    } else if (it->is_number_integer()) {
      r.id = it->dump();
    } else {
      return err("id", fmt::format("expected a string or an integer, found {}", Describe(*it)));
    }
  }
  if (auto it = j.find("max_new_tokens"); it != j.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > 4096) {
      return err("max_new_tokens", fmt::format("expected an integer in [1, 4096], found {}", Describe(*it)));
    }
    r.max_new_tokens = static_cast<int32_t>(it->get<int64_t>());
  }
  if (auto it = j.find("first_line_only"); it != j.end()) {
    if (!it->is_boolean()) return err("first_line_only", fmt::format("expected true or false, found {}", Describe(*it)));
    r.first_line_only = it->get<bool>();
  }
  return r;
}

}  // namespace

StatusOr<std::vector<UserTaskRecord>> ParseUserTasks(std::string_view jsonl, std::string_view source,
                                                     std::string_view default_task) {
  std::vector<UserTaskRecord> out;
  int32_t line_no = 0;
  size_t pos = 0;
  while (pos < jsonl.size()) {
    size_t end = jsonl.find('\n', pos);
    if (end == std::string_view::npos) end = jsonl.size();
    std::string_view line = jsonl.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    KVS_ASSIGN_OR_RETURN(UserTaskRecord r, ParseRecord(line, source, line_no, default_task));
    out.push_back(std::move(r));
  }
  if (out.empty()) return InvalidArgumentError(fmt::format("{}: no samples (expected one JSON object per line)", source));
  return out;
}

StatusOr<std::vector<UserTaskRecord>> LoadUserTasks(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(fmt::format("cannot read user task file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseUserTasks(ss.str(), path, std::filesystem::path(path).stem().string());
}

BenchSample BuildUserSample(const UserTaskRecord& record, const Tokenizer& tokenizer, const UserSampleOptions& options) {
  BenchSample s;
  s.task = record.task;
  s.subtask = record.subtask;
  s.id = record.id;
  s.context_text = record.context;
  s.context = tokenizer.Encode(record.context, /*add_bos=*/true);
  const int32_t max_ctx = options.max_context_tokens;
  if (max_ctx > 0 && static_cast<int32_t>(s.context.size()) > max_ctx) {
    // Middle truncation: the start (instructions) and the end (closest to the question) matter most.
    const int32_t head = max_ctx / 2;
    std::vector<int32_t> kept(s.context.begin(), s.context.begin() + head);
    kept.insert(kept.end(), s.context.end() - (max_ctx - head), s.context.end());
    s.context = std::move(kept);
    s.context_text = tokenizer.Decode(s.context);
  }
  s.target_length = static_cast<int32_t>(s.context.size());
  s.question_text = record.question;
  s.question = bench_internal::EncodeAfter(tokenizer, s.context_text, s.question_text);
  const std::string prompt_tail =
      s.context_text.substr(s.context_text.size() > 128 ? s.context_text.size() - 128 : 0) + s.question_text;
  const bool spaced = !record.question.empty() && std::isspace(static_cast<unsigned char>(record.question.back()));
  for (const std::string& a : record.answers) {
    s.answers.push_back(bench_internal::EncodeAfter(tokenizer, prompt_tail, spaced ? a : " " + a));
    s.answer_texts.push_back(a);
  }
  s.metric = record.metric;
  s.first_line_only = record.first_line_only;
  s.max_new_tokens = record.max_new_tokens;
  return s;
}

}  // namespace kvsparse
