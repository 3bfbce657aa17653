#include "kvsparse/sparse_kv_controller.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>

#include "kvsparse/attention_scores.h"
#include "kvsparse/kv_policies.h"
#include "kvsparse/machine_memory.h"
#include "kvsparse/quest_pages.h"
#include "policy/adakv.h"
#include "common/timing.h"

namespace kvsparse {

namespace {

std::string MiB(size_t bytes) { return fmt::format("{:.3f}", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

StatusOr<std::unique_ptr<SparseKvController>> SparseKvController::Create(const KvSparsityConfig& config,
                                                                         PagedKvCache* cache, uint64_t seed) {
  if (cache == nullptr) return InvalidArgumentError("sparse KV controller: no paged KV cache given");
  const int n_layers = cache->geometry().n_layers;
  if (static_cast<int>(config.layers.size()) != n_layers) {
    return InvalidArgumentError(fmt::format("sparse KV controller: the KV config describes {} layers, the cache has {}",
                                            config.layers.size(), n_layers));
  }
  KVS_RETURN_IF_ERROR(ValidateKvSparsityConfig(config));
  for (int layer = 0; layer < n_layers; ++layer) {
    if (config.layers[layer].kv_type != cache->layer_storage(layer)) {
      return InvalidArgumentError(fmt::format("sparse KV controller: layer {} is configured as {} but the cache stores {}",
                                              layer, KvStorageName(config.layers[layer].kv_type),
                                              KvStorageName(cache->layer_storage(layer))));
    }
    if (config.layers[layer].per_head != cache->per_head(layer)) {
      return InvalidArgumentError(fmt::format("sparse KV controller: layer {} is configured with per_head {} but the "
                                              "cache's layer is {}",
                                              layer, config.layers[layer].per_head,
                                              cache->per_head(layer) ? "per-head" : "shared by all heads"));
    }
  }
  for (int layer = 0; layer < n_layers; ++layer) {
    const LayerKvConfig& l = config.layers[layer];
    const int n_kv_heads = cache->geometry().n_kv_heads;
    if (l.method == KvMethod::kRazor && n_kv_heads < 64 && (l.params.full_heads >> n_kv_heads) != 0) {
      return InvalidArgumentError(fmt::format("sparse KV controller: layer {} (razor) keeps KV heads the model does "
                                              "not have (it has {}); was the heads file made for another model?",
                                              layer, n_kv_heads));
    }
  }
  std::unique_ptr<SparseKvController> controller(new SparseKvController(config, cache, seed));
  for (int seq = 0; seq < cache->n_seqs(); ++seq) KVS_RETURN_IF_ERROR(controller->BuildPolicies(seq));
  for (int layer = 0; layer < n_layers; ++layer) {
    for (int head = 0; head < controller->n_policies(layer); ++head) {
      auto policy = CreatePolicy(config.layers[layer], layer, n_layers, seed, head);
      if (!policy.ok()) return policy.status();
      controller->layer_templates_.push_back(std::move(*policy));
    }
  }
  return controller;
}

SparseKvController::SparseKvController(const KvSparsityConfig& config, PagedKvCache* cache, uint64_t seed)
    : config_(config),
      cache_(cache),
      seed_(seed),
      n_layers_(cache->geometry().n_layers),
      policy_offset_(n_layers_),
      generation_(cache->n_seqs(), 0),
      seen_(cache->n_seqs(), 0),
      last_position_(cache->n_seqs(), -1),
      released_(cache->n_seqs(), 0),
      seq_layers_(cache->n_seqs()),
      stats_(n_layers_) {
  for (int layer = 0; layer < n_layers_; ++layer) {
    policy_offset_[layer] = policies_per_seq_;
    policies_per_seq_ += static_cast<size_t>(n_policies(layer));
  }
  policies_.resize(static_cast<size_t>(cache->n_seqs()) * policies_per_seq_);
}

Status SparseKvController::BuildPolicies(int seq) {
  // A per-sequence config may store its pages in other types (the sequence holds no token yet).
  std::vector<KvStorage> storage(static_cast<size_t>(n_layers_));
  bool same_storage = true;
  for (int layer = 0; layer < n_layers_; ++layer) {
    storage[layer] = LayerConfig(seq, layer).kv_type;
    same_storage = same_storage && storage[layer] == cache_->sequence_storage(seq, layer);
  }
  if (!same_storage) KVS_RETURN_IF_ERROR(cache_->SetSequenceStorage(seq, storage));
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {
      // Distinct, reproducible seeds per (restart, sequence, layer, head); head 0 (and every
      // shared layer) keeps the per-layer seed.
      const uint64_t seed = seed_ * 0x9E3779B97F4A7C15ull +
                            (generation_[seq] * cache_->n_seqs() + seq) * 1000003ull + static_cast<uint64_t>(layer) +
                            static_cast<uint64_t>(head) * 0xD1B54A32D192ED03ull;
      const LayerKvConfig& layer_config = LayerConfig(seq, layer);
      auto policy = CreatePolicy(layer_config, layer, n_layers_, seed, head);
      if (!policy.ok()) {
        return Status(policy.status().code(),
                      fmt::format("sparse KV controller: layer {}: {}", layer, policy.status().message()));
      }
      if (const auto& old = policies_[Index(seq, layer, head)]) stats_[layer].metadata_bytes -= old->MetadataBytes();
      policies_[Index(seq, layer, head)] = std::move(*policy);
    }
  }
  LinkSequence(seq);
  return Status::Ok();
}

void SparseKvController::LinkSequence(int seq) {
  std::vector<KvPolicy*> layers(static_cast<size_t>(n_layers_)), all;
  for (int layer = 0; layer < n_layers_; ++layer) {
    layers[layer] = policies_[Index(seq, layer)].get();
    for (int head = 0; head < n_policies(layer); ++head) all.push_back(policies_[Index(seq, layer, head)].get());
  }
  LinkSequencePolicies(layers, all);
}

Status SparseKvController::ResetSequence(int seq) {
  if (seq < 0 || seq >= cache_->n_seqs()) {
    return InvalidArgumentError(fmt::format("sparse KV controller: sequence {} is out of range [0, {})", seq,
                                            cache_->n_seqs()));
  }
  cache_->Clear(seq);
  ++generation_[seq];
  seen_[seq] = 0;
  last_position_[seq] = -1;
  return BuildPolicies(seq);
}

Status SparseKvController::CheckSequenceLayers(const std::vector<LayerKvConfig>& layers) const {
  if (static_cast<int>(layers.size()) != n_layers_) {
    return InvalidArgumentError(
        fmt::format("KV override: {} layer configs for a model of {} layers", layers.size(), n_layers_));
  }
  for (int layer = 0; layer < n_layers_; ++layer) {
    const LayerKvConfig& l = layers[layer];
    if (l.per_head != config_.layers[layer].per_head) {
      return InvalidArgumentError(fmt::format("per_head: layer {} is {} in this server; a request cannot change it",
                                              layer, config_.layers[layer].per_head ? "per-head" : "shared"));
    }
    const bool cache_positions = l.method == KvMethod::kStreamingLlm && l.params.cache_positions;
    if (cache_positions != UsesCachePositions(layer)) {
      return InvalidArgumentError(fmt::format("cache_positions: layer {}: a request cannot change how positions are "
                                              "numbered (streaming_llm cache_positions)",
                                              layer));
    }
  }
  KvSparsityConfig config = config_;
  config.layers = layers;
  return ValidateKvSparsityConfig(config);
}

StatusOr<int> SparseKvController::AcquireSequence(std::shared_ptr<const std::vector<LayerKvConfig>> layers) {
  if (layers) KVS_RETURN_IF_ERROR(CheckSequenceLayers(*layers));
  for (size_t seq = 0; seq < released_.size(); ++seq) {
    if (!released_[seq]) continue;
    released_[seq] = 0;
    seq_layers_[seq] = std::move(layers);
    KVS_RETURN_IF_ERROR(ResetSequence(static_cast<int>(seq)));
    return static_cast<int>(seq);
  }
  const int seq = cache_->AddSequence();
  KVS_CHECK(static_cast<size_t>(seq) == released_.size());
  generation_.push_back(0);
  seen_.push_back(0);
  last_position_.push_back(-1);
  released_.push_back(0);
  seq_layers_.push_back(std::move(layers));
  policies_.resize(static_cast<size_t>(cache_->n_seqs()) * policies_per_seq_);
  KVS_RETURN_IF_ERROR(BuildPolicies(seq));
  return seq;
}

Status SparseKvController::ReleaseSequence(int seq) {
  if (seq < 0 || seq >= cache_->n_seqs() || released_[seq]) {
    return InvalidArgumentError(fmt::format("sparse KV controller: release of sequence {}, which is not in use", seq));
  }
  cache_->Clear(seq);
  released_[seq] = 1;
  seq_layers_[seq].reset();
  seen_[seq] = 0;
  last_position_[seq] = -1;
  // Fresh policies: the old ones' per-token state is freed now, not at the next acquire.
  return BuildPolicies(seq);
}

int SparseKvController::n_active_sequences() const {
  int n = 0;
  for (uint8_t r : released_) n += r == 0;
  return n;
}

Status SparseKvController::Fork(int src, int dst) {
  const int n_seqs = cache_->n_seqs();
  if (src < 0 || src >= n_seqs || dst < 0 || dst >= n_seqs || released_[src] || released_[dst]) {
    return InvalidArgumentError(
        fmt::format("sparse KV controller: fork from sequence {} to {}: both must be in use", src, dst));
  }
  if (src == dst) return Status::Ok();
  KVS_RETURN_IF_ERROR(cache_->Fork(src, dst));
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {
      auto& slot = policies_[Index(dst, layer, head)];
      stats_[layer].metadata_bytes -= slot->MetadataBytes();
      slot = policy(src, layer, head).Clone();
      stats_[layer].metadata_bytes += slot->MetadataBytes();
    }
  }
  LinkSequence(dst);
  seen_[dst] = seen_[src];
  last_position_[dst] = last_position_[src];
  seq_layers_[dst] = seq_layers_[src];
  return Status::Ok();
}

Status SparseKvController::RemoveRange(int seq, int32_t p0, int32_t p1) {
  if (seq < 0 || seq >= cache_->n_seqs() || released_[seq]) {
    return InvalidArgumentError(fmt::format("sparse KV controller: remove-range on sequence {}, which is not in use", seq));
  }
  const int32_t begin = std::max(p0, 0);
  const int32_t end = p1 < 0 ? INT32_MAX : p1;
  if (begin >= end) return Status::Ok();
  // The masks the cache will apply, table by table, taken before it changes.
  std::vector<std::vector<uint8_t>> masks;
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {
      if (per_head(layer)) {
        cache_->HeadSpans(seq, layer, head, &spans_);
      } else {
        cache_->Spans(seq, layer, &spans_);
      }
      std::vector<uint8_t>& keep = masks.emplace_back();
      for (const KvSpan& span : spans_) {
        for (int32_t i = 0; i < span.n; ++i) keep.push_back(span.positions[i] < begin || span.positions[i] >= end);
      }
    }
  }
  KVS_RETURN_IF_ERROR(cache_->RemoveRange(seq, p0, p1));
  size_t table = 0;
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {
      const std::vector<uint8_t>& keep = masks[table++];
      if (std::find(keep.begin(), keep.end(), 0) != keep.end()) policy(seq, layer, head).OnEvict(keep);
    }
  }
  // The context shrinks by the positions removed from the run 0 .. newest.
  const int64_t removed = std::max<int64_t>(
      0, static_cast<int64_t>(std::min<int64_t>(end, static_cast<int64_t>(last_position_[seq]) + 1)) - begin);
  seen_[seq] = static_cast<int32_t>(std::max<int64_t>(0, seen_[seq] - removed));
  return Status::Ok();
}

const KvPolicy& SparseKvController::ReservePolicy(int layer, int kv_head, const std::vector<LayerKvConfig>* layers,
                                                  std::unique_ptr<KvPolicy>* own) const {
  if (layers == nullptr) return *layer_templates_[policy_offset_[layer] + static_cast<size_t>(kv_head)];
  auto made = CreatePolicy((*layers)[layer], layer, n_layers_, seed_, kv_head);
  KVS_CHECK_MSG(made.ok(), made.status().ToString());  // CheckSequenceLayers validated it
  *own = std::move(*made);
  return **own;
}

size_t SparseKvController::SequenceReserveBytes(int32_t prompt_tokens, int32_t max_new_tokens,
                                                const std::vector<LayerKvConfig>* layers) const {
  const int64_t prompt = std::max(prompt_tokens, 0);
  const int64_t total = prompt + std::max(max_new_tokens, 0);
  const bool prompt_end_eviction = config_.prefill_eviction == PrefillEviction::kPromptEnd;
  size_t bytes = 0;
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {  // per-head layers: each head's own policy
      std::unique_ptr<KvPolicy> own;
      const KvPolicy& p = ReservePolicy(layer, head, layers, &own);
      auto budget = [&](int64_t n_seen) -> int64_t {
        return p.BudgetTokens(static_cast<int32_t>(std::min<int64_t>(n_seen, INT32_MAX)));
      };
      int64_t live = total;
      if (!p.SelectsSpans() && budget(total) < total) {
        // Prompt: what the budget keeps after each chunk (all of it when the prompt is only
        // trimmed at its end). The chunk on top, until its eviction, is ChunkReserveBytes'.
        const int64_t prompt_peak = prompt_end_eviction ? prompt : std::min(prompt, budget(prompt));
        const int64_t decode_peak = p.EvictsDuringDecode()
                                        ? std::min(total, budget(total) + config_.evict_interval)
                                        : std::min(prompt, budget(prompt)) + (total - prompt);
        live = std::max(prompt_peak, decode_peak);
      }
      // A sliding-window layer never holds more than its window, the page the window is in and
      // a prompt chunk (TrimToWindow frees whole pages once a step's attention is done); the
      // chunk is counted here, not in ChunkReserveBytes.
      if (const int32_t window = cache_->geometry().LayerWindow(layer); window > 0 && !UsesCachePositions(layer)) {
        live = std::min<int64_t>(live, static_cast<int64_t>(window) + cache_->page_size() + config_.prefill_chunk);
      }
      const int32_t live_tokens = static_cast<int32_t>(std::min<int64_t>(live, INT32_MAX - cache_->page_size()));
      const KvStorage storage = (layers != nullptr ? (*layers)[layer] : config_.layers[layer]).kv_type;
      bytes += cache_->TableReserveBytes(layer, live_tokens, storage);
    }
  }
  return bytes;
}

size_t SparseKvController::ChunkReserveBytes(int32_t chunk_tokens, const std::vector<LayerKvConfig>* layers) const {
  if (config_.prefill_eviction == PrefillEviction::kPromptEnd || chunk_tokens <= 0) return 0;
  const int32_t chunk = std::min(chunk_tokens, INT32_MAX / 2);
  constexpr int32_t kLarge = INT32_MAX / 4;
  size_t bytes = 0;
  for (int layer = 0; layer < n_layers_; ++layer) {
    for (int head = 0; head < n_policies(layer); ++head) {
      std::unique_ptr<KvPolicy> own;
      const KvPolicy& p = ReservePolicy(layer, head, layers, &own);
      // Tables that keep every prompt token have it in SequenceReserveBytes already, and so do
      // sliding-window layers.
      const bool windowed = cache_->geometry().LayerWindow(layer) > 0 && !UsesCachePositions(layer);
      if (p.SelectsSpans() || p.BudgetTokens(kLarge) >= kLarge || windowed) continue;
      // A table of B tokens holds ceil(B / page) pages, and B + chunk at most ceil(chunk / page)
      // more; its reservation has a page in flight on top, and an int8_kivi page being quantized
      // one more: TableReserveBytes(chunk) covers both.
      const KvStorage storage = (layers != nullptr ? (*layers)[layer] : config_.layers[layer]).kv_type;
      bytes += cache_->TableReserveBytes(layer, chunk, storage);
    }
  }
  return bytes;
}

void SparseKvController::OnAppend(int seq, int layer, int32_t n_new, int32_t last_position) {
  if (layer == 0) {
    seen_[seq] += n_new;
    last_position_[seq] = std::max(last_position_[seq], last_position);
  }
  for (int head = 0; head < n_policies(layer); ++head) {
    KvPolicy& p = policy(seq, layer, head);
    p.OnAppend(n_new);
    // A cross-layer ranking's due global re-rank runs in OnAppend: selection time, reported apart.
    const auto [reranks, seconds] = p.TakeRerankWork();
    SparseKvLayerStats& st = stats_[layer];
    st.reranks += reranks;
    st.rerank_s += seconds;
    st.select_s += seconds;
  }
}

bool SparseKvController::WantsScores(int seq, int layer, EvictionPoint point) const {
  // Every head of a per-head layer runs the same method: head 0 answers for all.
  const KvPolicy& p = *policies_[Index(seq, layer)];
  return p.NeedsAttention() && (point == EvictionPoint::kDecodeStep ? p.ObservesDecode() : p.ObservesPrompt());
}

void SparseKvController::ObserveAttention(int seq, int layer, const AttentionShape& shape, const float* q,
                                          const int32_t* q_pos, int32_t n_q, const KvSpan* spans, int32_t n_spans,
                                          const float* row_max_sum, int n_threads, const float* raw_scores) {
  KVS_CHECK_MSG(!per_head(layer), fmt::format("ObserveAttention: layer {} is per-head; observe its heads with "
                                              "ObserveHeadsAttention",
                                              layer));
  const auto t0 = Clock::now();
  if (observe_scratch_.empty()) observe_scratch_.resize(1);
  std::function<void(const AttentionObservation&)> tap;
  if (tap_) tap = [&](const AttentionObservation& obs) { tap_(seq, layer, -1, obs); };
  Observe(policy(seq, layer), cache_->sequence_storage(seq, layer), config_.agg, shape, q, q_pos, n_q, spans, n_spans,
          row_max_sum, n_threads, raw_scores, &observe_scratch_[0], tap, tap_query_heads_);
  SparseKvLayerStats& st = stats_[layer];
  ++st.observations;
  st.score_s += Seconds(t0, Clock::now());
}

void SparseKvController::ObserveHeadsAttention(int seq, int layer, const AttentionShape& head_shape,
                                               const AttentionJob* jobs, int n_kv_heads, const int32_t* q_pos,
                                               int32_t n_q, int n_threads) {
  KVS_CHECK_MSG(per_head(layer), fmt::format("ObserveHeadsAttention: layer {} keeps the same tokens for every kv "
                                             "head; use ObserveAttention",
                                             layer));
  KVS_CHECK_MSG(n_kv_heads == n_policies(layer) && head_shape.n_kv_heads == 1,
                fmt::format("ObserveHeadsAttention: {} heads with a {}-kv-head shape on layer {} of {} heads",
                            n_kv_heads, head_shape.n_kv_heads, layer, n_policies(layer)));
  const auto t0 = Clock::now();
  const KvStorage storage = cache_->sequence_storage(seq, layer);
  if (observe_scratch_.size() < static_cast<size_t>(n_kv_heads)) observe_scratch_.resize(n_kv_heads);
  bool all_raw = true;
  for (int h = 0; h < n_kv_heads; ++h) all_raw = all_raw && jobs[h].raw_scores != nullptr;
  auto observe = [&](int h, int threads) {
    const AttentionJob& job = jobs[h];
    std::function<void(const AttentionObservation&)> tap;
    if (tap_) tap = [&](const AttentionObservation& obs) { tap_(seq, layer, h, obs); };
    Observe(policy(seq, layer, h), storage, config_.agg, head_shape, job.q, q_pos, n_q, job.spans, job.n_spans,
            job.row_max_sum, threads, job.raw_scores, &observe_scratch_[h], tap, tap_query_heads_);
  };
  if (all_raw) {
    // Decode: each head's gathering is small ([group, n_tokens]), so the heads share one
    // parallel region instead of running one after another on one thread.
    const int threads = std::max(1, std::min(n_threads, n_kv_heads));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int h = 0; h < n_kv_heads; ++h) observe(h, 1);
  } else {
    for (int h = 0; h < n_kv_heads; ++h) observe(h, n_threads);
  }
  SparseKvLayerStats& st = stats_[layer];
  st.observations += n_kv_heads;
  st.score_s += Seconds(t0, Clock::now());
}

// The asked outputs of one layer call: each KV head's fold, or with query_heads one row per query
// head. Per query head a decode step's raw scores are gathered as if each query head had its own
// KV head (their rows do not depend on the K mapping); a prompt chunk's pass runs once per head
// index g of the groups, every KV head's g-th query head at a time (the kernel then reads K once
// per g), and its rows are scattered into place.
void SparseKvController::GatherScores(const AttentionShape& shape, KvStorage storage, const ScoreGathering& gathering,
                                      const float* q, const int32_t* q_pos, int32_t n_q, const KvSpan* spans,
                                      int32_t n_spans, int64_t n_tokens, const float* row_max_sum,
                                      const float* raw_scores, bool query_heads, const ScoreOutputs& outputs,
                                      int n_threads, ObserveScratch* scratch) {
  const int n_kv = shape.n_kv_heads, group = shape.n_heads / shape.n_kv_heads;
  if (!query_heads || group == 1) {
    if (raw_scores != nullptr) {
      ops::GatherScoresFromRaw(shape, q_pos, n_q, n_tokens, raw_scores, row_max_sum, gathering, outputs, n_threads);
    } else {
      ops::AttentionScores(shape, storage, q, q_pos, n_q, spans, n_spans, row_max_sum, gathering, outputs, n_threads);
    }
    return;
  }
  AttentionShape each = shape;
  if (raw_scores != nullptr) {
    each.n_kv_heads = shape.n_heads;
    ops::GatherScoresFromRaw(each, q_pos, n_q, n_tokens, raw_scores, row_max_sum, gathering, outputs, n_threads);
    return;
  }
  each.n_heads = n_kv;
  int32_t n_window = 0;  // the window's queries: the call's last ones (positions ascend)
  while (n_window < n_q && q_pos[n_q - 1 - n_window] >= gathering.window_start) ++n_window;
  const size_t d = static_cast<size_t>(shape.head_dim), plane = static_cast<size_t>(n_kv) * n_tokens;
  scratch->q_slice.resize(static_cast<size_t>(n_q) * n_kv * d);             // [n_q, n_kv, head_dim]
  scratch->row_max_sum_slice.resize(static_cast<size_t>(n_q) * n_kv * 2);  // [n_q, n_kv, 2]
  scratch->slice.resize((3 + static_cast<size_t>(n_window)) * plane);       // the fields' [.., n_kv, n_tokens]
  ScoreOutputs slice;
  if (outputs.sum_all != nullptr) slice.sum_all = scratch->slice.data();
  if (outputs.sum_window != nullptr) slice.sum_window = scratch->slice.data() + plane;
  if (outputs.last != nullptr) slice.last = scratch->slice.data() + 2 * plane;
  if (outputs.window_rows != nullptr) slice.window_rows = scratch->slice.data() + 3 * plane;
  for (int g = 0; g < group; ++g) {
    for (int32_t i = 0; i < n_q; ++i) {
      for (int h = 0; h < n_kv; ++h) {
        const size_t from = static_cast<size_t>(i) * shape.n_heads + static_cast<size_t>(h) * group + g;
        const size_t to = static_cast<size_t>(i) * n_kv + h;
        std::copy_n(q + from * d, d, scratch->q_slice.data() + to * d);
        std::copy_n(row_max_sum + 2 * from, 2, scratch->row_max_sum_slice.data() + 2 * to);
      }
    }
    ops::AttentionScores(each, storage, scratch->q_slice.data(), q_pos, n_q, spans, n_spans,
                         scratch->row_max_sum_slice.data(), gathering, slice, n_threads);
    // Row h of a slice plane is query head h·group + g of the output's.
    auto scatter = [&](const float* from, float* to, int32_t planes) {
      for (int32_t w = 0; w < planes; ++w) {
        for (int h = 0; h < n_kv; ++h) {
          std::copy_n(from + (static_cast<size_t>(w) * n_kv + h) * n_tokens, n_tokens,
                      to + (static_cast<size_t>(w) * shape.n_heads + static_cast<size_t>(h) * group + g) * n_tokens);
        }
      }
    };
    if (outputs.sum_all != nullptr) scatter(slice.sum_all, outputs.sum_all, 1);
    if (outputs.sum_window != nullptr) scatter(slice.sum_window, outputs.sum_window, 1);
    if (outputs.last != nullptr) scatter(slice.last, outputs.last, 1);
    if (outputs.window_rows != nullptr) scatter(slice.window_rows, outputs.window_rows, n_window);
  }
}

void SparseKvController::Observe(KvPolicy& p, KvStorage storage, GqaAggregation aggregation,
                                 const AttentionShape& shape, const float* q, const int32_t* q_pos, int32_t n_q,
                                 const KvSpan* spans, int32_t n_spans, const float* row_max_sum, int n_threads,
                                 const float* raw_scores, ObserveScratch* scratch,
                                 const std::function<void(const AttentionObservation&)>& tap, bool tap_query_heads) {
  int64_t n_tokens = 0;
  for (int32_t s = 0; s < n_spans; ++s) n_tokens += spans[s].n;
  const uint32_t needed = p.NeededObservations();
  const bool query_heads = (needed & kObserveQueryHeads) != 0;
  const int heads = query_heads ? shape.n_heads : shape.n_kv_heads;  // rows of each output
  const size_t n_out = static_cast<size_t>(heads) * n_tokens;
  const int32_t window = std::min(p.ObservationWindow(), n_q);
  // A single query's window row is its `last` row (decode steps gather no rows of their own).
  const bool rows_from_last = (needed & kObserveWindowRows) && window > 0 && n_q == 1;
  // The fields asked, into the four buffers given ([rows, n_tokens], window rows [window, rows, n_tokens]).
  auto outputs_into = [&](size_t rows_out, std::vector<float>* sum_all, std::vector<float>* sum_window,
                          std::vector<float>* last, std::vector<float>* window_rows) {
    ScoreOutputs outputs;
    if (needed & kObserveSumAll) {
      sum_all->resize(rows_out);
      outputs.sum_all = sum_all->data();
    }
    if ((needed & kObserveSumWindow) && window > 0) {
      sum_window->resize(rows_out);
      outputs.sum_window = sum_window->data();
    }
    if ((needed & kObserveLast) || rows_from_last) {
      last->resize(rows_out);
      outputs.last = last->data();
    }
    if ((needed & kObserveWindowRows) && window > 0 && !rows_from_last) {
      window_rows->resize(static_cast<size_t>(window) * rows_out);
      outputs.window_rows = window_rows->data();
    }
    return outputs;
  };
  const ScoreOutputs outputs = outputs_into(n_out, &scratch->sum_all, &scratch->sum_window, &scratch->last,
                                            &scratch->window_rows);
  ScoreGathering gathering;
  gathering.aggregation = aggregation;
  // The window is the call's last `window` queries; positions ascend within a call.
  gathering.window_start = window > 0 ? q_pos[n_q - window] : INT32_MAX;
  // Decode steps: the attention call kept its scores, so K is not read a second time.
  GatherScores(shape, storage, gathering, q, q_pos, n_q, spans, n_spans, n_tokens, row_max_sum, raw_scores,
               query_heads, outputs, n_threads, scratch);
  auto observation = [&](const ScoreOutputs& o, int rows) {
    AttentionObservation obs;
    obs.n_queries = n_q;
    obs.n_tokens = static_cast<int32_t>(n_tokens);
    obs.n_kv_heads = shape.n_kv_heads;
    obs.n_heads = rows;
    obs.query_positions = q_pos;
    obs.sum_all = o.sum_all;
    obs.sum_window = o.sum_window;
    obs.last = o.last;
    if (needed & kObserveWindowRows) {
      obs.n_window = window;
      obs.window_rows = rows_from_last ? o.last : o.window_rows;
    }
    return obs;
  };
  const AttentionObservation obs = observation(outputs, heads);
  if (tap) {
    if (tap_query_heads && !query_heads && shape.n_heads != shape.n_kv_heads) {
      const ScoreOutputs own = outputs_into(static_cast<size_t>(shape.n_heads) * n_tokens, &scratch->tap_sum_all,
                                            &scratch->tap_sum_window, &scratch->tap_last, &scratch->tap_window_rows);
      GatherScores(shape, storage, gathering, q, q_pos, n_q, spans, n_spans, n_tokens, row_max_sum, raw_scores,
                   /*query_heads=*/true, own, n_threads, scratch);
      tap(observation(own, shape.n_heads));
    } else {
      tap(obs);
    }
  }
  p.Observe(obs);
}

Status SparseKvController::AfterAttention(int seq, int layer, EvictionPoint point, int32_t n_seen,
                                          int32_t current_position) {
  // Prompt-end eviction: the prompt's chunks all stay until its last one has been attended
  // (but a sliding layer's window still moves on: that is no choice of the policy's).
  if (point == EvictionPoint::kPrefillChunk && config_.prefill_eviction == PrefillEviction::kPromptEnd) {
    return TrimLayerToWindow(seq, layer, current_position);
  }
  KVS_RETURN_IF_ERROR(EvictLayer(seq, layer, point, n_seen, current_position));
  // CAKE's cascade: this layer's prompt measurement re-divided the total, so the earlier layers
  // that share it shrink now (their attention for this call is done).
  if (point != EvictionPoint::kDecodeStep && policy(seq, layer).CascadesBudget()) {
    for (int earlier = 0; earlier < layer; ++earlier) {
      if (policy(seq, earlier).CascadesBudget()) {
        KVS_RETURN_IF_ERROR(EvictLayer(seq, earlier, point, n_seen, current_position));
      }
    }
  }
  return Status::Ok();
}

Status SparseKvController::EvictLayer(int seq, int layer, EvictionPoint point, int32_t n_seen,
                                      int32_t current_position) {
  // A sliding layer first drops what its window has passed, so a method placed on it chooses
  // among tokens a later query can still see.
  KVS_RETURN_IF_ERROR(TrimLayerToWindow(seq, layer, current_position));
  if (!per_head(layer)) return EvictTable(seq, layer, -1, point, n_seen, current_position);
  if (LayerConfig(seq, layer).params.head_budgets == HeadBudgets::kAdaptive)
    return EvictHeadsAdaptively(seq, layer, point, n_seen, current_position);
  for (int head = 0; head < n_policies(layer); ++head) {
    KVS_RETURN_IF_ERROR(EvictTable(seq, layer, head, point, n_seen, current_position));
  }
  return Status::Ok();
}

Status SparseKvController::TrimLayerToWindow(int seq, int layer, int32_t current_position) {
  if (cache_->geometry().LayerWindow(layer) <= 0) return Status::Ok();
  if (!per_head(layer)) return TrimToWindow(seq, layer, -1, current_position);
  for (int head = 0; head < n_policies(layer); ++head) {
    KVS_RETURN_IF_ERROR(TrimToWindow(seq, layer, head, current_position));
  }
  return Status::Ok();
}

Status SparseKvController::TrimToWindow(int seq, int layer, int kv_head, int32_t current_position) {
  const int32_t window = cache_->geometry().LayerWindow(layer);
  if (window <= 0 || UsesCachePositions(layer)) return Status::Ok();
  const bool one_head = kv_head >= 0;
  if (one_head) {
    cache_->HeadSpans(seq, layer, kv_head, &spans_);
  } else {
    cache_->Spans(seq, layer, &spans_);
  }
  // The next query, at current_position + 1, sees positions > current_position + 1 - window;
  // positions ascend, so the tokens it cannot see are a prefix.
  const int64_t last_unseen = static_cast<int64_t>(current_position) + 1 - window;
  int32_t n_live = 0, unseen = 0;
  for (const KvSpan& span : spans_) {
    for (int32_t i = 0; i < span.n; ++i) unseen += span.positions[i] <= last_unseen ? 1 : 0;
    n_live += span.n;
  }
  // Whole pages only: dropping a table's leading pages frees them without moving a token; the
  // rest (under a page) stays until the window has passed its page, masked by the kernel.
  const int32_t page = cache_->page_size();
  const int32_t drop = unseen / page * page;
  if (drop == 0) return Status::Ok();
  const auto t0 = Clock::now();
  keep_.assign(static_cast<size_t>(n_live), 1);
  std::fill(keep_.begin(), keep_.begin() + drop, 0);
  const Status evicted = one_head ? cache_->Evict(seq, layer, kv_head, keep_) : cache_->Evict(seq, layer, keep_);
  SparseKvLayerStats& st = stats_[layer];
  if (evicted.code() == StatusCode::kResourceExhausted) {
    ++st.deferred_evictions;
    return Status::Ok();
  }
  if (!evicted.ok()) {
    return Status(evicted.code(), fmt::format("freeing the {} tokens of sequence {} layer {}{} that left its {}-token "
                                              "window: {}",
                                              drop, seq, layer, one_head ? fmt::format(" kv head {}", kv_head) : "",
                                              window, evicted.message()));
  }
  policy(seq, layer, one_head ? kv_head : 0).OnEvict(keep_);
  st.window_evicted_tokens += drop;
  st.compact_s += Seconds(t0, Clock::now());
  return Status::Ok();
}

Status SparseKvController::EvictTable(int seq, int layer, int kv_head, EvictionPoint point, int32_t n_seen,
                                      int32_t current_position) {
  const bool one_head = kv_head >= 0;
  KvPolicy& p = policy(seq, layer, one_head ? kv_head : 0);
  SparseKvLayerStats& st = stats_[layer];
  const int32_t n_live = one_head ? cache_->NumHeadTokens(seq, layer, kv_head) : cache_->NumTokens(seq, layer);
  st.peak_live_tokens = std::max(st.peak_live_tokens, n_live);
  const int32_t target = p.EvictionTarget(n_live, n_seen, point, config_.evict_interval);
  if (target >= n_live) return Status::Ok();

  const auto t0 = Clock::now();
  SelectionContext ctx = TableSelection(seq, layer, kv_head, point, current_position, &spans_, &positions_);
  KVS_CHECK(ctx.n_live == n_live);
  ctx.target = target;
  p.SelectKeep(ctx, &keep_);
  const auto t1 = Clock::now();
  KVS_CHECK_MSG(static_cast<int32_t>(keep_.size()) == n_live,
                fmt::format("policy '{}' returned a keep mask of {} entries for {} live tokens", p.name(), keep_.size(),
                            n_live));
  int32_t kept = 0;
  for (uint8_t k : keep_) kept += k != 0;
  KVS_CHECK_MSG(kept == target, fmt::format("policy '{}' kept {} of {} tokens, asked for {}", p.name(), kept, n_live,
                                            target));
  Status evicted = one_head ? cache_->Evict(seq, layer, kv_head, keep_) : cache_->Evict(seq, layer, keep_);
  if (evicted.code() == StatusCode::kResourceExhausted) {
    // The cache is unchanged and the policy was not told: evict at the next point instead.
    ++st.deferred_evictions;
    return Status::Ok();
  }
  if (!evicted.ok()) {
    return Status(evicted.code(), fmt::format("evicting {} tokens of sequence {} layer {}{}: {}", n_live - target, seq,
                                              layer, one_head ? fmt::format(" kv head {}", kv_head) : "",
                                              evicted.message()));
  }
  p.OnEvict(keep_);
  // Cache positions: survivors become 0..n-1; the re-rotation counts as compaction time.
  if (UsesCachePositions(layer)) KVS_RETURN_IF_ERROR(RenumberPositions(seq, layer, kv_head));
  const auto t2 = Clock::now();
  ++st.evictions;
  st.evicted_tokens += n_live - target;
  st.select_s += Seconds(t0, t1);
  st.compact_s += Seconds(t1, t2);
  return Status::Ok();
}

SelectionContext SparseKvController::TableSelection(int seq, int layer, int kv_head, EvictionPoint point,
                                                    int32_t current_position, std::vector<KvSpan>* spans,
                                                    std::vector<int32_t>* positions) const {
  if (kv_head >= 0) {
    cache_->HeadSpans(seq, layer, kv_head, spans);
  } else {
    cache_->Spans(seq, layer, spans);
  }
  positions->clear();
  for (const KvSpan& s : *spans) positions->insert(positions->end(), s.positions, s.positions + s.n);
  const KvGeometry& g = cache_->geometry();
  SelectionContext ctx;
  ctx.layer = layer;
  ctx.n_live = static_cast<int32_t>(positions->size());
  ctx.target = ctx.n_live;
  ctx.positions = positions->data();
  ctx.current_position = current_position;
  ctx.in_prefill = point != EvictionPoint::kDecodeStep;
  ctx.spans = spans->data();
  ctx.n_spans = static_cast<int32_t>(spans->size());
  ctx.storage = cache_->sequence_storage(seq, layer);
  ctx.n_kv_heads = kv_head >= 0 ? 1 : g.n_kv_heads;  // head spans are [n, 1, head_dim]
  ctx.head_dim = g.head_dim;
  return ctx;
}

// AdaKV (policy/adakv.h): the layer's heads evict together, H·B tokens in all, split by their scores.
Status SparseKvController::EvictHeadsAdaptively(int seq, int layer, EvictionPoint point, int32_t n_seen,
                                                int32_t current_position) {
  const int n_heads = n_policies(layer);
  SparseKvLayerStats& st = stats_[layer];
  KvPolicy& first = policy(seq, layer, 0);
  const auto t_split = Clock::now();
  const int32_t min_excess = point == EvictionPoint::kDecodeStep ? config_.evict_interval * n_heads : 1;
  if (first.SplitHeadBudgets(min_excess)) {
    st.select_s += Seconds(t_split, Clock::now());
    for (int head = 0; head < n_heads; ++head) {
      KVS_RETURN_IF_ERROR(EvictTable(seq, layer, head, point, n_seen, current_position));
    }
    return Status::Ok();
  }
  const int32_t budget = first.BudgetTokens(n_seen);  // per head
  int64_t live = 0;
  for (int head = 0; head < n_heads; ++head) {
    const int32_t n = cache_->NumHeadTokens(seq, layer, head);
    st.peak_live_tokens = std::max(st.peak_live_tokens, n);
    live += n;
  }
  // The layer's schedule, as EvictionTarget's for one table of H·B tokens.
  const int64_t layer_budget = static_cast<int64_t>(budget) * n_heads;
  if (live <= layer_budget) return Status::Ok();
  if (point == EvictionPoint::kDecodeStep &&
      (!first.EvictsDuringDecode() || live - layer_budget < static_cast<int64_t>(config_.evict_interval) * n_heads)) {
    return Status::Ok();
  }
  const auto t0 = Clock::now();
  head_spans_.resize(static_cast<size_t>(n_heads));
  head_positions_.resize(static_cast<size_t>(n_heads));
  std::vector<policy::HeadTokens> heads(static_cast<size_t>(n_heads));
  for (int head = 0; head < n_heads; ++head) {
    SelectionContext ctx =
        TableSelection(seq, layer, head, point, current_position, &head_spans_[head], &head_positions_[head]);
    ctx.target = std::min(budget, ctx.n_live);
    heads[head].n_live = ctx.n_live;
    KvPolicy& p = policy(seq, layer, head);
    KVS_CHECK_MSG(p.ScoreForSelection(ctx, &heads[head].scoring),
                  fmt::format("layer {}: method '{}' has no per-token scores for adaptive head budgets", layer,
                              p.name()));
  }
  const KvMethodParams& params = LayerConfig(seq, layer).params;
  policy::AdaptiveHeadKeep(heads, budget, {params.adaptive_rule, params.alpha, params.floor}, &head_keeps_);
  const auto t1 = Clock::now();
  for (int head = 0; head < n_heads; ++head) {
    const std::vector<uint8_t>& keep = head_keeps_[head];
    int32_t kept = 0;
    for (uint8_t k : keep) kept += k != 0;
    if (kept == heads[head].n_live) continue;
    const Status evicted = cache_->Evict(seq, layer, head, keep);
    if (evicted.code() == StatusCode::kResourceExhausted) {
      ++st.deferred_evictions;  // this head keeps its tokens until the next eviction point
      continue;
    }
    if (!evicted.ok()) {
      return Status(evicted.code(), fmt::format("evicting sequence {} layer {} kv head {}: {}", seq, layer, head,
                                                evicted.message()));
    }
    policy(seq, layer, head).OnEvict(keep);
    ++st.evictions;
    st.evicted_tokens += heads[head].n_live - kept;
  }
  st.select_s += Seconds(t0, t1);
  st.compact_s += Seconds(t1, Clock::now());
  return Status::Ok();
}

Status SparseKvController::RenumberPositions(int seq, int layer, int kv_head) {
  if (!rotate_) {
    return InvalidArgumentError(fmt::format("sparse KV controller: layer {} numbers positions inside the cache "
                                            "(streaming_llm cache_positions) but no key rotation was set; an Engine "
                                            "sets it (SetKeyRotation)",
                                            layer));
  }
  const Status status = cache_->RenumberPositions(
      seq, layer, kv_head, [&](float* k, int64_t n_rows, int32_t delta) { rotate_(layer, k, n_rows, delta); });
  if (!status.ok()) {
    return Status(status.code(), fmt::format("renumbering the positions of sequence {} layer {}: {}", seq, layer,
                                             status.message()));
  }
  return Status::Ok();
}

StatusOr<int32_t> SparseKvController::NextCachePosition(int seq, int layer) {
  KVS_CHECK_MSG(UsesCachePositions(layer), fmt::format("NextCachePosition: layer {} keeps absolute positions", layer));
  const int32_t n = cache_->NumTokens(seq, layer);
  bool renumber = false;
  for (int head = 0; head < n_policies(layer); ++head) {
    // StreamingLLM keeps the same count in every head; positions 0..n-1 need equal counts.
    if (cache_->NumHeadTokens(seq, layer, head) != n) {
      return InvalidArgumentError(fmt::format("sparse KV controller: sequence {} layer {}: kv head {} holds {} tokens, "
                                              "another {}; cache positions need the same count in every head",
                                              seq, layer, head, cache_->NumHeadTokens(seq, layer, head), n));
    }
    renumber = renumber || cache_->LastTokenPosition(seq, layer, head) != n - 1;
  }
  if (renumber) KVS_RETURN_IF_ERROR(RenumberPositions(seq, layer, -1));
  return n;
}

bool SparseKvController::SelectSpans(int seq, int layer, int kv_head, const AttentionShape& shape, const float* q,
                                     std::vector<KvSpan>* spans, std::vector<KvSpan>* query_head_spans) {
  KvPolicy& p = policy(seq, layer, kv_head < 0 ? 0 : kv_head);
  if (!p.SelectsSpans()) return false;
  KVS_CHECK_MSG((kv_head >= 0) == per_head(layer) && kv_head < n_policies(layer),
                fmt::format("SelectSpans: kv head {} on layer {} ({})", kv_head, layer,
                            per_head(layer) ? "per-head: pass the head" : "shared: pass -1"));
  const auto t0 = Clock::now();
  int64_t live = 0;
  for (const KvSpan& s : *spans) live += s.n;
  SpanSelectionContext ctx;
  ctx.layer = layer;
  ctx.q = q;
  ctx.n_q_heads = shape.n_heads;
  ctx.n_kv_heads = shape.n_kv_heads;
  ctx.head_dim = shape.head_dim;
  ctx.storage = cache_->sequence_storage(seq, layer);
  ctx.cache_page_size = cache_->page_size();
  ctx.scale = shape.scale;
  const size_t bytes_before = p.MetadataBytes();
  bool per_query = false;
  int64_t read = 0;
  if (query_head_spans != nullptr && p.SelectsPerQueryHead()) {
    per_query = p.SelectQueryHeadSpans(ctx, *spans, query_head_spans);
    if (per_query) {
      // Mean over the query heads (over each group's first, which speaks for the group, when the
      // policy selects per KV head).
      const int step = p.SelectsPerKvHead() ? shape.n_heads / shape.n_kv_heads : 1;
      const int lists = shape.n_heads / step;
      int64_t sum = 0;
      for (int h = 0; h < shape.n_heads; h += step)
        for (const KvSpan& s : query_head_spans[h]) sum += s.n;
      read = (sum + lists / 2) / lists;
    } else {
      read = live;
    }
  } else {
    p.SelectSpans(ctx, spans);
    for (const KvSpan& s : *spans) read += s.n;
  }
  SparseKvLayerStats& st = stats_[layer];
  st.metadata_bytes = st.metadata_bytes - bytes_before + p.MetadataBytes();
  ++st.span_selections;
  st.selected_tokens += read;
  st.selectable_tokens += live;
  st.select_s += Seconds(t0, Clock::now());
  return per_query;
}

void SparseKvController::ResetStats() {
  for (SparseKvLayerStats& s : stats_) {
    const size_t metadata = s.metadata_bytes;  // a gauge of what is allocated, not a counter
    s = SparseKvLayerStats{};
    s.metadata_bytes = metadata;
  }
}

size_t SparseKvController::PolicyStateBytes() const {
  size_t bytes = 0;
  for (int seq = 0; seq < cache_->n_seqs(); ++seq) {
    for (int layer = 0; layer < n_layers_; ++layer) {
      for (int head = 0; head < n_policies(layer); ++head) {
        if (const auto& p = policies_[Index(seq, layer, head)]) bytes += p->StateBytes();
      }
    }
  }
  return bytes;
}

std::string SparseKvController::FormatStats() const {
  std::string out = "| layer | method | kv | allocated MiB | live MiB | live tokens | peak tokens | evictions | "
                    "evicted | score ms | select ms | compact ms |\n"
                    "|------:|--------|----|--------------:|---------:|------------:|------------:|----------:|"
                    "--------:|---------:|----------:|-----------:|\n";
  SparseKvLayerStats total;
  int64_t total_live = 0;
  for (int layer = 0; layer < n_layers_; ++layer) {
    const SparseKvLayerStats& s = stats_[layer];
    // Per-head layers: tokens per head (all sequences), shown as the range over heads.
    int64_t live = 0, live_min = INT64_MAX;
    for (int head = 0; head < n_policies(layer); ++head) {
      int64_t head_live = 0;
      for (int seq = 0; seq < cache_->n_seqs(); ++seq) head_live += cache_->NumHeadTokens(seq, layer, head);
      live = std::max(live, head_live);
      live_min = std::min(live_min, head_live);
    }
    const std::string live_text = per_head(layer) ? fmt::format("{}-{}", live_min, live) : fmt::format("{}", live);
    out += fmt::format("| {} | {} | {}{} | {} | {} | {} | {} | {} | {} | {:.2f} | {:.2f} | {:.2f} |\n", layer,
                       KvMethodName(config_.layers[layer].method), KvStorageName(cache_->layer_storage(layer)),
                       per_head(layer) ? "/head" : "", MiB(cache_->LayerAllocatedBytes(layer)),
                       MiB(cache_->LayerLiveBytes(layer)), live_text,
                       s.peak_live_tokens, s.evictions, s.evicted_tokens, s.score_s * 1e3, s.select_s * 1e3,
                       s.compact_s * 1e3);
    total.evictions += s.evictions;
    total.evicted_tokens += s.evicted_tokens;
    total.score_s += s.score_s;
    total.select_s += s.select_s;
    total.compact_s += s.compact_s;
    total.reranks += s.reranks;
    total.rerank_s += s.rerank_s;
    total_live += live;
  }
  out += fmt::format("| all | | | {} | {} | {} | | {} | {} | {:.2f} | {:.2f} | {:.2f} |\n",
                     MiB(cache_->AllocatedBytes()), MiB(cache_->LiveBytes()), total_live, total.evictions,
                     total.evicted_tokens, total.score_s * 1e3, total.select_s * 1e3, total.compact_s * 1e3);
  const KvLiveBytesByPart parts = cache_->LiveBytesByPart();
  const size_t live_bytes = parts.total();
  auto share = [&](size_t bytes) {
    return fmt::format("{} MiB ({:.1f}%)", MiB(bytes),
                       live_bytes > 0 ? 100.0 * static_cast<double>(bytes) / static_cast<double>(live_bytes) : 0.0);
  };
  out += fmt::format(
      "live KV bytes: K and V values {}, scales and zero points {}, positions {}, f16 residual {}; "
      "allocated but not live (unfilled slots, padding) {} MiB\n",
      share(parts.values), share(parts.scales), share(parts.positions), share(parts.residual),
      MiB(cache_->AllocatedBytes() - live_bytes));
  // Each kind of layer with its own bytes: sliding-window layers hold their window, global ones
  // what their method keeps.
  int n_sliding = 0;
  size_t sliding_alloc = 0, sliding_live = 0, global_alloc = 0, global_live = 0;
  int64_t window_freed = 0;
  for (int layer = 0; layer < n_layers_; ++layer) {
    const bool sliding = cache_->geometry().LayerWindow(layer) > 0;
    n_sliding += sliding ? 1 : 0;
    (sliding ? sliding_alloc : global_alloc) += cache_->LayerAllocatedBytes(layer);
    (sliding ? sliding_live : global_live) += cache_->LayerLiveBytes(layer);
    window_freed += stats_[layer].window_evicted_tokens;
  }
  if (n_sliding > 0) {
    out += fmt::format("sliding-window layers ({} of {}, window {}): {} MiB allocated, {} MiB live, {} tokens freed "
                       "behind the window; global layers: {} MiB allocated, {} MiB live\n",
                       n_sliding, n_layers_,
                       *std::max_element(cache_->geometry().layer_window.begin(), cache_->geometry().layer_window.end()),
                       MiB(sliding_alloc), MiB(sliding_live), window_freed, MiB(global_alloc), MiB(global_live));
  }
  out += fmt::format("policy time: {:.2f} ms (scoring {:.2f}, selection {:.2f}, compaction {:.2f}); "
                     "peak KV allocated {} MiB\n",
                     total.policy_s() * 1e3, total.score_s * 1e3, total.select_s * 1e3, total.compact_s * 1e3,
                     MiB(cache_->Stats().peak_allocated_bytes));
  // Memory on top of the KV pages: what a method's bookkeeping costs.
  const size_t state = PolicyStateBytes(), allocated = cache_->AllocatedBytes();
  out += fmt::format("policy state: {} MiB ({:.1f}% of the KV pages allocated)\n", MiB(state),
                     allocated > 0 ? 100.0 * static_cast<double>(state) / static_cast<double>(allocated) : 0.0);
  // Cross-layer rankings (cumulative): the periodic re-ranks apart from the incremental updates.
  if (total.reranks > 0) {
    out += fmt::format("global re-ranks: {} in {:.2f} ms (part of selection); incremental policy work {:.2f} ms\n",
                       total.reranks, total.rerank_s * 1e3, (total.policy_s() - total.rerank_s) * 1e3);
  }
  // Query-aware layers keep every token; what they save is reads, and their page metadata
  // is memory on top of the KV pages.
  int64_t selections = 0, selected = 0, selectable = 0;
  size_t metadata = 0;
  std::string per_layer;
  for (int layer = 0; layer < n_layers_; ++layer) {
    const SparseKvLayerStats& s = stats_[layer];
    selections += s.span_selections;
    selected += s.selected_tokens;
    selectable += s.selectable_tokens;
    metadata += s.metadata_bytes;
    if (s.metadata_bytes > 0 || s.span_selections > 0) {
      const double read = s.selectable_tokens > 0 ? 100.0 * static_cast<double>(s.selected_tokens) /
                                                        static_cast<double>(s.selectable_tokens)
                                                  : 0.0;
      per_layer += fmt::format("{}{}: {:.1f}% read, {} B", per_layer.empty() ? "" : ", ", layer, read,
                               s.metadata_bytes);
    }
  }
  if (selections > 0 || metadata > 0) {
    out += fmt::format("query-aware selection: {} decode attention calls read {} of {} live tokens ({:.1f}%); "
                       "page metadata {} MiB (per layer: tokens read of the live ones, metadata: {})\n",
                       selections, selected, selectable,
                       selectable > 0 ? 100.0 * static_cast<double>(selected) / static_cast<double>(selectable) : 0.0,
                       MiB(metadata), per_layer);
  }
  return out;
}

namespace {

PagedKvCacheOptions CacheOptionsFor(const KvSparsityConfig& config, int n_seqs, int head_dim) {
  PagedKvCacheOptions options;
  options.n_seqs = n_seqs;
  options.page_size = EffectivePageSize(config);
  options.kivi_residual = EffectiveKiviResidual(config);
  options.kivi_v_group = EffectiveKiviVGroup(config, head_dim);
  options.layer_storage.clear();
  options.layer_per_head.clear();
  for (const LayerKvConfig& l : config.layers) {
    options.layer_storage.push_back(l.kv_type);
    options.layer_per_head.push_back(l.per_head ? 1 : 0);
  }
  return options;
}

Status CheckLayerCount(const KvGeometry& geometry, const KvSparsityConfig& config) {
  if (static_cast<int>(config.layers.size()) != geometry.n_layers) {
    return InvalidArgumentError(fmt::format("sparse KV: the KV config describes {} layers, the model has {}",
                                            config.layers.size(), geometry.n_layers));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<SparseKvSetup> CreateServingKv(const KvGeometry& geometry, const KvSparsityConfig& config,
                                        size_t budget_bytes, uint64_t seed) {
  KVS_RETURN_IF_ERROR(CheckLayerCount(geometry, config));
  PagedKvCacheOptions options = CacheOptionsFor(config, 0, geometry.head_dim);
  options.budget_bytes = budget_bytes;
  SparseKvSetup setup;
  KVS_ASSIGN_OR_RETURN(setup.cache, PagedKvCache::Create(geometry, options));
  KVS_ASSIGN_OR_RETURN(setup.controller, SparseKvController::Create(config, setup.cache.get(), seed));
  return setup;
}

StatusOr<SparseKvSetup> CreateSparseKv(const KvGeometry& geometry, const KvSparsityConfig& config, int n_seqs,
                                       int32_t max_tokens, uint64_t seed, size_t reserved_bytes) {
  KVS_RETURN_IF_ERROR(CheckLayerCount(geometry, config));
  if (max_tokens <= 0) return InvalidArgumentError(fmt::format("sparse KV: max_tokens must be positive, got {}", max_tokens));
  PagedKvCacheOptions options = CacheOptionsFor(config, n_seqs, geometry.head_dim);
  // Page sizes come from the cache's own layout: ask a probe cache, then reserve room for
  // max_tokens (+ one partly filled page) per (sequence, layer). The reservation is address
  // space only; memory is used as pages fill.
  const size_t page_tokens = static_cast<size_t>(options.page_size);
  const size_t heads = static_cast<size_t>(geometry.n_kv_heads);
  options.budget_bytes = page_tokens * (2 * heads * geometry.head_dim * sizeof(float) + sizeof(int32_t) +
                                        2 * heads * sizeof(float)) +
                         5 * 64;  // at least one page of any storage type, sections padded to 64 bytes
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> probe, PagedKvCache::Create(geometry, options));
  size_t budget = 0;
  for (int layer = 0; layer < geometry.n_layers; ++layer) {
    budget += probe->TableReserveBytes(layer, max_tokens) * static_cast<size_t>(probe->tables_per_seq(layer)) *
              static_cast<size_t>(n_seqs);
  }
  probe.reset();
  // Pages past what the machine has would meet the OOM killer: the budget stops there, and a
  // sequence that outgrows it gets the cache's ResourceExhausted error instead.
  const size_t available = ReadMachineMemory().available_bytes;
  options.budget_bytes = std::min(budget, available > reserved_bytes ? available - reserved_bytes : 0);
  SparseKvSetup setup;
  KVS_ASSIGN_OR_RETURN(setup.cache, PagedKvCache::Create(geometry, options));
  KVS_ASSIGN_OR_RETURN(setup.controller, SparseKvController::Create(config, setup.cache.get(), seed));
  return setup;
}

}  // namespace kvsparse
