// Text task generators: build text from seeded word lists, encode it with the model's
// tokenizer, and fit the context to the target length.
//
// Length fitting: a context is head + a variable number m of filler units (prose words, JSON
// pairs, coded words) + fixed inserts. The token cost of a unit is measured once (cached) in
// context ("so <unit>" minus "so"), so cost(m) is a sum; m is picked from that estimate and then
// corrected with exact encodes of the whole text until the exact length is within tolerance and
// not above the target.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

#include "bench/tasks_internal.h"
#include "kvsparse/bench_metrics.h"
#include "kvsparse/bench_tasks.h"

namespace kvsparse {

using bench_internal::StreamSeed;
using bench_internal::TaskRng;

namespace {

// ---------------------------------------------------------------------------------------
// Word lists. Prose words, needle-key words and template words are disjoint, so a key or a
// coded word never occurs in the filler by accident. Prose has no digits.

constexpr std::string_view kAdj[] = {"quiet",  "old",    "small", "bright", "heavy",  "gentle", "narrow",
                                     "warm",   "pale",   "tall",  "busy",   "silent", "distant", "green",
                                     "wooden", "broad",  "soft",  "calm",   "dark",   "wide",   "young",
                                     "simple", "early",  "golden", "round"};
constexpr std::string_view kNoun[] = {"river",  "lamp",   "garden", "letter", "basket",  "bridge", "window",
                                      "wagon",  "blanket", "bottle", "door",  "field",   "coat",   "mirror",
                                      "candle", "fence",  "ladder", "kitchen", "rope",   "table",  "stone",
                                      "shell",  "cloud",  "road",   "feather"};
constexpr std::string_view kIntransitive[] = {"rested", "waited", "drifted", "wandered", "stayed", "paused",
                                              "leaned", "turned", "settled", "lingered", "glowed", "swayed"};
constexpr std::string_view kTransitive[] = {"painted", "carried", "found",    "cleaned",   "opened",   "mended",
                                            "watched", "moved",   "borrowed", "described", "followed", "counted"};
constexpr std::string_view kPrep[] = {"near",   "beside", "under",  "behind", "across",
                                      "along",  "beyond", "inside", "above",  "around"};
constexpr std::string_view kPlace[] = {"valley",   "market",   "village", "meadow", "station",
                                       "library",  "orchard",  "courtyard", "hillside", "workshop",
                                       "forest",   "shore",    "square",  "bakery", "cellar"};
constexpr std::string_view kName[] = {"Mara", "Tobin", "Elsie", "Rowan", "Nadia", "Hugo",
                                      "Ines", "Felix", "Greta", "Omar",  "Lena",  "Pavel"};
constexpr std::string_view kTime[] = {"in the morning",    "after supper", "before the rain", "at noon",
                                      "during the winter", "on a cold evening", "late at night", "at dawn"};
constexpr std::string_view kAdverb[] = {"slowly", "quietly", "happily", "carefully",
                                        "briefly", "calmly", "gladly",  "softly"};
// Needle keys: "<adjective>-<noun>" from these lists only.
constexpr std::string_view kKeyAdj[] = {"amber", "brisk", "cobalt", "dusty",  "eager",  "fuzzy",  "hollow", "icy",
                                        "jolly", "keen",  "lucky",  "misty",  "noble",  "olive",  "plucky", "quirky",
                                        "rusty", "silky", "tidy",   "vivid",  "witty",  "zesty",  "crimson", "frosty"};
constexpr std::string_view kKeyNoun[] = {"anchor", "badger", "cactus", "dolphin", "ember",  "falcon", "glacier",
                                         "igloo",  "jackal", "kettle", "lantern", "magnet", "nectar", "otter",
                                         "pebble", "quiver", "raven",  "saddle",  "tulip",  "urchin", "violin",
                                         "walrus", "yacht",  "zephyr"};

template <size_t N>
std::string_view Pick(const std::string_view (&list)[N], TaskRng& rng) {
  return list[rng.Below(N)];
}

// A second pick different from `first` (lists have more than one entry).
template <size_t N>
std::string_view PickOther(const std::string_view (&list)[N], std::string_view first, TaskRng& rng) {
  std::string_view w;
  do w = Pick(list, rng); while (w == first);
  return w;
}

std::string Capitalize(std::string_view s) {
  std::string out(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 'a' + 'A');
  return out;
}

// One sentence of plain, varied filler prose. Words are drawn into locals in a fixed order:
// the evaluation order of function arguments is unspecified, and a seed must give the same
// text with every compiler.
std::string ProseSentence(TaskRng& rng) {
  const uint64_t form = rng.Below(6);
  const std::string_view adj = Pick(kAdj, rng);
  const std::string_view adj2 = PickOther(kAdj, adj, rng);
  const std::string_view noun = Pick(kNoun, rng);
  const std::string_view noun2 = PickOther(kNoun, noun, rng);
  const std::string_view verb = Pick(kIntransitive, rng);
  const std::string_view tverb = Pick(kTransitive, rng);
  const std::string_view prep = Pick(kPrep, rng);
  const std::string_view place = Pick(kPlace, rng);
  const std::string_view name = Pick(kName, rng);
  const std::string_view time = Pick(kTime, rng);
  const std::string_view adverb = Pick(kAdverb, rng);
  switch (form) {
    case 0: return fmt::format("The {} {} {} {} the {}.", adj, noun, verb, prep, place);
    case 1: return fmt::format("{} {} the {} {} {}.", name, tverb, adj, noun, time);
    case 2: return fmt::format("{}, a {} {} {} {} the {}.", Capitalize(time), adj, noun, verb, prep, place);
    case 3: return fmt::format("In the {}, {} {} {}.", place, name, verb, adverb);
    case 4: return fmt::format("The {} and the {} {} {} {} the {} {}.", noun, noun2, verb, adverb, prep, adj, place);
    default: return fmt::format("{} said that the {} was {} and {}.", name, place, adj, adj2);
  }
}

// Templates, kept here so coded words can avoid every word they use.
constexpr std::string_view kNiahHead =
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n";
constexpr std::string_view kNiahNeedle = "One of the special magic numbers for {} is: {}.";
constexpr std::string_view kNiahQuestion =
    "\nWhat is the special magic number for {0} mentioned in the provided text? "
    "The special magic number for {0} mentioned in the provided text is";
constexpr std::string_view kNiahMultiQuestion =
    "\nWhat are all the special magic numbers for {0} mentioned in the provided text? "
    "The special magic numbers for {0} mentioned in the provided text are";
constexpr std::string_view kKvHead = "Extract the value corresponding to the specified key in the JSON object below.\n";
constexpr std::string_view kKvQuestion = "\nKey: \"{}\"\nThe value associated with the specified key is:";
constexpr std::string_view kVtHead =
    "Memorize and track the chains of variable assignments hidden in the following text.\n";
constexpr std::string_view kVtQuestion =
    "\nQuestion: Following the chain of assignments, what number does VAR {0} hold? "
    "Answer: VAR {0} holds the number";
constexpr std::string_view kFwHead =
    "Read the following coded text and track the frequency of each coded word. "
    "Find the {} most frequently appearing coded words.\n";
constexpr std::string_view kFwQuestion =
    "\nQuestion: What are the {0} most frequently appearing words in the above coded text? "
    "Answer: According to the coded text above, the {0} most frequently appearing words are:";
constexpr std::string_view kCopyHead =
    "Memorize the sequence of words hidden in the following text. I will ask you to repeat it.\n";
constexpr std::string_view kCopyIntro = "The sequence to remember is:";
constexpr std::string_view kCopyQuestion = "\nRepeat the sequence to remember, word for word. ";

// Every lowercase word of the templates and prose lists: coded words must not be one of them.
const std::set<std::string>& KnownWords() {
  static const std::set<std::string> words = [] {
    std::string all;
    for (std::string_view t : {kNiahHead, kNiahNeedle, kNiahQuestion, kNiahMultiQuestion, kKvHead, kKvQuestion,
                               kVtHead, kVtQuestion, kFwHead, kFwQuestion, kCopyHead, kCopyIntro, kCopyQuestion}) {
      all += std::string(t) + " ";
    }
    auto add = [&](auto& list) {
      for (std::string_view w : list) all += std::string(w) + " ";
    };
    add(kAdj), add(kNoun), add(kIntransitive), add(kTransitive), add(kPrep), add(kPlace), add(kName), add(kTime),
        add(kAdverb), add(kKeyAdj), add(kKeyNoun);
    std::set<std::string> out;
    for (const std::string& w : NormalizedWords(all)) out.insert(w);
    for (std::string w : {"a", "an", "the", "var", "json", "data", "key"}) out.insert(w);
    return out;
  }();
  return words;
}

// n distinct random lowercase "coded" words of 4 to 6 letters, none a template or prose word.
std::vector<std::string> CodedWords(size_t n, TaskRng& rng) {
  std::set<std::string> used;
  std::vector<std::string> out;
  while (out.size() < n) {
    std::string w;
    const size_t len = 4 + rng.Below(3);
    for (size_t i = 0; i < len; ++i) w.push_back(static_cast<char>('a' + rng.Below(26)));
    if (KnownWords().count(w) || !used.insert(w).second) continue;
    out.push_back(std::move(w));
  }
  return out;
}

std::string RandomDigits(size_t n, TaskRng& rng) {
  std::string s(1, static_cast<char>('1' + rng.Below(9)));  // no leading zero
  while (s.size() < n) s.push_back(static_cast<char>('0' + rng.Below(10)));
  return s;
}

std::string RandomUuid(TaskRng& rng) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) s.push_back('-');
    s.push_back(kHex[rng.Below(16)]);
  }
  return s;
}

// ---------------------------------------------------------------------------------------
// Encoding helpers.

// Token cost of units as they appear inside running text (after a space), cached.
class UnitCost {
 public:
  explicit UnitCost(const Tokenizer& tok) : tok_(tok), anchor_(Count("so")) {}
  int64_t operator()(const std::string& unit) {
    auto it = cache_.find(unit);
    if (it != cache_.end()) return it->second;
    const int64_t c = std::max<int64_t>(1, Count("so " + unit) - anchor_);
    cache_.emplace(unit, c);
    return c;
  }

 private:
  int64_t Count(const std::string& text) const { return static_cast<int64_t>(tok_.Encode(text, false).size()); }
  const Tokenizer& tok_;
  int64_t anchor_;
  std::unordered_map<std::string, int64_t> cache_;
};

// Ids of `cont` as they follow `prefix` when the two are encoded as one text. Only a short
// tail of the prefix (starting at a word) is re-encoded; when its ids are not a prefix of the
// joint encoding (a token spans the seam), `cont` is encoded alone.
std::vector<int32_t> EncodeContinuation(const Tokenizer& tok, std::string_view prefix, std::string_view cont) {
  size_t pos = prefix.size() > 64 ? prefix.size() - 64 : 0;
  if (pos > 0) {
    const size_t sp = prefix.find(' ', pos);
    pos = sp == std::string_view::npos ? prefix.size() : sp + 1;
  }
  const std::string tail(prefix.substr(pos));
  const std::vector<int32_t> a = tok.Encode(tail, false);
  const std::vector<int32_t> b = tok.Encode(tail + std::string(cont), false);
  if (!tail.empty() && b.size() >= a.size() && std::equal(a.begin(), a.end(), b.begin())) {
    return std::vector<int32_t>(b.begin() + static_cast<std::ptrdiff_t>(a.size()), b.end());
  }
  return tok.Encode(cont, false);
}

using CharRange = std::pair<size_t, size_t>;  // [begin, end) byte offsets into the text

// Token ranges covering each character range, from the decoded pieces of `ids`. Empty when the
// pieces do not spell `text` (allowing the leading space SPM adds).
std::vector<TokenRange> MapEvidence(const Tokenizer& tok, const std::string& text, const std::vector<int32_t>& ids,
                                    const std::vector<CharRange>& ranges) {
  if (ranges.empty()) return {};
  std::string spelled;
  std::vector<int64_t> start(ids.size()), end(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    start[i] = static_cast<int64_t>(spelled.size());
    if (tok.GetTokenType(ids[i]) != TokenType::kControl) spelled += tok.TokenToPiece(ids[i]);
    end[i] = static_cast<int64_t>(spelled.size());
  }
  int64_t shift = 0;
  if (spelled != text) {
    if (spelled.size() == text.size() + 1 && spelled[0] == ' ' && spelled.compare(1, std::string::npos, text) == 0) {
      shift = 1;
    } else {
      return {};
    }
  }
  std::vector<TokenRange> out;
  for (const auto& [cb, ce] : ranges) {
    const auto b = static_cast<int64_t>(cb) + shift;
    const auto e = static_cast<int64_t>(ce) + shift;
    // First token ending after b; first token starting at or after e (both non-decreasing).
    const auto first = std::partition_point(end.begin(), end.end(), [&](int64_t x) { return x <= b; }) - end.begin();
    const auto last = std::partition_point(start.begin(), start.end(), [&](int64_t x) { return x < e; }) - start.begin();
    out.push_back({static_cast<int32_t>(first), static_cast<int32_t>(last)});
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Length fitting.

struct Rendered {
  std::string text;
  std::vector<CharRange> evidence;
};

struct Fitted {
  Rendered rendered;
  std::vector<int32_t> ids;
  int64_t m = 0;
};

// Finds m in [0, max_m] whose render encodes (with BOS) to at most `target` tokens and at least
// target - tol. `extra(m)` estimates the tokens the m units add to render(0) (non-decreasing).
StatusOr<Fitted> FitLength(const Tokenizer& tok, std::string_view task, int32_t target, int32_t tol, int64_t max_m,
                           const std::function<int64_t(int64_t)>& extra,
                           const std::function<Rendered(int64_t)>& render) {
  Fitted best;
  best.rendered = render(0);
  best.ids = tok.Encode(best.rendered.text, true);
  const auto base = static_cast<int64_t>(best.ids.size());
  if (base > target) {
    return InvalidArgumentError(fmt::format(
        "task {}: target length {} is below the minimum of {} tokens this task needs with this tokenizer "
        "(instructions and needles)",
        task, target, base));
  }
  // Largest m whose estimate stays within goal_extra.
  auto pick = [&](int64_t goal_extra) {
    int64_t lo = 0, hi = max_m;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (extra(mid) <= goal_extra) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  };
  std::map<int64_t, int64_t> tried;  // m → exact length
  tried[0] = base;
  int64_t m = pick(target - base);
  for (int iter = 0; iter < 12 && !tried.count(m); ++iter) {
    Rendered r = render(m);
    std::vector<int32_t> ids = tok.Encode(r.text, true);
    const auto n = static_cast<int64_t>(ids.size());
    tried[m] = n;
    if (n <= target && n > static_cast<int64_t>(best.ids.size())) best = {std::move(r), std::move(ids), m};
    if (n == target) break;
    const int64_t err = target - n;
    int64_t next = pick(extra(m) + err);
    if (err < 0 && next >= m) next = m - 1;
    if (err > 0 && next <= m) {
      if (target - n <= tol) break;  // close enough; one more unit is estimated to overshoot
      next = m + 1;
    }
    m = std::clamp<int64_t>(next, 0, max_m);
  }
  const auto got = static_cast<int64_t>(best.ids.size());
  if (target - got > tol) {
    return InternalError(fmt::format("task {}: could not fit the context to {} tokens (best {}, tolerance {})", task,
                                     target, got, tol));
  }
  return best;
}

// Appends a piece to running text with one separating space (none after a newline).
void Append(std::string& out, std::string_view piece, std::vector<CharRange>* evidence = nullptr) {
  if (!out.empty() && out.back() != '\n' && out.back() != ' ') out.push_back(' ');
  const size_t begin = out.size();
  out += piece;
  if (evidence) evidence->push_back({begin, out.size()});
}

// Prose filler: a word stream cut at any word, and the word indices where sentences start.
struct Filler {
  std::vector<std::string> words;
  std::vector<int64_t> prefix_cost;      // [words + 1]
  std::vector<int64_t> sentence_starts;  // ascending word indices, 0 first
};

Filler MakeFiller(UnitCost& cost, int64_t min_cost, TaskRng& rng) {
  Filler f;
  f.prefix_cost.push_back(0);
  while (f.prefix_cost.back() < min_cost) {
    f.sentence_starts.push_back(static_cast<int64_t>(f.words.size()));
    const std::string sentence = ProseSentence(rng);
    size_t pos = 0;
    while (pos < sentence.size()) {
      size_t sp = sentence.find(' ', pos);
      if (sp == std::string::npos) sp = sentence.size();
      f.words.push_back(sentence.substr(pos, sp - pos));
      f.prefix_cost.push_back(f.prefix_cost.back() + cost(f.words.back()));
      pos = sp + 1;
    }
  }
  return f;
}

struct Insert {
  double depth;
  std::string text;
  bool evidence;
};

// head + the first m filler words with the inserts at the sentence starts nearest their
// depths, measured in filler tokens (never past m) + tail.
Rendered RenderHaystack(std::string_view head, const Filler& f, int64_t m, const std::vector<Insert>& inserts,
                        std::string_view tail) {
  std::vector<std::pair<int64_t, size_t>> at;  // (word index, insert index)
  const auto cost_at = [&](int64_t w) { return static_cast<double>(f.prefix_cost[w]); };
  for (size_t i = 0; i < inserts.size(); ++i) {
    const double want = inserts[i].depth * cost_at(m);
    int64_t best = 0;
    for (int64_t s : f.sentence_starts) {
      if (s > m) break;
      if (std::abs(cost_at(s) - want) < std::abs(cost_at(best) - want)) best = s;
    }
    // The end of the last whole sentence is a boundary too.
    if (m == static_cast<int64_t>(f.words.size()) && std::abs(cost_at(m) - want) < std::abs(cost_at(best) - want)) {
      best = m;
    }
    at.push_back({best, i});
  }
  std::stable_sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Rendered r;
  r.text = head;
  size_t next = 0;
  for (int64_t w = 0; w <= m; ++w) {
    while (next < at.size() && at[next].first == w) {
      const Insert& ins = inserts[at[next++].second];
      Append(r.text, ins.text, ins.evidence ? &r.evidence : nullptr);
    }
    if (w < m) Append(r.text, f.words[w]);
  }
  if (!tail.empty()) Append(r.text, tail);
  return r;
}

// Haystack tasks: fits the filler around the inserts and fills the sample's context fields.
Status BuildHaystack(const Tokenizer& tok, BenchSample& s, std::string_view head, const std::vector<Insert>& inserts,
                     TaskRng& filler_rng) {
  UnitCost cost(tok);
  const Filler filler = MakeFiller(cost, static_cast<int64_t>(s.target_length) + 64, filler_rng);
  KVS_ASSIGN_OR_RETURN(
      Fitted fit, FitLength(
                      tok, s.task, s.target_length, TextLengthTolerance(s.target_length),
                      static_cast<int64_t>(filler.words.size()),
                      [&](int64_t m) { return filler.prefix_cost[m]; },
                      [&](int64_t m) { return RenderHaystack(head, filler, m, inserts, ""); }));
  s.context_text = std::move(fit.rendered.text);
  s.context = std::move(fit.ids);
  s.evidence = MapEvidence(tok, s.context_text, s.context, fit.rendered.evidence);
  return Status::Ok();
}

// Question ids, answers (text and ids) and the generation budget.
void FinishSample(const Tokenizer& tok, BenchSample& s, std::string question, std::vector<std::string> answers,
                  AnswerMetric metric, int32_t extra_new_tokens) {
  s.question_text = std::move(question);
  s.question = EncodeContinuation(tok, s.context_text, s.question_text);
  const std::string prompt_tail =
      s.context_text.substr(s.context_text.size() > 128 ? s.context_text.size() - 128 : 0) + s.question_text;
  int32_t longest = 0, total = 0;
  for (std::string& a : answers) {
    s.answers.push_back(EncodeContinuation(tok, prompt_tail, " " + a));
    longest = std::max(longest, static_cast<int32_t>(s.answers.back().size()));
    total += static_cast<int32_t>(s.answers.back().size());
    s.answer_texts.push_back(std::move(a));
  }
  s.metric = metric;
  s.max_new_tokens = (metric == AnswerMetric::kContainsAll ? total + 4 * static_cast<int32_t>(s.answers.size())
                                                           : longest) +
                     extra_new_tokens;
}

std::string NeedleKey(TaskRng& rng) {
  const std::string_view adj = Pick(kKeyAdj, rng);
  return fmt::format("{}-{}", adj, Pick(kKeyNoun, rng));
}

// ---------------------------------------------------------------------------------------
// Tasks.

// n_keys needles; ask_all: every key is asked and every value scored (RULER's multi-query),
// else only needle 0's (at o.depth).
Status GenNiah(const Tokenizer& tok, BenchSample& s, const BenchTaskOptions& o, int32_t n_keys, bool ask_all,
               TaskRng& rng, TaskRng& filler_rng) {
  if (static_cast<size_t>(n_keys) > std::size(kKeyAdj) * std::size(kKeyNoun)) {
    return InvalidArgumentError(fmt::format("task {}: n_keys {} exceeds the {} distinct keys available", s.task,
                                            n_keys, std::size(kKeyAdj) * std::size(kKeyNoun)));
  }
  std::set<std::string> keys_used, values_used;
  std::vector<Insert> inserts;
  std::vector<std::string> keys, values;
  for (int32_t i = 0; i < n_keys; ++i) {
    std::string key, value;
    do key = NeedleKey(rng); while (!keys_used.insert(key).second);
    do value = RandomDigits(7, rng); while (!values_used.insert(value).second);
    const double depth = i == 0 ? o.depth : rng.Uniform();
    inserts.push_back({depth, fmt::format(fmt::runtime(kNiahNeedle), key, value), i == 0 || ask_all});
    keys.push_back(std::move(key));
    values.push_back(std::move(value));
  }
  KVS_RETURN_IF_ERROR(BuildHaystack(tok, s, kNiahHead, inserts, filler_rng));
  if (!ask_all) {
    FinishSample(tok, s, fmt::format(fmt::runtime(kNiahQuestion), keys[0]), {values[0]}, AnswerMetric::kContains,
                 8);
    return Status::Ok();
  }
  std::string listed;  // "A, B, C and D"
  for (int32_t i = 0; i < n_keys; ++i) {
    listed += i == 0 ? "" : i + 1 == n_keys ? " and " : ", ";
    listed += keys[i];
  }
  FinishSample(tok, s, fmt::format(fmt::runtime(kNiahMultiQuestion), listed), std::move(values),
               AnswerMetric::kContainsAll, 8);
  return Status::Ok();
}

Status GenKv(const Tokenizer& tok, BenchSample& s, const BenchTaskOptions& o, TaskRng& rng, TaskRng& filler_rng) {
  UnitCost cost(tok);
  // Pairs: enough for the target by their estimated cost.
  std::vector<std::pair<std::string, std::string>> pairs;
  std::vector<int64_t> prefix = {0};
  while (prefix.back() < static_cast<int64_t>(s.target_length) + 64) {
    pairs.push_back({RandomUuid(rng), RandomUuid(rng)});
    prefix.push_back(prefix.back() + cost(fmt::format("\"{}\": \"{}\",", pairs.back().first, pairs.back().second)));
  }
  auto render_json = [&](std::string& out, int64_t n_pairs, int64_t asked, std::vector<CharRange>* evidence) {
    out += "JSON data:\n{";
    for (int64_t i = 0; i < n_pairs; ++i) {
      if (i) out += ", ";
      const size_t begin = out.size();
      out += fmt::format("\"{}\": \"{}\"", pairs[i].first, pairs[i].second);
      if (i == asked && evidence) evidence->push_back({begin, out.size()});
    }
    out += "}";
  };
  // Stage 1: as many pairs as fit (at least one); stage 2: prose words pad the remainder
  // between the instruction and the JSON object (pairs are ~50-70 tokens each).
  KVS_ASSIGN_OR_RETURN(Fitted pair_fit,
                       FitLength(
                           tok, s.task, s.target_length, /*tol=*/s.target_length,
                           static_cast<int64_t>(pairs.size()) - 1,
                           [&](int64_t m) { return prefix[m + 1] - prefix[1]; },
                           [&](int64_t m) {
                             Rendered r;
                             r.text = kKvHead;
                             render_json(r.text, m + 1, -1, nullptr);
                             return r;
                           }));
  const int64_t n_pairs = pair_fit.m + 1;
  const auto asked = static_cast<int64_t>(std::lround(o.depth * static_cast<double>(n_pairs - 1)));
  const Filler filler = MakeFiller(cost, static_cast<int64_t>(s.target_length) + 64, filler_rng);
  auto render = [&](int64_t m) {
    Rendered r;
    r.text = kKvHead;
    for (int64_t w = 0; w < m; ++w) Append(r.text, filler.words[w]);
    if (m > 0) r.text += "\n";
    render_json(r.text, n_pairs, asked, &r.evidence);
    return r;
  };
  KVS_ASSIGN_OR_RETURN(Fitted fit, FitLength(
                                       tok, s.task, s.target_length, TextLengthTolerance(s.target_length),
                                       static_cast<int64_t>(filler.words.size()),
                                       [&](int64_t m) { return filler.prefix_cost[m]; }, render));
  s.context_text = std::move(fit.rendered.text);
  s.context = std::move(fit.ids);
  s.evidence = MapEvidence(tok, s.context_text, s.context, fit.rendered.evidence);
  FinishSample(tok, s, fmt::format(fmt::runtime(kKvQuestion), pairs[asked].first), {pairs[asked].second},
               AnswerMetric::kContains, 8);
  return Status::Ok();
}

std::string VariableName(TaskRng& rng) {
  std::string v;
  for (int i = 0; i < 5; ++i) v.push_back(static_cast<char>('A' + rng.Below(26)));
  return v;
}

Status GenVt(const Tokenizer& tok, BenchSample& s, const BenchTaskOptions& o, TaskRng& rng, TaskRng& filler_rng) {
  std::set<std::string> names, numbers;
  std::vector<Insert> inserts;
  std::string asked_var, asked_number;
  for (int32_t c = 0; c < o.n_chains; ++c) {
    std::string number;
    do number = RandomDigits(5, rng); while (!numbers.insert(number).second);
    std::vector<std::string> vars;
    for (int32_t h = 0; h <= o.n_hops; ++h) {
      std::string v;
      do v = VariableName(rng); while (v == "VAR" || !names.insert(v).second);
      vars.push_back(v);
    }
    // Statement depths, sorted so a chain reads in order.
    std::vector<double> depths;
    for (int32_t h = 0; h <= o.n_hops; ++h) depths.push_back(rng.Uniform());
    std::sort(depths.begin(), depths.end());
    for (int32_t h = 0; h <= o.n_hops; ++h) {
      const std::string rhs = h == 0 ? number : "VAR " + vars[h - 1];
      inserts.push_back({depths[h], fmt::format("VAR {} = {}.", vars[h], rhs), c == 0});
    }
    if (c == 0) asked_var = vars.back(), asked_number = number;
  }
  KVS_RETURN_IF_ERROR(BuildHaystack(tok, s, kVtHead, inserts, filler_rng));
  FinishSample(tok, s, fmt::format(fmt::runtime(kVtQuestion), asked_var), {asked_number}, AnswerMetric::kContains, 8);
  return Status::Ok();
}

// Occurrence counts of freq_words for m words: the top_k words 2(T+1) + (k-1-r) times each,
// where T = m / (n_tail + 2k), the n_tail others share the rest evenly (at most T + 1 each), so
// the top k are strictly more frequent than any other word.
std::vector<int64_t> FreqCounts(int64_t m, int32_t k, int32_t n_tail) {
  std::vector<int64_t> counts(static_cast<size_t>(k + n_tail), 0);
  const int64_t t = m / (n_tail + 2 * k);
  int64_t top = 0;
  for (int32_t r = 0; r < k; ++r) top += counts[r] = 2 * (t + 1) + (k - 1 - r);
  const int64_t rest = std::max<int64_t>(0, m - top);
  for (int32_t i = 0; i < n_tail; ++i) counts[k + i] = rest / n_tail + (i < rest % n_tail ? 1 : 0);
  KVS_CHECK(n_tail == 0 || counts[k] < counts[k - 1]);
  return counts;
}

Status GenFreqWords(const Tokenizer& tok, BenchSample& s, const BenchTaskOptions& o, TaskRng& rng) {
  const int32_t k = o.top_k;
  const int32_t n_tail = std::max(40, 10 * k);
  const std::vector<std::string> words = CodedWords(static_cast<size_t>(k + n_tail), rng);
  const uint64_t shuffle_seed = rng.Next();
  UnitCost cost(tok);
  std::vector<int64_t> word_cost;
  for (const std::string& w : words) word_cost.push_back(cost(w));
  const std::string head = fmt::format(fmt::runtime(kFwHead), k);
  auto extra = [&](int64_t m) {
    if (m == 0) return int64_t{0};
    const std::vector<int64_t> counts = FreqCounts(m, k, n_tail);
    int64_t c = 0;
    for (size_t i = 0; i < counts.size(); ++i) c += counts[i] * word_cost[i];
    return c;
  };
  auto render = [&](int64_t m) {
    Rendered r;
    r.text = head;
    if (m == 0) return r;
    std::vector<int32_t> seq;
    const std::vector<int64_t> counts = FreqCounts(m, k, n_tail);
    for (size_t i = 0; i < counts.size(); ++i) seq.insert(seq.end(), static_cast<size_t>(counts[i]), static_cast<int32_t>(i));
    TaskRng shuffle(shuffle_seed);
    shuffle.Shuffle(seq);
    for (int32_t i : seq) Append(r.text, words[i]);
    return r;
  };
  KVS_ASSIGN_OR_RETURN(Fitted fit, FitLength(tok, s.task, s.target_length, TextLengthTolerance(s.target_length),
                                                 s.target_length, extra, render));
  if (fit.m == 0) {
    return InvalidArgumentError(fmt::format("task {}: target length {} leaves no room for the coded text", s.task,
                                            s.target_length));
  }
  s.context_text = std::move(fit.rendered.text);
  s.context = std::move(fit.ids);
  FinishSample(tok, s, fmt::format(fmt::runtime(kFwQuestion), k),
               std::vector<std::string>(words.begin(), words.begin() + k), AnswerMetric::kContainsAll, 8);
  return Status::Ok();
}

Status GenCopy(const Tokenizer& tok, BenchSample& s, const BenchTaskOptions& o, TaskRng& rng, TaskRng& filler_rng) {
  const std::vector<std::string> span = CodedWords(static_cast<size_t>(o.span_length), rng);
  std::string joined;
  for (const std::string& w : span) Append(joined, w);
  const std::vector<Insert> inserts = {{o.depth, fmt::format("{} {}.", kCopyIntro, joined), true}};
  KVS_RETURN_IF_ERROR(BuildHaystack(tok, s, kCopyHead, inserts, filler_rng));
  std::string question = std::string(kCopyQuestion) + std::string(kCopyIntro);
  std::string answer;
  for (int32_t i = 0; i < o.span_length; ++i) Append(i < o.copy_prompt ? question : answer, span[i]);
  FinishSample(tok, s, std::move(question), {std::move(answer)}, AnswerMetric::kContains, 8);
  return Status::Ok();
}

}  // namespace

int32_t TextLengthTolerance(int32_t target_length) { return std::max(16, target_length / 64); }

StatusOr<BenchSample> GenerateTextSample(BenchTask task, const Tokenizer& tokenizer, int32_t target_length,
                                         uint64_t seed, const BenchTaskOptions& o) {
  KVS_RETURN_IF_ERROR(bench_internal::ValidateTaskOptions(task, target_length, o));
  const std::string_view name = BenchTaskName(task);
  TaskRng rng(StreamSeed(seed, name, 1));         // keys, values, depths, coded words
  TaskRng filler_rng(StreamSeed(seed, name, 2));  // prose
  BenchSample s;
  s.task = std::string(name);
  s.subtask = BenchSubtask(task, o);
  s.seed = seed;
  s.target_length = target_length;
  switch (task) {
    case BenchTask::kNiahSingle: KVS_RETURN_IF_ERROR(GenNiah(tokenizer, s, o, 1, false, rng, filler_rng)); break;
    case BenchTask::kNiahMultiKey:
      KVS_RETURN_IF_ERROR(GenNiah(tokenizer, s, o, o.n_keys, false, rng, filler_rng));
      break;
    case BenchTask::kNiahMultiQuery:
      KVS_RETURN_IF_ERROR(GenNiah(tokenizer, s, o, o.n_keys, true, rng, filler_rng));
      break;
    case BenchTask::kKvRetrieval: KVS_RETURN_IF_ERROR(GenKv(tokenizer, s, o, rng, filler_rng)); break;
    case BenchTask::kVariableTracking: KVS_RETURN_IF_ERROR(GenVt(tokenizer, s, o, rng, filler_rng)); break;
    case BenchTask::kFreqWords: KVS_RETURN_IF_ERROR(GenFreqWords(tokenizer, s, o, rng)); break;
    case BenchTask::kCopy: KVS_RETURN_IF_ERROR(GenCopy(tokenizer, s, o, rng, filler_rng)); break;
  }
  return s;
}

namespace bench_internal {
std::vector<int32_t> EncodeAfter(const Tokenizer& tok, std::string_view prefix, std::string_view cont) {
  return EncodeContinuation(tok, prefix, cont);
}
}  // namespace bench_internal

}  // namespace kvsparse
