// Maps a runtime tile shape (n_rows x n_tokens, each 1..4) onto a kernel template
// `K::template Run<R, T>(args)`, so the tile loops are fully unrolled with accumulators in registers;
// or, for TileArgs::row_strip, runs Run<1, T> over every row of the strip.
#pragma once

#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"

namespace kvsparse::matmul {

template <class K, int R>
void DispatchTokens(const TileArgs& a) {
  switch (a.n_tokens) {
    case 1: return K::template Run<R, 1>(a);
    case 2: return K::template Run<R, 2>(a);
    case 3: return K::template Run<R, 3>(a);
    case 4: return K::template Run<R, 4>(a);
  }
  KVS_CHECK_MSG(false, "tile token count out of range");
}

// A strip of any number of rows, computed one row at a time (each row fully, left to right), so
// the weights are read as one sequential stream -- the decode (few tokens) path.
template <class K, int T>
void RunStrip(const TileArgs& a) {
  TileArgs row = a;
  row.n_rows = 1;
  row.w_prefetch = nullptr;
  for (int r = 0; r < a.n_rows; ++r) {
    row.w = a.w + r * a.w_row_bytes;
    row.y = a.y + r;
    K::template Run<1, T>(row);
  }
}

template <class K>
void DispatchTile(const TileArgs& a) {
  static_assert(kMaxTileRows == 4 && kMaxTileTokens == 4);
  if (a.row_strip) {
    // Kernels may provide a dedicated single-token strip (the decode hot loop).
    if constexpr (requires { K::RunStripOneToken(a); }) {
      if (a.n_tokens == 1) return K::RunStripOneToken(a);
    }
    switch (a.n_tokens) {
      case 1: return RunStrip<K, 1>(a);
      case 2: return RunStrip<K, 2>(a);
      case 3: return RunStrip<K, 3>(a);
      case 4: return RunStrip<K, 4>(a);
    }
    KVS_CHECK_MSG(false, "strip token count out of range");
  }
  switch (a.n_rows) {
    case 1: return DispatchTokens<K, 1>(a);
    case 2: return DispatchTokens<K, 2>(a);
    case 3: return DispatchTokens<K, 3>(a);
    case 4: return DispatchTokens<K, 4>(a);
  }
  KVS_CHECK_MSG(false, "tile row count out of range");
}

}  // namespace kvsparse::matmul
