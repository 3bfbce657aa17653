// Model description, weights and the forward pass.
// Weights point into the mapped GGUF file (or into owned buffers for llama2.c checkpoints).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/gguf.h"
#include "kvsparse/kv_cache.h"
#include "kvsparse/kv_policy.h"
#include "kvsparse/ops.h"
#include "kvsparse/status.h"

namespace kvsparse {

enum class Arch { kLlama, kQwen2 };
std::string_view ArchName(Arch a);

// Weight types the forward pass computes with (what loaders accept and converters write).
bool IsSupportedWeightType(DType t);
std::string_view SupportedWeightTypeNames();  // "f32, f16, bf16, q8_0, q4_0, q4_K"

struct ModelConfig {
  Arch arch = Arch::kLlama;
  int n_vocab = 0;
  int dim = 0;         // embedding width
  int hidden_dim = 0;  // FFN inner width
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;    // dim / n_heads
  int max_context = 0; // training context length
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeStyle rope_style = RopeStyle::kAdjacentPairs;
  bool tied_output = false;  // output projection shares the token embedding
};

struct LayerWeights {
  const float* attn_norm = nullptr;  // [dim]
  WeightView wq, wk, wv, wo;         // [n_heads*head_dim, dim], [n_kv*hd, dim], [n_kv*hd, dim], [dim, n_heads*hd]
  const float* bq = nullptr;         // [n_heads*head_dim] (qwen2 only)
  const float* bk = nullptr;         // [n_kv_heads*head_dim]
  const float* bv = nullptr;         // [n_kv_heads*head_dim]
  const float* ffn_norm = nullptr;   // [dim]
  WeightView w_gate, w_up, w_down;   // [hidden, dim], [hidden, dim], [dim, hidden]
};

class Model {
 public:
  // Detects the format from the file's magic: GGUF or a llama2.c checkpoint.
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& path);
  static StatusOr<std::unique_ptr<Model>> LoadGguf(const std::string& path);
  static StatusOr<std::unique_ptr<Model>> LoadLlama2c(const std::string& path);
  ~Model();

  const ModelConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  const GgufFile* gguf() const { return gguf_.get(); }  // null for llama2.c checkpoints

  WeightView token_embedding;            // [n_vocab, dim]
  std::vector<LayerWeights> layers;      // [n_layers]
  const float* output_norm = nullptr;    // [dim]
  WeightView output;                     // [n_vocab, dim] (== token_embedding when tied)
  std::vector<float> rope_inv_freq;      // [head_dim/2], includes rope_freqs scaling when present

  int64_t ParameterCount() const;
  size_t WeightBytes() const;  // bytes of all weight tensors as stored

 private:
  Model() = default;
  std::string path_;
  ModelConfig config_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<std::vector<uint8_t>> owned_;  // llama2.c weights (f32)
  friend class ModelLoader;
};

class SparseKvController;
struct AttentionShape;

// Per-engine scratch and the forward pass. One Engine serves any number of sequences
// stored in its KvCache; it is not thread-safe (it uses its own threads inside).
class Engine {
 public:
  // With a controller (sparse_kv_controller.h; it must manage this same cache) the forward
  // pass feeds the sparsity policies and evicts after each layer's attention, and prompts
  // run in chunks of the controller's prefill_chunk (at most 512). A call of n > 1 tokens is
  // a prompt chunk, n == 1 a decode step; fraction budgets count pos0 + n tokens seen, so a
  // sequence's positions must start at 0. Without a controller nothing is ever evicted.
  // Layers whose policy numbers positions inside the cache (StreamingLLM "cache_positions")
  // rotate, store and attend the chunk at the layer's live token count + i instead of pos0 + i.
  Engine(const Model& model, KvCache* cache, int n_threads, SparseKvController* controller = nullptr);
  ~Engine();

  // Runs n tokens of sequence `seq` at positions pos0 .. pos0+n-1 (prefill when n > 1,
  // decode when n == 1), appending their K/V to the cache.
  // logits: [n, n_vocab] when all_logits, else [n_vocab] for the last token.
  // Errors: token id out of range (OutOfRange, before anything is stored), cache full or
  // positions not after the stored ones (from KvCache::Append, naming the layer).
  // Positions past the training context are allowed: the caller bounds the context.
  Status Forward(int seq, const int32_t* tokens, int32_t n, int32_t pos0, float* logits, bool all_logits = false);

  const Model& model() const { return model_; }
  int n_threads() const { return n_threads_; }
  SparseKvController* controller() const { return controller_; }

 private:
  struct Scratch;
  // One chunk of at most kMaxChunkTokens tokens; logits null when this chunk's are not wanted.
  Status ForwardChunk(int seq, const int32_t* tokens, int32_t n, int32_t pos0, float* logits, bool all_logits);
  // The attention of one layer when a SparseKvController is attached (scratch spans already gathered).
  Status SparseAttention(int seq, int layer, int32_t n, int32_t pos0, const AttentionShape& shape);
  // The attention of a per-head layer (KvCache::per_head): one call per kv head, with or without a controller.
  Status PerHeadAttention(int seq, int layer, int32_t n, int32_t pos0, const AttentionShape& shape);
  EvictionPoint chunk_point_ = EvictionPoint::kDecodeStep;  // of the chunk ForwardChunk is running
  const Model& model_;
  KvCache* cache_;
  int n_threads_;
  SparseKvController* controller_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace kvsparse
