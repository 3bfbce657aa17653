// The HTTP server: routes, the request flow into the Scheduler, SSE streaming, auth, limits and
// metrics. See http_server.h for the endpoints and the status codes.
#include "server/http_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/runtime.h"
#include "server/connection_watch.h"
#include "server/text_stream.h"

namespace kvsparse::server {
namespace {

using Clock = std::chrono::steady_clock;
using KvLayers = std::shared_ptr<const std::vector<LayerKvConfig>>;
constexpr auto kPollInterval = std::chrono::milliseconds(50);
// Exactly these strings: httplib compresses "application/json" only when the client asks, and
// never "text/event-stream" (any parameter after it would make httplib gzip the stream).
constexpr const char* kJsonType = "application/json";
constexpr const char* kSseType = "text/event-stream";

// The routes and their one method each (for 405 and the endpoint label of the metrics).
struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {
    {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"}, {"/health", "GET"},
    {"/tokenize", "POST"},       {"/detokenize", "POST"},           {"/metrics", "GET"},
    {"/tokenizer_info", "GET"},
};

const Route* FindRoute(std::string_view path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return &r;
  }
  return nullptr;
}

ApiError MakeError(int http_status, std::string type, std::string message, std::string param = {},
                   std::string code = {}) {
  ApiError e;
  e.http_status = http_status;
  e.type = std::move(type);
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

ApiError BadRequest(std::string message, std::string param = {}, std::string code = "invalid_value") {
  return MakeError(400, "invalid_request_error", std::move(message), std::move(param), std::move(code));
}

void SetError(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  res.set_content(ErrorBody(e), kJsonType);
  if (e.http_status == 503) res.set_header("Retry-After", "1");
  if (e.http_status == 401) res.set_header("WWW-Authenticate", "Bearer");
}

// HTTP optional whitespace (RFC 9110: spaces and tabs) around a header value.
std::string_view TrimOws(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool StartsWithNoCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(s[i])) != std::tolower(static_cast<unsigned char>(prefix[i])))
      return false;
  }
  return true;
}

}  // namespace

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // One pass over all of b (the secret) whatever a is: a's bytes past its end read as 0 and a
  // length difference counts as a mismatch. The time depends on b's length only, never on
  // where a first differs or on how long a is.
  volatile unsigned char diff = a.size() != b.size() ? 1 : 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

// One choice on its way: the handle, the text filter and what the response needs.
struct Generation {
  std::shared_ptr<RequestHandle> handle;
  int index = 0;  // the choice's index in the response (prompt * n + copy)
  TextStream text;
  bool skip_eog = true;  // end-of-generation tokens are not shown (ignore_eos shows them)
  bool echo = false;     // the prompt's text (and log-probabilities) come first
  Clock::time_point start;
  double timeout_s = 0;         // the deadline, from start
  std::vector<int32_t> tokens;  // scratch for WaitNext
  std::string unsent;           // text not yet sent (non-streaming: all of it)
  // logprobs: every delivered token's log-probability and text, in order.
  bool wants_logprobs = false;
  std::vector<TokenLogprob> logprobs;  // scratch for WaitNext
  std::vector<LogprobEntry> entries;
  size_t entries_sent = 0;  // streaming: entries already in a chunk
  size_t pieces_bytes = 0;  // the entries' text so far (their next text_offset)
  bool echo_placed = false;       // the echoed prompt is in `unsent` (and `entries`)
  bool role_sent = false;         // streaming chat: the choice's first delta (role) went out
  bool finish_sent = false;       // streaming: the choice's finish chunk went out
  bool stopped_by_string = false;
  bool cancelled_by_server = false;  // HttpServer::Stop ran out of grace
  bool ended = false;                // WaitNext returned false (or the server cancelled it)
  bool recorded = false;             // end-of-request metrics taken

  explicit Generation(std::vector<std::string> stop) : text(std::move(stop)) {}
};

// One completion request: its choices (each its own sequence in the scheduler) and what every
// chunk of its response repeats.
struct Completion {
  bool chat = false;
  bool include_usage = false;
  int n = 1;  // choices per prompt: usage counts a prompt's tokens once
  StreamMeta meta;
  std::vector<std::shared_ptr<Generation>> choices;
};

// The usage of all the choices: each prompt's tokens once (OpenAI's count), every choice's
// generated tokens, and the sum of their KV peaks (an upper bound where copies share pages).
static void AddUsage(const Completion& c, CompletionResult* result);

// Connections the kernel queues before the accept loop takes them.
constexpr int kListenBacklog = 1024;

// The connections BoundedConnectionQueue holds, shared with the server (which outlives the queue
// httplib owns): StopAccepting closes the gate and wakes an accept loop waiting at the cap.
struct ConnectionGate {
  std::mutex mu;
  std::condition_variable changed;  // a connection ended, or the gate closed
  std::atomic<int> held{0};
  bool closing = false;  // guarded by mu
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu);
      closing = true;
    }
    changed.notify_all();
  }
};

// httplib's thread pool with a cap on the connections it holds (served, or accepted and waiting
// for a thread). At the cap the accept loop waits for one to end, so further clients wait in the
// kernel's backlog (and past it, get no connection) instead of costing descriptors and memory:
// 10,000 idle connections hold `max_connections` descriptors, each closed after the read
// timeout. Once the server stops accepting, nothing waits (the sockets are closed by httplib).
class BoundedConnectionQueue : public httplib::TaskQueue {
 public:
  BoundedConnectionQueue(int threads, int max_connections, ConnectionGate* gate)
      : pool_(static_cast<size_t>(threads)), max_connections_(max_connections), gate_(gate) {}

  void enqueue(std::function<void()> fn) override {
    {
      std::unique_lock<std::mutex> lock(gate_->mu);
      gate_->changed.wait(lock, [this] { return gate_->held.load() < max_connections_ || gate_->closing; });
      gate_->held.fetch_add(1);
    }
    pool_.enqueue([gate = gate_, fn = std::move(fn)] {
      fn();
      {
        std::lock_guard<std::mutex> lock(gate->mu);
        gate->held.fetch_sub(1);
      }
      gate->changed.notify_one();
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
  const int max_connections_;
  ConnectionGate* gate_;
};

struct HttpServer::Impl {
  const Model& model;
  const Tokenizer* tokenizer;
  Scheduler* scheduler;
  ServerOptions options;
  std::string model_id;
  std::unique_ptr<Registry> own_registry;
  Registry* registry = nullptr;

  httplib::Server http;
  std::thread listener;
  int bound_port = -1;
  std::mutex stop_mu;  // Stop
  std::atomic<bool> started{false};
  std::atomic<int> listen_socket{-1};  // set by the socket-options callback, before bind
  ConnectionGate connections;  // BoundedConnectionQueue's count; closed by StopAccepting
  std::atomic<bool> stopped{false};
  std::atomic<bool> cancel_all{false};  // Stop's grace is over: cancel what still runs
  std::atomic<int> in_flight{0};        // generation requests submitted and not yet ended
  std::atomic<uint64_t> next_id{0};
  int64_t created = 0;  // Unix time at Create, what /v1/models reports

  std::vector<int32_t> stop_tokens;   // end-of-generation ids (GenerationRequest::stop_tokens)
  std::vector<uint8_t> hidden_token;  // [n_vocab] 1: control token, its text is never sent
  std::vector<uint8_t> eog_token;     // [n_vocab] 1: end of generation

  std::mutex seed_mu;
  std::mt19937_64 seed_rng;

  // Metrics.
  Counter* prompt_tokens_total = nullptr;
  Counter* generated_tokens_total = nullptr;
  Histogram* ttft = nullptr;
  Histogram* inter_token = nullptr;
  Histogram* duration = nullptr;
  Gauge* requests_running = nullptr;
  Gauge* requests_waiting = nullptr;
  Gauge* kv_pages_used = nullptr;
  Gauge* kv_bytes_used = nullptr;
  Gauge* kv_bytes_budget = nullptr;
  Gauge* kv_bytes_reserved = nullptr;
  Counter* kv_evicted_tokens = nullptr;
  Counter* preemptions = nullptr;
  Counter* rejected = nullptr;
  Counter* prefix_cache_hits = nullptr;
  Counter* prefix_cache_hit_tokens = nullptr;
  Counter* prefix_cache_evictions = nullptr;
  Gauge* prefix_cache_entries = nullptr;
  Gauge* prefix_cache_bytes = nullptr;
  std::mutex scrape_mu;  // the last scheduler counters seen, turned into increments
  int64_t last_evicted = 0, last_preemptions = 0, last_rejected = 0;
  int64_t last_cache_hits = 0, last_cache_hit_tokens = 0, last_cache_evictions = 0;

  Impl(const Model& m, const Tokenizer* t, Scheduler* s, ServerOptions o)
      : model(m), tokenizer(t), scheduler(s), options(std::move(o)) {}

  void InitMetrics();
  void InitVocab();
  void InitRoutes();

  // Routing helpers: auth, exceptions, the request body (POST, capped at max_body_bytes).
  bool Authorized(const httplib::Request& req) const;
  void AddGet(const char* path, std::function<void(const httplib::Request&, httplib::Response&)> fn);
  void AddPost(const char* path,
               std::function<void(const httplib::Request&, httplib::Response&, const std::string&)> fn);

  // Endpoints.
  void HandleCompletion(const httplib::Request& req, httplib::Response& res, const std::string& body, bool chat);
  void HandleTokenize(httplib::Response& res, const std::string& body);
  void HandleDetokenize(httplib::Response& res, const std::string& body);
  void HandleTokenizerInfo(httplib::Response& res);
  void HandleMetrics(httplib::Response& res);
  void HandleHttpError(const httplib::Request& req, httplib::Response& res);

  // The request flow.
  // The request's "kvsparse" methods and budgets as per-layer settings (null: the server's).
  std::variant<KvLayers, ApiError> KvOverrideLayers(const KvOverride& kv) const;
  // Prompt i of a completions request (or the chat's rendered messages) as token ids, after
  // `context` (kvsparse.context's tokens; a text prompt then has no BOS of its own).
  std::variant<std::vector<int32_t>, ApiError> PromptTokens(CompletionRequest& r, size_t i,
                                                            const std::vector<int32_t>& context) const;
  // Submits every choice (prompts x n); on a failure cancels those already submitted.
  // context_tokens: each prompt's leading tokens that are its context (GenerationRequest's).
  std::variant<std::shared_ptr<Completion>, ApiError> SubmitChoices(CompletionRequest& r,
                                                                    std::vector<std::vector<int32_t>> prompts,
                                                                    int32_t context_tokens, KvLayers kv_layers,
                                                                    Clock::time_point start);
  // Waits up to `timeout` for g's next tokens and adds their text to g.unsent (entries too).
  void Pull(Generation& g, std::chrono::milliseconds timeout);
  // Once the echoed prompt has run: its text (and log-probabilities) start the choice.
  void PlaceEcho(Generation& g);
  // Pulls every choice not yet ended once, sharing kPollInterval between them.
  void PullAll(Completion& c);
  void CancelAll(Completion& c);
  void SendFinished(Completion& c, httplib::Response& res);  // non-streaming: the whole response
  // A token's text as responses show it (control tokens, and end-of-generation ones when
  // skip_eog, are empty; without a tokenizer "<id> ").
  std::string VisiblePiece(int32_t token, bool skip_eog) const;
  // logprobs: one more token of g's entries, its text starting where the entries' text ends.
  void AddLogprobEntry(Generation& g, const TokenLogprob& logprob, const std::string& piece);
  // After the end: the finish_reason, or the error the client gets.
  std::variant<std::string, ApiError> Outcome(const Generation& g) const;
  void RecordEnd(Generation& g);
  bool StreamBody(Completion& c, httplib::DataSink& sink);
  void RefreshSchedulerMetrics();
  void StopAccepting();
};

void HttpServer::Impl::InitMetrics() {
  Registry& r = *registry;
  prompt_tokens_total = &r.GetCounter("kvsparse_prompt_tokens_total", "Prompt tokens of the requests accepted.");
  generated_tokens_total = &r.GetCounter("kvsparse_generated_tokens_total", "Tokens generated for clients.");
  ttft = &r.GetHistogram("kvsparse_time_to_first_token_seconds", "Time from submission to the first token.",
                         ExponentialBuckets(0.005, 2, 16));
  inter_token = &r.GetHistogram("kvsparse_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                                ExponentialBuckets(0.001, 2, 16));
  duration = &r.GetHistogram("kvsparse_request_duration_seconds", "Generation requests, arrival to the last token.",
                             ExponentialBuckets(0.01, 2, 18));
  requests_running = &r.GetGauge("kvsparse_requests_running", "Requests being generated.");
  requests_waiting = &r.GetGauge("kvsparse_requests_waiting", "Requests waiting for admission.");
  kv_pages_used = &r.GetGauge("kvsparse_kv_pages_used", "KV cache pages in use.");
  kv_bytes_used = &r.GetGauge("kvsparse_kv_bytes_used", "Bytes of the KV cache pages in use.");
  kv_bytes_budget = &r.GetGauge("kvsparse_kv_bytes_budget", "KV page budget in bytes.");
  kv_bytes_reserved = &r.GetGauge("kvsparse_kv_bytes_reserved", "KV bytes reserved by the running requests.");
  kv_evicted_tokens = &r.GetCounter("kvsparse_kv_evicted_tokens_total", "Tokens evicted from the KV cache (all layers).");
  preemptions = &r.GetCounter("kvsparse_preemptions_total", "Running requests preempted for want of KV pages.");
  rejected = &r.GetCounter("kvsparse_requests_rejected_total", "Requests refused by a full queue.");
  prefix_cache_hits =
      &r.GetCounter("kvsparse_prefix_cache_hits_total", "Requests that started from a cached prefix (--prefix-cache).");
  prefix_cache_hit_tokens = &r.GetCounter("kvsparse_prefix_cache_hit_tokens_total",
                                          "Prompt tokens taken from cached prefixes instead of computed.");
  prefix_cache_evictions = &r.GetCounter("kvsparse_prefix_cache_evictions_total",
                                         "Cached prefixes freed for room, least recently used first.");
  prefix_cache_entries = &r.GetGauge("kvsparse_prefix_cache_entries", "Finished sequences kept for later prompts.");
  prefix_cache_bytes = &r.GetGauge("kvsparse_prefix_cache_bytes", "KV bytes only the prefix cache holds.");
  // kvsparse_requests_total{endpoint,status} series appear as requests come (the logger).
}

void HttpServer::Impl::InitVocab() {
  if (!tokenizer) return;
  const int32_t n = std::min(tokenizer->n_vocab(), model.config().n_vocab);
  hidden_token.assign(static_cast<size_t>(std::max(n, 0)), 0);
  eog_token.assign(hidden_token.size(), 0);
  for (int32_t t = 0; t < n; ++t) {
    if (tokenizer->IsEndOfGeneration(t)) {
      stop_tokens.push_back(t);
      eog_token[static_cast<size_t>(t)] = 1;
    }
    if (tokenizer->GetTokenType(t) == TokenType::kControl) hidden_token[static_cast<size_t>(t)] = 1;
  }
}

bool HttpServer::Impl::Authorized(const httplib::Request& req) const {
  if (options.api_key.empty()) return true;
  const std::string header = req.get_header_value("Authorization");
  std::string_view token;
  if (StartsWithNoCase(header, "Bearer ")) token = TrimOws(std::string_view(header).substr(7));
  return ConstantTimeEquals(token, options.api_key);
}

namespace {
ApiError Unauthorized() {
  return MakeError(401, "authentication_error",
                   "invalid or missing API key: send the header 'Authorization: Bearer <key>'", "",
                   "invalid_api_key");
}
ApiError BodyTooLarge(size_t limit) {
  return MakeError(413, "invalid_request_error",
                   fmt::format("the request body is larger than the server's limit of {} bytes", limit), "",
                   "request_too_large");
}
ApiError Internal(std::string_view what) {
  return MakeError(500, "server_error", fmt::format("internal server error: {}", what));
}
}  // namespace

void HttpServer::Impl::AddGet(const char* path, std::function<void(const httplib::Request&, httplib::Response&)> fn) {
  const bool open = std::string_view(path) == "/health";
  http.Get(path, [this, fn = std::move(fn), open](const httplib::Request& req, httplib::Response& res) {
    try {
      if (!open && !Authorized(req)) return SetError(res, Unauthorized());
      fn(req, res);
    } catch (const std::exception& e) {
      SetError(res, Internal(e.what()));
    } catch (...) {
      SetError(res, Internal("unknown exception"));
    }
  });
}

void HttpServer::Impl::AddPost(
    const char* path, std::function<void(const httplib::Request&, httplib::Response&, const std::string&)> fn) {
  http.Post(path, [this, fn = std::move(fn)](const httplib::Request& req, httplib::Response& res,
                                              const httplib::ContentReader& reader) {
    try {
      // Read the body here rather than letting httplib do it: httplib caps bodies with a
      // Content-Length (payload_max_length, 413) but not chunked ones.
      std::string body;
      bool too_large = false;
      const bool read = reader([&](const char* data, size_t n) {
        if (body.size() + n > options.max_body_bytes) {
          too_large = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      if (!read) {
        res.set_header("Connection", "close");  // the rest of a chunked body may still be on the wire
        if (too_large || res.status == 413) return SetError(res, BodyTooLarge(options.max_body_bytes));
        return SetError(res, BadRequest("could not read the request body", "", "invalid_body"));
      }
      if (!Authorized(req)) return SetError(res, Unauthorized());
      fn(req, res, body);
    } catch (const std::exception& e) {
      SetError(res, Internal(e.what()));
    } catch (...) {
      SetError(res, Internal("unknown exception"));
    }
  });
}

// httplib calls this for every response with status >= 400 (those our handlers wrote too):
// fill in an OpenAI-style body where there is none (unknown routes, 413 from httplib itself).
void HttpServer::Impl::HandleHttpError(const httplib::Request& req, httplib::Response& res) {
  if (!res.body.empty() || res.content_provider_) return;
  ApiError e;
  switch (res.status) {
    case 404: {
      if (const Route* r = FindRoute(req.path); r && req.method != r->method &&
                                                !(req.method == "HEAD" && std::string_view(r->method) == "GET")) {
        e = MakeError(405, "invalid_request_error",
                      fmt::format("{} {} is not allowed; use {}", req.method, req.path, r->method), "",
                      "method_not_allowed");
        res.set_header("Allow", r->method);
      } else {
        e = MakeError(404, "invalid_request_error", fmt::format("unknown endpoint: {} {}", req.method, req.path), "",
                      "unknown_url");
      }
      break;
    }
    case 413:
      e = BodyTooLarge(options.max_body_bytes);
      break;
    case 414:
      e = MakeError(414, "invalid_request_error", "the request URI is too long");
      break;
    case 500:
      e = Internal("the request could not be handled");
      break;
    default:
      e = MakeError(res.status, "invalid_request_error",
                    fmt::format("the request could not be handled (HTTP {})", res.status));
      break;
  }
  SetError(res, e);
}

void HttpServer::Impl::InitRoutes() {
  http.set_payload_max_length(options.max_body_bytes);
  http.set_tcp_nodelay(true);
  auto whole_and_micro = [](double seconds) {
    const auto whole = static_cast<time_t>(seconds);
    return std::pair<time_t, time_t>{whole, static_cast<time_t>((seconds - static_cast<double>(whole)) * 1e6)};
  };
  const auto [read_s, read_us] = whole_and_micro(options.read_timeout_s);
  http.set_read_timeout(read_s, read_us);
  const auto [write_s, write_us] = whole_and_micro(options.write_timeout_s);
  http.set_write_timeout(write_s, write_us);
  http.set_keep_alive_timeout(options.keep_alive_timeout_s);
  // httplib's default sets SO_REUSEPORT, which lets a second server bind the same port and
  // silently take half the connections: SO_REUSEADDR only (a restart may reuse a TIME_WAIT
  // port), so a port in use is a bind error.
  http.set_socket_options([this](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_socket = static_cast<int>(sock);
  });
  const int threads = options.http_threads > 0
                          ? options.http_threads
                          : std::min(256, scheduler->options().max_running + scheduler->options().max_queue + 4);
  const int max_connections = options.max_connections > 0 ? options.max_connections : 4 * threads;
  http.new_task_queue = [this, threads, max_connections] {
    return new BoundedConnectionQueue(threads, max_connections, &connections);
  };

  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    SetError(res, Internal(what));
  });
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
        HandleHttpError(req, res);
        // Handled: httplib then sets Content-Length for the body written here.
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    const Route* r = FindRoute(req.path);
    registry
        ->GetCounter("kvsparse_requests_total", "HTTP requests by endpoint and status.",
                     {{"endpoint", r ? r->path : "other"}, {"status", std::to_string(res.status)}})
        .Inc();
  });

  AddPost("/v1/completions", [this](const httplib::Request& req, httplib::Response& res, const std::string& body) {
    HandleCompletion(req, res, body, /*chat=*/false);
  });
  AddPost("/v1/chat/completions",
          [this](const httplib::Request& req, httplib::Response& res, const std::string& body) {
            HandleCompletion(req, res, body, /*chat=*/true);
          });
  AddPost("/tokenize", [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
    HandleTokenize(res, body);
  });
  AddPost("/detokenize", [this](const httplib::Request&, httplib::Response& res, const std::string& body) {
    HandleDetokenize(res, body);
  });
  AddGet("/tokenizer_info", [this](const httplib::Request&, httplib::Response& res) { HandleTokenizerInfo(res); });
  AddGet("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(ModelsBody(model_id, created), kJsonType);
  });
  AddGet("/health",
         [](const httplib::Request&, httplib::Response& res) { res.set_content("{\"status\":\"ok\"}", kJsonType); });
  AddGet("/metrics", [this](const httplib::Request&, httplib::Response& res) { HandleMetrics(res); });
}

std::variant<KvLayers, ApiError> HttpServer::Impl::KvOverrideLayers(const KvOverride& kv) const {
  if (!kv.method && !kv.budget && !kv.kv_type) return KvLayers();
  const KvSparsityConfig* c = options.kv_config;
  if (c == nullptr || c->layers.empty()) {
    const char* field = kv.method ? "kv_method" : kv.budget ? "kv_budget" : "kv_type";
    return BadRequest("this server takes no per-request KV settings", fmt::format("kvsparse.{}", field),
                      "unsupported_value");
  }
  // A JSON number: an integer >= 2 is a token count, anything else a fraction of the context
  // (1.0 is the whole context, not one token).
  std::string budget;
  if (kv.budget) {
    const double b = *kv.budget;
    if (b >= 2 && b == std::floor(b) && b <= 2147483647.0) {
      budget = fmt::format("{}", static_cast<int64_t>(b));
    } else {
      budget = fmt::format("{}", b);
      if (budget.find_first_of(".eE") == std::string::npos) budget += ".0";  // "1" -> "1.0": a fraction
    }
  }
  auto layers = KvLayersWithOverride(*c, kv.method.value_or(""), budget, kv.kv_type.value_or(""));
  if (!layers.ok()) {
    const std::string& m = layers.status().message();
    const char* param = m.rfind("kv_budget", 0) == 0  ? "kvsparse.kv_budget"
                        : m.rfind("kv_method", 0) == 0 ? "kvsparse.kv_method"
                        : m.rfind("kv_type", 0) == 0   ? "kvsparse.kv_type"
                        : kv.method                    ? "kvsparse.kv_method"
                        : kv.budget                    ? "kvsparse.kv_budget"
                                                       : "kvsparse.kv_type";
    return BadRequest(m, param);
  }
  // As at start-up: on sliding-window layers the method stays "full" unless the config names them.
  KvSparsityConfig resolved;
  resolved.layers = std::move(*layers);
  if (Status sliding = ResolveSlidingLayers(model, &resolved); !sliding.ok()) {
    return BadRequest(sliding.message(), "kvsparse.kv_method");
  }
  return std::make_shared<const std::vector<LayerKvConfig>>(std::move(resolved.layers));
}

std::variant<std::vector<int32_t>, ApiError> HttpServer::Impl::PromptTokens(CompletionRequest& r, size_t i,
                                                                          const std::vector<int32_t>& context) const {
  const std::string param = r.chat ? "messages" : r.prompts.size() == 1 ? "prompt" : fmt::format("prompt[{}]", i);
  std::vector<int32_t> prompt = context;
  if (!r.chat && r.prompts[i].is_tokens) {
    const int32_t n_vocab = model.config().n_vocab;
    const std::vector<int32_t>& ids = r.prompts[i].tokens;
    for (size_t k = 0; k < ids.size(); ++k) {
      if (ids[k] < 0 || ids[k] >= n_vocab) {
        return BadRequest(fmt::format("{}[{}]: token id {} is outside the vocabulary [0, {})", param, k, ids[k],
                                      n_vocab),
                          fmt::format("{}[{}]", param, k));
      }
    }
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  } else if (!tokenizer) {
    return BadRequest(fmt::format("the model '{}' has no tokenizer (no tokenizer.ggml.tokens in its file): send the "
                                  "prompt as token ids to /v1/completions",
                                  model_id),
                      param, "no_tokenizer");
  } else if (r.chat) {
    auto text = ApplyChatTemplate(options.chat_template, r.messages, /*add_generation_prompt=*/true);
    if (!text.ok()) {
      ApiError e = ApiErrorFromStatus(text.status());
      if (e.param.empty()) e.param = "messages";
      return e;
    }
    prompt = tokenizer->Encode(*text, /*add_bos=*/true, /*parse_special=*/true);
  } else {
    const std::vector<int32_t> text = tokenizer->Encode(r.prompts[i].text, /*add_bos=*/context.empty());
    prompt.insert(prompt.end(), text.begin(), text.end());
  }
  if (prompt.size() <= context.size()) return BadRequest("the prompt is empty (it has no tokens)", param);
  if (r.kv.context_tokens && prompt.size() <= static_cast<size_t>(*r.kv.context_tokens)) {
    return BadRequest(fmt::format("{} has {} tokens, not more than kvsparse.context_tokens ({}): a question must "
                                  "follow the context",
                                  param, prompt.size(), *r.kv.context_tokens),
                      param);
  }
  const int32_t max_context = scheduler->options().max_context;
  if (prompt.size() >= static_cast<size_t>(max_context)) {
    return BadRequest(fmt::format("{} has {} tokens but the context is {} tokens (prompt and completion together); "
                                  "shorten the prompt",
                                  param, prompt.size(), max_context),
                      param, "context_length_exceeded");
  }
  return prompt;
}

std::variant<std::shared_ptr<Completion>, ApiError> HttpServer::Impl::SubmitChoices(
    CompletionRequest& r, std::vector<std::vector<int32_t>> prompts, int32_t context_tokens, KvLayers kv_layers,
    Clock::time_point start) {
  auto completion = std::make_shared<Completion>();
  Completion& c = *completion;
  c.chat = r.chat;
  c.include_usage = r.stream && r.include_usage_in_stream;
  c.n = r.n;
  c.meta.id = CompletionId(r.chat, next_id.fetch_add(1));
  c.meta.created = static_cast<int64_t>(std::time(nullptr));
  c.meta.model = model_id;
  double timeout_s = options.request_timeout_s;
  if (r.timeout_s) timeout_s = std::min(timeout_s, *r.timeout_s);
  const int32_t context = scheduler->options().max_context;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const int32_t n_prompt = static_cast<int32_t>(prompts[p].size());
    for (int copy = 0; copy < r.n; ++copy) {
      GenerationRequest g;
      // The copies of a prompt are submitted together: the scheduler computes it once and forks
      // its pages for the others (SchedulerOptions::share_prefixes).
      g.prompt = copy + 1 < r.n ? prompts[p] : std::move(prompts[p]);
      // What does not fit the context is cut: the choice then ends with finish_reason "length".
      g.max_tokens = std::min<int32_t>(r.max_tokens, context - n_prompt);
      g.sampling.temperature = r.temperature;
      g.sampling.top_k = r.top_k;
      g.sampling.top_p = r.top_p;
      g.sampling.repeat_penalty = r.repeat_penalty;
      g.sampling.presence_penalty = r.presence_penalty;
      g.sampling.frequency_penalty = r.frequency_penalty;
      g.sampling.min_p = r.min_p;
      g.sampling.logit_bias = r.logit_bias;
      if (r.seed) {
        g.sampling.seed = *r.seed + static_cast<uint64_t>(copy);  // the copies differ, reproducibly
      } else {
        std::lock_guard<std::mutex> lock(seed_mu);
        g.sampling.seed = seed_rng();
      }
      if (!r.ignore_eos) g.stop_tokens = stop_tokens;
      g.stop_tokens.insert(g.stop_tokens.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
      g.logprobs = r.logprobs;
      g.echo = r.echo;
      g.context_tokens = context_tokens;
      g.kv_layers = kv_layers;
      g.deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
      auto handle = scheduler->Submit(std::move(g));
      if (!handle.ok()) {
        CancelAll(c);
        ApiError e = ApiErrorFromStatus(handle.status());
        if (e.http_status == 503) e.code = "server_busy";
        if (prompts.size() > 1 && e.param.empty()) e.param = fmt::format("prompt[{}]", p);
        return e;
      }
      prompt_tokens_total->Inc(n_prompt);
      in_flight.fetch_add(1);
      auto gen = std::make_shared<Generation>(r.stop);
      gen->handle = std::move(*handle);
      gen->index = static_cast<int>(c.choices.size());
      gen->skip_eog = !r.ignore_eos;
      gen->echo = r.echo;
      gen->wants_logprobs = r.logprobs >= 0;
      gen->start = start;
      gen->timeout_s = timeout_s;
      c.choices.push_back(std::move(gen));
    }
  }
  return completion;
}

void HttpServer::Impl::CancelAll(Completion& c) {
  for (auto& g : c.choices) {
    if (!g->ended) g->handle->Cancel();
    g->ended = true;
    RecordEnd(*g);
  }
}

void HttpServer::Impl::HandleCompletion(const httplib::Request& req, httplib::Response& res, const std::string& body,
                                        bool chat) {
  const Clock::time_point start = Clock::now();
  auto parsed = ParseCompletionRequest(body, chat, options.limits);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return SetError(res, *e);
  CompletionRequest& r = std::get<CompletionRequest>(parsed);
  if (!r.model.empty() && r.model != model_id) {
    return SetError(res, MakeError(404, "invalid_request_error",
                                   fmt::format("the model '{}' does not exist; this server serves '{}'", r.model,
                                               model_id),
                                   "model", "model_not_found"));
  }
  auto kv_layers = KvOverrideLayers(r.kv);
  if (const ApiError* e = std::get_if<ApiError>(&kv_layers)) return SetError(res, *e);

  // kvsparse.context: compressed once, before every prompt.
  std::vector<int32_t> context;
  if (r.kv.context) {
    if (!tokenizer) {
      return SetError(res, BadRequest(fmt::format("the model '{}' has no tokenizer: send the context as the prompts' "
                                                  "first tokens with kvsparse.context_tokens",
                                                  model_id),
                                      "kvsparse.context", "no_tokenizer"));
    }
    context = tokenizer->Encode(*r.kv.context, /*add_bos=*/true);
  }
  const int32_t context_tokens = r.kv.context_tokens ? *r.kv.context_tokens : static_cast<int32_t>(context.size());
  // Every prompt's tokens, before anything is submitted: a bad prompt refuses the whole batch.
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < (chat ? 1 : r.prompts.size()); ++i) {
    auto prompt = PromptTokens(r, i, context);
    if (const ApiError* e = std::get_if<ApiError>(&prompt)) return SetError(res, *e);
    prompts.push_back(std::move(std::get<std::vector<int32_t>>(prompt)));
  }
  const int32_t n_vocab = model.config().n_vocab;
  for (size_t i = 0; i < r.stop_token_ids.size(); ++i) {
    if (r.stop_token_ids[i] >= n_vocab) {
      return SetError(res, BadRequest(fmt::format("stop_token_ids[{}]: token id {} is outside the vocabulary [0, {})",
                                                  i, r.stop_token_ids[i], n_vocab),
                                      fmt::format("stop_token_ids[{}]", i)));
    }
  }
  for (const auto& [token, bias] : r.logit_bias) {
    if (token >= n_vocab) {
      return SetError(res, BadRequest(fmt::format("logit_bias: token id {} is outside the vocabulary [0, {})", token,
                                                  n_vocab),
                                      fmt::format("logit_bias.{}", token)));
    }
  }
  if (cancel_all.load() || stopped.load()) {
    return SetError(res, MakeError(503, "unavailable_error", "the server is shutting down"));
  }

  auto submitted =
      SubmitChoices(r, std::move(prompts), context_tokens, std::get<KvLayers>(std::move(kv_layers)), start);
  if (const ApiError* e = std::get_if<ApiError>(&submitted)) return SetError(res, *e);
  std::shared_ptr<Completion> completion = std::get<std::shared_ptr<Completion>>(std::move(submitted));
  Completion& c = *completion;
  // Should anything below throw, the choices must not go on generating for nobody.
  struct CancelUnlessHandedOff {
    Impl* impl;
    Completion& c;
    bool handed_off = false;
    ~CancelUnlessHandedOff() {
      if (!handed_off) impl->CancelAll(c);
    }
  } guard{this, c};
  auto all_ended = [&] {
    return std::all_of(c.choices.begin(), c.choices.end(), [](const auto& g) { return g->ended; });
  };

  if (!r.stream) {
    // Nothing is written before the end, so a client that hangs up is seen by watching its
    // socket between pulls: its choices are cancelled and their pages freed at once.
    const ConnectionWatch watch(req.local_port, req.remote_port);
    while (!all_ended()) {
      PullAll(c);
      if (!all_ended() && watch.PeerClosed()) {
        CancelAll(c);
        res.status = 499;  // nginx's "client closed request", for the logs and /metrics; nobody reads it
        return;
      }
    }
    for (auto& g : c.choices) RecordEnd(*g);
    return SendFinished(c, res);
  }

  // Streaming. Wait for the first text (or every choice's end) before committing to "200 OK", so
  // a request that fails before its first token gets a real status code.
  auto has_output = [](const Generation& g) { return !g.unsent.empty() || g.entries_sent < g.entries.size(); };
  while (!all_ended() && std::none_of(c.choices.begin(), c.choices.end(), [&](const auto& g) { return has_output(*g); })) {
    PullAll(c);
  }
  for (const auto& g : c.choices) {
    if (!g->ended) continue;
    auto outcome = Outcome(*g);
    if (const ApiError* e = std::get_if<ApiError>(&outcome)) {
      CancelAll(c);
      return SetError(res, *e);
    }
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      kSseType, [this, completion](size_t, httplib::DataSink& sink) { return StreamBody(*completion, sink); },
      [this, completion](bool) {
        // The stream ended early (client gone, server stopping) or never started.
        CancelAll(*completion);
      });
  guard.handed_off = true;  // the content provider and its releaser own it now
}

static void AddUsage(const Completion& c, CompletionResult* result) {
  for (const auto& g : c.choices) {
    const RequestStats stats = g->handle->stats();
    if (g->index % c.n == 0) result->prompt_tokens += stats.prompt_tokens;  // a prompt's tokens once
    result->completion_tokens += stats.completion_tokens;
    result->kv_peak_bytes += stats.kv_peak_bytes;
  }
}

void HttpServer::Impl::SendFinished(Completion& c, httplib::Response& res) {
  CompletionResult result;
  result.id = c.meta.id;
  result.created = c.meta.created;
  result.model = model_id;
  AddUsage(c, &result);
  for (auto& g : c.choices) {
    auto outcome = Outcome(*g);
    if (const ApiError* e = std::get_if<ApiError>(&outcome)) return SetError(res, *e);
    ChoiceResult choice;
    choice.text = std::move(g->unsent);
    choice.finish_reason = std::get<std::string>(outcome);
    if (g->wants_logprobs) {
      // A stop string cut the text: the tokens from the cut on are not part of it.
      std::erase_if(g->entries,
                    [&](const LogprobEntry& e) { return e.text_offset >= choice.text.size() && !e.piece.empty(); });
      choice.logprobs = std::move(g->entries);
    }
    result.choices.push_back(std::move(choice));
  }
  res.set_content(c.chat ? ChatCompletionResponseBody(result) : CompletionResponseBody(result), kJsonType);
}

std::string HttpServer::Impl::VisiblePiece(int32_t token, bool skip_eog) const {
  if (!tokenizer) return fmt::format("{} ", token);
  const size_t i = static_cast<size_t>(token);
  if (i < hidden_token.size() && (hidden_token[i] || (skip_eog && eog_token[i]))) return {};
  return tokenizer->TokenToPiece(token);
}

void HttpServer::Impl::AddLogprobEntry(Generation& g, const TokenLogprob& logprob, const std::string& piece) {
  LogprobEntry entry;
  entry.piece = piece;
  entry.text_offset = g.pieces_bytes;
  entry.logprob = logprob.logprob;
  for (const auto& [token, value] : logprob.top) entry.top.emplace_back(VisiblePiece(token, false), value);
  g.pieces_bytes += piece.size();
  g.entries.push_back(std::move(entry));
}

void HttpServer::Impl::PlaceEcho(Generation& g) {
  g.echo_placed = true;
  for (const TokenLogprob& lp : g.handle->prompt_logprobs()) {
    const std::string piece = VisiblePiece(lp.token, false);
    if (g.wants_logprobs) AddLogprobEntry(g, lp, piece);
    g.unsent += piece;
  }
  g.pieces_bytes = g.unsent.size();  // the generated tokens' offsets count the echoed text
}

void HttpServer::Impl::Pull(Generation& g, std::chrono::milliseconds timeout) {
  if (cancel_all.load()) {
    g.handle->Cancel();
    g.cancelled_by_server = true;
    g.ended = true;
    return;
  }
  g.tokens.clear();
  g.logprobs.clear();
  const bool more = g.handle->WaitNext(&g.tokens, timeout, g.wants_logprobs ? &g.logprobs : nullptr);
  generated_tokens_total->Inc(static_cast<double>(g.tokens.size()));
  // The prompt's log-probabilities are complete once its first token is delivered (or it ended).
  if (g.echo && !g.echo_placed && (!g.tokens.empty() || !more)) PlaceEcho(g);
  for (size_t k = 0; k < g.tokens.size(); ++k) {
    if (g.text.stopped()) break;
    const std::string piece = VisiblePiece(g.tokens[k], g.skip_eog);
    if (g.wants_logprobs && k < g.logprobs.size()) AddLogprobEntry(g, g.logprobs[k], piece);
    g.unsent += g.text.Push(piece);
  }
  if (g.text.stopped() && !g.stopped_by_string) {
    g.stopped_by_string = true;
    g.handle->Finish();  // a stop string: end it now, free its pages
  }
  if (!more) {
    g.ended = true;
    if (!g.text.stopped()) g.unsent += g.text.Finish();
  }
}

void HttpServer::Impl::PullAll(Completion& c) {
  const auto active = std::count_if(c.choices.begin(), c.choices.end(), [](const auto& g) { return !g->ended; });
  const auto slice = std::max(std::chrono::milliseconds(1), kPollInterval / std::max<decltype(active)>(active, 1));
  for (auto& g : c.choices) {
    if (!g->ended) Pull(*g, slice);
  }
}

std::variant<std::string, ApiError> HttpServer::Impl::Outcome(const Generation& g) const {
  if (g.stopped_by_string) return std::string("stop");
  if (g.cancelled_by_server) {
    return MakeError(503, "unavailable_error", "the server is shutting down; the request was not finished");
  }
  const RequestStats stats = g.handle->stats();
  switch (g.handle->finish_reason()) {
    case FinishReason::kStop:
      return std::string("stop");
    case FinishReason::kLength:
      return std::string("length");
    case FinishReason::kTimeout:
      return MakeError(408, "timeout_error",
                       fmt::format("the request ran past its deadline ({} s) after generating {} tokens; raise "
                                   "\"timeout_s\" or lower max_tokens",
                                   g.timeout_s, stats.completion_tokens),
                       "", "request_timeout");
    case FinishReason::kError:
      return MakeError(500, "server_error", fmt::format("generation failed: {}", g.handle->error().ToString()));
    case FinishReason::kShutdown:
    case FinishReason::kCancelled:
      return MakeError(503, "unavailable_error", "the server is shutting down; the request was not finished");
    case FinishReason::kNone:
      break;
  }
  return Internal("the request ended without a finish reason");
}

void HttpServer::Impl::RecordEnd(Generation& g) {
  if (g.recorded) return;
  g.recorded = true;
  in_flight.fetch_sub(1);
  const RequestStats stats = g.handle->stats();
  if (stats.ttft_s >= 0) ttft->Observe(stats.ttft_s);
  for (size_t i = 1; i < stats.token_times_s.size(); ++i) {
    inter_token->Observe(stats.token_times_s[i] - stats.token_times_s[i - 1]);
  }
  duration->Observe(std::chrono::duration<double>(Clock::now() - g.start).count());
}

bool HttpServer::Impl::StreamBody(Completion& c, httplib::DataSink& sink) {
  try {
    auto send = [&](const std::string& event) {
      if (sink.write(event.data(), event.size())) return true;
      // The client is gone: free the choices' sequences and pages now.
      CancelAll(c);
      return false;
    };
    // What a choice has that the client has not: its text and its tokens' log-probabilities.
    auto flush = [&](Generation& g) {
      if (c.chat && !g.role_sent) {  // as OpenAI: the role first, with empty content
        g.role_sent = true;
        if (!send(SseEvent(ChatDeltaChunk(c.meta, g.index, "", /*first=*/true)))) return false;
      }
      if (g.unsent.empty() && g.entries_sent == g.entries.size()) return true;
      std::vector<LogprobEntry> slice(g.entries.begin() + static_cast<std::ptrdiff_t>(g.entries_sent), g.entries.end());
      const std::vector<LogprobEntry>* logprobs = g.wants_logprobs ? &slice : nullptr;
      const std::string chunk = c.chat ? ChatDeltaChunk(c.meta, g.index, g.unsent, /*first=*/false, logprobs)
                                       : CompletionChunk(c.meta, g.index, g.unsent, {}, logprobs);
      g.unsent.clear();
      g.entries_sent = g.entries.size();
      return send(SseEvent(chunk));
    };
    for (;;) {
      bool all_finished = true;
      for (auto& gp : c.choices) {
        Generation& g = *gp;
        if (g.finish_sent) continue;
        if (!flush(g)) return false;
        if (!g.ended) {
          all_finished = false;
          continue;
        }
        RecordEnd(g);
        auto outcome = Outcome(g);
        if (const ApiError* e = std::get_if<ApiError>(&outcome)) {
          // One choice failed: the stream ends with its error, the others are cancelled.
          CancelAll(c);
          if (!send(SseEvent(ErrorBody(*e)))) return false;
          if (!send(std::string(kSseDone))) return false;
          sink.done();
          return true;
        }
        const std::string& reason = std::get<std::string>(outcome);
        if (!send(SseEvent(c.chat ? ChatFinishChunk(c.meta, g.index, reason)
                                  : CompletionChunk(c.meta, g.index, "", reason)))) {
          return false;
        }
        g.finish_sent = true;
      }
      if (all_finished) break;
      PullAll(c);
    }
    if (c.include_usage) {
      CompletionResult usage;
      AddUsage(c, &usage);
      if (!send(SseEvent(UsageChunk(c.meta, c.chat, usage.prompt_tokens, usage.completion_tokens,
                                    usage.kv_peak_bytes)))) {
        return false;
      }
    }
    if (!send(std::string(kSseDone))) return false;
    sink.done();
    return true;
  } catch (...) {
    // Nothing may escape: httplib runs this outside its handler's try block.
    CancelAll(c);
    return false;
  }
}

void HttpServer::Impl::HandleTokenize(httplib::Response& res, const std::string& body) {
  auto parsed = ParseTokenizeRequest(body, options.limits);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return SetError(res, *e);
  const TokenizeRequest& r = std::get<TokenizeRequest>(parsed);
  if (!tokenizer) {
    return SetError(res, BadRequest(fmt::format("the model '{}' has no tokenizer", model_id), "content",
                                    "no_tokenizer"));
  }
  const std::vector<int32_t> tokens = tokenizer->Encode(r.content, r.add_special, r.parse_special);
  res.set_content(TokenizeResponseBody(tokens, scheduler->options().max_context), kJsonType);
}

void HttpServer::Impl::HandleTokenizerInfo(httplib::Response& res) {
  if (!tokenizer) {
    return SetError(res, BadRequest(fmt::format("the model '{}' has no tokenizer", model_id), "", "no_tokenizer"));
  }
  TokenizerInfo info;
  info.tokenizer_class = fmt::format("kvsparse-{}", tokenizer->model_name() == "llama" ? "spm" : "bpe");
  info.bos_token_id = tokenizer->bos();
  info.eos_token_id = tokenizer->eos();
  info.bos_token = std::string(tokenizer->TokenText(info.bos_token_id));
  info.eos_token = std::string(tokenizer->TokenText(info.eos_token_id));
  const std::vector<int32_t> empty = tokenizer->Encode("", /*add_bos=*/true);
  info.add_bos_token = !empty.empty() && empty.front() == info.bos_token_id;
  info.vocab_size = tokenizer->n_vocab();
  info.model_max_length = scheduler->options().max_context;
  info.chat_template = std::string(ChatTemplateName(options.chat_template));
  res.set_content(TokenizerInfoBody(info), kJsonType);
}

void HttpServer::Impl::HandleDetokenize(httplib::Response& res, const std::string& body) {
  auto parsed = ParseDetokenizeRequest(body);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return SetError(res, *e);
  const DetokenizeRequest& r = std::get<DetokenizeRequest>(parsed);
  if (!tokenizer) {
    return SetError(res, BadRequest(fmt::format("the model '{}' has no tokenizer", model_id), "tokens",
                                    "no_tokenizer"));
  }
  const int32_t n_vocab = tokenizer->n_vocab();
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    if (r.tokens[i] < 0 || r.tokens[i] >= n_vocab) {
      return SetError(res, BadRequest(fmt::format("tokens[{}]: token id {} is outside the vocabulary [0, {})", i,
                                                  r.tokens[i], n_vocab),
                                      fmt::format("tokens[{}]", i)));
    }
  }
  res.set_content(DetokenizeResponseBody(tokenizer->Decode(r.tokens)), kJsonType);
}

void HttpServer::Impl::RefreshSchedulerMetrics() {
  const SchedulerStats s = scheduler->Stats();
  requests_running->Set(s.running);
  requests_waiting->Set(s.waiting);
  kv_pages_used->Set(static_cast<double>(s.kv_pages_used));
  kv_bytes_used->Set(static_cast<double>(s.kv_used_bytes));
  kv_bytes_budget->Set(static_cast<double>(s.kv_budget_bytes));
  kv_bytes_reserved->Set(static_cast<double>(s.kv_reserved_bytes));
  prefix_cache_entries->Set(s.prefix_cache_entries);
  prefix_cache_bytes->Set(static_cast<double>(s.prefix_cache_bytes));
  std::lock_guard<std::mutex> lock(scrape_mu);
  auto advance = [](Counter* c, int64_t now, int64_t* last) {
    if (now > *last) c->Inc(static_cast<double>(now - *last));
    *last = std::max(*last, now);
  };
  advance(kv_evicted_tokens, s.evicted_tokens, &last_evicted);
  advance(preemptions, s.preemptions, &last_preemptions);
  advance(rejected, s.rejected, &last_rejected);
  advance(prefix_cache_hits, s.prefix_cache_hits, &last_cache_hits);
  advance(prefix_cache_hit_tokens, s.prefix_cache_hit_tokens, &last_cache_hit_tokens);
  advance(prefix_cache_evictions, s.prefix_cache_evictions, &last_cache_evictions);
}

void HttpServer::Impl::HandleMetrics(httplib::Response& res) {
  RefreshSchedulerMetrics();
  res.set_content(registry->Render(), std::string(kPrometheusContentType));
}

void HttpServer::Impl::StopAccepting() {
  connections.Close();  // an accept loop waiting for a connection slot goes on (and ends)
  if (started.load()) http.stop();  // closes the listening socket; the accept loop ends
}

// ---- HttpServer ----

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Create(const Model& model, const Tokenizer* tokenizer,
                                                         Scheduler* scheduler, ServerOptions options,
                                                         Registry* metrics) {
  if (!scheduler) return InvalidArgumentError("HttpServer: no scheduler");
  if (options.port < 0 || options.port > 65535) {
    return InvalidArgumentError(fmt::format("--port: {} is not a TCP port (0-65535; 0 picks a free one)", options.port));
  }
  if (options.max_body_bytes == 0) return InvalidArgumentError("HttpServer: max_body_bytes must be positive");
  if (!(options.read_timeout_s > 0 && options.read_timeout_s < 86400) ||
      !(options.write_timeout_s > 0 && options.write_timeout_s < 86400) || options.keep_alive_timeout_s < 1) {
    return InvalidArgumentError(fmt::format(
        "server timeouts must be positive and under a day: read {} s, write {} s, keep-alive {} s",
        options.read_timeout_s, options.write_timeout_s, options.keep_alive_timeout_s));
  }
  if (!(options.request_timeout_s > 0)) {
    return InvalidArgumentError(fmt::format("--timeout: must be positive, got {}", options.request_timeout_s));
  }
  auto impl = std::make_unique<Impl>(model, tokenizer, scheduler, std::move(options));
  Impl& s = *impl;
  s.model_id = s.options.model_id;
  if (s.model_id.empty()) s.model_id = std::filesystem::path(model.path()).stem().string();
  if (s.model_id.empty()) s.model_id = "kvsparse";
  if (metrics) {
    s.registry = metrics;
  } else {
    s.own_registry = std::make_unique<Registry>();
    s.registry = s.own_registry.get();
  }
  std::random_device rd;
  s.seed_rng.seed((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                  static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  s.next_id = s.seed_rng() & 0xffffffff00000000ull;  // a random start; the low half counts
  s.created = static_cast<int64_t>(std::time(nullptr));
  s.InitMetrics();
  s.InitVocab();
  s.InitRoutes();
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

Status HttpServer::Start() {
  Impl& s = *impl_;
  if (s.started.load() || s.stopped.load()) return InvalidArgumentError("HttpServer::Start: already started");
  const std::string where = fmt::format("{}:{}", s.options.host, s.options.port);
  errno = 0;
  int port = -1;
  if (s.options.port == 0) {
    port = s.http.bind_to_any_port(s.options.host);
  } else if (s.http.bind_to_port(s.options.host, s.options.port)) {
    port = s.options.port;
  }
  if (port <= 0) {
    const int err = errno;
    return InvalidArgumentError(fmt::format("cannot listen on {}: {}", where,
                                            err != 0 ? std::strerror(err)
                                                     : "the address could not be resolved or bound"));
  }
  s.bound_port = port;
  // httplib 0.11 listens with a backlog of 5: a burst of clients would see dropped connections.
  // Linux lets listen() on a listening socket raise its backlog.
  if (const int fd = s.listen_socket.load(); fd >= 0) ::listen(fd, kListenBacklog);
  s.listener = std::thread([&s] { s.http.listen_after_bind(); });
  // httplib's stop() only works once the accept loop runs: wait for it.
  const auto give_up = Clock::now() + std::chrono::seconds(10);
  while (!s.http.is_running() && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.started = true;
  if (!s.http.is_running()) {
    Stop();
    return InternalError(fmt::format("the HTTP server on {} did not start", where));
  }
  return Status::Ok();
}

int HttpServer::open_connections() const { return impl_->connections.held.load(); }

int HttpServer::port() const { return impl_->bound_port > 0 ? impl_->bound_port : impl_->options.port; }

void HttpServer::StopAccepting() { impl_->StopAccepting(); }

void HttpServer::Stop(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.stop_mu);
  if (s.stopped.exchange(true)) return;
  s.StopAccepting();
  const auto give_up = Clock::now() + grace;
  while (s.in_flight.load() > 0 && Clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  s.cancel_all = true;
  if (s.listener.joinable()) s.listener.join();  // joins httplib's worker threads
}

const ServerOptions& HttpServer::options() const { return impl_->options; }
const std::string& HttpServer::model_id() const { return impl_->model_id; }

}  // namespace kvsparse::server
