// The retrieval-head probe and the resolution of razor's full heads (see head_probe.h).
#include "kvsparse/head_probe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvsparse/runtime.h"

namespace kvsparse {

StatusOr<std::vector<HeadScore>> ProbeRetrievalHeads(const Model& model, const HeadProbeOptions& options) {
  const ModelConfig& c = model.config();
  if (options.repeats < 2) {
    return InvalidArgumentError(fmt::format("probe-heads: --repeats must be >= 2 (a copy to read after the first); "
                                            "found {}",
                                            options.repeats));
  }
  const int n = std::min({options.tokens, c.n_vocab, c.max_context / options.repeats});
  if (n < 4) {
    return InvalidArgumentError(fmt::format("probe-heads: the probe sequence needs at least 4 distinct tokens; "
                                            "--tokens {} with a vocabulary of {} and a context of {} for {} copies",
                                            options.tokens, c.n_vocab, c.max_context, options.repeats));
  }
  if (options.trials < 1) return InvalidArgumentError(fmt::format("probe-heads: --trials must be >= 1, found {}", options.trials));
  const int n_layers = c.n_layers, n_kv_heads = c.n_kv_heads, n_heads = c.n_heads;
  const int group = n_heads / n_kv_heads;
  const int32_t total = options.repeats * n;
  // TOVA with a budget of the whole context: it never evicts, and it asks the attention kernel
  // for the last query's probabilities, which the tap reads per query head.
  KVS_ASSIGN_OR_RETURN(KvSparsityConfig config, KvSparsityConfigFromFlags("tova", "1.0", "f32", n_layers));
  std::vector<double> induction(static_cast<size_t>(n_layers) * n_heads, 0.0);  // [n_layers, n_heads]
  std::vector<double> echo(induction.size(), 0.0);
  std::vector<float> logits(static_cast<size_t>(c.n_vocab));
  std::mt19937_64 rng(options.seed);
  std::vector<int32_t> ids(static_cast<size_t>(c.n_vocab));
  int64_t queries = 0;
  for (int trial = 0; trial < options.trials; ++trial) {
    // n distinct tokens: a partial Fisher-Yates shuffle of the vocabulary.
    std::iota(ids.begin(), ids.end(), 0);
    for (int i = 0; i < n; ++i) {
      std::uniform_int_distribution<int> pick(i, c.n_vocab - 1);
      std::swap(ids[static_cast<size_t>(i)], ids[static_cast<size_t>(pick(rng))]);
    }
    std::vector<int32_t> seq;  // R repeated
    for (int copy = 0; copy < options.repeats; ++copy) seq.insert(seq.end(), ids.begin(), ids.begin() + n);
    KVS_ASSIGN_OR_RETURN(auto runtime, CreateRuntime(model, &config, KvStorage::kF32, 1, total, options.n_threads));
    // Every call's last query (a prompt chunk's, or a decode step's) past the first copy.
    runtime->controller()->SetObservationTap(
        [&](int, int layer, int kv_head, const AttentionObservation& obs) {
          if (obs.n_queries < 1 || obs.last == nullptr) return;
          const int32_t p = obs.query_positions[obs.n_queries - 1];
          if (p < n) return;
          KVS_CHECK(obs.n_tokens == p + 1);  // nothing is evicted
          const int first_head = kv_head < 0 ? 0 : kv_head * group;  // a per-head table's rows: its group
          const int32_t copy = p / n, j = p % n;
          for (int r = 0; r < obs.heads(); ++r) {
            const float* prob = obs.last + static_cast<size_t>(r) * obs.n_tokens;  // [n_tokens]
            double e = 0, i = 0;
            for (int32_t earlier = 0; earlier < copy; ++earlier) {
              e += prob[earlier * n + j];
              i += prob[earlier * n + j + 1];
            }
            const size_t at = static_cast<size_t>(layer) * n_heads + first_head + r;
            echo[at] += e;
            induction[at] += i;
          }
        },
        /*query_heads=*/true);
    // Prompt: the first copy and the second copy's first token; then the rest one token per step.
    KVS_RETURN_IF_ERROR(runtime->engine->Forward(0, seq.data(), n + 1, 0, logits.data()));
    for (int32_t p = n + 1; p < total; ++p) {
      KVS_RETURN_IF_ERROR(runtime->engine->Forward(0, &seq[static_cast<size_t>(p)], 1, p, logits.data()));
    }
    queries += total - n;
  }
  std::vector<HeadScore> heads;
  for (int l = 0; l < n_layers; ++l) {
    for (int h = 0; h < n_kv_heads; ++h) {
      HeadScore score{l, h, 0, 0};
      for (int g = 0; g < group; ++g) {  // the group's max of each score
        const size_t at = static_cast<size_t>(l) * n_heads + static_cast<size_t>(h) * group + g;
        score.induction = std::max(score.induction, induction[at] / queries);
        score.echo = std::max(score.echo, echo[at] / queries);
      }
      heads.push_back(score);
    }
  }
  std::stable_sort(heads.begin(), heads.end(), [](const HeadScore& a, const HeadScore& b) { return a.score() > b.score(); });
  return heads;
}

std::string HeadScoresToJson(const std::vector<HeadScore>& heads, int n_layers, int n_kv_heads) {
  nlohmann::json list = nlohmann::json::array();
  for (const HeadScore& h : heads) {
    list.push_back({{"layer", h.layer},
                    {"kv_head", h.kv_head},
                    {"score", h.score()},
                    {"induction", h.induction},
                    {"echo", h.echo}});
  }
  nlohmann::json out = {{"n_layers", n_layers}, {"n_kv_heads", n_kv_heads}, {"heads", list}};
  return out.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

StatusOr<std::vector<HeadScore>> LoadHeadScores(const std::string& path, int n_layers, int n_kv_heads) {
  std::ifstream f(path);
  if (!f) return NotFoundError(fmt::format("heads file {}: cannot open it (write one with kvsparse probe-heads)", path));
  std::stringstream text;
  text << f.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError(fmt::format("heads file {}: not a JSON object", path));
  for (const char* key : {"n_layers", "n_kv_heads"}) {
    const int expected = key[2] == 'l' ? n_layers : n_kv_heads;
    if (auto it = j.find(key); it != j.end() && !(it->is_number_integer() && it->get<int64_t>() == expected)) {
      return InvalidArgumentError(fmt::format("heads file {}: '{}' is {} but the model has {}; the file was made for "
                                              "another model",
                                              path, key, it->dump(), expected));
    }
  }
  const auto list = j.find("heads");
  if (list == j.end() || !list->is_array()) {
    return InvalidArgumentError(fmt::format("heads file {}: expected a 'heads' array of {{\"layer\", \"kv_head\", "
                                            "\"score\"}} objects",
                                            path));
  }
  std::vector<HeadScore> heads;
  std::vector<uint8_t> seen(static_cast<size_t>(n_layers) * n_kv_heads, 0);
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& e = (*list)[i];
    auto bad = [&](const std::string& what) {
      return InvalidArgumentError(fmt::format("heads file {}: heads[{}]: {}", path, i, what));
    };
    if (!e.is_object()) return bad("expected an object, found " + e.dump());
    const auto layer = e.find("layer"), head = e.find("kv_head"), score = e.find("score");
    if (layer == e.end() || !layer->is_number_integer() || layer->get<int64_t>() < 0 ||
        layer->get<int64_t>() >= n_layers) {
      return bad(fmt::format("'layer' must be an integer in [0, {})", n_layers));
    }
    if (head == e.end() || !head->is_number_integer() || head->get<int64_t>() < 0 ||
        head->get<int64_t>() >= n_kv_heads) {
      return bad(fmt::format("'kv_head' must be an integer in [0, {})", n_kv_heads));
    }
    if (score == e.end() || !score->is_number() || !std::isfinite(score->get<double>())) {
      return bad("'score' must be a finite number");
    }
    HeadScore h{static_cast<int>(layer->get<int64_t>()), static_cast<int>(head->get<int64_t>()), 0, 0};
    uint8_t& once = seen[static_cast<size_t>(h.layer) * n_kv_heads + h.kv_head];
    if (once) return bad(fmt::format("layer {} KV head {} is listed twice", h.layer, h.kv_head));
    once = 1;
    // The ranking uses `score`; keep the split when given and consistent, else all of it as induction.
    const double s = score->get<double>();
    const auto ind = e.find("induction"), ech = e.find("echo");
    if (ind != e.end() && ech != e.end() && ind->is_number() && ech->is_number() &&
        std::abs(ind->get<double>() + ech->get<double>() - s) < 1e-6) {
      h.induction = ind->get<double>();
      h.echo = ech->get<double>();
    } else {
      h.induction = s;
    }
    heads.push_back(h);
  }
  std::stable_sort(heads.begin(), heads.end(), [](const HeadScore& a, const HeadScore& b) { return a.score() > b.score(); });
  return heads;
}

Status ResolveRetrievalHeads(const Model& model, int n_threads, KvSparsityConfig* config) {
  const int n_layers = model.config().n_layers, n_kv_heads = model.config().n_kv_heads;
  std::map<std::string, std::vector<HeadScore>> rankings;  // heads file ("" = probed) -> best first
  for (size_t l = 0; l < config->layers.size(); ++l) {
    KvMethodParams& p = config->layers[l].params;
    if (config->layers[l].method != KvMethod::kRazor || p.full_heads_resolved) continue;
    if (n_kv_heads > 64) {
      return UnimplementedError(fmt::format("layer {} (razor): the model has {} KV heads; razor supports up to 64", l,
                                            n_kv_heads));
    }
    auto it = rankings.find(p.heads_file);
    if (it == rankings.end()) {
      StatusOr<std::vector<HeadScore>> ranking =
          p.heads_file.empty() ? ProbeRetrievalHeads(model, HeadProbeOptions{.n_threads = n_threads})
                               : LoadHeadScores(p.heads_file, n_layers, n_kv_heads);
      if (!ranking.ok()) {
        return Status(ranking.status().code(), fmt::format("layer {} (razor): {}", l, ranking.status().message()));
      }
      it = rankings.emplace(p.heads_file, std::move(*ranking)).first;
    }
    const std::vector<HeadScore>& ranked = it->second;  // best echo + induction first
    const double total = static_cast<double>(n_layers) * n_kv_heads;
    // A count, or a share of every KV head of the model: the reference's lists round it half to
    // even (Python's round(), so a small model may get none); retrieval_heads to nearest, at
    // least 1 when > 0.
    auto count = [&](double heads, bool reference) {
      int64_t keep = heads >= 1.0  ? static_cast<int64_t>(heads)
                     : reference   ? static_cast<int64_t>(std::nearbyint(heads * total))
                                   : std::max<int64_t>(heads > 0.0, std::llround(heads * total));
      return std::min<int64_t>(keep, static_cast<int64_t>(ranked.size()));
    };
    p.full_heads = 0;
    auto mark = [&](const std::vector<HeadScore>& list, int64_t keep) {
      for (int64_t r = 0; r < keep; ++r) {
        const HeadScore& h = list[static_cast<size_t>(r)];
        if (h.layer == static_cast<int>(l)) p.full_heads |= uint64_t{1} << h.kv_head;
      }
    };
    if (p.retrieval_heads >= 0) {
      mark(ranked, count(p.retrieval_heads, /*reference=*/false));
    } else {
      // The reference's two lists, each ranked on its own score (ties: the combined order).
      for (const bool by_echo : {true, false}) {
        std::vector<HeadScore> list = ranked;
        std::stable_sort(list.begin(), list.end(), [&](const HeadScore& a, const HeadScore& b) {
          return by_echo ? a.echo > b.echo : a.induction > b.induction;
        });
        mark(list, count(by_echo ? p.echo_heads : p.induction_heads, /*reference=*/true));
      }
    }
    p.full_heads_resolved = true;
  }
  return Status::Ok();
}

}  // namespace kvsparse
