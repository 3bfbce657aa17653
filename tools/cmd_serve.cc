// `kvsparse serve`: an OpenAI-compatible HTTP server (like llama.cpp's llama-server) in front of
// the continuous-batching Scheduler, on the paged, sparsified KV cache.
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "commands.h"
#include "kv_flags.h"
#include "kvsparse/head_probe.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/tokenizer.h"
#include "server/chat_template.h"
#include "server/http_server.h"
#include "server/metrics.h"

namespace kvsparse::cli {
namespace {

constexpr const char* kDefaultKvType = "f16";
constexpr double kMiB = 1024.0 * 1024.0;

struct ServeArgs {
  std::string model;
  std::string host = "127.0.0.1";
  int port = 8080;
  int parallel = 4;
  int n_threads = 0;
  int n_ctx = 0;
  double kv_memory_mib = 0;
  KvFlags kv;
  std::string api_key;
  std::string chat_template;
  std::string model_id;
  int queue = 64;
  int step_tokens = 512;
  int prefix_cache = 64;
  bool share_prefixes = true;
  double timeout_s = 600;
  double read_timeout_s = 10;
  int max_connections = 0;
  int http_threads = 0;
};

// The KV budget when --kv-memory is not given: `parallel` requests of n_ctx tokens each (the
// larger of a long prompt and a long generation, as admission reserves them) plus the prompt
// chunk a step holds on top.
StatusOr<size_t> DefaultKvBudget(const KvGeometry& geometry, const KvSparsityConfig& config, int32_t n_ctx,
                                 int parallel, int32_t step_tokens) {
  // A probe: the reservations only read the page layouts and the config.
  KVS_ASSIGN_OR_RETURN(SparseKvSetup probe, CreateServingKv(geometry, config, size_t{1} << 30));
  const int32_t n = std::max<int32_t>(n_ctx, 2);
  const size_t per_request =
      std::max(probe.controller->SequenceReserveBytes(n - 1, 1), probe.controller->SequenceReserveBytes(1, n - 1));
  return per_request * static_cast<size_t>(parallel) +
         probe.controller->ChunkReserveBytes(std::min({config.prefill_chunk, step_tokens, n}));
}

int Run(const ServeArgs& a) {
  // SIGINT/SIGTERM are taken by sigwait on this thread: block them before any thread starts
  // (every thread inherits the mask), so no handler ever runs inside the engine or httplib.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not a kill

  if (a.parallel < 1) return Fail(InvalidArgumentError(fmt::format("--parallel must be >= 1, got {}", a.parallel)));
  auto loaded = LoadModelWithTokenizer(a.model);
  if (!loaded.ok()) return Fail(loaded.status());
  const std::string& path = loaded->path;
  const Model& model = *loaded->model;
  const ModelConfig& c = model.config();
  std::unique_ptr<Tokenizer>& tokenizer = loaded->tokenizer;
  if (!tokenizer) {
    std::fprintf(stderr, "kvsparse serve: %s has no tokenizer: only token-id prompts (/v1/completions) will work\n",
                 path.c_str());
  }

  server::ChatTemplate chat_template = server::ChatTemplate::kChatml;
  std::string template_note;
  if (!a.chat_template.empty()) {
    auto parsed = server::ParseChatTemplateName(a.chat_template);
    if (!parsed.ok()) return Fail(InvalidArgumentError("--chat-template: " + parsed.status().message()));
    chat_template = *parsed;
  } else {
    std::string_view jinja;
    if (model.gguf() && model.gguf()->Find("tokenizer.chat_template")) {
      auto s = model.gguf()->GetString("tokenizer.chat_template");
      if (s.ok()) jinja = *s;
    }
    bool recognized = false;
    chat_template = server::DetectChatTemplate(jinja, &recognized);
    if (!recognized) {
      template_note = jinja.empty() ? " (no tokenizer.chat_template in the model: chatml; set --chat-template)"
                                    : " (tokenizer.chat_template not recognised: chatml; set --chat-template)";
    }
  }

  const int32_t n_ctx = a.n_ctx > 0 ? a.n_ctx : std::min(c.max_context > 0 ? c.max_context : 4096, 4096);
  loaded->model->SetContextLength(n_ctx);  // LongRoPE files pick their factor table by the context
  if (n_ctx < 2) return Fail(InvalidArgumentError(fmt::format("-c must be at least 2, got {}", n_ctx)));

  // Always the paged cache with its controller: a method-less run is "full" at --kv-type.
  KvStorage dense_storage = KvStorage::kF16;
  auto sparsity = ResolveKvFlags(a.kv, kDefaultKvType, c.n_layers, &dense_storage);
  if (!sparsity.ok()) return Fail(sparsity.status());
  KvSparsityConfig config;
  if (*sparsity) {
    config = std::move(**sparsity);
  } else {
    auto full = KvSparsityConfigFromFlags("full", "", KvStorageName(dense_storage), c.n_layers);
    if (!full.ok()) return Fail(full.status());
    config = std::move(*full);
  }
  // Razor's retrieval heads (its heads file, or a probe of the model), once: the budget below and
  // every request's layers start from the resolved config.
  if (Status s = ResolveRetrievalHeads(model, a.n_threads, &config); !s.ok()) return Fail(s);
  const KvGeometry geometry = ModelKvGeometry(model, /*with_windows=*/false);

  size_t budget_bytes = 0;
  if (a.kv_memory_mib > 0) {
    budget_bytes = static_cast<size_t>(a.kv_memory_mib * kMiB);
  } else {
    auto budget = DefaultKvBudget(geometry, config, n_ctx, a.parallel, a.step_tokens);
    if (!budget.ok()) return Fail(budget.status());
    budget_bytes = *budget;
  }
  auto runtime = CreateServingRuntime(model, config, budget_bytes, a.n_threads);
  if (!runtime.ok()) return Fail(runtime.status());
  SparseKvController* controller = (*runtime)->controller();

  SchedulerOptions sched_options;
  sched_options.max_running = a.parallel;
  sched_options.step_tokens = a.step_tokens;
  sched_options.max_queue = a.queue;
  sched_options.max_context = n_ctx;
  sched_options.prefix_cache_entries = a.prefix_cache;
  sched_options.share_prefixes = a.share_prefixes;
  Scheduler scheduler((*runtime)->engine.get(), controller, sched_options);

  server::ServerOptions options;
  options.host = a.host;
  options.port = a.port;
  options.api_key = a.api_key;
  options.model_id = a.model_id;
  options.chat_template = chat_template;
  options.request_timeout_s = a.timeout_s;
  options.read_timeout_s = a.read_timeout_s;
  options.max_connections = a.max_connections;
  options.http_threads = a.http_threads;
  options.kv_config = &config;
  // max_tokens beyond what the context leaves is cut to fit (finish_reason "length"), so any
  // value up to the context is accepted.
  options.limits.max_tokens_limit = std::max(options.limits.max_tokens_limit, n_ctx);
  server::Registry metrics;
  auto http = server::HttpServer::Create(model, tokenizer.get(), &scheduler, options, &metrics);
  if (!http.ok()) return Fail(http.status());
  scheduler.Start();
  if (Status started = (*http)->Start(); !started.ok()) {
    scheduler.Stop();
    return Fail(started);
  }
  for (const LayerKvConfig& layer : config.layers) {
    if (!layer.prefill.two_pass) continue;
    // The scheduler's steps mix sequences chunk by chunk: there is no whole prompt to run twice.
    std::fprintf(stderr, "kvsparse serve: note: two-pass Vertical-Slash (two_pass=1) applies to generate and bench; "
                         "the server estimates each prompt chunk on its own (two_pass=0)\n");
    break;
  }
  std::fprintf(stderr, "kvsparse serve: context %d tokens per request, chat template %s%s%s\n", n_ctx,
               std::string(server::ChatTemplateName(chat_template)).c_str(), template_note.c_str(),
               a.api_key.empty() ? "" : ", API key required");
  std::fprintf(stderr, "kvsparse serve: listening on http://%s:%d (model %s, kv %s, parallel %d, KV budget %.1f MiB)\n",
               a.host.c_str(), (*http)->port(), (*http)->model_id().c_str(),
               KvSparsityConfigSummary(controller->config()).c_str(),
               a.parallel, budget_bytes / kMiB);
  std::fflush(stderr);

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  std::fprintf(stderr, "kvsparse serve: %s: stopping (finishing requests in flight, at most 5 s)\n",
               sig == SIGINT ? "SIGINT" : "SIGTERM");
  std::fflush(stderr);
  (*http)->StopAccepting();
  scheduler.Stop(/*drain=*/true, std::chrono::seconds(5));
  (*http)->Stop(std::chrono::seconds(1));
  const SchedulerStats stats = scheduler.Stats();
  std::fprintf(stderr, "kvsparse serve: stopped (%lld prompt tokens, %lld generated, %lld preemptions)\n",
               static_cast<long long>(stats.prompt_tokens), static_cast<long long>(stats.generated_tokens),
               static_cast<long long>(stats.preemptions));
  if (a.kv.stats) std::fprintf(stderr, "%s", controller->FormatStats().c_str());
  return 0;
}

}  // namespace

void RegisterServe(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  cmd->add_option("-m,--model", args->model, "GGUF or llama2.c .bin model (default: built-in synthetic TinyLlama shape)");
  cmd->add_option("--host", args->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", args->port, "TCP port (0: any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
  cmd->add_option("--parallel", args->parallel, "requests generated at once (continuous batching)")
      ->capture_default_str()
      ->check(kPositive);
  AddThreadsOption(cmd, &args->n_threads);
  cmd->add_option("-c,--ctx-size", args->n_ctx, "context per request: prompt + completion (0 = min(model context, 4096))")
      ->capture_default_str();
  cmd->add_option("--kv-memory", args->kv_memory_mib,
                  "KV page budget in MiB for all requests together (0 = room for --parallel requests of -c tokens "
                  "under the KV config)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  AddKvFlags(cmd, &args->kv, kDefaultKvType);
  cmd->add_option("--api-key", args->api_key, "require 'Authorization: Bearer KEY' (all endpoints but /health)")
      ->envname("KVSPARSE_API_KEY");
  cmd->add_option("--chat-template", args->chat_template,
                  "llama2, llama3, chatml, mistral, gemma, phi3, deepseek2, deepseek3 or gpt-oss (default: detected from the GGUF "
                  "tokenizer.chat_template)");
  cmd->add_option("--alias", args->model_id, "model id clients name (default: the model file's name)");
  cmd->add_option("--queue", args->queue, "requests that may wait for a slot; more get 503")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--step-tokens", args->step_tokens, "rows per batch step: decode rows, then prompt chunks")
      ->capture_default_str()
      ->check(kPositive);
  cmd->add_option("--prefix-cache", args->prefix_cache,
                  "finished requests' sequences kept for later prompts that start like them (dense KV layers; "
                  "their pages are freed least recently used first when requests need the room; 0 = off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("!--no-share-prefixes", args->share_prefixes,
                "never fork another request's pages, running or cached (every prompt is computed whole: a cold "
                "baseline for measurements)");
  cmd->add_option("--max-connections", args->max_connections,
                  "connections held at once, served or waiting for an HTTP thread; more wait in the kernel's "
                  "backlog (0 = 4 x the HTTP threads)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--read-timeout", args->read_timeout_s,
                  "seconds a client may take to send the next bytes of its request (headers, body); then the "
                  "connection closes")
      ->capture_default_str()
      ->check(kPositive);
  cmd->add_option("--timeout", args->timeout_s, "seconds a generation request may take (then 408)")
      ->capture_default_str()
      ->check(kPositive);
  cmd->add_option("--http-threads", args->http_threads,
                  "HTTP worker threads (0 = --parallel + --queue + 4, at most 256)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args, exit_code] { *exit_code = Run(*args); });
}

}  // namespace kvsparse::cli
