// Maps a runtime tile shape (n_rows x n_tokens, each 1..4) onto a kernel template
// `K::template Run<R, T>(args)`, so the tile loops are fully unrolled with accumulators in registers.
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

template <class K>
void DispatchTile(const TileArgs& a) {
  static_assert(kMaxTileRows == 4 && kMaxTileTokens == 4);
  switch (a.n_rows) {
    case 1: return DispatchTokens<K, 1>(a);
    case 2: return DispatchTokens<K, 2>(a);
    case 3: return DispatchTokens<K, 3>(a);
    case 4: return DispatchTokens<K, 4>(a);
  }
  KVS_CHECK_MSG(false, "tile row count out of range");
}

}  // namespace kvsparse::matmul
