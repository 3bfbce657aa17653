// The OpenAI-compatible HTTP server end to end: a real server on 127.0.0.1 (ephemeral port) in
// front of a running Scheduler, over a tiny random-weight model with a real tokenizer, driven by
// httplib's client (and a raw socket for the client that walks away mid-stream).
#include "server/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvsparse/contiguous_kv_cache.h"
#include "kvsparse/engine.h"
#include "kvsparse/logprob.h"
#include "kvsparse/kv_config.h"
#include "kvsparse/model.h"
#include "kvsparse/runtime.h"
#include "kvsparse/scheduler.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/tokenizer.h"
#include "support/cli_runner.h"
#include "support/raw_http.h"
#include "support/shared_data.h"
#include "support/tiny_chat_model.h"

namespace kvsparse::server {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kModelId = "tiny-test";
constexpr const char* kApiKey = "sk-test-0123456789";
constexpr size_t kMaxBody = 64 * 1024;
constexpr int32_t kContext = 512;

// Everything one test process serves: the model, the runtime, and three front ends on the same
// scheduler (open, with an API key, without a tokenizer).
struct Serving {
  std::unique_ptr<Runtime> runtime;
  std::unique_ptr<Scheduler> scheduler;
};

struct Env {
  std::string vocab_note;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  KvSparsityConfig kv_config;
  Serving serving;
  Scheduler* scheduler = nullptr;  // serving's
  std::unique_ptr<HttpServer> open;
  std::unique_ptr<HttpServer> keyed;
  std::unique_ptr<HttpServer> no_tokenizer;
};

Env* g_env = nullptr;
std::string g_setup_error;

ServerOptions BaseOptions() {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.model_id = kModelId;
  o.chat_template = ChatTemplate::kLlama2;
  o.max_body_bytes = kMaxBody;
  o.http_threads = 24;  // 16 concurrent clients and room to spare
  o.request_timeout_s = 60;
  return o;
}

// A paged cache with room for every running request at the whole context, its engine and a
// scheduler (not started).
std::string MakeServing(const Env& env, SchedulerOptions sched, Serving* out) {
  const ModelConfig& c = env.model->config();
  auto probe = CreateServingKv(KvGeometry{c.n_layers, c.n_kv_heads, c.head_dim}, env.kv_config, size_t{1} << 30);
  if (!probe.ok()) return probe.status().ToString();
  sched.max_context = kContext;
  const size_t budget = sched.max_running * probe->controller->SequenceReserveBytes(kContext - 1, 1);
  auto runtime = CreateServingRuntime(*env.model, env.kv_config, budget, /*n_threads=*/2);
  if (!runtime.ok()) return runtime.status().ToString();
  out->runtime = std::move(*runtime);
  out->scheduler = std::make_unique<Scheduler>(out->runtime->engine.get(), out->runtime->controller(), sched);
  return {};
}

std::string SetUpEnv(Env* env) {
  auto written = testing::WriteTinyChatModel("server_test_model.gguf", kContext, &env->vocab_note);
  if (!written.ok()) return written.status().ToString();
  const std::string path = *written;
  auto model = Model::Load(path);
  if (!model.ok()) return model.status().ToString();
  env->model = std::move(*model);
  auto tokenizer = Tokenizer::FromGguf(*env->model->gguf());
  if (!tokenizer.ok()) return tokenizer.status().ToString();
  env->tokenizer = std::move(*tokenizer);

  const ModelConfig& c = env->model->config();
  auto config = KvSparsityConfigFromFlags("full", "", "f16", c.n_layers);
  if (!config.ok()) return config.status().ToString();
  env->kv_config = *config;
  SchedulerOptions sched;
  sched.max_running = 4;
  sched.max_queue = 64;
  if (std::string e = MakeServing(*env, sched, &env->serving); !e.empty()) return e;
  env->scheduler = env->serving.scheduler.get();
  env->scheduler->Start();

  auto start = [&](const Tokenizer* tokenizer, ServerOptions o, std::unique_ptr<HttpServer>* out) -> std::string {
    o.kv_config = &env->kv_config;
    auto server = HttpServer::Create(*env->model, tokenizer, env->scheduler, std::move(o));
    if (!server.ok()) return server.status().ToString();
    if (Status st = (*server)->Start(); !st.ok()) return st.ToString();
    *out = std::move(*server);
    return {};
  };
  if (std::string e = start(env->tokenizer.get(), BaseOptions(), &env->open); !e.empty()) return e;
  ServerOptions keyed = BaseOptions();
  keyed.api_key = kApiKey;
  if (std::string e = start(env->tokenizer.get(), keyed, &env->keyed); !e.empty()) return e;
  if (std::string e = start(nullptr, BaseOptions(), &env->no_tokenizer); !e.empty()) return e;
  return {};
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_env = new Env;
    g_setup_error = SetUpEnv(g_env);
  }
  static void TearDownTestSuite() {
    if (g_env) {
      for (auto* s : {&g_env->open, &g_env->keyed, &g_env->no_tokenizer}) {
        if (*s) (*s)->StopAccepting();
      }
      if (g_env->scheduler) g_env->scheduler->Stop(/*drain=*/false);
      for (auto* s : {&g_env->open, &g_env->keyed, &g_env->no_tokenizer}) {
        if (*s) (*s)->Stop(std::chrono::seconds(1));
      }
    }
    delete g_env;
    g_env = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(g_setup_error.empty()) << "server setup failed: " << g_setup_error;
    env_ = g_env;
  }

  struct Reply {
    int status = -1;  // -1: no response
    std::string body;
    httplib::Headers headers;
    Json json() const {
      Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
      EXPECT_FALSE(j.is_discarded()) << "not JSON: " << body;
      return j;
    }
  };

  static Reply ToReply(const httplib::Result& r) {
    Reply out;
    if (!r) return out;
    out.status = r->status;
    out.body = r->body;
    out.headers = r->headers;
    return out;
  }
  static httplib::Client MakeClient(int port) {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(5);
    c.set_read_timeout(60);
    c.set_write_timeout(10);
    return c;
  }
  Reply Post(const std::string& path, const std::string& body, int port = 0, const httplib::Headers& headers = {}) {
    httplib::Client c = MakeClient(port ? port : env_->open->port());
    return ToReply(c.Post(path, headers, body, "application/json"));
  }
  Reply Get(const std::string& path, int port = 0, const httplib::Headers& headers = {}) {
    httplib::Client c = MakeClient(port ? port : env_->open->port());
    return ToReply(c.Get(path, headers));
  }

  // The error body every failure carries; returns error.
  static Json ExpectError(const Reply& r, int status, const std::string& what) {
    EXPECT_EQ(r.status, status) << what << ": " << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    if (j.is_discarded() || !j.contains("error")) {
      ADD_FAILURE() << what << ": not an OpenAI error body: " << r.body;
      return Json::object();
    }
    const Json& e = j["error"];
    EXPECT_TRUE(e.contains("message") && e["message"].is_string() && !e["message"].get<std::string>().empty()) << r.body;
    EXPECT_TRUE(e.contains("type") && e["type"].is_string()) << r.body;
    EXPECT_TRUE(e.contains("param")) << r.body;
    EXPECT_TRUE(e.contains("code")) << r.body;
    return e;
  }

  // "data: <payload>\n\n" events; fails on anything else.
  static std::vector<std::string> SseEvents(const std::string& body) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos < body.size()) {
      if (body.compare(pos, 6, "data: ") != 0) {
        ADD_FAILURE() << "event at byte " << pos << " does not start with 'data: ': " << body.substr(pos, 80);
        break;
      }
      const size_t end = body.find("\n\n", pos);
      if (end == std::string::npos) {
        ADD_FAILURE() << "event at byte " << pos << " is not terminated by a blank line";
        break;
      }
      std::string payload = body.substr(pos + 6, end - pos - 6);
      EXPECT_EQ(payload.find('\n'), std::string::npos) << "one line per event: " << payload;
      out.push_back(std::move(payload));
      pos = end + 2;
    }
    return out;
  }

  // Waits until the scheduler holds no request, and returns its stats then.
  SchedulerStats Idle() {
    const auto until = Clock::now() + std::chrono::seconds(20);
    SchedulerStats s = env_->scheduler->Stats();
    while ((s.running > 0 || s.waiting > 0) && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      s = env_->scheduler->Stats();
    }
    return s;
  }

  static std::string CompletionBody(const std::string& prompt, int max_tokens, bool stream = false) {
    Json j = {{"model", kModelId}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
    if (stream) j["stream"] = true;
    return j.dump();
  }

  Env* env_ = nullptr;
};

void ExpectUsage(const Json& usage, int max_completion) {
  ASSERT_TRUE(usage.is_object()) << usage.dump();
  const int prompt = usage.at("prompt_tokens").get<int>();
  const int completion = usage.at("completion_tokens").get<int>();
  EXPECT_GT(prompt, 0);
  EXPECT_GE(completion, 1);
  EXPECT_LE(completion, max_completion);
  EXPECT_EQ(usage.at("total_tokens").get<int>(), prompt + completion);
  EXPECT_GT(usage.at("kv_bytes").get<int64_t>(), 0) << "usage.kv_bytes: the request's peak KV bytes";
}

TEST(ConstantTimeEquals, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("secreT", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("secret2", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("", "secret"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("secret\0", 7), "secret"));
}

TEST_F(ServerTest, CompletionWithTextPrompt) {
  const int64_t before = static_cast<int64_t>(std::time(nullptr));
  const Reply r = Post("/v1/completions", CompletionBody("Once upon a time", 8));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.find("Content-Type")->second, "application/json");
  const Json j = r.json();
  EXPECT_EQ(j.at("id").get<std::string>().rfind("cmpl-", 0), 0u) << j.dump();
  EXPECT_EQ(j.at("object"), "text_completion");
  EXPECT_GE(j.at("created").get<int64_t>(), before);
  EXPECT_LE(j.at("created").get<int64_t>(), static_cast<int64_t>(std::time(nullptr)));
  EXPECT_EQ(j.at("model"), kModelId);
  ASSERT_EQ(j.at("choices").size(), 1u);
  const Json& choice = j["choices"][0];
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_TRUE(choice.at("text").is_string());
  EXPECT_TRUE(choice.at("logprobs").is_null());
  const std::string reason = choice.at("finish_reason").get<std::string>();
  EXPECT_TRUE(reason == "stop" || reason == "length") << reason;
  ExpectUsage(j.at("usage"), 8);
  // The prompt is tokenized with BOS.
  const Reply tok = Post("/tokenize", R"({"content": "Once upon a time", "add_special": true})");
  ASSERT_EQ(tok.status, 200) << tok.body;
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<size_t>(), tok.json()["tokens"].size());
  // Greedy: the same request gives the same text, under another id.
  const Reply again = Post("/v1/completions", CompletionBody("Once upon a time", 8));
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.json()["choices"][0]["text"], choice["text"]);
  EXPECT_NE(again.json()["id"], j["id"]);
}

TEST_F(ServerTest, CompletionWithTokenIdPrompt) {
  const Reply r = Post("/v1/completions", R"({"prompt": [1, 100, 200, 300], "max_tokens": 4, "temperature": 0})");
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = r.json();
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  ExpectUsage(j["usage"], 4);
  EXPECT_EQ(j["choices"][0]["finish_reason"].is_string(), true);

  const Json e = ExpectError(Post("/v1/completions", R"({"prompt": [1, 100, 99999999], "max_tokens": 4})"), 400,
                             "token id outside the vocabulary");
  EXPECT_EQ(e["param"], "prompt[2]");
}

TEST_F(ServerTest, ChatCompletion) {
  const std::string body = R"({"model": "tiny-test", "temperature": 0, "max_tokens": 6, "messages": [
      {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]})";
  const Reply r = Post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = r.json();
  EXPECT_EQ(j.at("id").get<std::string>().rfind("chatcmpl-", 0), 0u) << j.dump();
  EXPECT_EQ(j.at("object"), "chat.completion");
  EXPECT_TRUE(j.at("created").is_number_integer());
  EXPECT_EQ(j.at("model"), kModelId);
  ASSERT_EQ(j.at("choices").size(), 1u);
  const Json& choice = j["choices"][0];
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  EXPECT_TRUE(choice.at("message").at("content").is_string());
  const std::string reason = choice.at("finish_reason").get<std::string>();
  EXPECT_TRUE(reason == "stop" || reason == "length") << reason;
  ExpectUsage(j.at("usage"), 6);
  // The prompt went through the llama2 template, tokenized with BOS and special tokens.
  auto text = ApplyChatTemplate(ChatTemplate::kLlama2, {{"system", "You are terse."}, {"user", "Say hello."}}, true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<size_t>(), env_->tokenizer->Encode(*text, true, true).size());
}

TEST_F(ServerTest, StreamingCompletionMatchesNonStreaming) {
  const Reply plain = Post("/v1/completions", CompletionBody("The quick brown fox", 12));
  ASSERT_EQ(plain.status, 200) << plain.body;
  const Reply r = Post("/v1/completions", CompletionBody("The quick brown fox", 12, /*stream=*/true));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.find("Content-Type")->second, "text/event-stream");
  const std::vector<std::string> events = SseEvents(r.body);
  ASSERT_GE(events.size(), 2u) << r.body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text, id;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const Json c = Json::parse(events[i]);
    EXPECT_EQ(c.at("object"), "text_completion");
    EXPECT_EQ(c.at("model"), kModelId);
    if (id.empty()) id = c.at("id").get<std::string>();
    EXPECT_EQ(c.at("id"), id) << "every chunk repeats the id";
    ASSERT_EQ(c.at("choices").size(), 1u);
    text += c["choices"][0].at("text").get<std::string>();
    const bool last = i + 2 == events.size();
    EXPECT_EQ(c["choices"][0].at("finish_reason").is_null(), !last) << events[i];
  }
  EXPECT_EQ(text, plain.json()["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(Json::parse(events[events.size() - 2])["choices"][0]["finish_reason"],
            plain.json()["choices"][0]["finish_reason"]);
}

TEST_F(ServerTest, StreamingChatHasRoleFirstFinishLastUsageThenDone) {
  const std::string messages = R"([{"role": "user", "content": "Tell me a story."}])";
  const Reply plain =
      Post("/v1/chat/completions", R"({"temperature": 0, "max_tokens": 10, "messages": )" + messages + "}");
  ASSERT_EQ(plain.status, 200) << plain.body;
  const Reply r = Post("/v1/chat/completions", R"({"temperature": 0, "max_tokens": 10, "stream": true,
      "stream_options": {"include_usage": true}, "messages": )" + messages + "}");
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<std::string> events = SseEvents(r.body);
  ASSERT_GE(events.size(), 4u) << r.body;  // role, finish, usage, [DONE] at least
  EXPECT_EQ(events.back(), "[DONE]");
  const Json first = Json::parse(events.front());
  EXPECT_EQ(first.at("object"), "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"].at("role"), "assistant");
  std::string content;
  for (size_t i = 0; i + 3 < events.size(); ++i) {
    const Json c = Json::parse(events[i]);
    EXPECT_EQ(c.at("id"), first.at("id"));
    EXPECT_TRUE(c["choices"][0].at("finish_reason").is_null());
    if (i > 0) {
      EXPECT_FALSE(c["choices"][0]["delta"].contains("role")) << events[i];
    }
    if (c["choices"][0]["delta"].contains("content")) content += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  const Json finish = Json::parse(events[events.size() - 3]);
  EXPECT_EQ(finish["choices"][0].at("finish_reason"), plain.json()["choices"][0]["finish_reason"]);
  const Json usage = Json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage.at("choices").empty());
  ExpectUsage(usage.at("usage"), 10);
  EXPECT_EQ(usage["usage"]["completion_tokens"], plain.json()["usage"]["completion_tokens"]);
  EXPECT_EQ(content, plain.json()["choices"][0]["message"]["content"].get<std::string>());
}

TEST_F(ServerTest, ModelsHealthTokenizeDetokenizeMetrics) {
  const Reply health = Get("/health");
  ASSERT_EQ(health.status, 200);
  EXPECT_EQ(health.json(), Json({{"status", "ok"}}));

  const Reply models = Get("/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  const Json m = models.json();
  EXPECT_EQ(m.at("object"), "list");
  ASSERT_EQ(m.at("data").size(), 1u);
  EXPECT_EQ(m["data"][0].at("id"), kModelId);
  EXPECT_EQ(m["data"][0].at("object"), "model");
  EXPECT_TRUE(m["data"][0].at("created").is_number_integer());
  EXPECT_TRUE(m["data"][0].at("owned_by").is_string());

  const std::string text = "Hello world, this is a test.";
  const Reply tok = Post("/tokenize", Json{{"content", text}}.dump());
  ASSERT_EQ(tok.status, 200) << tok.body;
  const Json tokens = tok.json().at("tokens");
  ASSERT_FALSE(tokens.empty());
  const Reply detok = Post("/detokenize", Json{{"tokens", tokens}}.dump());
  ASSERT_EQ(detok.status, 200) << detok.body;
  EXPECT_EQ(detok.json().at("content"), text);
  ExpectError(Post("/detokenize", R"({"tokens": [1, 99999999]})"), 400, "detokenize outside the vocabulary");

  ASSERT_EQ(Post("/v1/completions", CompletionBody("metrics", 3)).status, 200);
  // Requests are counted once their response is written (httplib's logger), which can be just
  // after the client has read it: scrape until the count shows.
  Reply metrics = Get("/metrics");
  for (const auto until = Clock::now() + std::chrono::seconds(5);
       metrics.body.find("kvsparse_requests_total{endpoint=\"/v1/completions\",status=\"200\"}") == std::string::npos &&
       Clock::now() < until;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    metrics = Get("/metrics");
  }
  ASSERT_EQ(metrics.status, 200);
  EXPECT_EQ(metrics.headers.find("Content-Type")->second.rfind("text/plain; version=0.0.4", 0), 0u);
  for (const char* name :
       {"kvsparse_requests_total{endpoint=\"/v1/completions\",status=\"200\"}", "kvsparse_prompt_tokens_total",
        "kvsparse_generated_tokens_total", "kvsparse_time_to_first_token_seconds_bucket",
        "kvsparse_inter_token_latency_seconds_bucket", "kvsparse_request_duration_seconds_count",
        "kvsparse_requests_running", "kvsparse_requests_waiting", "kvsparse_kv_pages_used", "kvsparse_kv_bytes_used",
        "kvsparse_kv_bytes_budget", "kvsparse_kv_bytes_reserved", "kvsparse_kv_evicted_tokens_total",
        "kvsparse_preemptions_total", "kvsparse_requests_rejected_total"}) {
    EXPECT_NE(metrics.body.find(name), std::string::npos) << name << " missing from /metrics";
  }
  EXPECT_EQ(metrics.body.find("kvsparse_kv_bytes_budget 0\n"), std::string::npos) << "the budget gauge is filled";
}

TEST_F(ServerTest, BadRequestsGetTheirStatusAndTheServerKeepsServing) {
  Json e = ExpectError(Post("/v1/completions", "{not json"), 400, "malformed JSON");
  e = ExpectError(Post("/v1/completions", R"({"prompt": 5})"), 400, "prompt of the wrong type");
  EXPECT_EQ(e["param"], "prompt");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "max_tokens": "ten"})"), 400, "max_tokens string");
  EXPECT_EQ(e["param"], "max_tokens");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "temperature": 3})"), 400, "temperature out of range");
  EXPECT_EQ(e["param"], "temperature");
  e = ExpectError(Post("/v1/chat/completions", R"({"messages": [{"role": "robot", "content": "x"}]})"), 400,
                  "unknown role");
  e = ExpectError(Post("/v1/chat/completions", R"({"messages": "hi"})"), 400, "messages of the wrong type");
  EXPECT_EQ(e["param"], "messages");
  e = ExpectError(Post("/tokenize", R"({"content": 7})"), 400, "tokenize content type");
  e = ExpectError(Post("/v1/completions", R"({"model": "gpt-4", "prompt": "x"})"), 404, "unknown model");
  EXPECT_EQ(e["code"], "model_not_found");
  EXPECT_EQ(e["param"], "model");
  ExpectError(Get("/v1/nothing"), 404, "unknown route");
  ExpectError(Post("/v1/nothing", "{}"), 404, "unknown POST route");
  const Reply wrong_method = Get("/v1/completions");
  ExpectError(wrong_method, 405, "GET on a POST route");
  EXPECT_EQ(wrong_method.headers.find("Allow")->second, "POST");
  ExpectError(Post("/metrics", "{}"), 405, "POST on a GET route");
  ExpectError(Post("/v1/completions", std::string(kMaxBody + 1, ' ')), 413, "oversized body");
  // A prompt that cannot fit the context, and per-request KV settings the server does not run.
  Json long_prompt = {{"prompt", std::vector<int>(kContext + 10, 100)}, {"max_tokens", 4}};
  e = ExpectError(Post("/v1/completions", long_prompt.dump()), 400, "prompt longer than the context");
  EXPECT_EQ(e["code"], "context_length_exceeded");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_method": "h3o", "kv_budget": 0.2}})"),
                  400, "unknown KV method");
  EXPECT_EQ(e["param"], "kvsparse.kv_method");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_method": "h2o"}})"), 400,
                  "a sparse method without a budget on a full-cache server");
  EXPECT_EQ(e["param"], "kvsparse.kv_budget");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_method": "h2o", "kv_budget": 1.5}})"),
                  400, "budget fraction above 1");
  EXPECT_EQ(e["param"], "kvsparse.kv_budget");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_type": "int3"}})"), 400,
                  "an unknown page type");
  EXPECT_EQ(e["param"], "kvsparse.kv_type");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_type": 8}})"), 400,
                  "a page type that is not a string");
  EXPECT_EQ(e["param"], "kvsparse.kv_type");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "kvsparse": {"kv_methods": "h2o"}})"), 400,
                  "misspelt extension field");
  const Reply same_kv = Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2, "kvsparse": {"kv_method": "full",
      "kv_type": "f16"}})");
  EXPECT_EQ(same_kv.status, 200) << "the KV settings in force are accepted: " << same_kv.body;

  // Still serving.
  EXPECT_EQ(Get("/health").status, 200);
  const Reply ok = Post("/v1/completions", CompletionBody("still alive", 3));
  EXPECT_EQ(ok.status, 200) << ok.body;
}

TEST_F(ServerTest, ApiKeyGuardsEverythingButHealth) {
  const int port = env_->keyed->port();
  const httplib::Headers good = {{"Authorization", std::string("Bearer ") + kApiKey}};
  EXPECT_EQ(Get("/health", port).status, 200) << "/health needs no key";
  Json e = ExpectError(Get("/v1/models", port), 401, "no key");
  EXPECT_EQ(e["code"], "invalid_api_key");
  ExpectError(Get("/v1/models", port, {{"Authorization", "Bearer wrong"}}), 401, "wrong key");
  ExpectError(Get("/v1/models", port, {{"Authorization", std::string("Bearer ") + kApiKey + "x"}}), 401,
              "key with a suffix");
  ExpectError(Get("/v1/models", port, {{"Authorization", kApiKey}}), 401, "key without Bearer");
  ExpectError(Get("/metrics", port), 401, "metrics without key");
  ExpectError(Post("/v1/completions", CompletionBody("x", 2), port), 401, "completion without key");
  ExpectError(Post("/tokenize", R"({"content": "x"})", port, {{"Authorization", "Bearer "}}), 401, "empty key");
  EXPECT_EQ(Get("/v1/models", port, good).status, 200);
  const Reply ok = Post("/v1/completions", CompletionBody("with a key", 2), port, good);
  EXPECT_EQ(ok.status, 200) << ok.body;
}

TEST_F(ServerTest, WithoutTokenizerOnlyTokenIdsWork) {
  const int port = env_->no_tokenizer->port();
  Json e = ExpectError(Post("/v1/completions", R"({"prompt": "text"})", port), 400, "text prompt, no tokenizer");
  EXPECT_EQ(e["code"], "no_tokenizer");
  ExpectError(Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}]})", port), 400,
              "chat, no tokenizer");
  ExpectError(Post("/tokenize", R"({"content": "x"})", port), 400, "tokenize, no tokenizer");
  const Reply r = Post("/v1/completions", R"({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
      "ignore_eos": true})", port);
  ASSERT_EQ(r.status, 200) << r.body;
  // The text is the generated ids, separated by spaces.
  const std::string text = r.json()["choices"][0]["text"];
  EXPECT_EQ(std::count(text.begin(), text.end(), ' '), 3) << text;
}

TEST_F(ServerTest, BindFailureNamesTheAddress) {
  ServerOptions o = BaseOptions();
  o.port = env_->open->port();  // taken
  auto server = HttpServer::Create(*env_->model, env_->tokenizer.get(), env_->scheduler, o);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const Status st = (*server)->Start();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("127.0.0.1:" + std::to_string(o.port)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("in use"), std::string::npos) << st.message();
}

TEST_F(ServerTest, StopStringsCutTheTextAndFinishAsStop) {
  const std::string prompt = "Once upon a time there was";
  const Reply plain = Post("/v1/completions", CompletionBody(prompt, 16));
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::string text = plain.json()["choices"][0]["text"];
  // A stop string from the middle of the greedy text: two printable ASCII characters.
  std::string stop;
  for (size_t i = 2; i + 2 <= text.size() && stop.empty(); ++i) {
    auto printable = [](char ch) { return ch > ' ' && ch < 127 && ch != '"' && ch != '\\'; };
    if (printable(text[i]) && printable(text[i + 1])) stop = text.substr(i, 2);
  }
  if (stop.empty()) GTEST_SKIP() << "the random model's text has no ASCII pair to stop at: " << text;
  const std::string want = text.substr(0, text.find(stop));
  Json body = {{"prompt", prompt}, {"max_tokens", 16}, {"temperature", 0}, {"stop", {stop}}};
  const Reply r = Post("/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json()["choices"][0]["text"], want) << "stop " << stop << " in " << text;
  EXPECT_EQ(r.json()["choices"][0]["finish_reason"], "stop");

  body["stream"] = true;
  const Reply streamed = Post("/v1/completions", body.dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const std::vector<std::string> events = SseEvents(streamed.body);
  ASSERT_GE(events.size(), 2u);
  std::string got;
  for (size_t i = 0; i + 1 < events.size(); ++i) got += Json::parse(events[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(got, want);
  EXPECT_EQ(Json::parse(events[events.size() - 2])["choices"][0]["finish_reason"], "stop");
}

// What evaluation harnesses send (lm-eval's local-completions, vLLM's clients): /tokenize with
// vLLM's fields, /tokenizer_info, logit_bias, stop_token_ids, more than 4 stop strings, and a
// response_format the server cannot honour refused by name.
TEST_F(ServerTest, HarnessFieldsAndTokenizerEndpoints) {
  const Reply info = Get("/tokenizer_info");
  ASSERT_EQ(info.status, 200) << info.body;
  const Json i = info.json();
  EXPECT_TRUE(i.at("eos_token").is_string());
  EXPECT_TRUE(i.at("eos_token_id").is_number_integer());
  EXPECT_GT(i.at("model_max_length").get<int>(), 0);
  EXPECT_GT(i.at("vocab_size").get<int>(), 0);

  const Reply tok = Post("/tokenize", R"({"model": "tiny-test", "prompt": "hello there"})");
  ASSERT_EQ(tok.status, 200) << tok.body;
  const Json tokens = tok.json().at("tokens");
  ASSERT_GE(tokens.size(), 2u);
  EXPECT_EQ(tokens[0], i.at("bos_token_id")) << "vLLM's add_special_tokens defaults to true";
  EXPECT_EQ(tok.json().at("count"), tokens.size());
  const Reply bare = Post("/tokenize", R"({"prompt": "hello there", "add_special_tokens": false})");
  ASSERT_EQ(bare.status, 200) << bare.body;
  EXPECT_EQ(bare.json().at("tokens").size(), tokens.size() - 1);

  // A large bias makes every greedy token `forced`; stopping on it ends at once, as "stop".
  const int32_t forced = tokens[1].get<int32_t>();
  Json body = {{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"temperature", 0},
               {"logit_bias", {{std::to_string(forced), 100}}}};
  const Reply biased = Post("/v1/completions", body.dump());
  ASSERT_EQ(biased.status, 200) << biased.body;
  const Reply piece = Post("/detokenize", Json{{"tokens", {forced, forced, forced, forced}}}.dump());
  auto without_spaces = [](std::string text) {  // /detokenize drops an SPM text's leading space
    std::erase(text, ' ');
    return text;
  };
  EXPECT_EQ(without_spaces(biased.json()["choices"][0]["text"]), without_spaces(piece.json()["content"]));
  EXPECT_EQ(biased.json()["usage"]["completion_tokens"], 4);
  body["stop_token_ids"] = {forced};
  body["stop"] = {"a1", "b2", "c3", "d4", "e5", "f6"};
  const Reply stopped = Post("/v1/completions", body.dump());
  ASSERT_EQ(stopped.status, 200) << stopped.body;
  EXPECT_EQ(stopped.json()["choices"][0]["text"], "");
  EXPECT_EQ(stopped.json()["choices"][0]["finish_reason"], "stop");

  Json e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "logit_bias": {"99999999": 1}})"), 400,
                       "logit_bias outside the vocabulary");
  EXPECT_EQ(e["param"], "logit_bias.99999999");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "stop_token_ids": [99999999]})"), 400,
                  "stop_token_ids outside the vocabulary");
  EXPECT_EQ(e["param"], "stop_token_ids[0]");
  e = ExpectError(Post("/v1/completions", R"({"prompt": "x", "response_format": {"type": "json_object"}})"), 400,
                  "response_format json_object");
  EXPECT_EQ(e["param"], "response_format.type");
}

// lm-eval's loglikelihood request (openai_completions.py): context and continuation as one token
// list, max_tokens 1, logprobs 1, echo; the harness sums token_logprobs[ctxlen:-1] and calls the
// continuation greedy when each token is its top_logprobs' best. Every prompt log-probability is
// the model's, as a plain forward pass over the same tokens gives it.
TEST_F(ServerTest, LoglikelihoodViaEchoMatchesTheModel) {
  const Reply tok = Post("/tokenize", R"({"prompt": "Once upon a time there was a little girl"})");
  ASSERT_EQ(tok.status, 200) << tok.body;
  const std::vector<int32_t> tokens = tok.json().at("tokens").get<std::vector<int32_t>>();
  const size_t n = tokens.size();
  ASSERT_GE(n, 6u);
  const size_t ctxlen = 4;
  Json body = {{"model", kModelId}, {"prompt", {tokens}}, {"max_tokens", 1}, {"temperature", 0},
               {"logprobs", 1},     {"echo", true},        {"seed", 1234}};
  const Reply r = Post("/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const Json reply = r.json();
  const Json& lp = reply["choices"][0].at("logprobs");
  const Json& token_logprobs = lp.at("token_logprobs");
  const Json& top = lp.at("top_logprobs");
  ASSERT_EQ(token_logprobs.size(), n + 1);  // the prompt, then the one generated token
  ASSERT_EQ(lp.at("tokens").size(), n + 1);
  ASSERT_EQ(lp.at("text_offset").size(), n + 1);
  EXPECT_TRUE(token_logprobs[0].is_null());
  EXPECT_TRUE(top[0].is_null());
  std::string text;
  for (size_t i = 0; i <= n; ++i) {
    EXPECT_EQ(lp["text_offset"][i], text.size()) << i;
    text += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(reply["choices"][0]["text"], text);

  // The reference: one dense forward pass over the prompt, every row's logits.
  const Model& model = *env_->model;
  const int32_t n_vocab = model.config().n_vocab;
  ContiguousKvCache cache(KvGeometry{model.config().n_layers, model.config().n_kv_heads, model.config().head_dim},
                          KvStorage::kF16, 1, static_cast<int32_t>(n));
  Engine engine(model, &cache, 2);
  std::vector<float> logits(n * static_cast<size_t>(n_vocab));
  ASSERT_TRUE(engine.Forward(0, tokens.data(), static_cast<int32_t>(n), 0, logits.data(), /*all_logits=*/true).ok());
  double continuation = 0, expected = 0;
  bool greedy = true, expected_greedy = true;
  for (size_t i = 1; i < n; ++i) {
    const TokenLogprob want = LogprobOf(logits.data() + (i - 1) * n_vocab, n_vocab, tokens[i], 1);
    EXPECT_NEAR(token_logprobs[i].get<double>(), want.logprob, 2e-3) << "prompt token " << i;
    ASSERT_EQ(top[i].size(), 1u);
    if (i < ctxlen) continue;
    continuation += token_logprobs[i].get<double>();
    expected += want.logprob;
    greedy = greedy && top[i].begin().key() == lp["tokens"][i].get<std::string>();
    expected_greedy = expected_greedy && want.top[0].first == tokens[i];
  }
  EXPECT_NEAR(continuation, expected, 1e-2);
  EXPECT_EQ(greedy, expected_greedy);
  // The generated token is the greedy one, with its own log-probability.
  const TokenLogprob last = LogprobOf(logits.data() + (n - 1) * n_vocab, n_vocab, 0, 1);
  EXPECT_NEAR(token_logprobs[n].get<double>(), last.top[0].second, 2e-3);

  // max_tokens 0: the prompt scored, nothing generated.
  body["max_tokens"] = 0;
  const Reply scored = Post("/v1/completions", body.dump());
  ASSERT_EQ(scored.status, 200) << scored.body;
  EXPECT_EQ(scored.json()["choices"][0]["logprobs"]["token_logprobs"].size(), n);
  EXPECT_EQ(scored.json()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(scored.json()["usage"]["completion_tokens"], 0);

  // Chat: the content list, each token with its alternatives, the greedy token the best of them.
  const Reply chat = Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}],
      "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 2})");
  ASSERT_EQ(chat.status, 200) << chat.body;
  const Json chat_reply = chat.json();
  const Json& content = chat_reply["choices"][0]["logprobs"].at("content");
  ASSERT_FALSE(content.empty());
  std::string joined;
  for (const Json& item : content) {
    ASSERT_EQ(item.at("top_logprobs").size(), 2u);
    EXPECT_LE(item.at("logprob").get<double>(), 0.0);
    EXPECT_NEAR(item.at("logprob").get<double>(), item["top_logprobs"][0].at("logprob").get<double>(), 1e-6);
    EXPECT_EQ(item.at("bytes").size(), item.at("token").get<std::string>().size());
    joined += item.at("token").get<std::string>();
  }
  EXPECT_EQ(chat_reply["choices"][0]["message"]["content"], joined);
  // Without logprobs the field stays null.
  const Reply plain = Post("/v1/completions", CompletionBody("Once", 2));
  EXPECT_TRUE(plain.json()["choices"][0].at("logprobs").is_null());
}

// lm-evaluation-harness's local-completions client, as its source builds requests and reads
// replies (lm_eval/models/openai_completions.py, api_models.py): batches of token lists for
// loglikelihood (max_tokens 1, logprobs 1, echo, seed 1234; the score is the sum of
// token_logprobs[ctxlen:-1] over the choices sorted by index, greedy when each token's logprob
// is the largest of its top_logprobs' values), batches of prompts for generate_until (`until`
// plus the EOS text as `stop`, temperature 0, max_tokens, seed; the texts placed by index), and
// the tokenizer endpoints. Each batched choice equals the same prompt sent alone.
TEST_F(ServerTest, LmEvalRequestShapes) {
  const Reply info = Get("/tokenizer_info");
  ASSERT_EQ(info.status, 200) << info.body;
  const std::string eos = info.json().at("eos_token").get<std::string>();
  auto tokenize = [&](const std::string& text) {
    const Reply r = Post("/tokenize", Json{{"prompt", text}, {"add_special_tokens", true}}.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    return r.json().at("tokens").get<std::vector<int32_t>>();
  };
  // Multiple choice: one context, three continuations (each its own sequence).
  const std::vector<int32_t> context = tokenize("Once upon a time there was a little girl named");
  const size_t ctxlen = context.size();
  std::vector<std::vector<int32_t>> requests;
  for (int32_t extra : {5, 17, 29}) {
    requests.push_back(context);
    requests.back().push_back(extra);
    requests.back().push_back(extra + 1);
  }
  auto loglikelihood_payload = [&](const Json& prompt) {
    return Json{{"model", kModelId}, {"prompt", prompt}, {"temperature", 0}, {"max_tokens", 1},
                {"logprobs", 1},     {"seed", 1234},     {"echo", true}}.dump();
  };
  // parse_logprobs: (sum, is_greedy) per choice, the choices sorted by index.
  auto parse_logprobs = [&](const Json& out) {
    std::vector<Json> choices(out.at("choices").begin(), out.at("choices").end());
    std::sort(choices.begin(), choices.end(),
              [](const Json& a, const Json& b) { return a.at("index").get<int>() < b.at("index").get<int>(); });
    std::vector<std::pair<double, bool>> res;
    for (const Json& choice : choices) {
      const Json& token_logprobs = choice.at("logprobs").at("token_logprobs");
      const Json& top_logprobs = choice.at("logprobs").at("top_logprobs");
      double sum = 0;
      bool greedy = true;
      for (size_t i = ctxlen; i + 1 < token_logprobs.size(); ++i) {
        const double lp = token_logprobs[i].get<double>();
        sum += lp;
        double best = -INFINITY;
        for (const auto& [piece, value] : top_logprobs[i].items()) best = std::max(best, value.get<double>());
        greedy = greedy && lp == best;
      }
      res.emplace_back(sum, greedy);
    }
    return res;
  };
  const Reply batch = Post("/v1/completions", loglikelihood_payload(requests));
  ASSERT_EQ(batch.status, 200) << batch.body;
  const Json batch_reply = batch.json();
  const auto batched = parse_logprobs(batch_reply);
  ASSERT_EQ(batched.size(), requests.size());
  int prompt_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Reply alone = Post("/v1/completions", loglikelihood_payload(Json::array({requests[i]})));
    ASSERT_EQ(alone.status, 200) << alone.body;
    const auto single = parse_logprobs(alone.json());
    ASSERT_EQ(single.size(), 1u);
    EXPECT_NEAR(batched[i].first, single[0].first, 2e-3) << "prompt " << i;
    EXPECT_LT(batched[i].first, 0.0);
    EXPECT_EQ(batched[i].second, single[0].second) << "prompt " << i;
    EXPECT_EQ(batch_reply["choices"][i]["logprobs"]["token_logprobs"].size(), requests[i].size() + 1);
    prompt_tokens += static_cast<int>(requests[i].size());
  }
  EXPECT_EQ(batch_reply["usage"]["prompt_tokens"], prompt_tokens);

  // generate_until: a batch of prompts, five `until` strings and the EOS text as stop.
  const std::vector<std::string> contexts = {"Once upon a time", "The little dog", "One day, a girl"};
  const Json stop = {"\n\n", "Question:", "</p>", "###", "Q:", eos};
  auto generate_payload = [&](const Json& prompt) {
    return Json{{"prompt", prompt},       {"model", kModelId}, {"max_tokens", 12},
                {"temperature", 0},       {"stop", stop},      {"seed", 1234}}.dump();
  };
  const Reply generated = Post("/v1/completions", generate_payload(contexts));
  ASSERT_EQ(generated.status, 200) << generated.body;
  const Json generations = generated.json();
  std::vector<std::string> texts(generations.at("choices").size());  // parse_generations
  for (const Json& choice : generations["choices"]) {
    texts.at(choice.at("index").get<size_t>()) = choice.at("text").get<std::string>();
  }
  ASSERT_EQ(texts.size(), contexts.size());
  for (size_t i = 0; i < contexts.size(); ++i) {
    const Reply alone = Post("/v1/completions", generate_payload(contexts[i]));
    ASSERT_EQ(alone.status, 200) << alone.body;
    EXPECT_EQ(texts[i], alone.json()["choices"][0]["text"].get<std::string>()) << "prompt " << i;
  }
  // A bad prompt refuses the whole batch, naming it; nothing is left running.
  Json bad = requests;
  bad[1][2] = 99999999;
  const Json e = ExpectError(Post("/v1/completions", loglikelihood_payload(bad)), 400, "a bad prompt in a batch");
  EXPECT_EQ(e["param"], "prompt[1][2]");
}

// n > 1: the copies fork the prompt's pages (it is computed once); each choice is sampled with its
// own seed; streamed, each chunk carries one choice's index and its tokens' log-probabilities.
TEST_F(ServerTest, ChoicesShareTheirPromptAndStreamWithLogprobs) {
  const std::string story =
      "Once upon a time there was a little girl. She liked to play in the park with her dog. One day the dog "
      "ran after a red ball and the girl ran after the dog, all the way to the river.";
  const int64_t reused_before = Idle().prefix_reused_tokens;
  Json body = {{"prompt", story}, {"max_tokens", 8}, {"temperature", 1.0}, {"seed", 7},
               {"n", 3},          {"logprobs", 0},   {"ignore_eos", true}};
  const Reply r = Post("/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const Json reply = r.json();
  ASSERT_EQ(reply.at("choices").size(), 3u);
  const int prompt_tokens = reply["usage"]["prompt_tokens"].get<int>();
  ASSERT_GE(prompt_tokens, 40);
  EXPECT_GE(Idle().prefix_reused_tokens - reused_before, 2 * (prompt_tokens / 16) * 16 - 2 * 16)
      << "the copies fork the first's prompt pages";
  for (int i = 0; i < 3; ++i) {
    const Json& choice = reply["choices"][i];
    EXPECT_EQ(choice.at("index"), i);
    std::string joined;
    for (const Json& piece : choice.at("logprobs").at("tokens")) joined += piece.get<std::string>();
    EXPECT_EQ(joined, choice.at("text").get<std::string>());
  }
  // Greedy copies agree; the prompt's tokens count once in the usage.
  body["temperature"] = 0;
  const Reply greedy = Post("/v1/completions", body.dump());
  ASSERT_EQ(greedy.status, 200) << greedy.body;
  const Json g = greedy.json();
  EXPECT_EQ(g["choices"][0]["text"], g["choices"][1]["text"]);
  EXPECT_EQ(g["choices"][0]["text"], g["choices"][2]["text"]);
  EXPECT_EQ(g["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(g["usage"]["completion_tokens"].get<int>(), 3 * 8);

  // Streamed with two prompts x n 2, echo and logprobs: each index's text and log-probabilities
  // put together equal the non-streamed choice, one finish chunk each, [DONE] last.
  body = {{"prompt", Json::array({story, "The little dog"})}, {"max_tokens", 6}, {"temperature", 0}, {"n", 2},
          {"logprobs", 1}, {"echo", true}};
  const Reply plain_reply = Post("/v1/completions", body.dump());
  ASSERT_EQ(plain_reply.status, 200) << plain_reply.body;
  const Json plain = plain_reply.json();
  body["stream"] = true;
  const Reply streamed = Post("/v1/completions", body.dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const std::vector<std::string> events = SseEvents(streamed.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<std::string> text(4);
  std::vector<std::vector<std::string>> tokens(4);
  std::vector<int> finishes(4, 0);
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const Json c = Json::parse(events[i]);
    ASSERT_EQ(c.at("choices").size(), 1u);
    const Json& choice = c["choices"][0];
    const size_t index = choice.at("index").get<size_t>();
    ASSERT_LT(index, 4u);
    EXPECT_EQ(finishes[index], 0) << "nothing after a choice's finish chunk";
    text[index] += choice.at("text").get<std::string>();
    if (!choice.at("logprobs").is_null()) {
      for (const Json& t : choice["logprobs"].at("tokens")) tokens[index].push_back(t.get<std::string>());
    }
    if (!choice.at("finish_reason").is_null()) ++finishes[index];
  }
  for (size_t i = 0; i < 4; ++i) {
    const Json& want = plain["choices"][i];
    EXPECT_EQ(finishes[i], 1) << i;
    EXPECT_EQ(text[i], want.at("text").get<std::string>()) << i;
    EXPECT_EQ(tokens[i], want.at("logprobs").at("tokens").get<std::vector<std::string>>()) << i;
  }
  EXPECT_EQ(plain["choices"][0]["text"], plain["choices"][1]["text"]);
  // echo: the prompt's token pieces first (an SPM piece brings its leading space).
  EXPECT_LE(plain["choices"][0]["text"].get<std::string>().find(story.substr(0, 10)), 1u);
}

// The prefix cache and compressed contexts through the API, on a server started with
// --prefix-cache: a dense prompt that starts like a finished one reuses its pages and gets the
// cold run's text; a batch of questions on one `kvsparse.context` compresses it once (H2O 20%,
// question after) and later requests attach to it, each text equal to a cold run's (the open
// server keeps nothing); /metrics counts the hits, the tokens saved and the bytes held.
TEST_F(ServerTest, PrefixCacheAndCompressedContexts) {
  Serving cached;
  SchedulerOptions sched;
  sched.max_running = 4;
  sched.prefix_cache_entries = 8;
  ASSERT_EQ(MakeServing(*env_, sched, &cached), "");
  cached.scheduler->Start();
  ServerOptions o = BaseOptions();
  o.kv_config = &env_->kv_config;
  auto server = HttpServer::Create(*env_->model, env_->tokenizer.get(), cached.scheduler.get(), o);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  const int port = (*server)->port();
  auto metric = [&](const std::string& name) {
    const std::string body = Get("/metrics", port).body;
    const size_t at = body.find("\n" + name + " ");
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? -1.0 : std::stod(body.substr(at + name.size() + 2));
  };
  const std::string document =
      "Once upon a time there was a little girl named Lily. She lived in a small house near a big forest with her "
      "mother, her father and a dog called Max. Every morning Lily and Max walked to the river to watch the fish.";
  auto text_of = [](const Reply& r) { return r.json()["choices"][0]["text"].get<std::string>(); };

  // Dense: the second prompt starts from the first's kept pages.
  ASSERT_EQ(Post("/v1/completions", CompletionBody(document + " Where did they walk?", 8), port).status, 200);
  const std::string second = document + " What was the dog called?";
  const Reply warm = Post("/v1/completions", CompletionBody(second, 8), port);
  ASSERT_EQ(warm.status, 200) << warm.body;
  EXPECT_EQ(text_of(warm), text_of(Post("/v1/completions", CompletionBody(second, 8))));
  EXPECT_EQ(metric("kvsparse_prefix_cache_hits_total"), 1);
  EXPECT_GT(metric("kvsparse_prefix_cache_hit_tokens_total"), 32);
  EXPECT_GT(metric("kvsparse_prefix_cache_bytes"), 0);

  // Compressed contexts: three questions on one context in one request, then one more request.
  const Json questions = Json::array({" Where did they walk?", " Who is Max?", " Where was the house?"});
  Json body = {{"prompt", questions},
               {"max_tokens", 8},
               {"temperature", 0},
               {"kvsparse", {{"kv_method", "h2o"}, {"kv_budget", 0.2}, {"context", document}}}};
  const Reply first = Post("/v1/completions", body.dump(), port);
  ASSERT_EQ(first.status, 200) << first.body;
  const Reply cold = Post("/v1/completions", body.dump());  // the same protocol, nothing kept
  ASSERT_EQ(cold.status, 200) << cold.body;
  const Json first_reply = first.json(), cold_reply = cold.json();
  for (size_t i = 0; i < questions.size(); ++i) {
    EXPECT_EQ(first_reply["choices"][i]["text"], cold_reply["choices"][i]["text"]) << "question " << i;
  }
  EXPECT_EQ(metric("kvsparse_prefix_cache_hits_total"), 1 + 2) << "the first question computes the context";
  body["prompt"] = " What did they watch?";
  const Reply later = Post("/v1/completions", body.dump(), port);
  ASSERT_EQ(later.status, 200) << later.body;
  EXPECT_EQ(text_of(later), text_of(Post("/v1/completions", body.dump())));
  EXPECT_EQ(metric("kvsparse_prefix_cache_hits_total"), 4);
  // The same context under another config is another entry.
  body["kvsparse"]["kv_budget"] = 0.3;
  ASSERT_EQ(Post("/v1/completions", body.dump(), port).status, 200);
  EXPECT_EQ(metric("kvsparse_prefix_cache_hits_total"), 4);

  // Bad uses name the field.
  Json e = ExpectError(Post("/v1/chat/completions",
                            R"({"messages": [{"role": "user", "content": "x"}], "kvsparse": {"context": "y"}})", port),
                       400, "context on chat");
  EXPECT_EQ(e["param"], "kvsparse.context");
  e = ExpectError(Post("/v1/completions", R"({"prompt": [1, 2, 3], "kvsparse": {"context_tokens": 3}})", port), 400,
                  "no question after the context");
  EXPECT_EQ(e["param"], "prompt");
  (*server)->Stop();
  cached.scheduler->Stop();
  EXPECT_EQ(cached.runtime->paged_cache()->pages_in_use(), 0) << "stopping frees the kept pages";
}

// The "kvsparse" extension runs one request under its own method and budget.
TEST_F(ServerTest, PerRequestKvMethodEvicts) {
  const int64_t evicted_before = Idle().evicted_tokens;
  const Reply r = Post("/v1/completions", R"({"prompt": "a story about a cat", "max_tokens": 80, "ignore_eos": true,
      "temperature": 0, "kvsparse": {"kv_method": "streaming_llm", "kv_budget": 24}})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json()["usage"]["completion_tokens"], 80);
  EXPECT_GT(Idle().evicted_tokens, evicted_before) << "the request ran with a 24-token budget";
  const Reply full = Post("/v1/completions", R"({"prompt": "a story about a cat", "max_tokens": 80,
      "ignore_eos": true, "temperature": 0})");
  ASSERT_EQ(full.status, 200) << full.body;
  EXPECT_LT(r.json()["usage"]["kv_bytes"].get<int64_t>(), full.json()["usage"]["kv_bytes"].get<int64_t>())
      << "a sparse request holds fewer KV bytes at its peak";
}

// ... and under its own page storage: int8 pages hold about half the bytes of the server's f16.
TEST_F(ServerTest, PerRequestKvTypeHoldsFewerBytes) {
  const std::string prompt = R"({"prompt": "a story about a dog", "max_tokens": 40, "ignore_eos": true,
      "temperature": 0)";
  const Reply int8 = Post("/v1/completions", prompt + R"(, "kvsparse": {"kv_type": "int8"}})");
  ASSERT_EQ(int8.status, 200) << int8.body;
  const Reply f16 = Post("/v1/completions", prompt + "}");
  ASSERT_EQ(f16.status, 200) << f16.body;
  const int64_t int8_bytes = int8.json()["usage"]["kv_bytes"].get<int64_t>();
  const int64_t f16_bytes = f16.json()["usage"]["kv_bytes"].get<int64_t>();
  EXPECT_LT(int8_bytes, f16_bytes * 3 / 4) << "int8 " << int8_bytes << " vs f16 " << f16_bytes;
  EXPECT_EQ(int8.json()["usage"]["completion_tokens"], 40);
  EXPECT_EQ(Idle().kv_pages_used, 0) << "the int8 request's pages went back to the pool";
}

TEST_F(ServerTest, RequestPastItsDeadlineGets408) {
  const std::string body = R"({"prompt": "slow", "max_tokens": 400, "ignore_eos": true, "timeout_s": 0.000001)";
  Json e = ExpectError(Post("/v1/completions", body + "}"), 408, "deadline passed");
  EXPECT_EQ(e["code"], "request_timeout");
  e = ExpectError(Post("/v1/completions", body + R"(, "stream": true})"), 408, "deadline passed, streaming");
  EXPECT_EQ(e["code"], "request_timeout");
  EXPECT_EQ(Post("/v1/completions", CompletionBody("after a timeout", 2)).status, 200);
}

TEST_F(ServerTest, FullQueueGets503) {
  SchedulerOptions sched;
  sched.max_queue = 0;  // every request is refused
  Serving serving;
  ASSERT_EQ(MakeServing(*env_, sched, &serving), "");
  serving.scheduler->Start();
  auto server = HttpServer::Create(*env_->model, env_->tokenizer.get(), serving.scheduler.get(), BaseOptions());
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  const Reply r = Post("/v1/completions", CompletionBody("busy", 2), (*server)->port());
  const Json e = ExpectError(r, 503, "queue full");
  EXPECT_EQ(e["code"], "server_busy");
  EXPECT_EQ(r.headers.find("Retry-After")->second, "1");
  (*server)->Stop();
  serving.scheduler->Stop();
}

// Stop with no grace cancels what is in flight: its client gets 503 and Stop returns.
TEST_F(ServerTest, StopCancelsRequestsInFlight) {
  Serving serving;  // never started: requests wait in its queue
  ASSERT_EQ(MakeServing(*env_, SchedulerOptions{}, &serving), "");
  auto server = HttpServer::Create(*env_->model, env_->tokenizer.get(), serving.scheduler.get(), BaseOptions());
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  Reply waiting;
  std::thread client([&] { waiting = Post("/v1/completions", CompletionBody("never runs", 4), (*server)->port()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the request is in the queue
  const auto t0 = Clock::now();
  (*server)->Stop();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  client.join();
  ExpectError(waiting, 503, "cancelled by Stop");
  serving.scheduler->Stop();
}

// Greedy results do not depend on what else runs: 16 requests alone, then all at once.
TEST_F(ServerTest, GreedyIsTheSameAloneAndWithFifteenOthers) {
  constexpr int kClients = 16;
  const std::vector<std::string> words = {"apple", "river", "stone", "cloud", "lamp", "forest", "tiger", "window"};
  std::vector<std::string> bodies;
  for (int i = 0; i < kClients; ++i) {
    std::string prompt;
    for (int w = 0; w <= i % 7; ++w) prompt += words[(i * 3 + w) % words.size()] + " ";
    const bool chat = i % 4 == 3;
    Json j = {{"temperature", 0}, {"max_tokens", 6 + i % 5}};
    if (chat) {
      j["messages"] = Json::array({{{"role", "user"}, {"content", prompt}}});
    } else {
      j["prompt"] = prompt;
    }
    bodies.push_back(j.dump());
  }
  auto path = [](int i) { return i % 4 == 3 ? "/v1/chat/completions" : "/v1/completions"; };
  auto text = [](const Reply& r, int i) -> std::string {
    const Json j = Json::parse(r.body, nullptr, false);
    if (j.is_discarded() || !j.contains("choices")) return "<no completion: " + r.body + ">";
    return i % 4 == 3 ? j["choices"][0]["message"]["content"].get<std::string>()
                      : j["choices"][0]["text"].get<std::string>();
  };
  std::vector<std::string> alone(kClients);
  for (int i = 0; i < kClients; ++i) {
    const Reply r = Post(path(i), bodies[i]);
    ASSERT_EQ(r.status, 200) << r.body;
    alone[i] = text(r, i);
  }
  std::vector<Reply> together(kClients);
  std::vector<std::thread> threads;
  const int port = env_->open->port();
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c = MakeClient(port);
      together[i] = ToReply(c.Post(path(i), bodies[i], "application/json"));
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(together[i].status, 200) << "client " << i << ": " << together[i].body;
    EXPECT_EQ(text(together[i], i), alone[i]) << "client " << i;
  }
  const SchedulerStats s = Idle();
  EXPECT_EQ(s.finished[static_cast<int>(FinishReason::kError)], 0);
}

// A raw loopback client that sends one completion request with `body` (-1 when it failed).
int SendRawCompletion(int port, const std::string& body) {
  return testing::SendRawLoopback(port, testing::CompletionRequestHead(body.size()) + body);
}

// After a client hung up: its request ends as cancelled (within 10 s), nothing runs, and the
// pages in use are those of `before`.
void ExpectCancelledAndPagesBack(const Scheduler& scheduler, const SchedulerStats& before) {
  const int64_t cancelled_before = before.finished[static_cast<int>(FinishReason::kCancelled)];
  const auto until = Clock::now() + std::chrono::seconds(10);
  SchedulerStats s = scheduler.Stats();
  while (Clock::now() < until &&
         (s.finished[static_cast<int>(FinishReason::kCancelled)] == cancelled_before || s.running > 0 ||
          s.kv_pages_used != before.kv_pages_used)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    s = scheduler.Stats();
  }
  EXPECT_EQ(s.finished[static_cast<int>(FinishReason::kCancelled)], cancelled_before + 1)
      << "the request was cancelled, not run to its end";
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.kv_pages_used, before.kv_pages_used) << "the cancelled request's pages came back";
}

// A raw client that reads the first event of a stream and hangs up: the request is cancelled
// and its pages come back.
TEST_F(ServerTest, StreamingClientThatDisconnectsIsCancelled) {
  const SchedulerStats before = Idle();
  const int fd = SendRawCompletion(env_->open->port(),
                                   R"({"prompt": "A long story:", "max_tokens": 480, "ignore_eos": true, "stream": true})");
  ASSERT_GE(fd, 0);
  std::string received;
  char buf[4096];
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  while (received.find("data: ") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    received.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  ASSERT_NE(received.find("HTTP/1.1 200"), std::string::npos) << received;
  ASSERT_NE(received.find("data: "), std::string::npos) << received;
  // The server notices at its next writes, cancels, and the scheduler frees the pages.
  ExpectCancelledAndPagesBack(*env_->scheduler, before);
  EXPECT_EQ(Get("/health").status, 200);
}

// A non-streaming client that hangs up before its answer: nothing is written to it until the
// end, so the server watches the socket; the request is cancelled and its pages come back long
// before its 480 tokens would have run.
TEST_F(ServerTest, NonStreamingClientThatDisconnectsIsCancelled) {
  const SchedulerStats before = Idle();
  const int fd =
      SendRawCompletion(env_->open->port(), R"({"prompt": "A long story:", "max_tokens": 480, "ignore_eos": true})");
  ASSERT_GE(fd, 0);
  // Hang up once the request runs.
  const auto started = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < started && env_->scheduler->Stats().running == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_GT(env_->scheduler->Stats().running, 0);
  ::close(fd);
  ExpectCancelledAndPagesBack(*env_->scheduler, before);
  EXPECT_EQ(Get("/health").status, 200);
}

// `kvsparse serve` itself: it prints where it listens, answers, and exits 0 on SIGTERM.
TEST_F(ServerTest, ServeCommandAnswersAndExitsCleanlyOnSigterm) {
  const std::string cli = testing::CliPath();
  const std::string model = env_->model->path();
  int err_pipe[2];
  ASSERT_EQ(pipe(err_pipe), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(err_pipe[1], STDERR_FILENO);
    close(err_pipe[0]);
    close(err_pipe[1]);
    execl(cli.c_str(), cli.c_str(), "serve", "-m", model.c_str(), "--port", "0", "-t", "1", "--parallel", "2",
          "--chat-template", "llama2", "--alias", "cli-model", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(err_pipe[1]);
  // Reads stderr until the "listening on" line (or 30 s).
  std::string log;
  int port = 0;
  const auto until = Clock::now() + std::chrono::seconds(30);
  while (port == 0 && Clock::now() < until) {
    pollfd p{err_pipe[0], POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[1024];
    const ssize_t n = read(err_pipe[0], buf, sizeof(buf));
    if (n <= 0) break;
    log.append(buf, static_cast<size_t>(n));
    const std::string marker = "listening on http://127.0.0.1:";
    const size_t at = log.find(marker);
    if (at != std::string::npos && log.find('\n', at) != std::string::npos) {
      port = std::atoi(log.c_str() + at + marker.size());
    }
  }
  auto finish = [&](int sig) {
    kill(pid, sig);
    int status = 0;
    for (int i = 0; i < 1000 && waitpid(pid, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (waitpid(pid, &status, WNOHANG) == 0) {  // still there after 10 s
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -2;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  if (port == 0) {
    finish(SIGKILL);
    close(err_pipe[0]);
    FAIL() << "no 'listening on' line from " << cli << ":\n" << log;
  }
  EXPECT_NE(log.find("(model cli-model, kv "), std::string::npos) << log;
  EXPECT_NE(log.find("parallel 2, KV budget "), std::string::npos) << log;
  EXPECT_EQ(Get("/health", port).status, 200);
  const Reply r = Post("/v1/chat/completions",
                       R"({"model": "cli-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})",
                       port);
  EXPECT_EQ(r.status, 200) << r.body;
  const int status = finish(SIGTERM);
  // The rest of its stderr (an abort's message, say) for the failure message.
  char buf[4096];
  for (ssize_t n; (n = read(err_pipe[0], buf, sizeof(buf))) > 0;) log.append(buf, static_cast<size_t>(n));
  EXPECT_EQ(status, 0) << "exit status after SIGTERM; log:\n" << log;
  close(err_pipe[0]);
}

// Seconds until the server closes `fd` (reading whatever it answers first); 30 when it does not.
double SecondsUntilClosed(int fd, std::string* answer) {
  const auto start = Clock::now();
  char buf[4096];
  while (Clock::now() - start < std::chrono::seconds(30)) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    answer->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Issue 30's probes against a server of its own (1 MiB bodies, a 0.5 s read timeout and 1 s
// keep-alive, 4 HTTP threads holding at most 8 connections): a 1 MiB prompt gets 413, a slow
// client's unfinished headers or body are cut off after the two timeouts, and 10,000 idle connections opened at once
// hold at most 8 connections on the server, which answers again as soon as they go.
TEST_F(ServerTest, OversizedSlowAndIdleClients) {
  ServerOptions o = BaseOptions();
  o.max_body_bytes = 1 << 20;
  o.read_timeout_s = 0.5;
  o.keep_alive_timeout_s = 1;  // httplib then waits this long for more bytes before closing
  o.http_threads = 4;
  o.max_connections = 8;
  o.kv_config = &env_->kv_config;
  auto server = HttpServer::Create(*env_->model, env_->tokenizer.get(), env_->scheduler, o);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  const int port = (*server)->port();

  // A 1 MiB prompt: its body is above the limit.
  const Json big = {{"prompt", std::string(1 << 20, 'a')}, {"max_tokens", 1}};
  ExpectError(Post("/v1/completions", big.dump(), port), 413, "a 1 MiB prompt");

  // Unfinished headers, then an unfinished body: closed at the read timeout, not held.
  std::string answer;
  const int headers_fd = testing::SendRawLoopback(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
  ASSERT_GE(headers_fd, 0);
  EXPECT_LT(SecondsUntilClosed(headers_fd, &answer), 5.0) << "a client stalled in its headers holds the connection";
  answer.clear();
  const int body_fd = testing::SendRawLoopback(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    "Content-Length: 100\r\n\r\n{\"prompt\": ");
  ASSERT_GE(body_fd, 0);
  EXPECT_LT(SecondsUntilClosed(body_fd, &answer), 5.0) << "a client stalled in its body holds the connection";
  EXPECT_TRUE(answer.empty() || answer.rfind("HTTP/1.1 4", 0) == 0) << answer.substr(0, 200);

  // 10,000 idle connections at once (non-blocking connects; the client needs the descriptors).
  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  constexpr rlim_t kIdle = 10000;
  if (files.rlim_cur < kIdle + 256) {
    files.rlim_cur = std::min<rlim_t>(files.rlim_max, kIdle + 256);
    setrlimit(RLIMIT_NOFILE, &files);
  }
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  const int n_idle = static_cast<int>(std::min<rlim_t>(kIdle, files.rlim_cur - 256));
  if (n_idle < static_cast<int>(kIdle)) std::fprintf(stderr, "note: %d idle connections (open-file limit)\n", n_idle);
  std::vector<int> idle;
  idle.reserve(static_cast<size_t>(n_idle));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < n_idle; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) break;
    ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));  // EINPROGRESS
    idle.push_back(fd);
  }
  EXPECT_EQ(static_cast<int>(idle.size()), n_idle);
  int most_held = 0;
  for (int i = 0; i < 20; ++i) {  // 2 s: several read timeouts
    most_held = std::max(most_held, (*server)->open_connections());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_LE(most_held, 8) << "the server holds more connections than max_connections";
  EXPECT_GT(most_held, 0);
  for (int fd : idle) ::close(fd);
  // Answers again once they are gone.
  Reply health;
  const auto until = Clock::now() + std::chrono::seconds(30);
  do {
    health = Get("/health", port);
  } while (health.status != 200 && Clock::now() < until);
  EXPECT_EQ(health.status, 200) << "the server did not answer after the idle connections closed";
  (*server)->Stop();
}

}  // namespace
}  // namespace kvsparse::server
