// Compute kernels. Every fast kernel has a plain scalar twin in namespace `ref`
// (same signature) that the tests compare against on random, ragged inputs.
// Layout conventions follow GGUF: a weight matrix is [rows, cols] with cols contiguous
// (GGUF ne0 = cols), so y = W x means y[r] = sum_c W[r, c] * x[c].
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <cstdlib>
#include <memory>

#include "kvsparse/dtype.h"

namespace kvsparse {

// A read-only weight matrix in any supported DType (usually pointing into an mmap).
struct WeightView {
  DType type = DType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;  // output features
  int64_t cols = 0;  // input features (contiguous); multiple of the block size
  // Optional: the same rows packed once into a kernel family's panel layout (ops::PackPanels).
  // MatMul reads them instead of `data` while the family that packed them (panel_kernel) is
  // active; `data` stays valid for every other reader and family.
  const void* panels = nullptr;
  const void* panel_kernel = nullptr;
};

enum class RopeStyle {
  kAdjacentPairs,  // llama / llama2.c: rotate (x[2i], x[2i+1])
  kNeox,           // qwen2 / GPT-NeoX: rotate (x[i], x[i + head_dim/2])
};

namespace ops {

// ---- row conversion (any DType <-> f32) ----
void DequantizeRow(DType type, const void* src, float* dst, int64_t n);
// Quantizes (or converts) n floats into `type` (used by convert/synth and for activations).
void QuantizeRow(DType type, const float* src, void* dst, int64_t n);

// ---- matrix products ----
// y[t, r] = sum_c W[r, c] * x[t, c]
// x: [n_tokens, w.cols] f32, y: [n_tokens, w.rows] f32.
// Quantized weights use ggml's scheme: activations are quantized once per call
// (Q8_0 for Q8_0/Q4_0 weights, Q8_K for Q4_K) and dotted in integer arithmetic.
// Runs on n_threads threads (OpenMP); n_threads <= 0 means all available. Each thread streams a
// disjoint slice of W's rows. Safe to call concurrently from several threads (scratch is per
// calling thread). With n_tokens <= 4 the weights are streamed once (decode, bandwidth-bound);
// larger n_tokens use register-tiled GEMM (compute-bound).
void MatMul(const WeightView& w, const float* x, int64_t n_tokens, float* y, int n_threads);
// One of several products MatMulMany runs together: y [n_tokens, w.rows] = x [n_tokens, w.cols] W^T.
struct MatMulJob {
  const WeightView* w = nullptr;
  const float* x = nullptr;
  int64_t n_tokens = 0;
  float* y = nullptr;
};
// The jobs' products in one parallel region (each thread takes its share of every job's rows, as
// MatMul splits one), so small products (a decode step's experts, Q/K/V) pay one fork and join
// between them, not one each; jobs with the same input pack it once. Results equal MatMul's job by
// job, bit for bit. Outputs must not overlap each other or any input.
void MatMulMany(std::span<const MatMulJob> jobs, int n_threads);
// Bytes of w packed into the active kernel family's panel layout (the many-token matmul path's
// own, see matmul_panel-inl.h), or 0 when the family keeps no panels for w.type (it does for
// Q8_0 on avx512, whose panels hold exactly the rows' bytes).
size_t PanelBytes(const WeightView& w);
// Packs w into dst (PanelBytes(w) bytes, 64-byte aligned) on n_threads threads and returns w
// with panels = dst: MatMul's per-call weight packing then happens once, here.
WeightView PackPanels(const WeightView& w, void* dst, int n_threads);
// out[r, t] = rows[r] . keys[t]: rows [n_rows, dim], keys [n_keys, dim], out [n_rows, n_keys], all
// f32, on n_threads threads (<= 0: all). The attention kernel's QK blocks: for many rows against
// a short inner dimension (query rows against keys), where MatMul's weight tiling is slow.
void ScoreMatrix(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, float* out,
                 int n_threads);

// Int8 score products, for estimates (the sparse-prefill selectors' query x key products): the
// keys are quantized once (QuantizeKeysInt8) into the active family's packed layout, then
// ScoreMatrixInt8 quantizes the rows the same way and computes
//   out[r, t] = (dot(codes_r, codes_t) * step_r) * step_t,   step = max|x| / 127 per row or key,
// with exact integer dots: VNNI on avx512, plain sums in the scalar family (its twin, bit for
// bit). Each score is within sum_c |r_c| step_t / 2 + |k_c| step_r / 2 + step_r step_t / 4 of
// the exact product. Int8ScoresAvailable() is false where the family has no integer dots (avx2):
// callers then use ScoreMatrix.
struct Int8Keys {
  int64_t n_keys = 0;
  int dim = 0, dp = 0;           // dp: dim padded to 16
  const void* layout = nullptr;  // the family that packed them (checked by ScoreMatrixInt8)
  // 64-byte aligned: codes [ceil(n_keys / 16) blocks][16 keys x dp] in the family's layout, then
  // lane_steps [blocks][16] each block's key steps in the family's lane order. Grows, never shrinks.
  std::unique_ptr<void, void (*)(void*)> buffer{nullptr, &std::free};
  size_t capacity = 0;
  size_t CodeBytes() const { return static_cast<size_t>((n_keys + 15) / 16) * 16 * static_cast<size_t>(dp); }
  const uint8_t* codes() const { return static_cast<const uint8_t*>(buffer.get()); }
  const float* lane_steps() const { return reinterpret_cast<const float*>(codes() + CodeBytes()); }
};
bool Int8ScoresAvailable();
void QuantizeKeysInt8(const float* keys, int64_t n_keys, int dim, Int8Keys* out, int n_threads);
// rows [n_rows, keys.dim], out [n_rows, keys.n_keys].
void ScoreMatrixInt8(const float* rows, int64_t n_rows, const Int8Keys& keys, float* out, int n_threads);

// ---- vector kernels ----
// gpt-oss's SwiGLU constants (OpenAI's reference model; llama.cpp's swiglu_oai).
inline constexpr float kSwigluAlpha = 1.702f;
inline constexpr float kSwigluLimit = 7.0f;
float Dot(const float* a, const float* b, int64_t n);
// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i]
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps);
// Rotates x: [n_heads, head_dim] in place for position `pos`.
// inv_freq: [head_dim/2], theta_i = pos * inv_freq[i].
void Rope(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style);
// gate[i] = silu(gate[i]) * up[i]
void SiluMul(float* gate, const float* up, int64_t n);
// gate[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (GeGLU: Gemma)
void GeluMul(float* gate, const float* up, int64_t n);
// gpt-oss's clamped SwiGLU (FfnActivation::kSwigluClamped): g = min(gate[i], 7),
// u = clamp(up[i], -7, 7), gate[i] = g * sigmoid(1.702 g) * (u + 1)
void SwigluClampedMul(float* gate, const float* up, int64_t n);
// x[i] = cap * tanh(x[i] / cap) (Gemma 2's logit softcapping); cap > 0
void SoftcapInPlace(float* x, int64_t n, float cap);
// In-place numerically stable softmax.
void Softmax(float* x, int64_t n);
// y[i] += x[i]
void Add(float* y, const float* x, int64_t n);

// ---- machine limits ----
// Sustained read bandwidth (GB/s) of a multi-threaded streaming sum over a `bytes` buffer,
// best of a few passes. Decode-time matvec cannot beat weight_bytes / this.
double MeasureReadBandwidthGBs(int n_threads, size_t bytes = 1ull << 30);

// Peak arithmetic rates of the active kernel family's dot-product instructions over n_threads
// (<= 0: all), counting a multiply-add as two operations: f32 FMA (the f32 attention and matmul
// paths) and u8 x s8 int8 dot products (vpdpbusd on avx512, vpmaddubsw + vpmaddwd on avx2;
// the integer attention and the quantized matmuls), and bf16 dot products (vdpbf16ps, bf16 KV's
// attention) where the avx512 family runs with Bf16DotsEnabled (0 elsewhere). A few ms.
struct ComputePeak {
  double f32_fma_gflops = 0;
  double int8_dot_gops = 0;
  double bf16_dot_gflops = 0;
};
ComputePeak MeasureComputePeak(int n_threads);

}  // namespace ops

// Scalar reference twins: straightforward loops, no SIMD, no threads.
// Quantized MatMul here dequantizes W to f32 and accumulates in double.
namespace ref {
void DequantizeRow(DType type, const void* src, float* dst, int64_t n);
void QuantizeRow(DType type, const float* src, void* dst, int64_t n);
void MatMul(const WeightView& w, const float* x, int64_t n_tokens, float* y);
void ScoreMatrix(const float* rows, int64_t n_rows, const float* keys, int64_t n_keys, int dim, float* out);
float Dot(const float* a, const float* b, int64_t n);
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps);
void Rope(float* x, int n_heads, int head_dim, int32_t pos, const float* inv_freq, RopeStyle style);
void SiluMul(float* gate, const float* up, int64_t n);
void GeluMul(float* gate, const float* up, int64_t n);
void SwigluClampedMul(float* gate, const float* up, int64_t n);
void SoftcapInPlace(float* x, int64_t n, float cap);
void Softmax(float* x, int64_t n);
void Add(float* y, const float* x, int64_t n);
}  // namespace ref

}  // namespace kvsparse
