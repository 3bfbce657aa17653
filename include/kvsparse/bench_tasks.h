// Task generators for the method benchmark (`kvsparse bench`). Every task is generated
// locally (nothing is downloaded), deterministically from a seed, and its answer is known by
// construction. Tasks come in two forms:
//   - text tasks, built as text and encoded with the model's tokenizer; answers are kept as
//     text (scored after normalization) and as token ids;
//   - token-level tasks, built directly from the filler / key / value ids of a TokenVocab for
//     models without a usable tokenizer (stories260K, the built-in retrieval model); answers
//     are token ids.
// Users bring their own data as JSONL (one sample a line; see ParseUserTasks).
//
// Every question task keeps context and question apart so the runner can use either protocol:
//   question_last:  prompt = context + question, processed (and compressed) together, so a
//                   method may look at the question when it chooses what to keep;
//   question_after: the context is processed and compressed first, the question is sent as the
//                   next turn (multi-turn): selection cannot know what will be asked.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/status.h"
#include "kvsparse/token_vocab.h"
#include "kvsparse/tokenizer.h"

namespace kvsparse {

enum class BenchProtocol { kQuestionLast, kQuestionAfter };
std::string_view BenchProtocolName(BenchProtocol p);  // "question_last", "question_after"
StatusOr<BenchProtocol> ParseBenchProtocol(std::string_view name);

// How a generation is scored against the sample's answers.
enum class AnswerMetric {
  kExact,        // max over answers of exact match
  kContains,     // max over answers of "the answer occurs in the generation"
  kContainsAll,  // fraction of the answers that occur in the generation (all are required)
  kF1,           // max over answers of token F1
};
std::string_view AnswerMetricName(AnswerMetric m);  // "exact", "contains", "contains_all", "f1"
StatusOr<AnswerMetric> ParseAnswerMetric(std::string_view name);

struct TokenRange {
  int32_t begin = 0;  // [begin, end) token indices into BenchSample::context
  int32_t end = 0;
};

struct BenchSample {
  std::string task;     // "niah_single", ... or the user task's name
  std::string subtask;  // "depth=0.25", "keys=4,depth=0.5", ...: the aggregation key below task
  std::string id;        // user tasks: the record's "id" (else empty)
  uint64_t seed = 0;     // built-in tasks: the generator's seed
  int32_t target_length = 0;  // requested context length in tokens (user tasks: the actual one)

  std::vector<int32_t> context;   // token ids, BOS included when the tokenizer adds one
  std::vector<int32_t> question;  // token ids that follow the context (either protocol)
  std::string context_text;       // text tasks: what `context` encodes; empty for token-level
  std::string question_text;      // text tasks: what `question` encodes

  // References; any one (kExact/kContains/kF1) or all (kContainsAll) must be produced.
  std::vector<std::vector<int32_t>> answers;  // token ids as the model would generate them
  std::vector<std::string> answer_texts;      // parallel to `answers`; empty for token-level
  AnswerMetric metric = AnswerMetric::kContains;
  // Text scoring keeps only the first non-empty line of the generation (exact-match tasks
  // whose model keeps talking after the answer).
  bool first_line_only = false;
  int32_t max_new_tokens = 0;  // generation budget the runner should allow

  // Where in `context` the information the answer needs lies (needles, the asked pair, the
  // chain statements, the span to copy), so a runner can report whether a method kept it.
  // Text tasks: derived from the token pieces; empty when pieces do not spell the text.
  // Aggregation tasks (freq_words) leave it empty: the evidence is everywhere.
  std::vector<TokenRange> evidence;
};

// The built-in tasks.
enum class BenchTask {
  kNiahSingle,        // "niah_single": one needle (key → 7-digit number) at a chosen depth
  kNiahMultiKey,      // "niah_multikey": several needles with distinct keys, one asked
  kNiahMultiQuery,    // "niah_multiquery": several needles, all asked in one question (RULER)
  kKvRetrieval,       // "kv_retrieval": a JSON object of random UUID pairs, one key asked
  kVariableTracking,  // "variable_tracking": chains VAR A = 12345, VAR B = VAR A, ...; text only
  kFreqWords,         // "freq_words": the most frequent words of a coded text; text only
  kCopy,              // "copy": repeat a span seen earlier, given its first word(s)
};
std::string_view BenchTaskName(BenchTask t);
StatusOr<BenchTask> ParseBenchTask(std::string_view name);
std::vector<BenchTask> AllBenchTasks();
// Whether GenerateTokenSample supports the task. Variable tracking and frequent words are
// text-only: with one symbol per token and an induction-head model there is no sound form
// (a chain variable appears twice, so "what follows it" is ambiguous; counting is not copying).
bool HasTokenLevelForm(BenchTask t);

struct BenchTaskOptions {
  // Depth fraction of the asked needle / pair / span: 0 = start, 1 = end. Token-level: of the
  // filler tokens; text: of the haystack's filler tokens after the instruction line (inserts
  // go to the nearest sentence boundary).
  double depth = 0.5;
  int32_t n_keys = 4;        // niah_multikey, niah_multiquery: needles in the context (>= 2)
  int32_t n_hops = 4;        // variable_tracking: assignments after the initial one, per chain
  int32_t n_chains = 2;      // variable_tracking: chains (one asked, the rest distractors)
  int32_t top_k = 3;         // freq_words: how many most frequent words are asked
  // copy: words (text) or tokens (token-level; clamped to the number of distinct values, and
  // the subtask names the clamped length) in the span, >= 2.
  int32_t span_length = 16;
  int32_t copy_prompt = 1;   // copy, token-level: span tokens given in the question (>= 1)
  // Token-level needles (niah_single, niah_multikey, kv_retrieval): value tokens after each key,
  // all distinct. The first answer token comes from the prompt's own forward pass (before any
  // compression after the prompt); the later ones are read from the compressed cache, so > 1
  // makes question-last runs measure the compression too.
  int32_t value_tokens = 1;
  int32_t bos_token = -1;    // token-level only: prepended to the context when >= 0
};

// Text tasks: the context length (tokens of `context`, BOS included) lands within
// TextLengthTolerance(target) of the target and never above it. Errors: InvalidArgument for
// bad options or a target too small for the task's fixed text (the message says the minimum).
StatusOr<BenchSample> GenerateTextSample(BenchTask task, const Tokenizer& tokenizer, int32_t target_length,
                                         uint64_t seed, const BenchTaskOptions& options = {});
int32_t TextLengthTolerance(int32_t target_length);  // max(16, target / 64)

// Token-level tasks: the context has exactly target_length tokens.
//   niah_single:    filler..., key, value (at depth), filler...; question = [key]; answer [value].
//   niah_multikey:  n_keys (key, value) pairs at scattered depths (the asked one at `depth`),
//                   distinct keys; question = [asked key]; answer [its value].
//   niah_multiquery: n_keys needles as niah_multikey, every key asked: question = the other keys
//                   in random order, then the scored key (needle 0, at `depth`); answer [its
//                   value(s)]. The induction-head model answers the last key only, so only that
//                   one is scored, but a method cannot know which: it must keep every asked
//                   needle. (The text form asks for all values and scores all, contains_all.)
//   kv_retrieval:   one contiguous block of (key, value) pairs, as many as there are distinct
//                   keys (and values), its asked pair at `depth`; question/answer as above.
//   copy:           span_length distinct value tokens, once, at depth; question = the first
//                   copy_prompt tokens of the span, answer = the rest (generated greedily).
// Keys and values occur nowhere else in the context; filler is drawn uniformly.
// Errors: InvalidArgument naming the vocab class or option at fault, Unimplemented for
// text-only tasks.
StatusOr<BenchSample> GenerateTokenSample(BenchTask task, const TokenVocab& vocab, int32_t target_length,
                                          uint64_t seed, const BenchTaskOptions& options = {});
// Checks a TokenVocab: non-empty classes, ids >= 0 (and < n_vocab when n_vocab > 0), no id
// in two classes or twice in one. Errors name the class and the id.
Status ValidateTokenVocab(const TokenVocab& vocab, int32_t n_vocab = 0);

// The subtask string a generator gives these options ("depth=0.25", "keys=4,depth=0.25",
// "hops=4,chains=2", "top=3", "span=16,depth=0.5").
std::string BenchSubtask(BenchTask task, const BenchTaskOptions& options);

// ---------------------------------------------------------------------------------------
// User tasks (JSONL). One JSON object per line; blank lines are skipped. Fields:
//   "context"  string, required   the document(s)
//   "question" string, required   appended verbatim after the context: include separators
//                                 such as a leading "\n" and the answer cue ("Answer:")
//   "answers"  array of strings   references (any one counts), non-empty, or
//   "answer"   string             a single reference (exactly one of answer/answers)
//   "metric"   string, optional   "exact" | "contains" | "contains_all" | "f1" (default "contains")
//   "task"     string, optional   aggregation key (default: the file's stem)
//   "subtask"  string, optional   (default "")
//   "id"       string or integer, optional
//   "max_new_tokens" integer in [1, 4096], optional (default 64)
//   "first_line_only" bool, optional (default: true for "exact", else false)
//   "meta"     anything, optional, ignored (carry extra fields of an export here)
// Any other field is rejected, so a misspelt optional field is not silently ignored.
// Example: {"context": "...", "question": "\nQ: Who wrote it?\nA:", "answers": ["Ann"], "metric": "f1"}
struct UserTaskRecord {
  std::string task;
  std::string subtask;
  std::string id;
  std::string context;
  std::string question;
  std::vector<std::string> answers;
  AnswerMetric metric = AnswerMetric::kContains;
  int32_t max_new_tokens = 64;
  bool first_line_only = false;
  int32_t line = 0;  // 1-based line in the source
};

// Parses JSONL text. `source` names it in errors ("data.jsonl:12: field 'answers': expected a
// non-empty array of strings, found an empty array"); `default_task` fills absent "task"
// fields. The first malformed line fails the whole file (DataLoss). No sample → InvalidArgument.
StatusOr<std::vector<UserTaskRecord>> ParseUserTasks(std::string_view jsonl, std::string_view source,
                                                     std::string_view default_task);
// Reads `path` and parses it with the file's stem as default task. NotFound if unreadable.
StatusOr<std::vector<UserTaskRecord>> LoadUserTasks(const std::string& path);

struct UserSampleOptions {
  // Contexts longer than this many tokens keep their first and last halves (LongBench's
  // middle truncation); 0 = never truncate.
  int32_t max_context_tokens = 0;
};
// Encodes a record with the model's tokenizer (context with BOS; question and answers as the
// continuation of what precedes them).
BenchSample BuildUserSample(const UserTaskRecord& record, const Tokenizer& tokenizer,
                            const UserSampleOptions& options = {});

// ---------------------------------------------------------------------------------------
// Scoring a generation against a sample (AnswerMetric semantics above, metric functions of
// bench_metrics.h). Returns a score in [0, 1].

// Text scoring (sample.answer_texts must be non-empty): the generation's text, cut to its first
// non-empty line when sample.first_line_only, against each answer text.
double ScoreGenerationText(const BenchSample& sample, std::string_view generated_text);
// Token scoring against sample.answers.
double ScoreGenerationIds(const BenchSample& sample, std::span<const int32_t> generated);
// Text scoring through tokenizer->Decode when the sample has answer texts and a tokenizer is
// given; token scoring otherwise. `generated` should stop before the end-of-generation token.
double ScoreGeneration(const BenchSample& sample, std::span<const int32_t> generated, const Tokenizer* tokenizer);

// The ids the model is fed first: context + question (question_last) or context alone
// (question_after, whose question is fed after compression).
std::vector<int32_t> PromptTokens(const BenchSample& sample, BenchProtocol protocol);

}  // namespace kvsparse
