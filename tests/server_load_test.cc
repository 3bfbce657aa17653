// The server's soak test on loopback: 64 concurrent clients, mixed prompt and completion lengths,
// streaming and not, clients that walk away mid-stream, malformed, oversized and truncated
// bodies, invalid UTF-8 in prompts, prompts longer than the context and per-request KV overrides.
// It must end with every error of an expected kind, every KV page back in the pool, and resident
// memory flat once warm; it prints requests served, errors by kind, pages leaked, RSS at start,
// middle and end, and the p99 latency of the answered requests.
// In CI: 20 requests per client (about a minute under the sanitizers). By hand, for a duration:
//   KVS_SOAK_SECONDS=300 ./build/server_load_test
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/tokenizer.h"
#include "server/http_server.h"
#include "support/raw_http.h"
#include "support/tiny_chat_model.h"

namespace kvsparse::server {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kClients = 64;
constexpr int kRequestsPerClient = 20;
constexpr int32_t kContext = 256;

// Resident set size in KiB (/proc/self/statm, pages).
long ResidentKiB() {
  std::ifstream statm("/proc/self/statm");
  long size = 0, resident = 0;
  statm >> size >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

struct Outcome {
  std::atomic<int> ok{0};
  std::atomic<int> walked_away{0};  // streams the client cut
  std::atomic<int> truncated{0};    // bodies cut short on the wire: the server closes
  std::atomic<int> unexpected{0};
  std::mutex mu;
  std::map<std::string, int> errors;   // expected errors by kind ("400 malformed JSON", ...)
  std::vector<double> latencies_s;     // answered requests (200), whole response
  std::vector<std::string> unexpected_samples;
  void Unexpected(const std::string& what) {
    ++unexpected;
    std::lock_guard<std::mutex> lock(mu);
    if (unexpected_samples.size() < 5) unexpected_samples.push_back(what);
  }
  void Error(const std::string& kind) {
    std::lock_guard<std::mutex> lock(mu);
    ++errors[kind];
  }
  void Answered(double seconds) {
    ++ok;
    std::lock_guard<std::mutex> lock(mu);
    latencies_s.push_back(seconds);
  }
};

// Sends the head and a part of a body that promises more, then hangs up: the server must drop it
// (an unfinished body never reaches the parser).
bool SendTruncatedBody(int port, const std::string& body) {
  const int fd = testing::SendRawLoopback(port, testing::CompletionRequestHead(body.size()) + body.substr(0, body.size() / 2));
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

TEST(ServerLoad, SixtyFourClientsTwentyRequestsEach) {
  // KVS_SOAK_SECONDS: run for that long instead of 20 requests per client.
  const char* soak_env = std::getenv("KVS_SOAK_SECONDS");
  const double soak_s = soak_env != nullptr ? std::atof(soak_env) : 0.0;
  std::string note;
  auto path = testing::WriteTinyChatModel("server_load_model.gguf", kContext, &note);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  auto model = Model::Load(*path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto tokenizer = Tokenizer::FromGguf(*(*model)->gguf());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  const ModelConfig& c = (*model)->config();
  // A sparse config, so eviction runs under load too.
  auto config = KvSparsityConfigFromFlags("h2o", "48", "int8", c.n_layers);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  SchedulerOptions sched;
  sched.max_running = 16;
  sched.max_queue = 128;
  sched.max_context = kContext;
  auto probe = CreateServingKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, *config, size_t{1} << 30);
  ASSERT_TRUE(probe.ok());
  // Pages for 12 requests at the whole context: admission, not luck, keeps it within budget.
  const size_t budget = 12 * probe->controller->SequenceReserveBytes(kContext - 1, 1);
  auto runtime = CreateServingRuntime(**model, *config, budget, /*n_threads=*/2);
  ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
  Scheduler scheduler((*runtime)->engine.get(), (*runtime)->controller(), sched);
  scheduler.Start();
  ServerOptions options;
  options.port = 0;
  options.model_id = "load";
  options.http_threads = kClients + 8;
  options.request_timeout_s = 120;
  options.read_timeout_s = 2;  // truncated bodies are dropped after it
  options.keep_alive_timeout_s = 2;
  constexpr size_t kMaxBody = 64 * 1024;
  options.max_body_bytes = kMaxBody;
  options.kv_config = &*config;
  auto server = HttpServer::Create(**model, tokenizer->get(), &scheduler, options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  const int port = (*server)->port();

  Outcome outcome;
  std::atomic<int> done{0};
  constexpr int kTotal = kClients * kRequestsPerClient;
  const auto start = Clock::now();
  const auto stop_at = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(soak_s > 0 ? soak_s : 240.0));
  // Resident memory once warm (a quarter in), half way and at the end (three quarters in for the
  // counted run, whose last requests are few).
  long rss_start = 0, rss_middle = 0, rss_end = 0;
  std::mutex rss_mu;
  auto note_rss = [&](int finished) {
    std::lock_guard<std::mutex> lock(rss_mu);
    if (soak_s > 0) {
      const double f = std::chrono::duration<double>(Clock::now() - start).count() / soak_s;
      if (rss_start == 0 && f >= 0.25) rss_start = ResidentKiB();
      if (rss_middle == 0 && f >= 0.5) rss_middle = ResidentKiB();
      if (f >= 0.75) rss_end = ResidentKiB();  // the last sample taken
    } else if (finished == kTotal / 4) {
      rss_start = ResidentKiB();
    } else if (finished == kTotal / 2) {
      rss_middle = ResidentKiB();
    } else if (finished == kTotal * 3 / 4) {
      rss_end = ResidentKiB();
    }
  };

  auto client_loop = [&](int client) {
    httplib::Client http("127.0.0.1", port);
    http.set_connection_timeout(10);
    http.set_read_timeout(120);
    for (int i = 0; soak_s > 0 ? Clock::now() < stop_at : (i < kRequestsPerClient && Clock::now() < stop_at); ++i) {
      // 0: malformed JSON, 1: walks away, 2-4: stream, 5: a field of the wrong type, 6: oversized,
      // 7: truncated on the wire, 8: invalid UTF-8, 9: longer than the context, 10: its own KV
      // method, else plain.
      const int kind = (client * 7 + i * 3) % 14;
      const int max_tokens = 2 + (client + i) % 12;
      std::string words;
      for (int w = 0; w < 1 + (client * 5 + i) % 40; ++w) words += "once upon a time ";
      nlohmann::json body = {{"prompt", words}, {"max_tokens", max_tokens}, {"temperature", 0.7},
                             {"seed", client * 100 + i}};
      const auto sent = Clock::now();
      auto expect_error = [&](const std::string& payload, int status, const std::string& kind_name) {
        auto r = http.Post("/v1/completions", payload, "application/json");
        if (r && r->status == status) {
          outcome.Error(std::to_string(status) + " " + kind_name);
        } else {
          outcome.Unexpected(kind_name + " got " + (r ? std::to_string(r->status) : httplib::to_string(r.error())));
        }
      };
      if (kind == 0) {
        expect_error("{not json", 400, "malformed JSON");
      } else if (kind == 5) {
        expect_error(R"({"prompt": "x", "max_tokens": "many"})", 400, "wrong field type");
      } else if (kind == 6) {
        expect_error(std::string(kMaxBody + 1, ' '), 413, "oversized body");
      } else if (kind == 7) {
        if (SendTruncatedBody(port, body.dump())) {
          ++outcome.truncated;
        } else {
          outcome.Unexpected("truncated body: the connection failed");
        }
      } else if (kind == 8) {
        expect_error("{\"prompt\": \"once \xff\xfe upon\", \"max_tokens\": 2}", 400, "invalid UTF-8");
      } else if (kind == 9) {
        const nlohmann::json long_prompt = {{"prompt", std::vector<int>(kContext + 10, 100)}, {"max_tokens", 2}};
        expect_error(long_prompt.dump(), 400, "longer than the context");
      } else if (kind <= 4) {
        body["stream"] = true;
        body["max_tokens"] = kind == 1 ? 200 : max_tokens;
        int chunks = 0;
        bool saw_done = false;
        std::string buffer;
        httplib::Request req;
        req.method = "POST";
        req.path = "/v1/completions";
        req.body = body.dump();
        req.set_header("Content-Type", "application/json");
        req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
          buffer.append(data, len);
          chunks += 1;
          if (buffer.find("data: [DONE]") != std::string::npos) saw_done = true;
          return kind != 1 || chunks < 2;  // kind 1: hang up after the first chunk
        };
        auto r = http.send(req);
        if (kind == 1) {
          ++outcome.walked_away;
        } else if (r && r->status == 200 && saw_done) {
          outcome.Answered(std::chrono::duration<double>(Clock::now() - sent).count());
        } else {
          outcome.Unexpected("stream got " + (r ? std::to_string(r->status) : httplib::to_string(r.error())) +
                             (saw_done ? "" : " without [DONE]"));
        }
      } else {
        if (kind == 10) body["kvsparse"] = {{"kv_method", "snapkv"}, {"kv_budget", 0.5}};
        auto r = http.Post("/v1/completions", body.dump(), "application/json");
        nlohmann::json j = r ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
        if (r && r->status == 200 && !j.is_discarded() && j["usage"]["completion_tokens"].get<int>() <= max_tokens) {
          outcome.Answered(std::chrono::duration<double>(Clock::now() - sent).count());
        } else {
          outcome.Unexpected("completion got " + (r ? std::to_string(r->status) + " " + r->body.substr(0, 200)
                                                    : httplib::to_string(r.error())));
        }
      }
      note_rss(++done);
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) clients.emplace_back(client_loop, i);
  for (auto& t : clients) t.join();
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();

  if (soak_s <= 0) EXPECT_EQ(done.load(), kTotal) << "the load did not finish within the time limit";
  EXPECT_EQ(outcome.unexpected.load(), 0) << [&] {
    std::string s;
    for (const auto& u : outcome.unexpected_samples) s += u + "\n";
    return s;
  }();
  EXPECT_GT(outcome.ok.load(), done.load() / 3);
  EXPECT_EQ(outcome.errors.size(), 5u) << "every expected error kind occurred";
  EXPECT_GT(outcome.walked_away.load(), 0);
  EXPECT_GT(outcome.truncated.load(), 0);
  // Every page comes back: cancelled streams included (the scheduler frees them at its next step).
  const auto wait_until = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < wait_until &&
         (scheduler.Stats().running > 0 || scheduler.Stats().waiting > 0 ||
          (*runtime)->paged_cache()->pages_in_use() > 0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  (*server)->StopAccepting();
  scheduler.Stop(/*drain=*/true, std::chrono::seconds(5));
  (*server)->Stop(std::chrono::seconds(2));
  const int64_t leaked_pages = (*runtime)->paged_cache()->pages_in_use();
  EXPECT_EQ(leaked_pages, 0) << "leaked KV pages";
  (*runtime)->paged_cache()->CheckInvariants();
  const SchedulerStats stats = scheduler.Stats();
  EXPECT_GT(stats.finished[static_cast<int>(FinishReason::kCancelled)], 0);
  EXPECT_GT(stats.evicted_tokens, 0);

  // The report.
  std::vector<double> latencies = outcome.latencies_s;
  std::sort(latencies.begin(), latencies.end());
  const double p50 = latencies.empty() ? 0 : latencies[latencies.size() / 2];
  const double p99 = latencies.empty() ? 0 : latencies[std::min(latencies.size() - 1, latencies.size() * 99 / 100)];
  std::string errors;
  for (const auto& [kind, count] : outcome.errors) errors += fmt::format("{}{} x{}", errors.empty() ? "" : ", ", kind, count);
  std::printf("soak: %.0f s, %d clients, %d requests: %d answered (p50 %.3f s, p99 %.3f s), %d walked away mid-stream "
              "(%lld cancelled), %d truncated bodies dropped; expected errors: %s; unexpected: %d; pages leaked: %lld; "
              "RSS start %ld / middle %ld / end %ld KiB (%s)\n",
              elapsed_s, kClients, done.load(), outcome.ok.load(), p50, p99, outcome.walked_away.load(),
              static_cast<long long>(stats.finished[static_cast<int>(FinishReason::kCancelled)]), outcome.truncated.load(),
              errors.c_str(), outcome.unexpected.load(), static_cast<long long>(leaked_pages), rss_start, rss_middle,
              rss_end, note.c_str());
  RecordProperty("ok", outcome.ok.load());
  RecordProperty("p99_ms", static_cast<int>(p99 * 1000));
  // Resident memory: flat once warm (allow 32 MiB for allocator and thread-stack noise). Under
  // AddressSanitizer freed memory sits in its quarantine (up to 256 MiB) by design; LeakSanitizer
  // checks for leaks there instead.
  ASSERT_GT(rss_start, 0);
#ifdef KVS_SANITIZED
  GTEST_SKIP() << "RSS under AddressSanitizer includes its quarantine: " << rss_start << " -> " << rss_end << " KiB";
#endif
  EXPECT_LT(rss_end - rss_start, 32 * 1024)
      << "RSS grew from " << rss_start << " KiB to " << rss_end << " KiB (" << note << ")";
}

}  // namespace
}  // namespace kvsparse::server
