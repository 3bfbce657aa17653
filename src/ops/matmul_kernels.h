// Internal interface between the MatMul driver (matmul.cc) and the per-weight-type kernels
// (matmul_<type>.cc). The driver quantizes/packs activations once per call, splits weight rows
// across threads and walks tiles; a kernel computes one tile of at most kMaxTileRows weight rows
// by kMaxTileTokens tokens over the full inner dimension. Every kernel family
// (include/kvsparse/isa.h) has its own Kernel per weight type (declared in matmul_tile-inl.h);
// the driver fetches the active family's once per MatMul call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvsparse/dtype.h"

namespace kvsparse::matmul {

inline constexpr int kMaxTileRows = 4;
inline constexpr int kMaxTileTokens = 4;

struct TileArgs {
  const uint8_t* w;      // first weight row of the tile (GGUF row layout)
  size_t w_row_bytes;    // bytes between consecutive weight rows
  int n_rows;            // 1..kMaxTileRows, or any count when row_strip
  const uint8_t* x;      // first token's packed activations
  size_t x_token_bytes;  // bytes between consecutive tokens' packed activations
  int n_tokens;          // 1..kMaxTileTokens
  int64_t cols;          // inner dimension (multiple of the weight block size)
  float* y;              // y[t * y_stride + r] for the tile's local r, t
  int64_t y_stride;
  const uint8_t* w_prefetch;  // weight bytes the caller will need next (may be null)
  bool accumulate = false;    // add to y instead of overwriting (later K chunks)
  bool row_strip = false;     // n_rows rows computed one at a time (decode: one sequential stream)
};

struct Kernel {
  // Bytes of one token's packed activations for `cols` inputs.
  size_t (*packed_token_bytes)(int64_t cols);
  // Packs one token's f32 activations [cols] into dst (PackedTokenBytes(cols) bytes, 64-aligned).
  void (*pack_token)(const float* x, int64_t cols, uint8_t* dst);
  void (*tile)(const TileArgs& args);
  // If > 0, the driver splits the inner dimension into chunks of this many columns (a multiple
  // of the block size) so a row tile's chunk stays in L1; the kernel must honour `accumulate`.
  int64_t k_chunk = 0;
  // Optional single-token (decode) packing, used instead of pack_token when n_tokens == 1; the
  // kernel's single-token strip then reads this layout. Null: pack_token serves decode too.
  size_t (*decode_token_bytes)(int64_t cols) = nullptr;
  void (*pack_decode_token)(const float* x, int64_t cols, uint8_t* dst) = nullptr;
  // Optional many-token path (prefill, batched decode): computes all args.n_rows rows (any
  // count) for all args.n_tokens tokens (any count) of one token block over the full inner
  // dimension, packing the weights into a layout of its own (matmul_panel-inl.h). Null: the
  // driver walks `tile`s.
  void (*panel)(const TileArgs& args) = nullptr;
  // Optional kept panels: the weights packed into the panel layout once (ops::PackPanels, at
  // model load) where that layout is no larger than the type's own (avx512 Q8_0), so that no
  // call packs them again and 1..4 tokens read them too. panel_bytes(rows, cols) sizes them;
  // pack_panels(w, w_row_bytes, rows, cols, dst) packs rows [0, rows) of GGUF-layout weights;
  // packed_panels(args) is `panel` reading args.w as kept panels (args.w at the first row's
  // panel: the driver splits rows in whole panels of panel_rows).
  size_t (*panel_bytes)(int64_t n_rows, int64_t cols) = nullptr;
  void (*pack_panels)(const uint8_t* w, size_t w_row_bytes, int64_t n_rows, int64_t cols, uint8_t* dst) = nullptr;
  void (*packed_panels)(const TileArgs& args) = nullptr;
  int panel_rows = 0;
};

}  // namespace kvsparse::matmul
