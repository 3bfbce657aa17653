// The OpenAI-compatible HTTP front end of a Scheduler (continuous batching), like llama.cpp's
// llama-server:
//
//   POST /v1/completions        prompt text or token ids, or a batch of either; n choices each
//                               (each its own sequence); logprobs, echo; "stream": true answers
//                               with SSE chunks, one choice each; "kvsparse": per-request KV
//                               settings and a context to compress once and keep
//   POST /v1/chat/completions   messages through the chat template; n, logprobs; SSE likewise
//   GET  /v1/models             the one model served
//   GET  /health                {"status":"ok"} (never needs the API key)
//   POST /tokenize              {"content": ".."} or {"prompt": ".."} -> {"tokens": [..], "count": n}
//   POST /detokenize            {"tokens": [..]}  -> {"content": ".."}
//   GET  /tokenizer_info        special tokens, vocabulary size, context (vLLM's)
//   GET  /metrics               Prometheus text format 0.0.4
//
// Every error is an OpenAI-style body {"error": {"message", "type", "param", "code"}}:
//   400 malformed or invalid request (the field named in "param"); a prompt that does not fit
//       the context; a text prompt when the model has no tokenizer
//   401 missing or wrong "Authorization: Bearer KEY" (when an API key is set)
//   404 unknown route, or a "model" other than the one served (code "model_not_found")
//   405 known route, wrong method (with an Allow header)
//   408 the request ran past its deadline (ServerOptions::request_timeout_s, or the request's own
//       "timeout_s" when shorter) before it finished: the partial text is dropped, the error says
//       how many tokens were generated (code "request_timeout")
//   413 body larger than ServerOptions::max_body_bytes
//   500 the engine failed (or a handler threw)
//   503 the scheduler's queue is full, or the server is shutting down (Retry-After: 1)
// A streamed response that fails after its 200 header ends with an error event
// (data: {"error": ...}) and then data: [DONE].
//
// Threads: the HTTP handlers run on a pool of ServerOptions::http_threads threads; each
// generation request keeps its thread while it waits for tokens (RequestHandle::WaitNext), so a
// streaming client that goes away is noticed at the next write and its request cancelled.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/status.h"
#include "kvsparse/tokenizer.h"
#include "server/chat_template.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"

namespace kvsparse::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: an ephemeral port (HttpServer::port() tells which)
  std::string api_key;   // non-empty: every endpoint but /health needs "Authorization: Bearer <key>"
  std::string model_id;  // what /v1/models lists and responses name; empty: the model file's stem
  ChatTemplate chat_template = ChatTemplate::kChatml;
  ProtocolLimits limits;
  size_t max_body_bytes = 1 << 20;  // larger request bodies get 413
  int http_threads = 0;  // 0: the scheduler's max_running + max_queue + 4 (at most 256)
  // Connections held at once (served, or accepted and waiting for a thread); more wait in the
  // kernel's backlog. 0: 4 x http_threads.
  int max_connections = 0;
  double request_timeout_s = 600;  // deadline of every generation request (a request's own "timeout_s" may shorten it)
  // Slow clients: each read of the request line, headers and body waits at most read_timeout_s
  // for the next bytes; then httplib waits keep_alive_timeout_s (whole seconds) for anything
  // more and closes, which is also how long a connection that sends nothing, or is idle between
  // keep-alive requests, is held. A response write (a stream chunk included) the client does not
  // take within write_timeout_s ends the connection, and so its request.
  double read_timeout_s = 10;
  double write_timeout_s = 30;
  int keep_alive_timeout_s = 5;
  // The KV config the scheduler's cache runs (must outlive the server). A request's "kvsparse"
  // object overrides its methods, budgets and page storage for that request
  // (KvLayersWithOverride: {"kv_method": "h2o", "kv_budget": 0.2, "kv_type": "int8"}; a budget
  // of 512 is tokens). Null: any such field gets 400.
  const KvSparsityConfig* kv_config = nullptr;
};

class HttpServer {
 public:
  // tokenizer may be null: then only token-id prompts work (/v1/completions with "prompt": [ids]);
  // text prompts, chat, /tokenize and /detokenize get 400 saying so, and the generated text is the
  // token ids separated by spaces. model, tokenizer, scheduler and metrics must outlive the
  // server; metrics null: the server keeps a registry of its own. The scheduler is used as it
  // is (its owner calls Scheduler::Start and Stop).
  static StatusOr<std::unique_ptr<HttpServer>> Create(const Model& model, const Tokenizer* tokenizer,
                                                      Scheduler* scheduler, ServerOptions options,
                                                      Registry* metrics = nullptr);
  ~HttpServer();  // Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (port 0: an ephemeral one) and serves on a thread of its own; returns once
  // connections are being accepted. Bind failures name host:port and the system's reason.
  Status Start();
  // The bound port (after Start), else ServerOptions::port.
  int port() const;
  // Connections the server holds now (at most ServerOptions::max_connections).
  int open_connections() const;

  // Closes the listening socket: new connections are refused, requests in flight go on.
  // Non-blocking; safe to call more than once.
  void StopAccepting();
  // StopAccepting, then waits up to `grace` for the requests in flight to end; generations still
  // running then are cancelled (their clients get 503 / an error event). Returns once every
  // handler thread has ended. For a graceful shutdown stop the scheduler with drain first (or
  // give a grace here). Safe to call more than once.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  const ServerOptions& options() const;
  // The model id responses carry.
  const std::string& model_id() const;

 private:
  struct Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// a == b without an early exit: the time depends only on b's length (the secret's), whatever a is.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

}  // namespace kvsparse::server
