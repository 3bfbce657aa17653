// Task names, option checks, token-level generators and scoring (text generators are in
// tasks_text.cc, the JSONL reader in tasks_user.cc).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "bench/tasks_internal.h"
#include "kvsparse/bench_metrics.h"
#include "kvsparse/bench_tasks.h"

namespace kvsparse {

using bench_internal::StreamSeed;
using bench_internal::TaskRng;

std::string_view BenchProtocolName(BenchProtocol p) {
  return p == BenchProtocol::kQuestionLast ? "question_last" : "question_after";
}

StatusOr<BenchProtocol> ParseBenchProtocol(std::string_view name) {
  if (name == "question_last") return BenchProtocol::kQuestionLast;
  if (name == "question_after") return BenchProtocol::kQuestionAfter;
  return InvalidArgumentError(fmt::format("unknown protocol '{}': expected question_last or question_after", name));
}

std::string_view AnswerMetricName(AnswerMetric m) {
  switch (m) {
    case AnswerMetric::kExact: return "exact";
    case AnswerMetric::kContains: return "contains";
    case AnswerMetric::kContainsAll: return "contains_all";
    case AnswerMetric::kF1: return "f1";
  }
  return "?";
}

StatusOr<AnswerMetric> ParseAnswerMetric(std::string_view name) {
  for (AnswerMetric m : {AnswerMetric::kExact, AnswerMetric::kContains, AnswerMetric::kContainsAll, AnswerMetric::kF1}) {
    if (AnswerMetricName(m) == name) return m;
  }
  return InvalidArgumentError(fmt::format("unknown metric '{}': expected exact, contains, contains_all or f1", name));
}

std::string_view BenchTaskName(BenchTask t) {
  switch (t) {
    case BenchTask::kNiahSingle: return "niah_single";
    case BenchTask::kNiahMultiKey: return "niah_multikey";
    case BenchTask::kNiahMultiQuery: return "niah_multiquery";
    case BenchTask::kKvRetrieval: return "kv_retrieval";
    case BenchTask::kVariableTracking: return "variable_tracking";
    case BenchTask::kFreqWords: return "freq_words";
    case BenchTask::kCopy: return "copy";
  }
  return "?";
}

std::vector<BenchTask> AllBenchTasks() {
  return {BenchTask::kNiahSingle,   BenchTask::kNiahMultiKey,      BenchTask::kNiahMultiQuery,
          BenchTask::kKvRetrieval, BenchTask::kVariableTracking, BenchTask::kFreqWords,
          BenchTask::kCopy};
}

StatusOr<BenchTask> ParseBenchTask(std::string_view name) {
  std::string known;
  for (BenchTask t : AllBenchTasks()) {
    if (BenchTaskName(t) == name) return t;
    known += known.empty() ? "" : ", ";
    known += BenchTaskName(t);
  }
  return InvalidArgumentError(fmt::format("unknown task '{}': expected one of {}", name, known));
}

bool HasTokenLevelForm(BenchTask t) {
  return t == BenchTask::kNiahSingle || t == BenchTask::kNiahMultiKey || t == BenchTask::kNiahMultiQuery ||
         t == BenchTask::kKvRetrieval || t == BenchTask::kCopy;
}

std::string BenchSubtask(BenchTask task, const BenchTaskOptions& o) {
  switch (task) {
    case BenchTask::kNiahSingle:
    case BenchTask::kKvRetrieval: return fmt::format("depth={:g}", o.depth);
    case BenchTask::kNiahMultiKey:
    case BenchTask::kNiahMultiQuery: return fmt::format("keys={},depth={:g}", o.n_keys, o.depth);
    case BenchTask::kVariableTracking: return fmt::format("hops={},chains={}", o.n_hops, o.n_chains);
    case BenchTask::kFreqWords: return fmt::format("top={}", o.top_k);
    case BenchTask::kCopy: return fmt::format("span={},depth={:g}", o.span_length, o.depth);
  }
  return "";
}

namespace bench_internal {

// Option checks shared by the text and token generators.
Status ValidateTaskOptions(BenchTask task, int32_t target_length, const BenchTaskOptions& o) {
  const std::string_view name = BenchTaskName(task);
  if (target_length <= 0) {
    return InvalidArgumentError(fmt::format("task {}: target length {} must be positive", name, target_length));
  }
  if (!(o.depth >= 0.0 && o.depth <= 1.0)) {
    return InvalidArgumentError(fmt::format("task {}: depth {} must be a fraction in [0, 1]", name, o.depth));
  }
  if (o.value_tokens < 1) {
    return InvalidArgumentError(fmt::format("task {}: value_tokens {} must be >= 1", name, o.value_tokens));
  }
  if ((task == BenchTask::kNiahMultiKey || task == BenchTask::kNiahMultiQuery) && o.n_keys < 2) {
    return InvalidArgumentError(fmt::format("task {}: n_keys {} must be >= 2", name, o.n_keys));
  }
  if (task == BenchTask::kVariableTracking && (o.n_hops < 1 || o.n_chains < 1)) {
    return InvalidArgumentError(
        fmt::format("task {}: n_hops {} and n_chains {} must both be >= 1", name, o.n_hops, o.n_chains));
  }
  if (task == BenchTask::kFreqWords && (o.top_k < 1 || o.top_k > 20)) {
    return InvalidArgumentError(fmt::format("task {}: top_k {} must be in [1, 20]", name, o.top_k));
  }
  if (task == BenchTask::kCopy && (o.span_length < 2 || o.copy_prompt < 1 || o.copy_prompt >= o.span_length)) {
    return InvalidArgumentError(fmt::format(
        "task {}: span_length {} must be >= 2 and copy_prompt {} in [1, span_length)", name, o.span_length,
        o.copy_prompt));
  }
  return Status::Ok();
}

}  // namespace bench_internal

Status ValidateTokenVocab(const TokenVocab& vocab, int32_t n_vocab) {
  std::unordered_set<int32_t> seen;
  const std::pair<const char*, const std::vector<int32_t>*> classes[] = {
      {"filler", &vocab.filler}, {"keys", &vocab.keys}, {"values", &vocab.values}};
  for (const auto& [name, ids] : classes) {
    if (ids->empty()) return InvalidArgumentError(fmt::format("token vocab: class '{}' is empty", name));
    for (int32_t id : *ids) {
      if (id < 0 || (n_vocab > 0 && id >= n_vocab)) {
        return InvalidArgumentError(
            fmt::format("token vocab: class '{}' has id {} outside [0, {})", name, id, n_vocab > 0 ? n_vocab : INT32_MAX));
      }
      if (!seen.insert(id).second) {
        return InvalidArgumentError(
            fmt::format("token vocab: id {} appears twice (found again in class '{}'); filler, keys and values "
                        "must be distinct ids",
                        id, name));
      }
    }
  }
  return Status::Ok();
}

namespace {

// Draws `n` distinct elements of `pool` (n <= pool.size()) in random order.
std::vector<int32_t> DrawDistinct(const std::vector<int32_t>& pool, size_t n, TaskRng& rng) {
  std::vector<int32_t> p = pool;
  rng.Shuffle(p);
  p.resize(n);
  return p;
}

// Values for `n` pairs: distinct while the pool allows, then with replacement (a repeated
// value never makes the answer ambiguous: the key decides).
std::vector<int32_t> DrawValues(const std::vector<int32_t>& pool, size_t n, TaskRng& rng) {
  if (n <= pool.size()) return DrawDistinct(pool, n, rng);
  std::vector<int32_t> v;
  for (size_t i = 0; i < n; ++i) v.push_back(pool[rng.Below(pool.size())]);
  return v;
}

int32_t SlotAt(double depth, int32_t n_filler) {
  return static_cast<int32_t>(std::lround(depth * static_cast<double>(n_filler)));
}

}  // namespace

StatusOr<BenchSample> GenerateTokenSample(BenchTask task, const TokenVocab& vocab, int32_t target_length,
                                          uint64_t seed, const BenchTaskOptions& o) {
  const std::string_view name = BenchTaskName(task);
  if (!HasTokenLevelForm(task)) {
    return UnimplementedError(fmt::format(
        "task {} has no token-level form (it needs a tokenizer): token-level tasks are niah_single, "
        "niah_multikey, niah_multiquery, kv_retrieval and copy",
        name));
  }
  KVS_RETURN_IF_ERROR(bench_internal::ValidateTaskOptions(task, target_length, o));
  KVS_RETURN_IF_ERROR(ValidateTokenVocab(vocab));
  TaskRng rng(StreamSeed(seed, name, 0));
  const int32_t n_bos = o.bos_token >= 0 ? 1 : 0;

  BenchSample s;
  s.task = std::string(name);
  s.seed = seed;
  s.target_length = target_length;
  s.metric = AnswerMetric::kExact;

  // Special runs inserted into the filler: (slot, tokens); slot = number of filler tokens before.
  struct Run {
    int32_t slot;
    std::vector<int32_t> tokens;
    bool evidence;
  };
  std::vector<Run> runs;
  int32_t special = 0;

  switch (task) {
    case BenchTask::kNiahSingle:
    case BenchTask::kNiahMultiKey:
    case BenchTask::kNiahMultiQuery: {
      const int32_t n_pairs = task == BenchTask::kNiahSingle ? 1 : o.n_keys;
      if (static_cast<size_t>(n_pairs) > vocab.keys.size()) {
        return InvalidArgumentError(fmt::format("task {}: n_keys {} needs {} distinct keys, the vocab has {}", name,
                                                n_pairs, n_pairs, vocab.keys.size()));
      }
      const int32_t width = o.value_tokens;
      if (width > 1 && static_cast<size_t>(n_pairs * width) > vocab.values.size()) {
        return InvalidArgumentError(fmt::format("task {}: {} needles of {} value tokens need {} distinct values, the vocab has {}",
                                                name, n_pairs, width, n_pairs * width, vocab.values.size()));
      }
      special = (1 + width) * n_pairs;
      if (target_length < n_bos + special) break;
      const std::vector<int32_t> keys = DrawDistinct(vocab.keys, n_pairs, rng);
      const std::vector<int32_t> values = DrawValues(vocab.values, static_cast<size_t>(n_pairs) * width, rng);
      const int32_t n_filler = target_length - n_bos - special;
      for (int32_t i = 0; i < n_pairs; ++i) {
        const int32_t slot = i == 0 ? SlotAt(o.depth, n_filler) : static_cast<int32_t>(rng.Below(n_filler + 1));
        std::vector<int32_t> run = {keys[i]};
        run.insert(run.end(), values.begin() + i * width, values.begin() + (i + 1) * width);
        runs.push_back({slot, run, i == 0});
      }
      s.question = {keys[0]};
      if (task == BenchTask::kNiahMultiQuery) {
        // Every key asked, the scored one last (the model answers the key it reads last).
        std::vector<int32_t> others(keys.begin() + 1, keys.end());
        rng.Shuffle(others);
        others.push_back(keys[0]);
        s.question = std::move(others);
      }
      s.answers = {std::vector<int32_t>(values.begin(), values.begin() + width)};
      s.subtask = BenchSubtask(task, o);
      break;
    }
    case BenchTask::kKvRetrieval: {
      const int32_t width = o.value_tokens;
      // Multi-token values must stay distinct, which caps the pairs at values / width.
      const int32_t max_pairs = width > 1 ? static_cast<int32_t>(vocab.values.size()) / width
                                          : static_cast<int32_t>(vocab.keys.size());
      const int32_t n_pairs = std::min({static_cast<int32_t>(vocab.keys.size()), max_pairs,
                                        std::max(1, (target_length - n_bos) / (1 + width))});
      if (n_pairs < 1) {
        return InvalidArgumentError(fmt::format("task {}: values of {} tokens need at least {} distinct values, the vocab has {}",
                                                name, width, width, vocab.values.size()));
      }
      const int32_t pair_len = 1 + width;
      special = pair_len * n_pairs;
      if (target_length < n_bos + special) break;
      const std::vector<int32_t> keys = DrawDistinct(vocab.keys, n_pairs, rng);
      const std::vector<int32_t> values = DrawValues(vocab.values, static_cast<size_t>(n_pairs) * width, rng);
      const int32_t n_filler = target_length - n_bos - special;
      const int32_t asked = static_cast<int32_t>(std::lround(o.depth * (n_pairs - 1)));
      std::vector<int32_t> block;
      for (int32_t i = 0; i < n_pairs; ++i) {
        block.push_back(keys[i]);
        block.insert(block.end(), values.begin() + i * width, values.begin() + (i + 1) * width);
      }
      const int32_t slot = SlotAt(o.depth, n_filler);
      // Only the asked pair is evidence; the block is split around it.
      runs.push_back({slot, std::vector<int32_t>(block.begin(), block.begin() + pair_len * asked), false});
      runs.push_back({slot, std::vector<int32_t>(block.begin() + pair_len * asked, block.begin() + pair_len * (asked + 1)), true});
      runs.push_back({slot, std::vector<int32_t>(block.begin() + pair_len * (asked + 1), block.end()), false});
      s.question = {keys[asked]};
      s.answers = {std::vector<int32_t>(values.begin() + asked * width, values.begin() + (asked + 1) * width)};
      s.subtask = BenchSubtask(task, o);
      break;
    }
    case BenchTask::kCopy: {
      const int32_t span = std::min<int32_t>(o.span_length, static_cast<int32_t>(vocab.values.size()));
      if (span <= o.copy_prompt) {
        return InvalidArgumentError(fmt::format(
            "task {}: the span needs more than copy_prompt = {} distinct value tokens, the vocab has {}", name,
            o.copy_prompt, vocab.values.size()));
      }
      special = span;
      if (target_length < n_bos + special) break;
      const std::vector<int32_t> tokens = DrawDistinct(vocab.values, span, rng);
      const int32_t n_filler = target_length - n_bos - special;
      runs.push_back({SlotAt(o.depth, n_filler), tokens, true});
      s.question.assign(tokens.begin(), tokens.begin() + o.copy_prompt);
      s.answers = {std::vector<int32_t>(tokens.begin() + o.copy_prompt, tokens.end())};
      BenchTaskOptions actual = o;
      actual.span_length = span;  // clamped to the distinct values available
      s.subtask = BenchSubtask(task, actual);
      break;
    }
    default: break;
  }
  if (target_length < n_bos + special) {
    return InvalidArgumentError(fmt::format("task {}: target length {} is below the minimum {} tokens", name,
                                            target_length, n_bos + special));
  }

  // Filler, then the runs spliced in at their slots (stable: equal slots keep their order).
  const int32_t n_filler = target_length - n_bos - special;
  std::stable_sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.slot < b.slot; });
  if (n_bos) s.context.push_back(o.bos_token);
  int32_t filled = 0;
  size_t next_run = 0;
  for (;;) {
    while (next_run < runs.size() && runs[next_run].slot == filled) {
      const Run& r = runs[next_run++];
      if (r.evidence) {
        const auto begin = static_cast<int32_t>(s.context.size());
        s.evidence.push_back({begin, begin + static_cast<int32_t>(r.tokens.size())});
      }
      s.context.insert(s.context.end(), r.tokens.begin(), r.tokens.end());
    }
    if (filled == n_filler) break;
    s.context.push_back(vocab.filler[rng.Below(vocab.filler.size())]);
    ++filled;
  }
  KVS_CHECK(static_cast<int32_t>(s.context.size()) == target_length);
  s.max_new_tokens = static_cast<int32_t>(s.answers[0].size());
  return s;
}

// ---------------------------------------------------------------------------------------
// Scoring.

namespace {

std::string_view FirstNonEmptyLine(std::string_view text) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) return line;
    start = end + 1;
  }
  return {};
}

}  // namespace

double ScoreGenerationText(const BenchSample& sample, std::string_view generated_text) {
  KVS_CHECK_MSG(!sample.answer_texts.empty(), "text scoring needs answer texts");
  const std::string_view gen = sample.first_line_only ? FirstNonEmptyLine(generated_text) : generated_text;
  double best = 0;
  double sum = 0;
  for (const std::string& ans : sample.answer_texts) {
    double v = 0;
    switch (sample.metric) {
      case AnswerMetric::kExact: v = ExactMatchText(gen, ans) ? 1 : 0; break;
      case AnswerMetric::kContains:
      case AnswerMetric::kContainsAll: v = ContainsText(gen, ans) ? 1 : 0; break;
      case AnswerMetric::kF1: v = TokenF1Text(gen, ans); break;
    }
    best = std::max(best, v);
    sum += v;
  }
  if (sample.metric == AnswerMetric::kContainsAll) return sum / static_cast<double>(sample.answer_texts.size());
  return best;
}

double ScoreGenerationIds(const BenchSample& sample, std::span<const int32_t> generated) {
  KVS_CHECK_MSG(!sample.answers.empty(), "token scoring needs answers");
  double best = 0;
  double sum = 0;
  for (const std::vector<int32_t>& ans : sample.answers) {
    double v = 0;
    switch (sample.metric) {
      case AnswerMetric::kExact: v = ExactMatchIds(generated, ans) ? 1 : 0; break;
      case AnswerMetric::kContains:
      case AnswerMetric::kContainsAll: v = ContainsIds(generated, ans) ? 1 : 0; break;
      case AnswerMetric::kF1: v = TokenF1Ids(generated, ans); break;
    }
    best = std::max(best, v);
    sum += v;
  }
  if (sample.metric == AnswerMetric::kContainsAll) return sum / static_cast<double>(sample.answers.size());
  return best;
}

double ScoreGeneration(const BenchSample& sample, std::span<const int32_t> generated, const Tokenizer* tokenizer) {
  if (tokenizer != nullptr && !sample.answer_texts.empty()) {
    return ScoreGenerationText(sample, tokenizer->Decode(std::vector<int32_t>(generated.begin(), generated.end())));
  }
  return ScoreGenerationIds(sample, generated);
}

std::vector<int32_t> PromptTokens(const BenchSample& sample, BenchProtocol protocol) {
  std::vector<int32_t> out = sample.context;
  if (protocol == BenchProtocol::kQuestionLast) out.insert(out.end(), sample.question.begin(), sample.question.end());
  return out;
}

}  // namespace kvsparse
