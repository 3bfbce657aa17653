// MatMul driver: packs (quantizes) activations once per call, splits weight rows across
// threads (each thread streams a disjoint slice of W), and walks register tiles of
// kMaxTileRows x kMaxTileTokens. Tokens are processed in blocks whose packed activations stay
// in L2, so each weight row tile is read from memory once per token block and then reused from L1.
// The driver is baseline code; the kernels are the active family's (include/kvsparse/isa.h),
// fetched once per call.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/ops.h"
#include "kvsparse/status.h"
#include "ops/matmul_kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/matmul.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
#include "ops/matmul_tile-inl.h"
namespace kvsparse::matmul::HWY_NAMESPACE {

// This family's kernel for weights of `type`; null for activation-only types.
const Kernel* KernelFor(DType type) {
  switch (type) {
    case DType::kQ8_0: return &KernelQ8_0();
    case DType::kQ4_0: return &KernelQ4_0();
    case DType::kQ4_K: return &KernelQ4_K();
    case DType::kQ4_1: return &KernelQ4_1();
    case DType::kQ5_0: return &KernelQ5_0();
    case DType::kQ5_1: return &KernelQ5_1();
    case DType::kQ2_K: return &KernelQ2_K();
    case DType::kQ3_K: return &KernelQ3_K();
    case DType::kQ5_K: return &KernelQ5_K();
    case DType::kQ6_K: return &KernelQ6_K();
    case DType::kIQ4_NL: return &KernelIQ4_NL();
    case DType::kIQ4_XS: return &KernelIQ4_XS();
    case DType::kMXFP4: return &KernelMXFP4();
    case DType::kF32: return &KernelF32();
    case DType::kF16: return &KernelF16();
    case DType::kBF16: return &KernelBF16();
    case DType::kQ8_K: break;
  }
  return nullptr;
}

}  // namespace kvsparse::matmul::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse {
namespace matmul {
HWY_EXPORT(KernelFor);
}  // namespace matmul

namespace {

// Budget for one token block's packed activations (about half of a Zen4 core's 1 MiB L2).
constexpr size_t kTokenBlockBytes = 512 * 1024;
// Below this many multiply-adds a call runs on the calling thread only (fork/join costs more).
constexpr int64_t kMinParallelMacs = 1 << 18;

// The active family's kernel (one dispatch per MatMul call).
const matmul::Kernel& KernelFor(DType type) {
  const matmul::Kernel* kernel = KVS_DISPATCH(matmul::KernelFor)(type);
  if (kernel == nullptr) {
    CheckFailed(__FILE__, __LINE__, "supported weight type",
                "MatMul has no kernel for weights of type " + std::string(DTypeName(type)));
  }
  return *kernel;
}

// Grow-only, 64-byte aligned scratch for packed activations, one per calling thread.
uint8_t* PackScratch(size_t bytes) {
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, FreeDeleter> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
    KVS_CHECK_MSG(buffer != nullptr, "MatMul: out of memory for packed activations");
    capacity = rounded;
  }
  return buffer.get();
}

// Whether MatMul reads w's kept panels (packed by this family's kernel).
bool UsesKeptPanels(const matmul::Kernel& kernel, const WeightView& w) {
  return w.panels != nullptr && w.panel_kernel == &kernel && kernel.packed_panels != nullptr;
}

// Computes weight rows [row_begin, row_end) for all tokens.
void MatMulRows(const matmul::Kernel& kernel, const WeightView& w, const uint8_t* x, size_t x_token_bytes,
                int64_t n_tokens, float* y, int64_t row_begin, int64_t row_end) {
  const size_t row_bytes = DTypeRowBytes(w.type, w.cols);
  const uint8_t* w_bytes = static_cast<const uint8_t*>(w.data);
  int64_t block_tokens = static_cast<int64_t>(kTokenBlockBytes / std::max<size_t>(x_token_bytes, 1));
  block_tokens =
      std::max<int64_t>(matmul::kMaxTileTokens, block_tokens / matmul::kMaxTileTokens * matmul::kMaxTileTokens);
  // Only unpacked (f32) activations can be split along K: packed steps span the whole row.
  const int64_t k_chunk = kernel.k_chunk > 0 && kernel.pack_token == nullptr ? kernel.k_chunk : w.cols;
  const size_t x_elem_bytes = sizeof(float);
  // Few tokens (decode): the weights are read once, so the kernel is bound by DRAM bandwidth.
  // Walking the thread's rows one at a time keeps its reads a single sequential stream, which the
  // hardware prefetcher sustains at full bandwidth (4 interleaved row streams reach ~60-70% of it).
  // All of the thread's rows against tokens [t0, t0 + count), full inner dimension.
  auto row_range = [&](int64_t t0, int64_t count) {
    matmul::TileArgs args;
    args.w = w_bytes + row_begin * row_bytes;
    args.w_row_bytes = row_bytes;
    args.n_rows = static_cast<int>(row_end - row_begin);
    args.x = x + t0 * x_token_bytes;
    args.x_token_bytes = x_token_bytes;
    args.n_tokens = static_cast<int>(count);
    args.cols = w.cols;
    args.y = y + t0 * w.rows + row_begin;
    args.y_stride = w.rows;
    args.w_prefetch = nullptr;
    return args;
  };
  if (UsesKeptPanels(kernel, w)) {  // row_begin is a whole panel's first row
    const size_t panel_bytes = kernel.panel_bytes(kernel.panel_rows, w.cols);
    for (int64_t t_block = 0; t_block < n_tokens; t_block += block_tokens) {
      matmul::TileArgs args = row_range(t_block, std::min(n_tokens, t_block + block_tokens) - t_block);
      args.w = static_cast<const uint8_t*>(w.panels) + static_cast<size_t>(row_begin / kernel.panel_rows) * panel_bytes;
      args.w_row_bytes = 0;
      kernel.packed_panels(args);
    }
    return;
  }
  if (n_tokens <= matmul::kMaxTileTokens) {
    matmul::TileArgs args = row_range(0, n_tokens);
    args.row_strip = true;
    kernel.tile(args);
    return;
  }
  // Many tokens: 4x4 register tiles reuse every load 4 times and are compute-bound; a kernel with
  // panels (matmul_panel-inl.h) walks the thread's rows itself, one token block at a time.
  for (int64_t t_block = 0; t_block < n_tokens; t_block += block_tokens) {
    const int64_t t_block_end = std::min(n_tokens, t_block + block_tokens);
    if (kernel.panel != nullptr) {
      kernel.panel(row_range(t_block, t_block_end - t_block));
      continue;
    }
    for (int64_t r0 = row_begin; r0 < row_end; r0 += matmul::kMaxTileRows) {
      const int n_rows = static_cast<int>(std::min<int64_t>(matmul::kMaxTileRows, row_end - r0));
      const int64_t next_r0 = r0 + matmul::kMaxTileRows;
      for (int64_t k0 = 0; k0 < w.cols; k0 += k_chunk) {
        const int64_t k_len = std::min(k_chunk, w.cols - k0);
        const size_t w_offset = k_len == w.cols ? 0 : DTypeRowBytes(w.type, k0);
        const size_t x_offset = k_len == w.cols ? 0 : k0 * x_elem_bytes;
        for (int64_t t0 = t_block; t0 < t_block_end; t0 += matmul::kMaxTileTokens) {
          matmul::TileArgs args;
          args.w = w_bytes + r0 * row_bytes + w_offset;
          args.w_row_bytes = row_bytes;
          args.n_rows = n_rows;
          args.x = x + t0 * x_token_bytes + x_offset;
          args.x_token_bytes = x_token_bytes;
          args.n_tokens = static_cast<int>(std::min<int64_t>(matmul::kMaxTileTokens, t_block_end - t0));
          args.cols = k_len;
          args.y = y + t0 * w.rows + r0;
          args.y_stride = w.rows;
          args.accumulate = k0 > 0;
          // 4 interleaved row streams defeat the hardware prefetcher: while the last token tile
          // runs, pull the next row tile's chunk into L2.
          const bool last_token_tile = t0 + matmul::kMaxTileTokens >= t_block_end;
          args.w_prefetch = (last_token_tile && next_r0 + matmul::kMaxTileRows <= row_end)
                                ? w_bytes + next_r0 * row_bytes + w_offset
                                : nullptr;
          kernel.tile(args);
        }
      }
    }
  }
}

}  // namespace


namespace {

// One product's plan: its kernel, how its rows split into tiles, and its packed activations.
struct PlannedProduct {
  const matmul::Kernel* kernel = nullptr;
  const WeightView* w = nullptr;
  const float* x = nullptr;
  int64_t n_tokens = 0;
  float* y = nullptr;
  int64_t tile_rows = 0;  // threads take whole row tiles, or whole panels when the panels are kept
  int64_t row_tiles = 0;
  void (*pack_token)(const float*, int64_t, uint8_t*) = nullptr;
  size_t token_bytes = 0;  // of one packed (or f32) activation row
  const uint8_t* packed = nullptr;
};

// Plans y = W x; false when there is nothing to multiply (the output is already written).
bool PlanProduct(const WeightView& w, const float* x, int64_t n_tokens, float* y, PlannedProduct* plan) {
  KVS_CHECK(w.rows >= 0 && w.cols >= 0 && n_tokens >= 0);
  if (w.rows == 0 || n_tokens == 0) return false;
  if (w.cols == 0) {
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(w.rows * n_tokens));
    return false;
  }
  KVS_CHECK_MSG(w.cols % DTypeBlockSize(w.type) == 0, "MatMul: cols must be a multiple of the weight block size");
  KVS_CHECK(w.data != nullptr && x != nullptr && y != nullptr);
  const matmul::Kernel& kernel = KernelFor(w.type);
  const bool kept_panels = UsesKeptPanels(kernel, w);
  plan->kernel = &kernel;
  plan->w = &w;
  plan->x = x;
  plan->n_tokens = n_tokens;
  plan->y = y;
  plan->tile_rows = kept_panels ? kernel.panel_rows : matmul::kMaxTileRows;
  plan->row_tiles = (w.rows + plan->tile_rows - 1) / plan->tile_rows;
  plan->token_bytes = sizeof(float) * static_cast<size_t>(w.cols);
  plan->packed = reinterpret_cast<const uint8_t*>(x);
  // Decode may use a kernel-specific compact single-token layout (see Kernel::pack_decode_token).
  plan->pack_token = kernel.pack_token;
  if (n_tokens == 1 && kernel.pack_decode_token != nullptr && !kept_panels) {
    plan->pack_token = kernel.pack_decode_token;
    plan->token_bytes = kernel.decode_token_bytes(w.cols);
  } else if (plan->pack_token != nullptr) {
    plan->token_bytes = kernel.packed_token_bytes(w.cols);
  }
  return true;
}

// Thread `id` of `n`'s contiguous share of the plan's row tiles.
void RunShare(const PlannedProduct& p, int id, int n) {
  const int64_t tile_begin = p.row_tiles * id / n;
  const int64_t tile_end = p.row_tiles * (id + 1) / n;
  const int64_t row_begin = tile_begin * p.tile_rows;
  const int64_t row_end = std::min(p.w->rows, tile_end * p.tile_rows);
  if (row_begin < row_end) {
    MatMulRows(*p.kernel, *p.w, p.packed, p.token_bytes, p.n_tokens, p.y, row_begin, row_end);
  }
}

}  // namespace

namespace ops {

void MatMul(const WeightView& w, const float* x, int64_t n_tokens, float* y, int n_threads) {
  PlannedProduct p;
  if (!PlanProduct(w, x, n_tokens, y, &p)) return;
  if (n_threads <= 0) n_threads = omp_get_max_threads();
  if (w.rows * w.cols * n_tokens < kMinParallelMacs) n_threads = 1;
  n_threads = static_cast<int>(std::min<int64_t>(n_threads, p.row_tiles));

  uint8_t* scratch = nullptr;
  if (p.pack_token != nullptr) {
    scratch = PackScratch(p.token_bytes * static_cast<size_t>(n_tokens));
    p.packed = scratch;
  }
  // A few tokens pack in about a microsecond: do it here rather than pay a barrier in the region.
  const bool pack_in_parallel = scratch != nullptr && n_tokens >= 2 * n_threads;
  if (scratch != nullptr && !pack_in_parallel) {
    for (int64_t t = 0; t < n_tokens; ++t) p.pack_token(x + t * w.cols, w.cols, scratch + t * p.token_bytes);
  }

#pragma omp parallel num_threads(n_threads)
  {
    if (pack_in_parallel) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < n_tokens; ++t) p.pack_token(x + t * w.cols, w.cols, scratch + t * p.token_bytes);
    }
    // Contiguous row-tile ranges keep each thread's weight reads one sequential stream.
    RunShare(p, omp_get_thread_num(), omp_get_num_threads());
  }
}

void MatMulMany(std::span<const MatMulJob> jobs, int n_threads) {
  std::vector<PlannedProduct> plans;
  plans.reserve(jobs.size());
  int64_t macs = 0, most_tiles = 0;
  size_t pack_bytes = 0;
  for (const MatMulJob& job : jobs) {
    PlannedProduct p;
    if (!PlanProduct(*job.w, job.x, job.n_tokens, job.y, &p)) continue;
    macs += job.w->rows * job.w->cols * job.n_tokens;
    most_tiles = std::max(most_tiles, p.row_tiles);
    if (p.pack_token != nullptr) pack_bytes += (p.token_bytes * static_cast<size_t>(p.n_tokens) + 63) / 64 * 64;
    plans.push_back(p);
  }
  if (plans.empty()) return;
  // Activations pack once per distinct (input, layout): the products of one input (an expert's
  // gate and up) share theirs.
  uint8_t* scratch = pack_bytes > 0 ? PackScratch(pack_bytes) : nullptr;
  size_t offset = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    PlannedProduct& p = plans[i];
    if (p.pack_token == nullptr) continue;
    bool shared = false;
    for (size_t j = 0; j < i && !shared; ++j) {
      const PlannedProduct& q = plans[j];
      if (q.x == p.x && q.n_tokens == p.n_tokens && q.pack_token == p.pack_token && q.w->cols == p.w->cols) {
        p.packed = q.packed;
        shared = true;
      }
    }
    if (shared) continue;
    uint8_t* dst = scratch + offset;
    for (int64_t t = 0; t < p.n_tokens; ++t) p.pack_token(p.x + t * p.w->cols, p.w->cols, dst + t * p.token_bytes);
    p.packed = dst;
    offset += (p.token_bytes * static_cast<size_t>(p.n_tokens) + 63) / 64 * 64;
  }
  if (n_threads <= 0) n_threads = omp_get_max_threads();
  if (macs < kMinParallelMacs) n_threads = 1;
  n_threads = static_cast<int>(std::min<int64_t>(n_threads, most_tiles));
  // Every thread takes its share of each product in turn: one fork and join for all of them,
  // each share still one sequential stream.
#pragma omp parallel num_threads(n_threads)
  {
    const int id = omp_get_thread_num(), n = omp_get_num_threads();
    for (const PlannedProduct& p : plans) RunShare(p, id, n);
  }
}

size_t PanelBytes(const WeightView& w) {
  const matmul::Kernel* kernel = KVS_DISPATCH(matmul::KernelFor)(w.type);
  if (kernel == nullptr || kernel->pack_panels == nullptr || w.rows <= 0 || w.cols <= 0) return 0;
  return kernel->panel_bytes(w.rows, w.cols);
}

WeightView PackPanels(const WeightView& w, void* dst, int n_threads) {
  const matmul::Kernel& kernel = KernelFor(w.type);
  KVS_CHECK_MSG(kernel.pack_panels != nullptr && PanelBytes(w) > 0,
                "PackPanels: the active family keeps no panels for this type");
  KVS_CHECK(w.data != nullptr && dst != nullptr && w.cols % DTypeBlockSize(w.type) == 0);
  const size_t row_bytes = DTypeRowBytes(w.type, w.cols);
  const size_t panel_bytes = kernel.panel_bytes(kernel.panel_rows, w.cols);
  const int64_t n_panels = (w.rows + kernel.panel_rows - 1) / kernel.panel_rows;
  if (n_threads <= 0) n_threads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(std::min<int64_t>(n_threads, n_panels)))
  for (int64_t p = 0; p < n_panels; ++p) {
    const int64_t r0 = p * kernel.panel_rows;
    kernel.pack_panels(static_cast<const uint8_t*>(w.data) + r0 * row_bytes, row_bytes,
                       std::min<int64_t>(kernel.panel_rows, w.rows - r0), w.cols,
                       static_cast<uint8_t*>(dst) + static_cast<size_t>(p) * panel_bytes);
  }
  WeightView packed = w;
  packed.panels = dst;
  packed.panel_kernel = &kernel;
  return packed;
}

}  // namespace ops
}  // namespace kvsparse
#endif  // HWY_ONCE
