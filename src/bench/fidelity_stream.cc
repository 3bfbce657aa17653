#include "kvsparse/bench_fidelity.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <fstream>
#include <sstream>

#include "bench/tasks_internal.h"
#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/runtime.h"
#include "kvsparse/sampler.h"

namespace kvsparse {
namespace {

StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError(fmt::format("{}: cannot read {}", flag, path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return InvalidArgumentError(fmt::format("{}: error while reading {}", flag, path));
  return text.str();
}

// A file stream must hold the whole configured length: the row's length is the stream's.
Status CheckFileLength(const std::string& flag, const std::string& path, const char* what, size_t found,
                       int32_t length) {
  if (found >= static_cast<size_t>(length)) return Status::Ok();
  return InvalidArgumentError(fmt::format(
      "{} {}: {} {} tokens, but the fidelity stream at length {} needs {}: give a longer file or shorter --lengths",
      flag, path, what, found, length, length));
}

}  // namespace

std::string FidelityStreamSource::Label() const {
  switch (kind) {
    case FidelityStreamKind::kSampled: return fmt::format("sampled(seed={})", seed);
    case FidelityStreamKind::kText: return "text:" + path;
    case FidelityStreamKind::kTokens: return "tokens:" + path;
  }
  return "?";
}

StatusOr<std::vector<int32_t>> ParseFidelityTokens(std::string_view text, const std::string& file, int32_t n_vocab) {
  std::vector<int32_t> ids;
  int line = 1;
  size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      line += c == '\n' ? 1 : 0;
      ++i;
      continue;
    }
    if (c == '#') {  // a comment to the end of the line
      while (i < text.size() && text[i] != '\n') ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end])) && text[end] != '#') ++end;
    const std::string_view word = text.substr(i, end - i);
    int64_t value = 0;
    auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), value);
    if (ec != std::errc() || ptr != word.data() + word.size()) {
      return InvalidArgumentError(fmt::format("{}:{}: token {} (0-based) is '{}', not a token id (expected an integer "
                                              "in [0, {}), the model's vocabulary)",
                                              file, line, ids.size(), word, n_vocab));
    }
    if (value < 0 || value >= n_vocab) {
      return InvalidArgumentError(fmt::format("{}:{}: token {} (0-based) is {}, outside the model's vocabulary [0, {})",
                                              file, line, ids.size(), value, n_vocab));
    }
    ids.push_back(static_cast<int32_t>(value));
    i = end;
  }
  if (ids.empty()) return InvalidArgumentError(fmt::format("{}: no token ids (expected whitespace-separated integers)", file));
  return ids;
}

StatusOr<int32_t> FidelityStartToken(const Model& model, const Tokenizer* tokenizer) {
  const int32_t n_vocab = model.config().n_vocab;
  int32_t start = 1;  // llama2.c checkpoints: llama's BOS
  if (tokenizer != nullptr) start = tokenizer->bos() >= 0 ? tokenizer->bos() : tokenizer->eos();
  if (start < 0 || start >= n_vocab) {
    return InvalidArgumentError(fmt::format(
        "fidelity: model {} has no BOS or EOS token to start a sampled stream; give the stream with "
        "--fidelity-text or --fidelity-tokens",
        model.path()));
  }
  return start;
}

StatusOr<std::vector<int32_t>> SampleFidelityStream(const Model& model, int32_t bos, int32_t length, uint64_t seed,
                                                    int n_threads) {
  const ModelConfig& c = model.config();
  KVS_CHECK(length >= 1 && bos >= 0 && bos < c.n_vocab);
  ContiguousKvCache cache(ModelKvGeometry(model, /*with_windows=*/false), KvStorage::kF32, 1, length);
  Engine engine(model, &cache, n_threads);
  SamplerParams params;
  params.temperature = 1.0f;  // the model's own distribution, untruncated
  params.top_k = 0;
  params.top_p = 1.0f;
  params.repeat_penalty = 1.0f;
  params.repeat_last_n = 0;
  params.seed = seed;
  Sampler sampler(params);
  std::vector<float> logits(c.n_vocab);  // [n_vocab]
  std::vector<int32_t> stream = {bos};
  stream.reserve(length);
  while (static_cast<int32_t>(stream.size()) < length) {
    const int32_t pos = static_cast<int32_t>(stream.size()) - 1;
    KVS_RETURN_IF_ERROR(engine.Forward(0, &stream.back(), 1, pos, logits.data()));
    stream.push_back(sampler.Sample(logits.data(), c.n_vocab));
  }
  return stream;
}

StatusOr<std::vector<std::vector<int32_t>>> MakeFidelityStreams(const FidelityStreamSource& source, const Model& model,
                                                                const Tokenizer* tokenizer, int32_t length,
                                                                int samples, int n_threads) {
  std::vector<std::vector<int32_t>> streams;
  switch (source.kind) {
    case FidelityStreamKind::kSampled: {
      KVS_ASSIGN_OR_RETURN(int32_t bos, FidelityStartToken(model, tokenizer));
      // Depends on (seed, length, index) only: every method, budget and kv type sees these.
      const uint64_t length_seed = bench_internal::StreamSeed(source.seed, "fidelity", static_cast<uint64_t>(length));
      for (int i = 0; i < samples; ++i) {
        const uint64_t seed = bench_internal::StreamSeed(length_seed, "fidelity", static_cast<uint64_t>(i));
        KVS_ASSIGN_OR_RETURN(std::vector<int32_t> s, SampleFidelityStream(model, bos, length, seed, n_threads));
        streams.push_back(std::move(s));
      }
      return streams;
    }
    case FidelityStreamKind::kText: {
      if (tokenizer == nullptr) {
        return InvalidArgumentError(fmt::format(
            "--fidelity-text {}: model {} has no tokenizer (no tokenizer.ggml.tokens), so text cannot be encoded; "
            "give token ids with --fidelity-tokens instead",
            source.path, model.path()));
      }
      KVS_ASSIGN_OR_RETURN(std::string text, ReadFile("--fidelity-text", source.path));
      std::vector<int32_t> ids = tokenizer->Encode(text, /*add_bos=*/true);
      KVS_RETURN_IF_ERROR(CheckFileLength("--fidelity-text", source.path, "encodes to", ids.size(), length));
      ids.resize(length);
      streams.push_back(std::move(ids));
      return streams;
    }
    case FidelityStreamKind::kTokens: {
      KVS_ASSIGN_OR_RETURN(std::string text, ReadFile("--fidelity-tokens", source.path));
      StatusOr<std::vector<int32_t>> ids = ParseFidelityTokens(text, source.path, model.config().n_vocab);
      if (!ids.ok()) {
        return Status(ids.status().code(), fmt::format("--fidelity-tokens: {} (model {})", ids.status().message(),
                                                       model.path()));
      }
      KVS_RETURN_IF_ERROR(CheckFileLength("--fidelity-tokens", source.path, "holds", ids->size(), length));
      ids->resize(length);
      streams.push_back(std::move(*ids));
      return streams;
    }
  }
  return InternalError("unknown fidelity stream kind");
}

std::string FidelityStreamHash(const std::vector<std::vector<int32_t>>& streams) {
  uint64_t h = 1469598103934665603ULL;
  auto add = [&](uint32_t v) {
    for (int b = 0; b < 4; ++b) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ULL;
  };
  for (const std::vector<int32_t>& s : streams) {
    add(static_cast<uint32_t>(s.size()));  // stream boundaries count
    for (int32_t t : s) add(static_cast<uint32_t>(t));
  }
  return fmt::format("{:016x}", h);
}

}  // namespace kvsparse
