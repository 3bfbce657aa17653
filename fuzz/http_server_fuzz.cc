// The HTTP server end to end on loopback: the input is sent as raw bytes (request line, headers,
// body: anything) to a running server over a tiny random-weight model, and the answer read to
// the end. Checked: the server answers with HTTP or closes, never with a 500 (an unhandled
// exception), and it keeps serving (a /health probe after each input).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "fuzz_target.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/synth.h"
#include "kvsparse/tokenizer.h"
#include "server/http_server.h"

namespace kvsparse::fuzz {
namespace {

struct Server {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  KvSparsityConfig kv_config;
  std::unique_ptr<Runtime> runtime;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<server::HttpServer> http;
};

#define FUZZ_REQUIRE(expr)                                  \
  do {                                                      \
    auto&& fuzz_status = (expr);                            \
    KVS_CHECK_MSG(fuzz_status.ok(), fuzz_status.status().ToString()); \
  } while (0)

Server* StartServer() {
  auto* s = new Server;
  auto shape = FindSynthShape("tiny-llama");
  FUZZ_REQUIRE(shape);
  shape->context = 64;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvsparse-fuzz-server-" + std::to_string(getpid()) + ".gguf")).string();
  SynthOptions options;
  options.weight_type = DType::kF32;
  const Status written = WriteSynthModel(*shape, options, path);
  KVS_CHECK_MSG(written.ok(), written.ToString());
  auto model = Model::Load(path);
  FUZZ_REQUIRE(model);
  s->model = std::move(*model);
  auto tokenizer = Tokenizer::FromGguf(*s->model->gguf());
  FUZZ_REQUIRE(tokenizer);
  s->tokenizer = std::move(*tokenizer);
  const ModelConfig& c = s->model->config();
  auto config = KvSparsityConfigFromFlags("full", "", "f16", c.n_layers);
  FUZZ_REQUIRE(config);
  s->kv_config = *config;
  auto runtime = CreateServingRuntime(*s->model, s->kv_config, size_t{8} << 20, /*n_threads=*/1);
  FUZZ_REQUIRE(runtime);
  s->runtime = std::move(*runtime);
  SchedulerOptions sched;
  sched.max_running = 4;
  sched.max_context = 64;
  s->scheduler = std::make_unique<Scheduler>(s->runtime->engine.get(), s->runtime->controller(), sched);
  s->scheduler->Start();
  server::ServerOptions o;
  o.port = 0;
  o.kv_config = &s->kv_config;
  o.request_timeout_s = 5;
  // An input that promises more than it sends costs the read timeout and the keep-alive wait.
  o.read_timeout_s = 0.25;
  o.keep_alive_timeout_s = 1;
  o.limits.max_tokens_limit = 8;  // short generations: many inputs per second
  o.limits.default_max_tokens = 4;
  auto http = server::HttpServer::Create(*s->model, s->tokenizer.get(), s->scheduler.get(), o);
  FUZZ_REQUIRE(http);
  s->http = std::move(*http);
  const Status started = s->http->Start();
  KVS_CHECK_MSG(started.ok(), started.ToString());
  return s;
}

// Sends `request` and reads the answer until the server closes, 100 ms pass without a byte after
// the answer started, or 10 s pass. (No half-close: httplib answers nothing to a client that
// shut its side down first.)
std::string Exchange(int port, std::string_view request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  KVS_CHECK(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  KVS_CHECK_MSG(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0, "the server stopped accepting");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close early (a 413, a bad request line)
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) {
      if (!answer.empty()) break;
      continue;
    }
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return answer;
}

}  // namespace

int FuzzHttpServer(const uint8_t* data, size_t size) {
  static Server* server = StartServer();
  if (size == 0) return 0;
  const std::string answer = Exchange(server->http->port(), AsText(data, size));
  if (!answer.empty()) {
    KVS_CHECK_MSG(answer.rfind("HTTP/1.1 ", 0) == 0, "the answer is not HTTP: " + answer.substr(0, 64));
    KVS_CHECK_MSG(answer.compare(9, 3, "500") != 0, "500 (an unhandled exception): " + answer.substr(0, 512));
  }
  const std::string health = Exchange(server->http->port(), "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  KVS_CHECK_MSG(health.rfind("HTTP/1.1 200", 0) == 0, "the server stopped answering /health: " + health.substr(0, 64));
  return 0;
}

}  // namespace kvsparse::fuzz
