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
  const int n = std::min(options.tokens, c.n_vocab);
  if (n < 4) {
    return InvalidArgumentError(fmt::format("probe-heads: the probe sequence needs at least 4 distinct tokens; "
                                            "--tokens {} with a vocabulary of {}",
                                            options.tokens, c.n_vocab));
  }
  if (options.trials < 1) return InvalidArgumentError(fmt::format("probe-heads: --trials must be >= 1, found {}", options.trials));
  if (2 * n > c.max_context) {
    return InvalidArgumentError(fmt::format("probe-heads: the probe prompt (2 x {} tokens) exceeds the model's context "
                                            "of {}; lower --tokens",
                                            n, c.max_context));
  }
  const int n_layers = c.n_layers, n_kv_heads = c.n_kv_heads;
  // TOVA with a budget of the whole context: it never evicts, and it asks the attention kernel
  // for the last query's probabilities per KV head, which the tap reads.
  KVS_ASSIGN_OR_RETURN(KvSparsityConfig config, KvSparsityConfigFromFlags("tova", "1.0", "f32", n_layers));
  std::vector<double> induction(static_cast<size_t>(n_layers) * n_kv_heads, 0.0);  // [n_layers, n_kv_heads]
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
    const std::vector<int32_t> seq(ids.begin(), ids.begin() + n);  // R
    KVS_ASSIGN_OR_RETURN(auto runtime, CreateRuntime(model, &config, KvStorage::kF32, 1, 2 * n, options.n_threads));
    int j = -1;  // the second copy's token now being read (R[j] at position n + j); -1: the prompt
    runtime->controller()->SetObservationTap([&](int, int layer, int, const AttentionObservation& obs) {
      if (j < 1 || obs.n_queries != 1 || obs.last == nullptr) return;
      KVS_CHECK(obs.n_tokens == n + j + 1 && obs.n_kv_heads == n_kv_heads);  // nothing is evicted
      for (int h = 0; h < n_kv_heads; ++h) {
        const float* p = obs.last + static_cast<size_t>(h) * obs.n_tokens;  // [n_tokens]
        const size_t at = static_cast<size_t>(layer) * n_kv_heads + h;
        induction[at] += p[j + 1];
        echo[at] += p[j];
      }
    });
    // Prompt: R and the second copy's first token; then the rest one token per step.
    std::vector<int32_t> prompt = seq;
    prompt.push_back(seq[0]);
    KVS_RETURN_IF_ERROR(runtime->engine->Forward(0, prompt.data(), n + 1, 0, logits.data()));
    for (j = 1; j < n; ++j) {
      KVS_RETURN_IF_ERROR(runtime->engine->Forward(0, &seq[static_cast<size_t>(j)], 1, n + j, logits.data()));
    }
    queries += n - 1;
  }
  std::vector<HeadScore> heads;
  for (int l = 0; l < n_layers; ++l) {
    for (int h = 0; h < n_kv_heads; ++h) {
      const size_t at = static_cast<size_t>(l) * n_kv_heads + h;
      heads.push_back(HeadScore{l, h, induction[at] / queries, echo[at] / queries});
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
  return out.dump(1) + "\n";
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
    const double total = static_cast<double>(n_layers) * n_kv_heads;
    int64_t keep = p.retrieval_heads >= 1.0 ? static_cast<int64_t>(p.retrieval_heads)
                                            : static_cast<int64_t>(std::llround(p.retrieval_heads * total));
    if (p.retrieval_heads > 0.0 && keep == 0) keep = 1;
    keep = std::min<int64_t>(keep, static_cast<int64_t>(it->second.size()));
    p.full_heads = 0;
    for (int64_t r = 0; r < keep; ++r) {
      const HeadScore& h = it->second[static_cast<size_t>(r)];
      if (h.layer == static_cast<int>(l)) p.full_heads |= uint64_t{1} << h.kv_head;
    }
    p.full_heads_resolved = true;
  }
  return Status::Ok();
}

}  // namespace kvsparse
