// Multi-head latent attention in its absorbed form (DeepSeek-V2, section 2.1 and appendix C;
// llama.cpp's deepseek2 graph). Per token the cache stores one row [latent (kv_lora_rank),
// rotated key part (rope)]: the latent is the value of every head and, with the rotated part,
// its key. A query head h is projected to [nope | rope]; its nope part is mapped into the latent
// by attn_k_b[h] (q_nope . k_nope = (k_b[h] q_nope) . latent), so the attention kernel sees
// n_heads query heads over one KV head of kv_lora_rank + rope values. Its output's latent part
// is mapped out by attn_v_b[h]. No key or value is ever expanded per head.
#include <omp.h>

#include <algorithm>

#include "kvsparse/engine.h"
#include "runtime/engine_internal.h"

namespace kvsparse {

using namespace engine_detail;  // NOLINT

void Engine::ProjectLatentAttention(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int heads = c.n_heads, nope = c.mla_nope_dim, rope = c.mla_rope_dim, rank = c.kv_lora_rank;
  const size_t q_head = static_cast<size_t>(c.QueryHeadDim());  // nope + rope
  const size_t row = static_cast<size_t>(c.head_dim);           // rank + rope
  const float* inv_freq = model_.RopeInvFreq(layer);
  const int threads = n_threads_ > 0 ? n_threads_ : omp_get_max_threads();
  const bool parallel_rows = n >= kParallelRowThreshold;

  // Queries [n, heads, nope + rope], directly or through the q_lora_rank bottleneck.
  // (The cache rows [n, rank + rope] come from the same input: kv_a_mqa runs beside.)
  if (w.wq_a.data != nullptr) {
    RunProducts({{&w.wq_a, s.normed.data(), n, s.mla_q_lora.data()}, {&w.wk, s.normed.data(), n, s.k.data()}},
                n_threads_);
    for (int32_t i = 0; i < n; ++i) {
      float* r = &s.mla_q_lora[static_cast<size_t>(i) * c.q_lora_rank];
      ops::RmsNorm(r, w.q_a_norm, r, c.q_lora_rank, c.rms_eps);
    }
    ops::MatMul(w.wq, s.mla_q_lora.data(), n, s.mla_q.data(), n_threads_);
  } else {
    RunProducts({{&w.wq, s.normed.data(), n, s.mla_q.data()}, {&w.wk, s.normed.data(), n, s.k.data()}}, n_threads_);
  }
  // The cache rows [n, rank + rope]: the normed latent and the rotated key part.
  const float magnitude = c.mla_rope_magnitude;
#pragma omp parallel for num_threads(threads) if (parallel_rows)
  for (int32_t i = 0; i < n; ++i) {
    const int32_t pos = s.positions[static_cast<size_t>(i)];
    float* k_row = &s.k[static_cast<size_t>(i) * row];
    ops::RmsNorm(k_row, w.kv_a_norm, k_row, rank, c.rms_eps);
    ops::Rope(k_row + rank, 1, rope, pos, inv_freq, c.rope_style);
    if (magnitude != 1.0f) {
      for (int j = 0; j < rope; ++j) k_row[rank + j] *= magnitude;
    }
    for (int h = 0; h < heads; ++h) {
      float* q_pe = &s.mla_q[(static_cast<size_t>(i) * heads + h) * q_head + nope];
      ops::Rope(q_pe, 1, rope, pos, inv_freq, c.rope_style);
      float* dst = &s.q[(static_cast<size_t>(i) * heads + h) * row + rank];
      for (int j = 0; j < rope; ++j) dst[j] = q_pe[j] * magnitude;
    }
  }
  // Absorption, head by head: q_nope [n, nope] -> [n, rank], the heads spread over the threads.
  const size_t width = Scratch::MlaHeadWidth(c);
  const size_t rows = static_cast<size_t>(n);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int h = 0; h < heads; ++h) {
    float* in = &s.mla_head_in[static_cast<size_t>(h) * rows * width];    // [n, nope]
    float* out = &s.mla_head_out[static_cast<size_t>(h) * rows * width];  // [n, rank]
    for (size_t i = 0; i < rows; ++i) {
      std::copy_n(&s.mla_q[(i * heads + h) * q_head], nope, in + i * nope);
    }
    ops::MatMul(w.k_b[static_cast<size_t>(h)], in, n, out, 1);
    for (size_t i = 0; i < rows; ++i) std::copy_n(out + i * rank, rank, &s.q[(i * heads + h) * row]);
  }
}

void Engine::LatentAttentionOutput(int layer, int32_t n) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers[static_cast<size_t>(layer)];
  Scratch& s = *scratch_;
  const int heads = c.n_heads, rank = c.kv_lora_rank, v_head = c.mla_v_head_dim;
  const size_t row = static_cast<size_t>(c.head_dim);
  const size_t width = Scratch::MlaHeadWidth(c);
  const size_t rows = static_cast<size_t>(n);
  const int threads = n_threads_ > 0 ? n_threads_ : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int h = 0; h < heads; ++h) {
    float* in = &s.mla_head_in[static_cast<size_t>(h) * rows * width];    // [n, rank]
    float* out = &s.mla_head_out[static_cast<size_t>(h) * rows * width];  // [n, v_head]
    for (size_t i = 0; i < rows; ++i) std::copy_n(&s.att[(i * heads + h) * row], rank, in + i * rank);
    ops::MatMul(w.v_b[static_cast<size_t>(h)], in, n, out, 1);
    for (size_t i = 0; i < rows; ++i) {
      std::copy_n(out + i * v_head, v_head, &s.mla_out[(i * heads + h) * static_cast<size_t>(v_head)]);
    }
  }
}

}  // namespace kvsparse
