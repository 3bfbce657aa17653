// The batched forward pass over a KvCache: one pre-norm decoder whose per-architecture parts
// (biases, Q/K norms, post-norms, GeGLU, embedding scale, softcaps, sliding windows, per-layer
// RoPE) are switches of ModelConfig / LayerWeights (src/model/arch.h).
#include "kvsparse/engine.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "common/timing.h"
#include "kvsparse/attention.h"
#include "kvsparse/sparse_kv_controller.h"
#include "kvsparse/sparse_prefill.h"
#include "runtime/engine_internal.h"

namespace kvsparse {

using namespace engine_detail;  // NOLINT

AttentionShape LayerAttentionShape(const ModelConfig& c, int layer) {
  AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim, c.AttentionLogitScale(layer)};
  shape.window = c.LayerWindow(layer);
  shape.softcap = c.attn_softcap;
  shape.integer_dots = true;  // int8 KV: integer q.k and p.v where the kernel family has them
  return shape;
}

size_t Engine::ScratchBytesFor(const ModelConfig& config, int32_t rows) {
  const size_t r = static_cast<size_t>(std::max<int32_t>(rows, 1));
  const size_t one_row_logits = static_cast<size_t>(config.dim) + static_cast<size_t>(config.n_vocab) +
                                (config.IsMoe() ? 2 * static_cast<size_t>(config.n_experts) + 1 : 0);  // + expert_first, router_probs
  return (r * Scratch::FloatsPerRow(config) + one_row_logits + Scratch::GroupedExpertFloats(config)) * sizeof(float);
}

Engine::Engine(const Model& model, KvCache* cache, int n_threads, SparseKvController* controller)
    : model_(model), cache_(cache), n_threads_(n_threads), controller_(controller),
      scratch_(std::make_unique<Scratch>()) {
  KVS_CHECK(cache != nullptr);
  KVS_CHECK_MSG(controller == nullptr || static_cast<KvCache*>(controller->cache()) == cache,
                "the sparse KV controller must manage the engine's own KV cache");
  const ModelConfig& c = model.config();
  const KvGeometry& g = cache->geometry();
  KVS_CHECK_MSG(g.n_layers == c.n_layers && g.n_kv_heads == c.n_kv_heads && g.head_dim == c.head_dim,
                fmt::format("KV cache geometry (layers {}, kv heads {}, head_dim {}) does not match the model "
                            "(layers {}, kv heads {}, head_dim {})",
                            g.n_layers, g.n_kv_heads, g.head_dim, c.n_layers, c.n_kv_heads, c.head_dim));
  KVS_CHECK_MSG(g.values_in_keys == c.IsMla(),
                c.IsMla() ? "an MLA model needs a latent KV cache (KvGeometry::values_in_keys; ModelKvGeometry sets it)"
                          : "a latent KV cache (values_in_keys) serves only MLA models");
  // The kernel masks by the model's windows; a cache that frees pages by other windows would
  // drop tokens a query still sees.
  for (int layer = 0; layer < c.n_layers && !g.layer_window.empty(); ++layer) {
    KVS_CHECK_MSG(g.LayerWindow(layer) == c.LayerWindow(layer),
                  fmt::format("KV cache window of layer {} is {} but the model's is {}", layer, g.LayerWindow(layer),
                              c.LayerWindow(layer)));
  }
  // Decode needs one row; prefill grows the scratch on first use.
  scratch_->Reserve(c, 1);
  scratch_->spans.reserve(16);
  scratch_->head_spans.resize(static_cast<size_t>(c.n_kv_heads));
  scratch_->query_spans.resize(static_cast<size_t>(c.n_heads));
  scratch_->relative_positions.assign(static_cast<size_t>(c.n_layers), 0);
  if (controller != nullptr) {
    for (int layer = 0; layer < c.n_layers; ++layer) {
      scratch_->relative_positions[layer] = controller->UsesCachePositions(layer) ? 1 : 0;
    }
    // Cache-position layers re-rotate surviving keys after an eviction: RoPE by the delta, with
    // this model's frequencies (copied, so the rotation does not depend on this Engine).
    // Under MLA only each row's tail (the rotated key part) turns.
    std::vector<std::vector<float>> layer_inv_freq;  // [n_layers][RopeDim()/2]
    for (int layer = 0; layer < c.n_layers; ++layer) {
      const float* f = model.RopeInvFreq(layer);
      layer_inv_freq.emplace_back(f, f + c.RopeDim() / 2);
    }
    controller->SetKeyRotation([inv_freq = std::move(layer_inv_freq), head_dim = c.head_dim, rope_dim = c.RopeDim(),
                                style = c.rope_style](int layer, float* k, int64_t n_rows, int32_t delta) {
      const float* f = inv_freq[static_cast<size_t>(layer)].data();
      if (rope_dim == head_dim) {
        ops::Rope(k, static_cast<int>(n_rows), head_dim, delta, f, style);
        return;
      }
      for (int64_t r = 0; r < n_rows; ++r) ops::Rope(k + r * head_dim + (head_dim - rope_dim), 1, rope_dim, delta, f, style);
    });
  }
}

Engine::~Engine() = default;

Status Engine::Forward(int seq, const int32_t* tokens, int32_t n, int32_t pos0, float* logits, bool all_logits) {
  const ModelConfig& c = model_.config();
  if (tokens == nullptr || logits == nullptr) return InvalidArgumentError("Forward: tokens and logits must be non-null");
  if (n <= 0) return InvalidArgumentError(fmt::format("Forward: token count must be positive, got {}", n));
  if (pos0 < 0) return InvalidArgumentError(fmt::format("Forward: start position must be >= 0, got {}", pos0));
  if (static_cast<int64_t>(pos0) + n - 1 > INT32_MAX) {
    return OutOfRangeError(fmt::format("Forward: positions {}..{} overflow int32", pos0, static_cast<int64_t>(pos0) + n - 1));
  }
  // Token ids are checked for the whole call before its first chunk stores anything.
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.n_vocab) {
      return OutOfRangeError(fmt::format("Forward: token id {} at index {} is out of range [0, {}) for model '{}'",
                                         tokens[i], i, c.n_vocab, model_.path()));
    }
  }
  // A controller may ask for smaller prompt chunks: it evicts between them.
  const int32_t max_chunk =
      controller_ != nullptr ? std::clamp(controller_->prefill_chunk(), 1, kMaxChunkTokens) : kMaxChunkTokens;
  if (!WantsPromptEstimate(seq, n, max_chunk)) return ForwardChunks(seq, tokens, n, pos0, max_chunk, logits, all_logits);
  KVS_RETURN_IF_ERROR(EstimatePrompt(seq, tokens, n, pos0, max_chunk));
  const Status second_pass = ForwardChunks(seq, tokens, n, pos0, max_chunk, logits, all_logits);
  prompt_estimate_->pattern_seq = -1;  // the patterns serve this prompt only
  return second_pass;
}

Status Engine::ForwardChunks(int seq, const int32_t* tokens, int32_t n, int32_t pos0, int32_t max_chunk, float* logits,
                             bool all_logits) {
  const ModelConfig& c = model_.config();
  for (int32_t done = 0; done < n; done += max_chunk) {
    const int32_t chunk = std::min(max_chunk, n - done);
    const bool last_chunk = done + chunk == n;
    BatchSequence b;
    b.seq = seq;
    b.tokens = tokens + done;
    b.n = chunk;
    b.pos0 = pos0 + done;
    // A one-token call is a decode step.
    b.phase = n == 1 ? EvictionPoint::kDecodeStep
                     : (last_chunk ? EvictionPoint::kPromptEnd : EvictionPoint::kPrefillChunk);
    b.all_logits = all_logits;
    if (logits != nullptr && all_logits) {
      b.logits = logits + static_cast<size_t>(done) * c.n_vocab;
    } else if (last_chunk) {
      b.logits = logits;
    }
    KVS_RETURN_IF_ERROR(ForwardBatch(std::span<const BatchSequence>(&b, 1)));
  }
  return Status::Ok();
}

Status Engine::Validate(std::span<const BatchSequence> batch) {
  const ModelConfig& c = model_.config();
  if (batch.empty()) return InvalidArgumentError("ForwardBatch: the batch is empty");
  int64_t rows = 0;
  Scratch& s = *scratch_;
  s.plans.clear();
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchSequence& b = batch[e];
    if (b.tokens == nullptr) return InvalidArgumentError(fmt::format("ForwardBatch: entry {} has no tokens", e));
    if (b.n <= 0) {
      return InvalidArgumentError(fmt::format("ForwardBatch: entry {} (sequence {}) has {} tokens; need >= 1", e,
                                              b.seq, b.n));
    }
    if (b.pos0 < 0) {
      return InvalidArgumentError(fmt::format("ForwardBatch: sequence {}: start position must be >= 0, got {}", b.seq,
                                              b.pos0));
    }
    if (static_cast<int64_t>(b.pos0) + b.n - 1 > INT32_MAX) {
      return OutOfRangeError(fmt::format("ForwardBatch: sequence {}: positions {}..{} overflow int32", b.seq, b.pos0,
                                         static_cast<int64_t>(b.pos0) + b.n - 1));
    }
    for (int32_t i = 0; i < b.n; ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab) {
        return OutOfRangeError(fmt::format(
            "ForwardBatch: sequence {}: token id {} at index {} is out of range [0, {}) for model '{}'", b.seq,
            b.tokens[i], i, c.n_vocab, model_.path()));
      }
    }
    for (size_t o = 0; o < e; ++o) {
      if (batch[o].seq == b.seq) {
        return InvalidArgumentError(fmt::format("ForwardBatch: sequence {} appears twice in one step", b.seq));
      }
    }
    rows += b.n;
    s.plans.push_back(KvAppendPlan{b.seq, b.n, b.pos0});
  }
  if (rows > kMaxBatchRows) {
    return InvalidArgumentError(
        fmt::format("ForwardBatch: {} rows in one step; at most {} (split prompts into chunks)", rows, kMaxBatchRows));
  }
  // Pages and positions for every layer of every sequence, before any layer writes.
  return cache_->CheckAppend(s.plans, s.relative_positions.data());
}

Status Engine::ForwardBatch(std::span<const BatchSequence> batch) {
  KVS_RETURN_IF_ERROR(Validate(batch));
  const ModelConfig& c = model_.config();
  Scratch& s = *scratch_;
  std::vector<Entry>& entries = s.entries;
  entries.clear();
  int32_t n = 0;  // rows of the step
  for (const BatchSequence& b : batch) {
    entries.push_back(Entry{b.seq, b.n, b.pos0, b.phase, n});
    n += b.n;
  }
  s.Reserve(c, n);
  const int64_t dim = c.dim;
  const int64_t kv_dim = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  const bool parallel_rows = n >= kParallelRowThreshold;
  AttentionShape shape;  // per layer: LayerAttentionShape

  // Embedding lookup: dequantize one row of token_embd per token.
  const WeightView& embd = model_.token_embedding;
  const size_t embd_row_bytes = DTypeRowBytes(embd.type, embd.cols);
  for (size_t e = 0; e < batch.size(); ++e) {
    for (int32_t i = 0; i < batch[e].n; ++i) {
      const auto* row =
          static_cast<const uint8_t*>(embd.data) + static_cast<size_t>(batch[e].tokens[i]) * embd_row_bytes;
      float* x = &s.x[static_cast<size_t>(entries[e].row0 + i) * dim];
      ops::DequantizeRow(embd.type, row, x, dim);
      if (c.embedding_scale != 1.0f) {
        for (int64_t j = 0; j < dim; ++j) x[j] *= c.embedding_scale;
      }
    }
  }

  auto norm_rows = [&](const float* weight) {
#pragma omp parallel for num_threads(n_threads_ > 0 ? n_threads_ : omp_get_max_threads()) if (parallel_rows)
    for (int32_t i = 0; i < n; ++i) {
      ops::RmsNorm(&s.x[static_cast<size_t>(i) * dim], weight, &s.normed[static_cast<size_t>(i) * dim], dim,
                   c.rms_eps);
    }
  };
  // x += proj, with proj first normalized by `post_norm` where the architecture has one (gemma).
  auto add_residual = [&](const float* post_norm) {
    if (post_norm != nullptr) {
#pragma omp parallel for num_threads(n_threads_ > 0 ? n_threads_ : omp_get_max_threads()) if (parallel_rows)
      for (int32_t i = 0; i < n; ++i) {
        float* row = &s.proj[static_cast<size_t>(i) * dim];
        ops::RmsNorm(row, post_norm, row, dim, c.rms_eps);  // in place is safe for RmsNorm
      }
    }
    ops::Add(s.x.data(), s.proj.data(), n * dim);
  };

  for (int layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
    shape = LayerAttentionShape(c, layer);
    shape.sinks = w.attn_sinks;
    // RoPE positions of each sequence's rows in this layer, which are also their stored and
    // query positions: absolute, or (StreamingLLM cache positions) the places right after the
    // layer's live tokens.
    for (const Entry& e : entries) {
      int32_t layer_pos0 = e.pos0;
      if (s.relative_positions[layer]) {
        KVS_ASSIGN_OR_RETURN(layer_pos0, controller_->NextCachePosition(e.seq, layer));
      }
      for (int32_t i = 0; i < e.n; ++i) s.positions[static_cast<size_t>(e.row0 + i)] = layer_pos0 + i;
    }

    // ---- attention ----
    norm_rows(w.attn_norm);
    if (c.IsMla()) {
      ProjectLatentAttention(layer, n);
    } else {
      ProjectAttention(layer, n);
    }
    s.decode_batch.clear();
    for (const Entry& e : entries) {
      const size_t r = static_cast<size_t>(e.row0);
      // An MLA row is its own value (the cache stores it once).
      const float* v_rows = c.IsMla() ? &s.k[r * kv_dim] : &s.v[r * kv_dim];
      Status appended = cache_->Append(e.seq, layer, e.n, &s.k[r * kv_dim], v_rows, &s.positions[r]);
      if (!appended.ok()) {
        return Status(appended.code(),
                      fmt::format("Forward: storing K/V of sequence {} layer {} (positions {}..{}): {}", e.seq, layer,
                                  s.positions[r], s.positions[r + e.n - 1], appended.message()));
      }
      if (entries.size() > 1 && JoinsDecodeBatch(e, layer)) {
        s.decode_batch.push_back(&e);
        continue;
      }
      KVS_RETURN_IF_ERROR(Attend(e, layer, shape));
    }
    KVS_RETURN_IF_ERROR(AttendDecodeBatch(layer, shape));
    if (c.IsMla()) {
      LatentAttentionOutput(layer, n);
      ops::MatMul(w.wo, s.mla_out.data(), n, s.proj.data(), n_threads_);
    } else {
      ops::MatMul(w.wo, s.att.data(), n, s.proj.data(), n_threads_);
    }
    if (w.bo != nullptr) {
      for (int32_t i = 0; i < n; ++i) ops::Add(&s.proj[static_cast<size_t>(i) * dim], w.bo, dim);
    }
    add_residual(w.post_attn_norm);

    // ---- feed-forward (SwiGLU or GeGLU; or the experts) ----
    norm_rows(w.ffn_norm);
    FeedForward(layer, n);
    add_residual(w.post_ffn_norm);
  }

  // Only the rows whose logits are wanted go through the [vocab, dim] output projection, all
  // sequences' in one matmul.
  s.wanted.clear();
  size_t wanting = 0;
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].logits == nullptr) continue;
    ++wanting;
    const int32_t first = batch[e].all_logits ? 0 : batch[e].n - 1;
    for (int32_t i = first; i < batch[e].n; ++i) s.wanted.push_back(entries[e].row0 + i);
  }
  if (s.wanted.empty()) return Status::Ok();
  const int32_t n_wanted = static_cast<int32_t>(s.wanted.size());
  s.logit_in.resize(static_cast<size_t>(n_wanted) * dim);
  for (int32_t j = 0; j < n_wanted; ++j) {
    ops::RmsNorm(&s.x[static_cast<size_t>(s.wanted[j]) * dim], model_.output_norm,
                 &s.logit_in[static_cast<size_t>(j) * dim], dim, c.rms_eps);
  }
  if (wanting == 1) {  // one sequence: straight into its buffer
    for (const BatchSequence& b : batch) {
      if (b.logits == nullptr) continue;
      ops::MatMul(model_.output, s.logit_in.data(), n_wanted, b.logits, n_threads_);
      if (c.final_softcap > 0.f) ops::SoftcapInPlace(b.logits, static_cast<int64_t>(n_wanted) * c.n_vocab, c.final_softcap);
    }
    return Status::Ok();
  }
  s.logit_out.resize(static_cast<size_t>(n_wanted) * c.n_vocab);
  ops::MatMul(model_.output, s.logit_in.data(), n_wanted, s.logit_out.data(), n_threads_);
  if (c.final_softcap > 0.f) ops::SoftcapInPlace(s.logit_out.data(), static_cast<int64_t>(n_wanted) * c.n_vocab, c.final_softcap);
  size_t j = 0;
  for (const BatchSequence& b : batch) {
    if (b.logits == nullptr) continue;
    const size_t rows = b.all_logits ? static_cast<size_t>(b.n) : 1;
    std::copy_n(s.logit_out.data() + j * c.n_vocab, rows * c.n_vocab, b.logits);
    j += rows;
  }
  return Status::Ok();
}

void Engine::ProjectAttention(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int64_t q_dim = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  const float* inv_freq = model_.RopeInvFreq(layer);
  const bool parallel_rows = n >= kParallelRowThreshold;
  RunProducts({{&w.wq, s.normed.data(), n, s.q.data()},
               {&w.wk, s.normed.data(), n, s.k.data()},
               {&w.wv, s.normed.data(), n, s.v.data()}},
              n_threads_);
#pragma omp parallel for num_threads(n_threads_ > 0 ? n_threads_ : omp_get_max_threads()) if (parallel_rows)
  for (int32_t i = 0; i < n; ++i) {
    float* q_row = &s.q[static_cast<size_t>(i) * q_dim];
    float* k_row = &s.k[static_cast<size_t>(i) * kv_dim];
    float* v_row = &s.v[static_cast<size_t>(i) * kv_dim];
    if (w.bq != nullptr) ops::Add(q_row, w.bq, q_dim);
    if (w.bk != nullptr) ops::Add(k_row, w.bk, kv_dim);
    if (w.bv != nullptr) ops::Add(v_row, w.bv, kv_dim);
    if (w.q_norm != nullptr && c.qk_norm_full_width) {  // olmoe: the whole projection at once
      ops::RmsNorm(q_row, w.q_norm, q_row, q_dim, c.rms_eps);
      ops::RmsNorm(k_row, w.k_norm, k_row, kv_dim, c.rms_eps);
    } else if (w.q_norm != nullptr) {  // qwen3: each head normalized on its own (in place is safe for RmsNorm)
      for (int h = 0; h < c.n_heads; ++h) {
        float* head = q_row + static_cast<size_t>(h) * c.head_dim;
        ops::RmsNorm(head, w.q_norm, head, c.head_dim, c.rms_eps);
      }
      for (int h = 0; h < c.n_kv_heads; ++h) {
        float* head = k_row + static_cast<size_t>(h) * c.head_dim;
        ops::RmsNorm(head, w.k_norm, head, c.head_dim, c.rms_eps);
      }
    }
    const int32_t pos = s.positions[static_cast<size_t>(i)];
    ops::Rope(q_row, c.n_heads, c.head_dim, pos, inv_freq, c.rope_style);
    ops::Rope(k_row, c.n_kv_heads, c.head_dim, pos, inv_freq, c.rope_style);
  }
}

Status Engine::Attend(const Entry& e, int layer, const AttentionShape& shape) {
  Scratch& s = *scratch_;
  if (controller_ != nullptr && e.phase != EvictionPoint::kDecodeStep) {
    const PrefillSparsity& prefill = controller_->prefill_sparsity(e.seq, layer);
    if (prompt_estimate_ != nullptr && e.seq == prompt_estimate_->capture_seq) {
      CapturePromptTail(e, layer, shape, prefill);
    }
    if (prefill.method != PrefillMethod::kDense && e.n >= prefill.min_queries &&
        cache_->NumTokens(e.seq, layer) >= prefill.min_context) {
      return SparsePrefillAttention(e, layer, shape, prefill);
    }
  }
  if (cache_->per_head(layer)) return PerHeadAttention(e, layer, shape);
  if (controller_ != nullptr) {
    cache_->Spans(e.seq, layer, &s.spans);
    return SparseAttention(e, layer, shape);
  }
  const size_t q_off = static_cast<size_t>(e.row0) * shape.n_heads * shape.head_dim;
  cache_->Spans(e.seq, layer, &s.spans);
  ops::Attention(shape, cache_->sequence_storage(e.seq, layer), s.q.data() + q_off, s.positions.data() + e.row0, e.n,
                 s.spans.data(), static_cast<int32_t>(s.spans.size()), s.att.data() + q_off, n_threads_);
  return Status::Ok();
}

bool Engine::JoinsDecodeBatch(const Entry& e, int layer) const {
  if (e.n != 1 || e.phase != EvictionPoint::kDecodeStep || cache_->per_head(layer)) return false;
  return controller_ == nullptr ||
         (!controller_->WantsScores(e.seq, layer, e.phase) && !controller_->SelectsSpans(e.seq, layer));
}

Status Engine::AttendDecodeBatch(int layer, const AttentionShape& shape) {
  Scratch& s = *scratch_;
  const size_t n = s.decode_batch.size();
  if (n == 0) return Status::Ok();
  if (s.decode_spans.size() < n) s.decode_spans.resize(n);
  const size_t row_floats = static_cast<size_t>(shape.n_heads) * shape.head_dim;
  for (size_t i = 0; i < n; ++i) {
    const Entry& e = *s.decode_batch[i];
    cache_->Spans(e.seq, layer, &s.decode_spans[i]);  // (before OnAppend, as Attend reads them)
    if (controller_ != nullptr) controller_->OnAppend(e.seq, layer, e.n, e.pos0 + e.n - 1);
  }
  // One call per storage type among the sequences (they may differ by request).
  std::vector<uint8_t>& done = s.decode_done;
  done.assign(n, 0);
  for (size_t first = 0; first < n; ++first) {
    if (done[first]) continue;
    const KvStorage storage = cache_->sequence_storage(s.decode_batch[first]->seq, layer);
    s.decode_jobs.clear();
    for (size_t i = first; i < n; ++i) {
      const Entry& e = *s.decode_batch[i];
      if (done[i] || cache_->sequence_storage(e.seq, layer) != storage) continue;
      done[i] = 1;
      const std::vector<KvSpan>& spans = s.decode_spans[i];
      AttentionJob job{spans.data(), static_cast<int32_t>(spans.size()), 0, s.q.data() + e.row0 * row_floats,
                       s.att.data() + e.row0 * row_floats};
      job.q_pos = s.positions.data() + e.row0;
      job.sinks = shape.sinks;
      s.decode_jobs.push_back(job);
    }
    ops::AttentionBatch(WithHeads(shape, shape.n_heads, shape.n_kv_heads), shape.n_kv_heads, storage,
                        s.decode_jobs[0].q_pos, 1, s.decode_jobs.data(), static_cast<int32_t>(s.decode_jobs.size()),
                        n_threads_);
  }
  if (controller_ != nullptr) {
    for (const Entry* e : s.decode_batch) {
      KVS_RETURN_IF_ERROR(controller_->AfterAttention(e->seq, layer, e->phase, controller_->SeenTokens(e->seq),
                                                      /*current_position=*/e->pos0 + e->n - 1));
    }
  }
  return Status::Ok();
}

void Engine::LoadPrefillKeys(int seq, int layer, const int32_t* q_pos, int32_t n_q, int round_to) {
  Scratch& s = *scratch_;
  const bool per_head = cache_->per_head(layer);
  const int n_kv = cache_->geometry().n_kv_heads, d = cache_->geometry().head_dim;
  // A shared layer's keys are loaded once for all heads; a per-head layer's heads keep their own tokens.
  const int n_tables = per_head ? n_kv : 1;
  s.prefill_keys.resize(static_cast<size_t>(n_tables));
  s.visible.resize(static_cast<size_t>(n_tables));
  s.prefill_key_rows.resize(static_cast<size_t>(n_tables));
  if (!per_head) cache_->Spans(seq, layer, &s.spans);
  for (int table = 0; table < n_tables; ++table) {
    if (per_head) cache_->HeadSpans(seq, layer, table, &s.head_spans[static_cast<size_t>(table)]);
    const std::vector<KvSpan>& spans = per_head ? s.head_spans[static_cast<size_t>(table)] : s.spans;
    if (round_to > 0) {
      LoadKeyMatrices(cache_->sequence_storage(seq, layer), spans.data(), static_cast<int32_t>(spans.size()),
                      per_head ? 1 : n_kv, d, round_to, n_threads_, &s.prefill_keys[table], &s.prefill_key_rows[table]);
    }
    VisibleCounts(spans.data(), static_cast<int32_t>(spans.size()), q_pos, n_q, &s.visible[table]);
  }
}

// A prompt chunk's attention over the tokens its estimator selects (sparse_prefill.h), for a
// shared or a per-head layer: each query head is one job with its own selection (or, with
// group_shared, each kv head's query heads one job with the group's). The policies see the chunk
// as on the dense path: OnAppend before, the gathering pass (over every live token, with the
// sparse attention's softmax statistics: the selected tokens' probabilities as attended, the
// others' relative to the same sum) and the eviction after.
Status Engine::SparsePrefillAttention(const Entry& e, int layer, const AttentionShape& shape,
                                      const PrefillSparsity& prefill) {
  Scratch& s = *scratch_;
  const KvStorage storage = cache_->sequence_storage(e.seq, layer);
  const int32_t n = e.n;
  const int n_kv = shape.n_kv_heads;
  const int group = shape.n_heads / n_kv;
  const int d = shape.head_dim;
  const int per_kv = PrefillSelectionsPerKvHead(prefill, group);  // selections (and jobs) per kv head
  const int n_jobs = n_kv * per_kv;
  const int job_heads = group / per_kv;                           // query heads a job serves
  const AttentionShape head_shape = WithHeads(shape, group, 1);   // a kv head's estimate and observation
  const AttentionShape job_shape = WithHeads(shape, job_heads, 1);
  const size_t group_values = static_cast<size_t>(group) * d;
  const size_t head_stride = static_cast<size_t>(n) * group_values;  // one kv head's rows in q_head
  const size_t job_values = static_cast<size_t>(job_heads) * d;
  const size_t job_stride = static_cast<size_t>(n) * job_values;  // one job's rows in its q and att_head
  const float* q_rows = s.q.data() + static_cast<size_t>(e.row0) * shape.n_heads * d;  // [n, n_heads, head_dim]
  float* att_rows = s.att.data() + static_cast<size_t>(e.row0) * shape.n_heads * d;
  const int32_t* q_pos = s.positions.data() + e.row0;
  const EvictionPoint point = e.phase;
  const bool per_head = cache_->per_head(layer);
  controller_->OnAppend(e.seq, layer, n, e.pos0 + n - 1);
  const bool scores = controller_->WantsScores(e.seq, layer, point);

  const Clock::time_point estimate_start = Clock::now();
  GroupRowsByKvHead(q_rows, n, n_kv, group_values, &s.q_head);  // [n_kv, n, group, head_dim]
  // The jobs' query rows [n_jobs, n, job_heads, head_dim]: q_head itself when a group shares one.
  const float* q_jobs = s.q_head.data();
  if (per_kv > 1) {
    GroupRowsByKvHead(q_rows, n, n_jobs, job_values, &s.q_job);
    q_jobs = s.q_job.data();
  }
  s.att_head.resize(static_cast<size_t>(n_jobs) * job_stride);
  s.selections.resize(static_cast<size_t>(n_jobs));
  s.selectors.resize(static_cast<size_t>(n_kv));
  s.selection_views.resize(static_cast<size_t>(n_jobs));
  s.jobs.resize(static_cast<size_t>(n_jobs));
  if (scores) s.head_row_max_sum.resize(static_cast<size_t>(n) * shape.n_heads * 2);  // [n_jobs, n, job_heads, 2]
  // A two-pass layer's second pass assembles its selections from the prompt's pattern: no keys
  // to estimate against.
  const bool from_prompt = prefill.two_pass && HasPromptPattern(e.seq, layer);
  const int round_to = prefill.method == PrefillMethod::kXAttention ? prefill.stride : 1;
  LoadPrefillKeys(e.seq, layer, q_pos, n, from_prompt ? 0 : round_to);
  if (from_prompt) TakeChunkKeyPositions(layer);
  auto head_spans_of = [&](int h) -> const std::vector<KvSpan>& {
    return per_head ? s.head_spans[static_cast<size_t>(h)] : s.spans;
  };
  // The kv heads' estimates in parallel, one selector (and one thread) each: their serial parts
  // (softmaxes, sums, top-k) would otherwise leave the other threads idle. A kv head's query
  // heads share its score products and get their selections from one call.
  const int estimate_threads = std::min(n_threads_, n_kv);
#pragma omp parallel for schedule(dynamic, 1) num_threads(estimate_threads) if (estimate_threads > 1)
  for (int h = 0; h < n_kv; ++h) {
    const int table = per_head ? h : 0;
    if (from_prompt) {
      for (int o = 0; o < per_kv; ++o) {
        const int j = h * per_kv + o;
        AssembleFromPromptPattern(layer, prefill, table, j, s.visible[table].data(), n, &s.selections[j]);
      }
      continue;
    }
    int64_t n_tokens = 0;
    for (const KvSpan& span : head_spans_of(h)) n_tokens += span.n;
    const float* keys =
        s.prefill_keys[table].data() + (per_head ? 0 : static_cast<size_t>(h) * s.prefill_key_rows[0] * d);
    s.selectors[h].Select(prefill, head_shape, s.q_head.data() + h * head_stride, s.visible[table].data(), n, keys,
                          n_tokens, /*n_threads=*/1, &s.selections[static_cast<size_t>(h) * per_kv]);
  }
  PrefillWork work;
  for (int j = 0; j < n_jobs; ++j) {
    const int h = j / per_kv;
    const std::vector<KvSpan>& spans = head_spans_of(h);
    const PrefillWork job_work = CountPrefillWork(s.selections[j], s.visible[per_head ? h : 0].data(), n);
    work.selected_pairs += job_work.selected_pairs;
    work.causal_pairs += job_work.causal_pairs;
    s.selection_views[j] = s.selections[j].view();
    AttentionJob& job = s.jobs[j];
    job = AttentionJob{spans.data(), static_cast<int32_t>(spans.size()), per_head ? 0 : h, q_jobs + j * job_stride,
                       s.att_head.data() + j * job_stride};
    if (scores) job.row_max_sum = s.head_row_max_sum.data() + static_cast<size_t>(j) * n * job_heads * 2;
    job.selection = &s.selection_views[j];
    job.sinks = JobSinks(shape, j * job_heads);
  }
  const Clock::time_point attention_start = Clock::now();
  ops::AttentionBatch(job_shape, per_head ? 1 : n_kv, storage, q_pos, n, s.jobs.data(), n_jobs, n_threads_);
  const Clock::time_point attention_end = Clock::now();
  UngroupRows(s.att_head.data(), n, n_jobs, job_values, att_rows);
  controller_->RecordSparsePrefill(layer, Seconds(estimate_start, attention_start),
                                   Seconds(attention_start, attention_end), work);
  if (scores) {
    // The statistics in the layer's order [n, n_heads, 2], as ObserveAttention reads them.
    s.row_max_sum.resize(s.head_row_max_sum.size());
    UngroupRows(s.head_row_max_sum.data(), n, n_jobs, static_cast<size_t>(job_heads) * 2, s.row_max_sum.data());
    if (per_head) {
      // A kv head's observation: its query rows [n, group, head_dim] and statistics [n, group, 2].
      if (per_kv > 1) {
        GroupRowsByKvHead(s.row_max_sum.data(), n, n_kv, static_cast<size_t>(group) * 2, &s.head_row_max_sum);
      }
      s.observe_jobs.resize(static_cast<size_t>(n_kv));
      for (int h = 0; h < n_kv; ++h) {
        const std::vector<KvSpan>& spans = head_spans_of(h);
        AttentionJob& job = s.observe_jobs[h];
        job = AttentionJob{spans.data(), static_cast<int32_t>(spans.size()), 0, s.q_head.data() + h * head_stride,
                           nullptr};
        job.row_max_sum = s.head_row_max_sum.data() + static_cast<size_t>(h) * n * group * 2;
      }
      controller_->ObserveHeadsAttention(e.seq, layer, head_shape, s.observe_jobs.data(), n_kv, q_pos, n, n_threads_);
    } else {
      controller_->ObserveAttention(e.seq, layer, shape, q_rows, q_pos, n, s.spans.data(),
                                    static_cast<int32_t>(s.spans.size()), s.row_max_sum.data(), n_threads_);
    }
  }
  return controller_->AfterAttention(e.seq, layer, point, controller_->SeenTokens(e.seq),
                                     /*current_position=*/e.pos0 + n - 1);
}

// Attention of one layer with the controller's hooks: the policy sees the chunk's K/V
// appended, observes the attention probabilities when it reads them (prompt chunks: a second,
// QK-only pass; decode steps: the scores the attention call kept), and evicts right after, so
// the next step attends to the reduced cache.
Status Engine::SparseAttention(const Entry& e, int layer, const AttentionShape& shape) {
  Scratch& s = *scratch_;
  const KvStorage storage = cache_->sequence_storage(e.seq, layer);
  const int32_t n = e.n;
  const size_t q_off = static_cast<size_t>(e.row0) * shape.n_heads * shape.head_dim;
  const float* q = s.q.data() + q_off;                  // [n, n_heads, head_dim]
  float* att = s.att.data() + q_off;                    // [n, n_heads, head_dim]
  const int32_t* q_pos = s.positions.data() + e.row0;  // [n]
  const EvictionPoint point = e.phase;
  controller_->OnAppend(e.seq, layer, n, e.pos0 + n - 1);
  const bool scores = controller_->WantsScores(e.seq, layer, point);
  // Query-aware methods (Quest) narrow a decode step's spans to the pages its query needs, for
  // all heads or per query head; prompt chunks stay dense.
  if (point == EvictionPoint::kDecodeStep && n == 1 &&
      controller_->SelectSpans(e.seq, layer, /*kv_head=*/-1, shape, q, &s.spans, s.query_spans.data())) {
    KVS_CHECK_MSG(!scores, "a policy that selects pages per query head cannot also observe attention");
    const int group = shape.n_heads / shape.n_kv_heads;
    // A choice per KV head (the oracle, reuse) is one job per group, which reads each K/V row
    // once for the group's query heads; Quest's per-query-head pages are a job per query head.
    const bool group_shares_runs = controller_->SelectsPerKvHead(e.seq, layer);
    const int n_jobs = group_shares_runs ? shape.n_kv_heads : shape.n_heads;
    const int heads_per_job = group_shares_runs ? group : 1;
    // Each job's query heads over its runs of the shared rows ([n, n_kv_heads, head_dim]).
    s.jobs.resize(static_cast<size_t>(n_jobs));
    for (int j = 0; j < n_jobs; ++j) {
      const int h = j * heads_per_job;  // the job's first query head
      const std::vector<KvSpan>& runs = s.query_spans[static_cast<size_t>(h)];
      s.jobs[j] = AttentionJob{runs.data(), static_cast<int32_t>(runs.size()), h / group,
                               q + static_cast<size_t>(h) * shape.head_dim, att + static_cast<size_t>(h) * shape.head_dim};
      s.jobs[j].sinks = JobSinks(shape, h);
    }
    ops::AttentionBatch(WithHeads(shape, heads_per_job, 1), shape.n_kv_heads, storage, q_pos,
                        1, s.jobs.data(), n_jobs, n_threads_);
    return controller_->AfterAttention(e.seq, layer, point, controller_->SeenTokens(e.seq),
                                       /*current_position=*/e.pos0 + n - 1);
  }
  const int32_t n_spans = static_cast<int32_t>(s.spans.size());
  if (scores) {
    s.row_max_sum.resize(static_cast<size_t>(n) * shape.n_heads * 2);
    // A decode step keeps its raw scores ([1, n_heads, n_live], small); a prompt chunk's would be
    // [chunk, n_heads, n_live], so chunks take the separate gathering pass.
    float* raw_scores = nullptr;
    if (n == 1) {
      int64_t n_live = 0;
      for (const KvSpan& span : s.spans) n_live += span.n;
      s.raw_scores.resize(static_cast<size_t>(shape.n_heads) * n_live);
      raw_scores = s.raw_scores.data();
    }
    const Clock::time_point start = Clock::now();
    ops::Attention(shape, storage, q, q_pos, n, s.spans.data(), n_spans, att, n_threads_, s.row_max_sum.data(),
                   raw_scores);
    if (point != EvictionPoint::kDecodeStep) controller_->RecordPrefillAttention(layer, Seconds(start, Clock::now()));
    controller_->ObserveAttention(e.seq, layer, shape, q, q_pos, n, s.spans.data(), n_spans, s.row_max_sum.data(),
                                  n_threads_, raw_scores);
  } else {
    const Clock::time_point start = Clock::now();
    ops::Attention(shape, storage, q, q_pos, n, s.spans.data(), n_spans, att, n_threads_);
    if (point != EvictionPoint::kDecodeStep) controller_->RecordPrefillAttention(layer, Seconds(start, Clock::now()));
  }
  return controller_->AfterAttention(e.seq, layer, point, controller_->SeenTokens(e.seq),
                                     /*current_position=*/e.pos0 + n - 1);
}

// Attention of a per-head layer, whose kv heads keep different tokens: each kv head's group of
// query heads (shape {group, 1, head_dim}) over that head's spans ([n, 1, head_dim]), all heads
// in one ops::AttentionBatch call, so the heads' token chunks share one parallel region. Every
// (query, head) row is computed exactly as in the shared call, so with the same tokens per
// head the output is bit-identical. With a controller, each head's policy observes its own head
// and evicts its own head table.
Status Engine::PerHeadAttention(const Entry& e, int layer, const AttentionShape& shape) {
  Scratch& s = *scratch_;
  const KvStorage storage = cache_->sequence_storage(e.seq, layer);
  const int32_t n = e.n;
  const int n_kv = shape.n_kv_heads;
  const int group = shape.n_heads / n_kv;
  const int d = shape.head_dim;
  const AttentionShape head_shape = WithHeads(shape, group, 1);
  const size_t row = static_cast<size_t>(shape.n_heads) * d;   // one token's q / att: [n_heads, head_dim]
  const size_t group_values = static_cast<size_t>(group) * d;  // one kv head's rows of it
  const float* q_rows = s.q.data() + static_cast<size_t>(e.row0) * row;  // [n, n_heads, head_dim]
  float* att_rows = s.att.data() + static_cast<size_t>(e.row0) * row;
  const int32_t* q_pos = s.positions.data() + e.row0;
  const EvictionPoint point = e.phase;
  bool scores = false;
  if (controller_ != nullptr) {
    controller_->OnAppend(e.seq, layer, n, e.pos0 + n - 1);
    scores = controller_->WantsScores(e.seq, layer, point);
  }
  for (int h = 0; h < n_kv; ++h) cache_->HeadSpans(e.seq, layer, h, &s.head_spans[static_cast<size_t>(h)]);
  const bool decode = n == 1;  // a decode step's group rows are contiguous in q and att; a chunk's are gathered

  // Query-aware layers (Quest) narrow each head's spans for a decode step, or pick runs per query head.
  bool per_query = false;
  if (controller_ != nullptr && point == EvictionPoint::kDecodeStep && decode) {
    s.selected_by_query.assign(static_cast<size_t>(n_kv), 0);
    for (int h = 0; h < n_kv; ++h) {
      const float* q = q_rows + h * group_values;  // [1, group, head_dim]
      if (controller_->SelectSpans(e.seq, layer, h, head_shape, q, &s.head_spans[static_cast<size_t>(h)],
                                   s.query_spans.data() + static_cast<size_t>(h) * group)) {
        s.selected_by_query[h] = 1;
        per_query = true;
      }
    }
    if (per_query) {
      KVS_CHECK_MSG(!scores, "a policy that selects pages per query head cannot also observe attention");
      // A head whose table was not narrowed (budget covers it) reads all of it for each query head.
      for (int h = 0; h < n_kv; ++h) {
        if (s.selected_by_query[h]) continue;
        for (int g = 0; g < group; ++g) s.query_spans[static_cast<size_t>(h) * group + g] = s.head_spans[h];
      }
      s.jobs.resize(static_cast<size_t>(shape.n_heads));
      for (int qh = 0; qh < shape.n_heads; ++qh) {
        const std::vector<KvSpan>& runs = s.query_spans[static_cast<size_t>(qh)];
        s.jobs[qh] = AttentionJob{runs.data(), static_cast<int32_t>(runs.size()), 0,
                                  q_rows + static_cast<size_t>(qh) * d, att_rows + static_cast<size_t>(qh) * d};
        s.jobs[qh].sinks = JobSinks(shape, qh);
      }
      ops::AttentionBatch(WithHeads(shape, 1, 1), 1, storage, q_pos, 1, s.jobs.data(), shape.n_heads,
                          n_threads_);
    }
  }

  if (!per_query) {
    const float* q_all = q_rows;  // [n_kv, n, group, head_dim] once gathered
    float* att_all = att_rows;
    if (!decode) {
      GroupRowsByKvHead(q_rows, n, n_kv, group_values, &s.q_head);
      s.att_head.resize(s.q_head.size());
      q_all = s.q_head.data();
      att_all = s.att_head.data();
    }
    // Decode: kv head h's rows are at h * group_values of the one token's row; a chunk's at h * n * group_values.
    const size_t head_stride = static_cast<size_t>(n) * group_values;
    // razor's local heads add their compensation token to the attention (ops::MergeWeightedToken),
    // which needs the rows' softmax statistics. A windowed layer has none (its trim is not compensated).
    bool compensate = false;
    if (controller_ != nullptr && shape.window == 0) {
      s.compensations.resize(static_cast<size_t>(n_kv));
      for (int h = 0; h < n_kv; ++h) {
        s.compensations[h] = controller_->Compensation(e.seq, layer, h);
        compensate |= s.compensations[h].count > 0;
      }
    }
    const bool with_stats = scores || compensate;
    if (with_stats) s.row_max_sum.resize(static_cast<size_t>(n_kv) * n * group * 2);  // [n_kv, n, group, 2]
    if (scores && decode) {
      // Raw scores [group, n_live of head h] for each head, one after another.
      s.raw_offset.resize(static_cast<size_t>(n_kv) + 1);
      size_t total = 0;
      for (int h = 0; h < n_kv; ++h) {
        s.raw_offset[h] = total;
        for (const KvSpan& span : s.head_spans[h]) total += static_cast<size_t>(group) * span.n;
      }
      s.raw_offset[n_kv] = total;
      s.raw_scores.resize(total);
    }
    s.jobs.resize(static_cast<size_t>(n_kv));
    for (int h = 0; h < n_kv; ++h) {
      const std::vector<KvSpan>& spans = s.head_spans[static_cast<size_t>(h)];
      AttentionJob& job = s.jobs[h];
      job = AttentionJob{spans.data(), static_cast<int32_t>(spans.size()), 0, q_all + h * head_stride,
                         att_all + h * head_stride};
      if (with_stats) job.row_max_sum = s.row_max_sum.data() + static_cast<size_t>(h) * n * group * 2;
      if (scores && decode) job.raw_scores = s.raw_scores.data() + s.raw_offset[h];
      job.sinks = JobSinks(shape, h * group);
    }
    const Clock::time_point start = Clock::now();
    ops::AttentionBatch(head_shape, 1, storage, q_pos, n, s.jobs.data(), n_kv, n_threads_);
    if (controller_ != nullptr && point != EvictionPoint::kDecodeStep) {
      controller_->RecordPrefillAttention(layer, Seconds(start, Clock::now()));
    }
    if (scores) {
      // Decode: the heads' raw scores are gathered in one parallel region; chunks take the
      // parallel QK pass head after head.
      controller_->ObserveHeadsAttention(e.seq, layer, head_shape, s.jobs.data(), n_kv, q_pos, n, n_threads_);
    }
    // After the observation: the policies score the cached tokens only. The dropped tokens all
    // precede this call's queries, so every row sees the compensation token.
    for (int h = 0; compensate && h < n_kv; ++h) {
      const KvCompensation& c = s.compensations[h];
      if (c.count == 0) continue;
      ops::MergeWeightedToken(head_shape, q_all + h * head_stride, n * group,
                              s.row_max_sum.data() + static_cast<size_t>(h) * n * group * 2, c.k, c.v,
                              static_cast<double>(c.count), att_all + h * head_stride);
    }
    if (!decode) UngroupRows(s.att_head.data(), n, n_kv, group_values, att_rows);
  }
  if (controller_ == nullptr) return Status::Ok();
  return controller_->AfterAttention(e.seq, layer, point, controller_->SeenTokens(e.seq),
                                     /*current_position=*/e.pos0 + n - 1);
}

}  // namespace kvsparse
