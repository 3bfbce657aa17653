#include "kvsparse/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include <functional>

#include "kvsparse/kv_config.h"
#include "kvsparse/paged_kv_cache.h"
#include "common/timing.h"

namespace kvsparse {

namespace {

// Prompt chunks never exceed what one Engine::Forward chunk may hold.
constexpr int32_t kMaxPromptChunk = 512;

}  // namespace

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kTimeout: return "timeout";
    case FinishReason::kError: return "error";
    case FinishReason::kShutdown: return "shutdown";
  }
  return "?";
}

void detail::SchedulerWaker::Notify() {
  {
    std::lock_guard<std::mutex> lock(mu);
    signalled = true;
  }
  cv.notify_all();
}

// ---- RequestHandle ----

bool RequestHandle::WaitNext(std::vector<int32_t>* tokens, std::chrono::milliseconds timeout,
                             std::vector<TokenLogprob>* logprobs) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !pending_.empty() || ended_; });
  tokens->insert(tokens->end(), pending_.begin(), pending_.end());
  if (logprobs != nullptr) {
    logprobs->insert(logprobs->end(), std::make_move_iterator(pending_logprobs_.begin()),
                     std::make_move_iterator(pending_logprobs_.end()));
  }
  pending_logprobs_.clear();
  const bool had = !pending_.empty();
  pending_.clear();
  return had || !ended_;
}

std::vector<TokenLogprob> RequestHandle::prompt_logprobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prompt_logprobs_;
}

void RequestHandle::RequestStop(FinishReason reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_ || stop_requested_) return;
    stop_requested_ = true;
    requested_reason_ = reason;
  }
  waker_->Notify();
}

void RequestHandle::Cancel() { RequestStop(FinishReason::kCancelled); }
void RequestHandle::Finish() { RequestStop(FinishReason::kStop); }

bool RequestHandle::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ended_;
}

FinishReason RequestHandle::finish_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

Status RequestHandle::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

RequestStats RequestHandle::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// ---- Scheduler ----

struct Scheduler::Active {
  std::shared_ptr<RequestHandle> handle;
  GenerationRequest request;
  std::vector<int32_t> tokens;  // prompt, then every generated token (what a recompute feeds)
  int32_t n_generated = 0;
  int32_t n_computed = 0;       // leading tokens already in the cache
  int seq = -1;                 // -1: not admitted
  size_t reserved = 0;          // admission reservation while admitted
  size_t chunk_reserve = 0;     // what one of its prompt chunks holds on top (ChunkReserveBytes)
  uint64_t admit_order = 0;     // later admissions are preempted first
  Sampler sampler;
  std::vector<float> logits;    // [n_vocab]
  Clock::time_point submitted;
  // echo: every row's logits of its prompt chunks ([chunk, n_vocab]), the prompt's
  // log-probabilities as they come, and whether they are complete (a recompute after a
  // preemption does not redo them).
  std::vector<float> echo_logits;
  std::vector<TokenLogprob> prompt_logprobs;
  bool echo_done = false;
  // A key for its layer config (methods, budgets, types and parameters: compressed contexts,
  // prompt copies), and whether its compressed context is in the cache (kept or attached).
  uint64_t config_key = 0;
  bool context_kept = false;

  Active(GenerationRequest r, const SamplerParams& p) : request(std::move(r)), sampler(p) {}
  int32_t remaining() const { return static_cast<int32_t>(tokens.size()) - n_computed; }
};

Scheduler::Scheduler(Engine* engine, SparseKvController* controller, const SchedulerOptions& options)
    : engine_(engine),
      controller_(controller),
      options_(options),
      n_vocab_(engine->model().config().n_vocab),
      waker_(std::make_shared<detail::SchedulerWaker>()),
      prefix_cache_(controller->cache()->page_size(), std::max(options.prefix_cache_entries, 0)) {
  KVS_CHECK(engine != nullptr && controller != nullptr);
  KVS_CHECK_MSG(engine->controller() == controller, "the scheduler's engine must run with its controller");
  KVS_CHECK_MSG(options.max_running >= 1 && options.step_tokens >= 1 && options.max_queue >= 0 &&
                    options.max_context >= 1 && options.overcommit >= 1.0,
                "scheduler options: max_running, step_tokens, max_context and overcommit must be >= 1, max_queue >= 0");
  stats_.kv_budget_bytes = controller->cache()->budget().limit_bytes();
}

Scheduler::~Scheduler() { Stop(); }

size_t Scheduler::ReserveBytes(int32_t prompt_tokens, int32_t max_tokens,
                               const std::vector<LayerKvConfig>* kv_layers) const {
  return controller_->SequenceReserveBytes(prompt_tokens, max_tokens, kv_layers);
}

int32_t Scheduler::ChunkTokens() const {
  return std::min(std::clamp(controller_->prefill_chunk(), 1, kMaxPromptChunk), options_.step_tokens);
}

size_t Scheduler::ChunkReserveBytes(int32_t prompt_tokens, const std::vector<LayerKvConfig>* kv_layers) const {
  return controller_->ChunkReserveBytes(std::min(ChunkTokens(), prompt_tokens), kv_layers);
}

StatusOr<std::shared_ptr<RequestHandle>> Scheduler::Submit(GenerationRequest request) {
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  if (prompt == 0) return InvalidArgumentError("the prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= n_vocab_) {
      return InvalidArgumentError(fmt::format("prompt token {} at index {} is outside the vocabulary [0, {})", t, i,
                                              n_vocab_));
    }
  }
  if (request.max_tokens < (request.echo ? 0 : 1)) {
    return InvalidArgumentError(fmt::format("max_tokens must be >= {}, got {}", request.echo ? 0 : 1,
                                            request.max_tokens));
  }
  if (prompt + request.max_tokens > options_.max_context) {
    return InvalidArgumentError(fmt::format("the prompt has {} tokens and max_tokens is {}: together above the context "
                                            "of {} tokens; shorten the prompt or lower max_tokens",
                                            prompt, request.max_tokens, options_.max_context));
  }
  if (request.context_tokens < 0 || request.context_tokens >= prompt) {
    return InvalidArgumentError(fmt::format("context_tokens must be in [0, {}) (the prompt's tokens, a question after "
                                            "the context), got {}",
                                            prompt, request.context_tokens));
  }
  if (request.kv_layers) KVS_RETURN_IF_ERROR(controller_->CheckSequenceLayers(*request.kv_layers));
  const size_t need = ReserveBytes(static_cast<int32_t>(prompt), request.max_tokens, request.kv_layers.get()) +
                      ChunkReserveBytes(static_cast<int32_t>(prompt), request.kv_layers.get());
  const size_t budget = controller_->cache()->budget().limit_bytes();
  if (need > budget) {
    return InvalidArgumentError(fmt::format(
        "the request needs up to {:.1f} MiB of KV pages ({} prompt + {} new tokens under the KV config) but the whole "
        "KV budget is {:.1f} MiB; lower max_tokens, shorten the prompt or raise the server's KV memory",
        need / 1048576.0, prompt, request.max_tokens, budget / 1048576.0));
  }
  const SamplerParams sampling = request.sampling;
  auto active = std::make_unique<Active>(std::move(request), sampling);
  active->tokens = active->request.prompt;
  for (int32_t t : active->tokens) active->sampler.Accept(t);
  active->logits.resize(static_cast<size_t>(n_vocab_));
  active->submitted = Clock::now();
  {
    KvSparsityConfig layers = controller_->config();
    if (active->request.kv_layers) layers.layers = *active->request.kv_layers;
    active->config_key = std::hash<std::string>{}(KvSparsityConfigSummary(layers));
  }
  std::shared_ptr<RequestHandle> handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return ResourceExhaustedError("the server is shutting down and accepts no new requests");
    if (static_cast<int>(incoming_.size()) + stats_.waiting >= options_.max_queue) {
      ++stats_.rejected;
      return ResourceExhaustedError(fmt::format(
          "the request queue is full ({} waiting); retry later", static_cast<int>(incoming_.size()) + stats_.waiting));
    }
    handle = std::shared_ptr<RequestHandle>(new RequestHandle(next_id_++, waker_));
    handle->stats_.prompt_tokens = static_cast<int32_t>(prompt);
    active->handle = handle;
    incoming_.push_back(std::move(active));
  }
  waker_->Notify();
  return handle;
}

void Scheduler::End(Active& a, FinishReason reason, Status error) {
  if (a.seq >= 0) {
    if (!KeepInPrefixCache(a, reason)) {
      const Status released = controller_->ReleaseSequence(a.seq);
      KVS_CHECK_MSG(released.ok(), released.ToString());
    }
    reserved_bytes_ -= a.reserved;
    a.seq = -1;
    a.reserved = 0;
  }
  {
    std::lock_guard<std::mutex> lock(a.handle->mu_);
    if (!a.handle->ended_) {
      a.handle->ended_ = true;
      a.handle->reason_ = reason;
      a.handle->error_ = std::move(error);
    }
  }
  a.handle->cv_.notify_all();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.finished[static_cast<int>(reason)];
}

void Scheduler::Preempt(Active& a) {
  KVS_CHECK(a.seq >= 0);
  const Status released = controller_->ReleaseSequence(a.seq);
  KVS_CHECK_MSG(released.ok(), released.ToString());
  reserved_bytes_ -= a.reserved;
  a.seq = -1;
  a.reserved = 0;
  a.n_computed = 0;  // recomputed from its prompt and generated tokens
  a.context_kept = false;  // attached again, or kept again if the cache let it go
  if (!a.echo_done) a.prompt_logprobs.clear();  // scored again from the first row
  {
    std::lock_guard<std::mutex> lock(a.handle->mu_);
    ++a.handle->stats_.preemptions;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.preemptions;
}

const std::vector<LayerKvConfig>& Scheduler::LayersOf(const Active& a) const {
  return a.request.kv_layers ? *a.request.kv_layers : controller_->config().layers;
}

bool Scheduler::IsDense(const Active& a) const {
  const std::vector<LayerKvConfig>& layers = LayersOf(a);
  return std::all_of(layers.begin(), layers.end(), [](const LayerKvConfig& l) { return l.method == KvMethod::kFull; });
}

bool Scheduler::CanShare(const Active& a) const {
  // Only dense sequences: a full-policy table holds every position, so a fork trimmed to the
  // common prefix is exactly the cache a recomputation would build. (A sparse table has chosen
  // its tokens with the rest of its prompt in view.) Echo scores every prompt row itself.
  return options_.share_prefixes && IsDense(a) && !(a.request.echo && !a.echo_done);
}

int32_t Scheduler::CommonPrefix(const Active& donor, const Active& a, int32_t limit) const {
  // A fork shares pages, so the donor must store them in the same types.
  if (&donor == &a || donor.seq < 0 || !IsDense(donor)) return 0;
  const std::vector<LayerKvConfig>& layers = LayersOf(a);
  const std::vector<LayerKvConfig>& other = LayersOf(donor);
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].kv_type != other[l].kv_type) return 0;
  }
  limit = std::min<int32_t>({limit, static_cast<int32_t>(donor.tokens.size()), static_cast<int32_t>(a.tokens.size()) - 1});
  int32_t common = 0;
  while (common < limit && donor.tokens[common] == a.tokens[common]) ++common;
  return common;
}

uint64_t Scheduler::DenseCacheKey(const Active& a) const {
  uint64_t key = 0x6b7673706172ull;  // the pages' storage types, layer by layer
  for (const LayerKvConfig& l : LayersOf(a)) key = key * 1000003u + static_cast<uint64_t>(l.kv_type) + 1;
  return key;
}

PrefixCache::Match Scheduler::CachedPrefix(const Active& a) const {
  if (prefix_cache_.size() == 0) return {};
  return prefix_cache_.Find(DenseCacheKey(a), a.tokens, static_cast<int32_t>(a.tokens.size()) - 1);
}

bool Scheduler::WaitsForDonor(const Active& a) const {
  if (a.n_computed > 0) return false;
  const int32_t context = a.request.context_tokens;
  if (context > 0 && options_.share_prefixes && options_.prefix_cache_entries > 0 && !(a.request.echo && !a.echo_done)) {
    // An earlier request computing the same context under the same config will keep it.
    const std::span<const int32_t> mine(a.tokens.data(), static_cast<size_t>(context));
    for (const auto& r : running_) {
      if (r->admit_order >= a.admit_order || r->context_kept || r->n_computed >= context ||
          r->config_key != a.config_key || r->request.context_tokens != context || r->seq < 0) {
        continue;
      }
      if (std::equal(mine.begin(), mine.end(), r->tokens.begin())) return true;
    }
  }
  for (const auto& r : running_) {  // a copy of an earlier admission's prompt still running: forked at its end
    if (r->admit_order < a.admit_order && r->n_generated == 0 &&
        r->n_computed < static_cast<int32_t>(r->request.prompt.size()) && IsPromptCopy(a, *r)) {
      return true;
    }
  }
  if (!CanShare(a)) return false;
  const int32_t page = controller_->cache()->page_size();
  const int32_t cached = CachedPrefix(a).common;
  for (const auto& r : running_) {
    // Only an earlier admission: the earliest of a group never waits, so the group moves on.
    if (r->admit_order >= a.admit_order) continue;
    const int32_t common = CommonPrefix(*r, a, std::numeric_limits<int32_t>::max());
    if (common >= page && common > cached && r->n_computed < common) return true;
  }
  return false;
}

bool Scheduler::WindowsCover(int seq, int32_t common) const {
  // Sliding-window layers free the positions their window has passed: the donor must still hold
  // every position the new sequence's next query (at `common`) sees, common - window + 1 on.
  const PagedKvCache& cache = *controller_->cache();
  std::vector<KvSpan> spans;
  for (int layer = 0; layer < cache.geometry().n_layers; ++layer) {
    const int32_t window = cache.geometry().LayerWindow(layer);
    if (window <= 0) continue;
    if (cache.per_head(layer)) return false;
    cache.Spans(seq, layer, &spans);
    for (const KvSpan& span : spans) {
      if (span.n == 0) continue;
      if (span.positions[0] > std::max(0, common - window + 1)) return false;
      break;
    }
  }
  return true;
}

void Scheduler::SharePrefix(Active& a) {
  if (!CanShare(a) || a.n_computed > 0) return;
  const int32_t page = controller_->cache()->page_size();
  int donor_seq = -1;
  int32_t best = 0;
  for (const auto& r : running_) {
    const int32_t common = CommonPrefix(*r, a, r->n_computed);
    if (common > best && WindowsCover(r->seq, common)) {
      best = common;
      donor_seq = r->seq;
    }
  }
  const PrefixCache::Match cached = CachedPrefix(a);
  const bool from_cache = cached.common > best && WindowsCover(cached.entry->seq, cached.common);
  if (from_cache) {
    best = cached.common;
    donor_seq = cached.entry->seq;
  }
  if (donor_seq < 0 || best < page) return;  // less than a page is not worth a fork
  Status shared = controller_->Fork(donor_seq, a.seq);
  if (shared.ok()) shared = controller_->RemoveRange(a.seq, best, -1);
  if (!shared.ok()) {  // e.g. no page for the copy of a shared, partly kept page: compute it all
    const Status reset = controller_->ResetSequence(a.seq);
    KVS_CHECK_MSG(reset.ok(), reset.ToString());
    return;
  }
  a.n_computed = best;
  if (from_cache) prefix_cache_.Touch(cached.entry, tick_);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.prefix_reused_tokens += best;
  if (from_cache) {
    ++stats_.prefix_cache_hits;
    stats_.prefix_cache_hit_tokens += best;
  }
}

void Scheduler::AttachContext(Active& a) {
  const int32_t context = a.request.context_tokens;
  if (context <= 0 || a.n_computed > 0 || !options_.share_prefixes || prefix_cache_.size() == 0 ||
      (a.request.echo && !a.echo_done)) {
    return;
  }
  const PrefixCache::Entry* kept =
      prefix_cache_.FindExact(a.config_key, std::span<const int32_t>(a.tokens.data(), static_cast<size_t>(context)));
  if (kept == nullptr) return;
  if (Status forked = controller_->Fork(kept->seq, a.seq); !forked.ok()) {
    const Status reset = controller_->ResetSequence(a.seq);  // no page for a copy: compute it all
    KVS_CHECK_MSG(reset.ok(), reset.ToString());
    return;
  }
  prefix_cache_.Touch(kept, tick_);
  a.n_computed = context;
  a.context_kept = true;
  std::lock_guard<std::mutex> lock(mu_);
  stats_.prefix_reused_tokens += context;
  ++stats_.prefix_cache_hits;
  stats_.prefix_cache_hit_tokens += context;
}

void Scheduler::KeepContext(Active& a) {
  if (a.context_kept || a.n_computed != a.request.context_tokens || options_.prefix_cache_entries <= 0) return;
  a.context_kept = true;
  auto copy = controller_->AcquireSequence(a.request.kv_layers);
  if (!copy.ok()) return;  // the request goes on; its context is just not kept
  if (Status forked = controller_->Fork(a.seq, *copy); !forked.ok()) {
    ReleaseSequences({*copy});
    return;
  }
  std::vector<int32_t> context(a.tokens.begin(), a.tokens.begin() + a.n_computed);
  ReleaseSequences(prefix_cache_.Insert(*copy, a.config_key, std::move(context), /*whole_only=*/true, tick_));
}

bool Scheduler::KeepInPrefixCache(Active& a, FinishReason reason) {
  // Only dense sequences whose pages are the exact cache of their computed tokens.
  if (options_.prefix_cache_entries <= 0 || reason == FinishReason::kError || !IsDense(a) ||
      a.n_computed < controller_->cache()->page_size()) {
    return false;
  }
  std::vector<int32_t> computed(a.tokens.begin(), a.tokens.begin() + a.n_computed);
  std::vector<int> release = prefix_cache_.Insert(a.seq, DenseCacheKey(a), std::move(computed), false, tick_);
  const bool kept = std::find(release.begin(), release.end(), a.seq) == release.end();
  std::erase(release, a.seq);
  ReleaseSequences(release);
  return kept;
}

void Scheduler::ReleaseSequences(const std::vector<int>& seqs) {
  for (int seq : seqs) {
    const Status released = controller_->ReleaseSequence(seq);
    KVS_CHECK_MSG(released.ok(), released.ToString());
  }
}

bool Scheduler::EvictCachedPrefix(int keep_seq) {
  const int seq = prefix_cache_.EvictLeastRecentlyUsed(keep_seq);
  if (seq < 0) return false;
  ReleaseSequences({seq});
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.prefix_cache_evictions;
  return true;
}

size_t Scheduler::PrefixCacheBytes() const {
  if (prefix_cache_.size() == 0) return 0;
  // Pages a cached sequence shares with a running one are not the cache's alone: the bytes in use
  // beyond the running sequences', at most the cached sequences' own.
  const PagedKvCache& cache = *controller_->cache();
  size_t running = 0, cached = 0;
  for (const auto& r : running_) {
    if (r->seq >= 0) running += cache.SequenceLiveBytes(r->seq);
  }
  for (int seq : prefix_cache_.Sequences()) cached += cache.SequenceLiveBytes(seq);
  const size_t used = cache.budget().used_bytes();
  return std::min(cached, used > running ? used - running : 0);
}

FinishReason Scheduler::SampleAndDeliver(Active& a, size_t kv_bytes, Clock::time_point now) {
  const int32_t token = a.sampler.Sample(a.logits.data(), n_vocab_);
  a.sampler.AcceptGenerated(token);
  TokenLogprob logprob;
  if (a.request.logprobs >= 0) logprob = LogprobOf(a.logits.data(), n_vocab_, token, a.request.logprobs);
  a.tokens.push_back(token);
  ++a.n_generated;
  const bool stop =
      std::find(a.request.stop_tokens.begin(), a.request.stop_tokens.end(), token) != a.request.stop_tokens.end();
  {
    std::lock_guard<std::mutex> lock(a.handle->mu_);
    RequestStats& st = a.handle->stats_;
    st.completion_tokens = a.n_generated;
    const double t = Seconds(a.submitted, now);
    if (st.ttft_s < 0) st.ttft_s = t;
    st.token_times_s.push_back(t);
    st.kv_peak_bytes = std::max(st.kv_peak_bytes, kv_bytes);
    if (!stop) {  // end-of-generation tokens are not text
      a.handle->pending_.push_back(token);
      if (a.request.logprobs >= 0) a.handle->pending_logprobs_.push_back(std::move(logprob));
    }
  }
  a.handle->cv_.notify_all();
  if (stop) return FinishReason::kStop;
  if (a.n_generated >= a.request.max_tokens || static_cast<int32_t>(a.tokens.size()) >= options_.max_context) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

bool Scheduler::IsPromptCopy(const Active& copy, const Active& donor) const {
  // Whole-prompt copies (n > 1 under any method): a sparse table that has seen the whole prompt
  // is what the copy's would be, so the fork at the prompt's end is exact where a partial one
  // is not. Dense copies already fork a partial prefix (SharePrefix).
  return &copy != &donor && options_.share_prefixes && !IsDense(copy) && copy.n_computed == 0 && copy.seq >= 0 &&
         donor.seq >= 0 && copy.request.context_tokens == 0 && donor.request.context_tokens == 0 &&
         !copy.request.echo && !donor.request.echo && copy.config_key == donor.config_key &&
         copy.request.prompt == donor.request.prompt;
}

int64_t Scheduler::ForkPromptCopies(Active& donor, Clock::time_point now) {
  int64_t delivered = 0;
  // Only at the end of a first run of the prompt (a recompute after a preemption also holds the
  // tokens it generated).
  if (donor.n_generated > 0 || donor.n_computed != static_cast<int32_t>(donor.request.prompt.size())) return 0;
  for (auto& c : running_) {
    Active& copy = *c;
    // Only those that waited for donor (admitted after it, not in this step's batch).
    if (copy.admit_order < donor.admit_order || !IsPromptCopy(copy, donor) ||
        std::find(step_members_.begin(), step_members_.end(), &copy) != step_members_.end()) {
      continue;
    }
    if (!controller_->Fork(donor.seq, copy.seq).ok()) continue;  // no page for it: it computes its own
    copy.n_computed = donor.n_computed;
    std::copy(donor.logits.begin(), donor.logits.end(), copy.logits.begin());
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefix_reused_tokens += copy.n_computed;
    }
    const FinishReason finish = SampleAndDeliver(copy, controller_->cache()->SequenceLiveBytes(copy.seq), now);
    ++delivered;
    if (finish != FinishReason::kNone) End(copy, finish);
  }
  return delivered;
}

bool Scheduler::Admit() {
  bool admitted = false;
  const double budget = static_cast<double>(controller_->cache()->budget().limit_bytes()) * options_.overcommit;
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_running) {
    Active& a = *waiting_.front();
    const int32_t left = a.request.max_tokens - a.n_generated;
    const size_t need = ReserveBytes(static_cast<int32_t>(a.tokens.size()), left, a.request.kv_layers.get());
    const size_t chunk = ChunkReserveBytes(static_cast<int32_t>(a.tokens.size()), a.request.kv_layers.get());
    // Room for every reservation and, beside them, for the largest prompt chunk still to run:
    // a step always runs at least its oldest prompt chunk.
    size_t largest_chunk = chunk;
    for (const auto& r : running_) {
      if (r->remaining() > 1 || r->n_computed == 0) largest_chunk = std::max(largest_chunk, r->chunk_reserve);
    }
    // Cached prefixes give their pages back, least recently used first, before the head waits
    // (the one it would start from last).
    const PrefixCache::Entry* hit = CanShare(a) ? CachedPrefix(a).entry : nullptr;
    const int hit_seq = hit != nullptr ? hit->seq : -1;
    auto fits = [&] {
      return static_cast<double>(reserved_bytes_ + need + largest_chunk + PrefixCacheBytes()) <= budget;
    };
    while (!fits() && EvictCachedPrefix(hit_seq)) {
    }
    if (!fits()) EvictCachedPrefix();  // the hit itself, last
    // First come, first served: the head waits for room rather than being overtaken.
    if (!fits()) break;
    auto seq = controller_->AcquireSequence(a.request.kv_layers);
    if (!seq.ok()) {
      std::unique_ptr<Active> failed = std::move(waiting_.front());
      waiting_.pop_front();
      End(*failed, FinishReason::kError, seq.status());
      continue;
    }
    a.seq = *seq;
    a.reserved = need;
    a.chunk_reserve = chunk;
    a.admit_order = ++admit_counter_;
    reserved_bytes_ += need;
    {
      std::lock_guard<std::mutex> lock(a.handle->mu_);
      a.handle->stats_.kv_reserved_bytes = need;
      a.handle->stats_.queue_s = Seconds(a.submitted, Clock::now());
    }
    AttachContext(a);
    SharePrefix(a);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    admitted = true;
  }
  return admitted;
}

void Scheduler::ScorePromptRows(Active& a, const BatchSequence& b, bool ends_prompt) {
  const int top = std::max(a.request.logprobs, 0);
  const size_t prompt = a.request.prompt.size();
  if (b.pos0 == 0) {  // nothing predicts the first token
    TokenLogprob first;
    first.token = a.request.prompt[0];
    first.logprob = std::numeric_limits<float>::quiet_NaN();
    a.prompt_logprobs.push_back(std::move(first));
  }
  for (int32_t j = 0; j < b.n; ++j) {
    const size_t next = static_cast<size_t>(b.pos0) + j + 1;  // the token row j predicts
    if (next >= prompt) break;
    a.prompt_logprobs.push_back(
        LogprobOf(a.echo_logits.data() + static_cast<size_t>(j) * n_vocab_, n_vocab_, a.request.prompt[next], top));
  }
  if (!ends_prompt) return;
  std::copy_n(a.echo_logits.data() + static_cast<size_t>(b.n - 1) * n_vocab_, n_vocab_, a.logits.data());
  std::vector<float>().swap(a.echo_logits);
  a.echo_done = true;
  std::lock_guard<std::mutex> lock(a.handle->mu_);
  a.handle->prompt_logprobs_ = std::move(a.prompt_logprobs);
}

bool Scheduler::Step() {
  const auto now = Clock::now();
  bool progressed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
      progressed = true;
    }
  }
  // Requests asked to stop, or past their deadline, end now and free their pages.
  auto stop_reason = [&](const Active& a) {
    {
      std::lock_guard<std::mutex> lock(a.handle->mu_);
      if (a.handle->stop_requested_) return a.handle->requested_reason_;
    }
    if (a.request.deadline && now >= *a.request.deadline) return FinishReason::kTimeout;
    return FinishReason::kNone;
  };
  auto end_stopped = [&](auto& list) {
    for (size_t i = 0; i < list.size();) {
      const FinishReason r = stop_reason(*list[i]);
      if (r == FinishReason::kNone) {
        ++i;
        continue;
      }
      End(*list[i], r);
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
      progressed = true;
    }
  };
  end_stopped(running_);
  end_stopped(waiting_);
  progressed = Admit() || progressed;

  const int32_t chunk_limit = std::clamp(controller_->prefill_chunk(), 1, kMaxPromptChunk);
  const double budget = static_cast<double>(controller_->cache()->budget().limit_bytes()) * options_.overcommit;
  std::vector<BatchSequence>& batch = step_batch_;
  std::vector<Active*>& members = step_members_;
  batch.clear();  // kept from the last step: empty unless this step builds one
  members.clear();
  int64_t prompt_rows = 0;
  Status status = Status::Ok();
  while (!running_.empty()) {
    // Decode rows first (one per stream), then prompt chunks, oldest admission first.
    std::sort(running_.begin(), running_.end(),
              [](const auto& x, const auto& y) { return x->admit_order < y->admit_order; });
    batch.clear();
    members.clear();
    prompt_rows = 0;
    int32_t rows = 0;
    auto add = [&](Active& a, int32_t n, EvictionPoint phase) {
      BatchSequence b;
      b.seq = a.seq;
      b.tokens = a.tokens.data() + a.n_computed;
      b.n = n;
      b.pos0 = a.n_computed;
      b.phase = phase;
      b.logits = n == a.remaining() ? a.logits.data() : nullptr;
      if (a.request.echo && !a.echo_done && phase != EvictionPoint::kDecodeStep) {
        a.echo_logits.resize(static_cast<size_t>(n) * n_vocab_);  // every row's, for the prompt's logprobs
        b.logits = a.echo_logits.data();
        b.all_logits = true;
      }
      batch.push_back(b);
      members.push_back(&a);
      rows += n;
    };
    for (auto& a : running_) {
      if (a->remaining() == 1 && a->n_computed > 0 && rows < options_.step_tokens) {
        add(*a, 1, EvictionPoint::kDecodeStep);
      }
    }
    // Prompt chunks hold their tokens on top of their reservations until their eviction: the
    // first always runs (admission left room for it), the others while the budget has room.
    size_t chunk_bytes = 0;
    for (auto& a : running_) {
      if (a->remaining() > 1 || a->n_computed == 0) {
        // A prompt that starts like an earlier request's still being computed (n copies of one
        // prompt, a batch of questions on one context) waits for it and forks its pages.
        if (WaitsForDonor(*a)) continue;
        AttachContext(*a);
        SharePrefix(*a);
        // A context's last chunk ends at the context, like a prompt (question_after).
        int32_t left = a->remaining();
        const int32_t context = a->request.context_tokens;
        if (context > a->n_computed) left = std::min(left, context - a->n_computed);
        const int32_t n = std::min({left, chunk_limit, options_.step_tokens - rows});
        if (n <= 0) break;
        chunk_bytes += a->chunk_reserve;
        if (prompt_rows > 0 && static_cast<double>(reserved_bytes_ + chunk_bytes) > budget) break;
        prompt_rows += n;
        add(*a, n, n == left ? EvictionPoint::kPromptEnd : EvictionPoint::kPrefillChunk);
      }
    }
    if (batch.empty()) break;
    const auto t0 = Clock::now();
    status = engine_->ForwardBatch(batch);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.busy_s += Seconds(t0, Clock::now());
    }
    // Out of pages: cached prefixes go first (ForwardBatch stored nothing, so the step reruns).
    if (status.code() == StatusCode::kResourceExhausted && EvictCachedPrefix()) continue;
    if (status.code() != StatusCode::kResourceExhausted || running_.size() <= 1) break;
    // Out of pages: the newest request gives its pages back and waits to be recomputed.
    std::unique_ptr<Active> victim = std::move(running_.back());
    running_.pop_back();
    Preempt(*victim);
    waiting_.push_front(std::move(victim));
  }
  if (batch.empty()) {
    PublishStats();
    return progressed;
  }
  if (!status.ok()) {
    // Nothing was stored (ForwardBatch is all-or-nothing); the requests of this batch fail.
    for (Active* a : members) End(*a, FinishReason::kError, status);
    std::erase_if(running_, [&](const auto& a) { return a->seq < 0; });
  } else {
    const auto after = Clock::now();
    const PagedKvCache& cache = *controller_->cache();
    int64_t generated = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      Active& a = *members[i];
      const bool ends_prompt = batch[i].n == a.remaining();  // its last row's logits pick the next token
      a.n_computed += batch[i].n;
      if (a.request.context_tokens > 0) KeepContext(a);
      const size_t kv_bytes = cache.SequenceLiveBytes(a.seq);  // its pages' live slots now
      FinishReason finish = FinishReason::kNone;
      if (batch[i].all_logits) ScorePromptRows(a, batch[i], ends_prompt);
      if (ends_prompt && a.request.max_tokens == 0) {
        finish = FinishReason::kLength;  // echo only: the prompt is scored, nothing to generate
      } else if (ends_prompt) {
        generated += ForkPromptCopies(a, after);  // before a's sampler touches its logits
        finish = SampleAndDeliver(a, kv_bytes, after);
        ++generated;
      } else {
        std::lock_guard<std::mutex> lock(a.handle->mu_);
        a.handle->stats_.kv_peak_bytes = std::max(a.handle->stats_.kv_peak_bytes, kv_bytes);
      }
      if (finish != FinishReason::kNone) End(a, finish);
    }
    std::erase_if(running_, [&](const auto& a) { return a->seq < 0; });
    std::lock_guard<std::mutex> lock(mu_);
    stats_.prompt_tokens += prompt_rows;
    stats_.generated_tokens += generated;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.steps;
  }
  ++tick_;
  PublishStats();
  return true;
}

void Scheduler::PublishStats() {
  const size_t cache_bytes = PrefixCacheBytes();
  int64_t evicted = 0;
  for (const SparseKvLayerStats& l : controller_->layer_stats()) evicted += l.evicted_tokens;
  std::lock_guard<std::mutex> lock(mu_);
  stats_.running = static_cast<int>(running_.size());
  stats_.waiting = static_cast<int>(waiting_.size());
  stats_.kv_reserved_bytes = reserved_bytes_;
  stats_.kv_used_bytes = controller_->cache()->budget().used_bytes();
  stats_.kv_pages_used = controller_->cache()->pages_in_use();
  stats_.evicted_tokens = evicted;
  stats_.prefix_cache_entries = static_cast<int>(prefix_cache_.size());
  stats_.prefix_cache_bytes = cache_bytes;
}

void Scheduler::WorkerLoop() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(waker_->mu);
      if (worker_exit_) return;
    }
    if (Step()) continue;
    // Idle: sleep until a request arrives or asks to stop (or a deadline may have passed).
    std::unique_lock<std::mutex> lock(waker_->mu);
    waker_->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return waker_->signalled || worker_exit_; });
    waker_->signalled = false;
  }
}

void Scheduler::Start() {
  KVS_CHECK_MSG(!worker_.joinable(), "Scheduler::Start called twice");
  worker_ = std::thread([this] { WorkerLoop(); });
}

void Scheduler::Stop(bool drain, std::chrono::milliseconds grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  if (drain) {
    const auto until = Clock::now() + grace;
    while (Clock::now() < until) {
      if (!worker_.joinable() && !Step()) break;
      SchedulerStats s = Stats();
      std::size_t incoming;
      {
        std::lock_guard<std::mutex> lock(mu_);
        incoming = incoming_.size();
      }
      if (s.running == 0 && s.waiting == 0 && incoming == 0) break;
      if (worker_.joinable()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(waker_->mu);
      worker_exit_ = true;
    }
    waker_->cv.notify_all();
    worker_.join();
  }
  // Whatever is left ends now (the worker is gone: this thread owns the step state).
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  for (auto& a : running_) End(*a, FinishReason::kShutdown);
  running_.clear();
  for (auto& a : waiting_) End(*a, FinishReason::kShutdown);
  waiting_.clear();
  ReleaseSequences(prefix_cache_.Clear());
  PublishStats();
}

SchedulerStats Scheduler::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kvsparse
