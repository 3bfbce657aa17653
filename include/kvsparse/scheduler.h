// Continuous batching over one Engine: requests join and leave at any step.
//
// Every step (Scheduler::Step) builds one batch for Engine::ForwardBatch:
//   1. one decode row for every running sequence that has a prompt behind it;
//   2. then prompt chunks (at most the controller's prefill_chunk each, oldest request first)
//      until the step holds step_tokens rows, so a long prompt is spread over several steps
//      and never stalls the running streams.
// Admission: a waiting request starts when a sequence slot is free (max_running) and the KV
// pages it can ever hold between steps under its sparsity budget
// (SparseKvController::SequenceReserveBytes) fit beside what the running requests reserve and
// one prompt chunk on top (ChunkReserveBytes: a sparse layer holds a chunk beyond its budget
// until the chunk's eviction, and only the step's chunks do so at once): a request at a 20%
// budget with int8 pages reserves about a tenth of what a dense f16 one does. Should a step still lack pages (an
// eviction put off, an estimate short), the newest running request is preempted: its pages
// are freed and it goes back to the head of the queue, to be recomputed from its prompt and
// the tokens it already produced (its client sees no gap). A full queue refuses new requests.
// Cancellation (Cancel, a deadline) frees the request's pages at the next step.
//
// Thread-safety: Submit, Cancel, the handles and Stats may be called from any thread; Step runs
// on one thread at a time (Start runs it on a worker thread).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvsparse/engine.h"
#include "kvsparse/logprob.h"
#include "kvsparse/sampler.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/status.h"
#include "kvsparse/prefix_cache.h"

namespace kvsparse {

struct SchedulerOptions {
  int max_running = 4;          // sequences in flight at once (--parallel)
  int32_t step_tokens = 512;    // rows per step: decode rows first, then prompt chunks
  int max_queue = 64;           // waiting requests; Submit refuses beyond (HTTP 503)
  int32_t max_context = 4096;   // prompt + max_tokens of one request
  // Admission compares reservations with budget * overcommit. 1: no request is ever preempted
  // for pages its reservation covers; above 1, more requests start (most end before their
  // worst case) and preemption absorbs the excess, as vLLM's optimistic admission does.
  double overcommit = 1.0;
  // A dense request whose prompt starts like a running dense request's computed tokens (at least
  // a page) forks that sequence (pages shared by reference count) and computes only the rest;
  // one whose prompt starts like an earlier request's still being computed waits for it to get
  // there (n copies of a prompt, several questions on one context). false: nothing is ever
  // forked, running or cached (a cold baseline).
  bool share_prefixes = true;
  // Automatic prefix caching: > 0 keeps up to this many finished dense sequences (their computed
  // tokens, a page or more) for later prompts that start like them, as vLLM's prefix cache keeps
  // finished requests' blocks: a hit forks the kept sequence (pages shared copy-on-write) and
  // computes only the rest. Kept pages are freed least recently used first when admission or a
  // step needs the room; admission counts them. 0: off (pages return when a request ends).
  int prefix_cache_entries = 0;
};

enum class FinishReason {
  kNone,       // still running
  kStop,       // an end-of-generation token (or the caller's stop: Finish)
  kLength,     // max_tokens or the context
  kCancelled,  // Cancel (a client gone)
  kTimeout,    // past its deadline
  kError,      // the engine failed; error() says why
  kShutdown,   // the scheduler stopped before it finished
};
const char* FinishReasonName(FinishReason r);  // "stop", "length", "cancelled", ...

struct GenerationRequest {
  std::vector<int32_t> prompt;          // token ids, non-empty
  int32_t max_tokens = 128;             // tokens to generate at most
  SamplerParams sampling;
  std::vector<int32_t> stop_tokens;     // generation ends (reason kStop) after one of these
  std::optional<std::chrono::steady_clock::time_point> deadline;  // kTimeout past it
  // This request's own methods and budgets (KvLayersWithOverride); null: the server's config.
  std::shared_ptr<const std::vector<LayerKvConfig>> kv_layers;
  // >= 0: each generated token comes with its TokenLogprob (logprob.h) and this many
  // alternatives (WaitNext's logprobs); -1: none.
  int32_t logprobs = -1;
  // The prompt's own log-probabilities too (RequestHandle::prompt_logprobs; max(logprobs, 0)
  // alternatives): its chunks compute every row's logits, and it never starts from another
  // request's pages. With echo, max_tokens may be 0 (score the prompt, generate nothing).
  bool echo = false;
  // > 0: the prompt's first context_tokens tokens are a context, compressed on its own: they are
  // prefilled first and their last chunk ends like a prompt (the layers' prompt-end eviction), the
  // rest (the question) after them, as bench's question_after protocol. With the prefix cache
  // the compressed context is kept, keyed by its tokens and the request's layer config; a later
  // request with the same context and config forks it (pages and policy state) and prefills only
  // its question; one submitted while the first still computes it waits for it.
  int32_t context_tokens = 0;
};

// What one request did, filled as it runs.
struct RequestStats {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t preemptions = 0;
  size_t kv_reserved_bytes = 0;   // what admission reserved for it
  size_t kv_peak_bytes = 0;       // most KV bytes its pages held (live bytes, after a step)
  double queue_s = 0;             // submit to admission (last admission after a preemption)
  double ttft_s = -1;             // submit to first token; -1 before it
  std::vector<double> token_times_s;  // since submit, one per generated token
};

class Scheduler;
namespace detail {
// Wakes the scheduler's worker; shared with the handles so that a handle outliving its
// scheduler stays safe to cancel.
struct SchedulerWaker {
  std::mutex mu;
  std::condition_variable cv;
  bool signalled = false;
  void Notify();
};
}  // namespace detail

// The caller's end of one request: tokens as they come, the end, cancellation.
class RequestHandle {
 public:
  // Waits until new tokens are there, the request ended, or `timeout` passed; appends the
  // tokens produced since the last call to *tokens. Returns false once the request has ended
  // and every token has been taken.
  bool WaitNext(std::vector<int32_t>* tokens, std::chrono::milliseconds timeout,
                std::vector<TokenLogprob>* logprobs = nullptr);
  // With echo: one entry per prompt token (the first's logprob NaN), complete once the prompt
  // has run (before its first generated token is delivered); empty before.
  std::vector<TokenLogprob> prompt_logprobs() const;
  // Ends the request (kCancelled unless it already ended); its pages are freed at the next step.
  void Cancel();
  // Ends it as kStop (e.g. the caller matched a stop string), freeing its pages the same way.
  void Finish();
  bool finished() const;
  FinishReason finish_reason() const;
  Status error() const;
  RequestStats stats() const;
  uint64_t id() const { return id_; }

 private:
  friend class Scheduler;
  RequestHandle(uint64_t id, std::shared_ptr<detail::SchedulerWaker> waker) : id_(id), waker_(std::move(waker)) {}
  void RequestStop(FinishReason reason);
  const uint64_t id_;
  std::shared_ptr<detail::SchedulerWaker> waker_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> pending_;  // produced, not yet taken
  std::vector<TokenLogprob> pending_logprobs_;  // [pending_] with GenerationRequest::logprobs
  std::vector<TokenLogprob> prompt_logprobs_;   // with echo, once the prompt has run
  bool ended_ = false;            // FinishReason set
  FinishReason reason_ = FinishReason::kNone;
  bool stop_requested_ = false;   // Cancel / Finish asked; the scheduler ends it at its next step
  FinishReason requested_reason_ = FinishReason::kCancelled;
  Status error_;
  RequestStats stats_;
};

struct SchedulerStats {
  int running = 0;
  int waiting = 0;
  int64_t steps = 0;
  int64_t prompt_tokens = 0;     // prompt rows computed (recomputation after preemption included)
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  int64_t rejected = 0;          // refused by a full queue
  int64_t prefix_reused_tokens = 0;  // prompt tokens taken from another sequence's pages (running or cached)
  int64_t prefix_cache_hits = 0;         // requests that started from a cached sequence
  int64_t prefix_cache_hit_tokens = 0;   // prompt tokens they did not compute
  int64_t prefix_cache_evictions = 0;    // cached sequences freed for room (LRU)
  int prefix_cache_entries = 0;          // sequences kept now
  size_t prefix_cache_bytes = 0;         // KV bytes only the cache holds (what evicting it all frees)
  int64_t finished[7] = {};      // by FinishReason
  size_t kv_budget_bytes = 0;
  size_t kv_reserved_bytes = 0;  // admission reservations of the running requests
  size_t kv_used_bytes = 0;      // pages in use
  int64_t kv_pages_used = 0;
  int64_t evicted_tokens = 0;    // all layers, all sequences
  double busy_s = 0;             // time inside Engine::ForwardBatch
};

class Scheduler {
 public:
  // engine's cache must be controller's paged cache; both outlive the scheduler.
  Scheduler(Engine* engine, SparseKvController* controller, const SchedulerOptions& options);
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. InvalidArgument when it can never run (empty prompt, token ids out of
  // range, prompt + max_tokens above max_context, or a reservation above the whole KV budget),
  // ResourceExhausted when the queue is full or the scheduler is stopping.
  StatusOr<std::shared_ptr<RequestHandle>> Submit(GenerationRequest request);

  // One step: ends cancelled and timed-out requests, admits, runs a batch, samples, delivers.
  // Returns false when there was nothing to do. For tests and single-threaded use; do not call
  // it while Start's worker runs.
  bool Step();
  // Runs Step on a worker thread until Stop.
  void Start();
  // Refuses new requests; with drain, lets running and queued requests finish (until
  // grace passes), then ends the rest as kShutdown and joins the worker.
  void Stop(bool drain = false, std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  SchedulerStats Stats() const;
  const SchedulerOptions& options() const { return options_; }
  // KV bytes a request would reserve while admitted (SequenceReserveBytes).
  size_t ReserveBytes(int32_t prompt_tokens, int32_t max_tokens,
                      const std::vector<LayerKvConfig>* kv_layers = nullptr) const;
  // What one prompt chunk of a request holds on top while it runs (ChunkReserveBytes of its
  // largest chunk: the step's chunk size, or the whole prompt when shorter). Admission needs
  // room for the reservations plus the largest chunk still to run; a step runs its first prompt
  // chunk, and further ones while they fit.
  size_t ChunkReserveBytes(int32_t prompt_tokens, const std::vector<LayerKvConfig>* kv_layers = nullptr) const;

 private:
  struct Active;  // a request inside the scheduler
  // Ends a request: frees its sequence, delivers its reason (pages freed at once).
  void End(Active& a, FinishReason reason, Status error = Status::Ok());
  void Preempt(Active& a);
  bool Admit();
  int32_t ChunkTokens() const;  // the largest prompt chunk of a step
  bool IsDense(const Active& a) const;  // every layer of its config keeps every token
  const std::vector<LayerKvConfig>& LayersOf(const Active& a) const;  // its own config, or the server's
  // Samples a's next token from a.logits and hands it to the handle; the reason it ends, if it does.
  FinishReason SampleAndDeliver(Active& a, size_t kv_bytes, std::chrono::steady_clock::time_point now);
  // copy has donor's whole prompt under the same config and has not started (n > 1 under a
  // sparse method): it waits for donor's prompt end and forks it there.
  bool IsPromptCopy(const Active& copy, const Active& donor) const;
  // donor's prompt just ended: its copies fork it, take its last logits and sample their first
  // token now (before donor's sampler runs). Returns the tokens delivered.
  int64_t ForkPromptCopies(Active& donor, std::chrono::steady_clock::time_point now);
  // A context request (GenerationRequest::context_tokens) not yet started: fork its kept context.
  void AttachContext(Active& a);
  // After a step: a request whose context just ended keeps a fork of it in the prefix cache.
  void KeepContext(Active& a);
  bool CanShare(const Active& a) const;  // share_prefixes, dense, and not an echo still to score
  // Leading tokens a's prompt has in common with donor's tokens, at most `limit` and never a's
  // last (it must be computed for its logits); 0 when donor cannot give its pages to a.
  int32_t CommonPrefix(const Active& donor, const Active& a, int32_t limit) const;
  // An earlier admission computes a prefix (a page or more) of a's prompt: a waits to fork it.
  bool WaitsForDonor(const Active& a) const;
  void SharePrefix(Active& a);  // a's sequence acquired and still empty: fork the best donor's
  // The prefix cache's key for a's pages: its layers' storage types (dense entries).
  uint64_t DenseCacheKey(const Active& a) const;
  // The cached sequence sharing the longest prefix with a's prompt (CanShare(a) only).
  PrefixCache::Match CachedPrefix(const Active& a) const;
  // Whether seq's sliding-window layers still hold every position a query at `common` sees.
  bool WindowsCover(int seq, int32_t common) const;
  // A request that ends gives its sequence to the prefix cache when it may; false: release it.
  bool KeepInPrefixCache(Active& a, FinishReason reason);
  void ReleaseSequences(const std::vector<int>& seqs);
  // Frees the least recently used cached sequence (not keep_seq's); false when there is none.
  bool EvictCachedPrefix(int keep_seq = -1);
  size_t PrefixCacheBytes() const;  // KV bytes held by cached sequences alone
  // An echo request's prompt chunk b ran with every row's logits: the log-probabilities of the
  // prompt tokens its rows predict; at the prompt's end the last row's logits go to sampling and
  // the list to the handle.
  void ScorePromptRows(Active& a, const BatchSequence& b, bool ends_prompt);
  void WorkerLoop();
  void PublishStats();  // the step state's gauges into stats_

  Engine* engine_;
  SparseKvController* controller_;
  SchedulerOptions options_;
  int n_vocab_;

  std::shared_ptr<detail::SchedulerWaker> waker_;
  mutable std::mutex mu_;  // guards incoming_, stopping_, stats_
  std::deque<std::unique_ptr<Active>> incoming_;  // submitted, not yet seen by Step
  bool stopping_ = false;
  uint64_t next_id_ = 1;
  SchedulerStats stats_;

  // Step's own state (one thread).
  std::deque<std::unique_ptr<Active>> waiting_;
  std::vector<std::unique_ptr<Active>> running_;
  size_t reserved_bytes_ = 0;
  uint64_t admit_counter_ = 0;
  std::vector<BatchSequence> step_batch_;  // the step's batch, kept so a step does not allocate
  std::vector<Active*> step_members_;      // [batch] the request of each entry
  PrefixCache prefix_cache_;               // finished sequences kept for later prompts
  uint64_t tick_ = 0;                      // steps run: the prefix cache's clock

  std::thread worker_;
  bool worker_exit_ = false;  // under waker_->mu
};

}  // namespace kvsparse
