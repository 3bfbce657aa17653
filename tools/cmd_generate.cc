// `kvsparse generate`: stream a continuation of a prompt.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <limits>
#include <sstream>

#include "commands.h"
#include "kv_flags.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/sampler.h"
#include "kvsparse/tokenizer.h"

namespace kvsparse::cli {
namespace {

constexpr const char* kDefaultKvType = "f16";

struct GenerateArgs {
  std::string model;
  std::string prompt;
  std::string prompt_tokens;  // "1,2,3": token-level prompt for models without a tokenizer
  int n_predict = 128;
  int n_threads = 0;
  int n_ctx = 0;
  int batch = 512;
  KvFlags kv;
  SamplerParams sampling;
  bool ignore_eos = false;
  bool print_ids = false;
};

StatusOr<std::vector<int32_t>> ParseTokenList(const std::string& text) {
  std::vector<int32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      out.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return InvalidArgumentError(fmt::format("--tokens: '{}' is not a token id (expected e.g. 1,2,3)", item));
    }
  }
  return out;
}

// The flag that sets a sampling value (its JSON name in the server's errors).
const char* SamplingFlag(SamplerValue which) {
  switch (which) {
    case SamplerValue::kTemperature: return "--temp";
    case SamplerValue::kTopK: return "--top-k";
    case SamplerValue::kTopP: return "--top-p";
    case SamplerValue::kRepeatPenalty: return "--repeat-penalty";
    case SamplerValue::kRepeatLastN: return "--repeat-last-n";
    default: return "sampling";
  }
}

int Run(const GenerateArgs& a) {
  // The server's ranges (SamplerValueRequirement), checked before the model loads.
  if (auto problem = FindSamplerValueProblem(a.sampling)) {
    return Fail(InvalidArgumentError(
        fmt::format("{} {}, got {}", SamplingFlag(problem->which), problem->requirement, problem->value)));
  }
  auto loaded = LoadModelWithTokenizer(a.model);
  if (!loaded.ok()) return Fail(loaded.status());
  const std::string& path = loaded->path;
  const Model& model = *loaded->model;
  const ModelConfig& c = model.config();
  std::unique_ptr<Tokenizer>& tokenizer = loaded->tokenizer;

  std::vector<int32_t> prompt;
  if (!a.prompt_tokens.empty()) {
    auto p = ParseTokenList(a.prompt_tokens);
    if (!p.ok()) return Fail(p.status());
    prompt = *p;
  } else if (tokenizer) {
    prompt = tokenizer->Encode(a.prompt, /*add_bos=*/true);
  } else {
    if (!a.prompt.empty()) {
      return Fail(InvalidArgumentError(fmt::format(
          "{} has no tokenizer (no tokenizer.ggml.tokens); give the prompt as token ids with --tokens", path)));
    }
    prompt = {1};  // BOS of llama-family vocabularies
  }
  if (prompt.empty()) return Fail(InvalidArgumentError("the prompt is empty"));
  for (int32_t t : prompt) {
    if (t < 0 || t >= c.n_vocab)
      return Fail(InvalidArgumentError(fmt::format("prompt token {} is outside the vocabulary [0, {})", t, c.n_vocab)));
  }

  const int n_ctx = a.n_ctx > 0 ? a.n_ctx : std::min(c.max_context > 0 ? c.max_context : 4096, 4096);
  loaded->model->SetContextLength(n_ctx);  // LongRoPE files pick their factor table by the context
  if (static_cast<int>(prompt.size()) > n_ctx) {
    return Fail(InvalidArgumentError(
        fmt::format("the prompt has {} tokens but the context is {} (-c); shorten the prompt or raise -c", prompt.size(), n_ctx)));
  }
  KvStorage dense_storage = KvStorage::kF16;
  auto sparsity = ResolveKvFlags(a.kv, kDefaultKvType, c.n_layers, &dense_storage);
  if (!sparsity.ok()) return Fail(sparsity.status());
  // Dense: one contiguous buffer per layer. Sparse: paged cache + policies (room for n_ctx
  // tokens per layer is reserved as address space; memory follows the live tokens).
  auto runtime = CreateRuntime(model, *sparsity ? &**sparsity : nullptr, dense_storage, 1, n_ctx, a.n_threads,
                               a.sampling.seed);
  if (!runtime.ok()) return Fail(runtime.status());
  const std::string kv_desc = *sparsity ? KvSparsityConfigSummary((*runtime)->controller()->config())
                                        : std::string("dense ") + KvStorageName(dense_storage);
  KvCache& cache = (*runtime)->cache();
  Engine& engine = *(*runtime)->engine;
  SparseKvController* controller = (*runtime)->controller();
  Sampler sampler(a.sampling);
  std::vector<float> logits(c.n_vocab);  // [n_vocab]

  // --print-ids: token ids instead of text (to compare greedy ids with another engine).
  if (a.print_ids) tokenizer.reset();
  auto emit = [&](int32_t token) {
    if (tokenizer) {
      std::fputs(tokenizer->TokenToPiece(token).c_str(), stdout);
    } else {
      std::printf("%d ", token);
    }
    std::fflush(stdout);
  };
  if (!tokenizer) std::printf("prompt tokens: ");
  for (int32_t t : prompt) {
    if (tokenizer && t == tokenizer->bos()) continue;
    emit(t);
  }
  if (!tokenizer) std::printf("\ngenerated: ");

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const size_t batch = static_cast<size_t>(std::min(a.batch, n_ctx));  // a batch never exceeds the context
  for (size_t i = 0; i < prompt.size(); i += batch) {
    const int32_t n = static_cast<int32_t>(std::min(batch, prompt.size() - i));
    Status s = engine.Forward(0, prompt.data() + i, n, static_cast<int32_t>(i), logits.data());
    if (!s.ok()) return Fail(s);
  }
  for (int32_t t : prompt) sampler.Accept(t);
  const auto t1 = Clock::now();
  int n_generated = 0;
  int32_t pos = static_cast<int32_t>(prompt.size());
  while ((a.n_predict < 0 || n_generated < a.n_predict) && pos < n_ctx) {
    const int32_t token = sampler.Sample(logits.data(), c.n_vocab);
    sampler.AcceptGenerated(token);
    ++n_generated;
    if (tokenizer && !a.ignore_eos && tokenizer->IsEndOfGeneration(token)) break;
    emit(token);
    Status s = engine.Forward(0, &token, 1, pos++, logits.data());
    if (!s.ok()) return Fail(s);
  }
  const auto t2 = Clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("\n");
  std::fprintf(stderr, "\nprompt: %zu tokens in %.3f s (%.2f t/s); generated: %d tokens in %.3f s (%.2f t/s)\n",
               prompt.size(), prefill_s, prompt.size() / std::max(prefill_s, 1e-9), n_generated, decode_s,
               n_generated / std::max(decode_s, 1e-9));
  std::fprintf(stderr, "KV cache: %.2f MiB allocated, %.2f MiB live (%s)\n", cache.AllocatedBytes() / 1048576.0,
               cache.LiveBytes() / 1048576.0, kv_desc.c_str());
  if (a.kv.stats) {
    if (controller != nullptr) {
      std::fprintf(stderr, "%s", controller->FormatStats().c_str());
    } else {
      std::fprintf(stderr, "(dense cache: no evictions; per-layer stats need --kv-method or --kv-config)\n");
    }
  }
  return 0;
}

}  // namespace

void RegisterGenerate(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text (or tokens) continuing a prompt");
  cmd->add_option("-m,--model", args->model, "GGUF or llama2.c .bin model (default: built-in synthetic TinyLlama shape)");
  cmd->add_option("-p,--prompt", args->prompt, "prompt text (needs a tokenizer in the GGUF)");
  cmd->add_option("--tokens", args->prompt_tokens, "prompt as comma-separated token ids, e.g. 1,461,401");
  cmd->add_option("-n,--n-predict", args->n_predict, "tokens to generate (-1 = until the context is full)")
      ->capture_default_str()
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  AddThreadsOption(cmd, &args->n_threads);
  cmd->add_option("-c,--ctx-size", args->n_ctx, "context size in tokens (0 = min(model context, 4096))")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("-b,--batch-size", args->batch, "prompt tokens per forward pass")->capture_default_str()->check(kPositive);
  AddKvFlags(cmd, &args->kv, kDefaultKvType);
  cmd->add_option("--temp", args->sampling.temperature, "temperature (0 = greedy)")->capture_default_str();
  cmd->add_option("--top-k", args->sampling.top_k, "top-k (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", args->sampling.top_p, "top-p (1 = off)")->capture_default_str();
  cmd->add_option("--repeat-penalty", args->sampling.repeat_penalty, "repetition penalty (1 = off)")->capture_default_str();
  cmd->add_option("--repeat-last-n", args->sampling.repeat_last_n, "tokens the penalty looks back")->capture_default_str();
  cmd->add_option("-s,--seed", args->sampling.seed, "sampling seed")->capture_default_str();
  cmd->add_flag("--ignore-eos", args->ignore_eos, "keep generating past end-of-generation tokens");
  cmd->add_flag("--print-ids", args->print_ids, "print token ids, not text (implies --ignore-eos)");
  cmd->callback([args, exit_code] { *exit_code = Run(*args); });
}

}  // namespace kvsparse::cli
