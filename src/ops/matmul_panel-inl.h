// Panels: the many-token matmul path (Kernel::panel) of the avx512 family, shared by every
// quantized weight type (the 32-element types through PackedQ8Panel in matmul_packed_q8-inl.h,
// the super-blocks through SuperBlockPanel below). Include it inside a family region (see
// simd_family.h), after matmul_tile-inl.h, with <vector> and hwy/aligned_allocator.h before it.
//
// Why: a register tile (matmul_tile-inl.h) multiplies one weight row by one token per vpdpbusd,
// so each int32 lane sums 4 products of one row, and the block scales change every 8 lanes: a
// convert, a multiply and an FMA follow every vpdpbusd. A panel turns the weights so that one
// vpdpbusd serves 16 rows: a group of 16 rows is packed per 32-element block (or 16-element
// sub-block) as
//   uint8_t codes[8 (4) quads][16 lanes][4 bytes]   lane k: elements 4c..4c+3 of row PanelRow(k)
// plus the type's per-row f32 factors in the same lane order, so 8 (4) vpdpbusd with 4 of a
// token's int8 codes broadcast each sum the whole block for 16 rows, and the scales cost one
// convert and FMA (or two) per 8 (4) of them. A panel of kPanelGroups groups is packed once per token block into
// per-thread scratch (it stays in L2) and multiplied by every token of the block, kPanelTokens at
// a time (2 x 4 int32 sums and 2 x 4 f32 accumulators: 16 of the 32 zmm registers).
//
// A weight type supplies P (its block arithmetic; see RunPanels), and its Kernel's `panel` is
// &RunPanels<P>. The integer block dots are exact, as the tiles'; only the f32 sum order differs.
#if defined(KVS_OPS_MATMUL_PANEL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_MATMUL_PANEL_INL_H_
#undef KVS_OPS_MATMUL_PANEL_INL_H_
#else
#define KVS_OPS_MATMUL_PANEL_INL_H_
#endif

namespace kvsparse::matmul::HWY_NAMESPACE {

#if KVS_ISA_AVX512
constexpr int kPanelGroupRows = 16;  // rows per vector
constexpr int kPanelGroups = 2;      // groups per panel
constexpr int kPanelRows = kPanelGroups * kPanelGroupRows;
constexpr int kPanelTokens = 4;
constexpr size_t kPanelCodeBytes = 8 * 64;  // one 32-element block of a group: 8 quads x 64 bytes

// The row of a group held by vector lane k: the 4x4 dword transpose per 128-bit lane leaves row
// 4i + L in lane 4L + i (an involution, so it also maps rows to lanes).
constexpr int PanelRow(int lane) { return 4 * (lane % 4) + lane / 4; }

typedef int32_t PanelAliasedI32 __attribute__((may_alias, aligned(1)));  // four codes read as one word

// 16 bytes at chunk[j] of each row j of a group, as 4 quad vectors: quad[c] lane k holds bytes
// 4c..4c+3 of row PanelRow(k)'s chunk.
inline void TransposeRowChunks(const uint8_t* const* chunk, __m512i (&quad)[4]) {
  __m512i x[4];  // x[i] 128-bit lane L: row 4i + L
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk[4 * i])));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk[4 * i + 1])), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk[4 * i + 2])), 2);
    x[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk[4 * i + 3])), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
  quad[0] = _mm512_unpacklo_epi64(t0, t2);
  quad[1] = _mm512_unpackhi_epi64(t0, t2);
  quad[2] = _mm512_unpacklo_epi64(t1, t3);
  quad[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Lanes of a group whose row is one of its first n_valid rows.
inline __mmask16 PanelValidLanes(int n_valid) {
  __mmask16 lanes = 0;
  for (int k = 0; k < kPanelGroupRows; ++k) lanes |= static_cast<__mmask16>((PanelRow(k) < n_valid ? 1 : 0) << k);
  return lanes;
}

// dot[g][t] (16 rows' int32 sums, from their start values) += a block's kQuads quads of G
// groups' codes times token t's 4 kQuads codes: elements 0..15 at x[t], 16.. at x[t] + x_hi.
template <int G, int T, int kQuads = 8>
inline void PanelBlockDots(const uint8_t* codes, size_t group_stride, const int8_t* const* x, __m512i (&dot)[G][T],
                           int x_hi = 16) {
#pragma GCC unroll 8
  for (int c = 0; c < kQuads; ++c) {
    __m512i w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_load_si512(codes + g * group_stride + c * 64);
    const int x_offset = c < 4 ? 4 * c : x_hi + 4 * (c - 4);
    for (int t = 0; t < T; ++t) {
      const __m512i xq = _mm512_set1_epi32(*reinterpret_cast<const PanelAliasedI32*>(x[t] + x_offset));
      for (int g = 0; g < G; ++g) dot[g][t] = _mm512_dpbusd_epi32(dot[g][t], w[g], xq);
    }
  }
}

// Pulls the next panel's weight rows into L2 while this panel computes: packing is where a
// panel's weights come from DRAM, and without this it would wait for them with the vector units
// idle (at 16 tokens a quarter of the time). Sums call Step() once per block, which issues the
// share of prefetches spread over this token group's blocks.
struct PanelPrefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int per_step = 0;
  void Step() {
    for (int i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// The super-block types against Q8_K activations (value = s_j * u - m_j per row and sub-block j
// of kSubBlockElems elements, u unsigned codes): per row and token
//   sum = d_x * (sum_j s_j dot(u_j, x_j) - sum_j m_j sum(x_j))
// with sum(x_j) from the activations' bsums, converted once per call. C supplies kSubBlockElems
// (32 or 16), optionally XOffset / kXHi (see below), and PackSuperBlock(src, n_valid, b, group,
// block), which writes a super-block's codes
// [sub-block][group][kQuads x 64 bytes], then s [sub-block][group][16 f32] at kScalesOffset and
// m likewise at kMinsOffset (lanes of rows past n_valid get s = m = 0).
template <class C>
struct SuperBlockPanel {
  using Block = typename C::Block;
  static constexpr int kBlockElems = kQK_K;
  static constexpr int kSubBlocks = kQK_K / C::kSubBlockElems;
  static constexpr int kQuads = C::kSubBlockElems / 4;
  static constexpr size_t kSubBlockCodeBytes = kQuads * 64;
  static constexpr size_t kGroupBlockBytes = kSubBlocks * (kSubBlockCodeBytes + 2 * kPanelGroupRows * sizeof(float));
  static constexpr size_t kBlockBytes = kPanelGroups * kGroupBlockBytes;
  static constexpr size_t kScalesOffset = kSubBlocks * kPanelGroups * kSubBlockCodeBytes;
  static constexpr size_t kMinsOffset = kScalesOffset + kSubBlocks * kPanelGroups * kPanelGroupRows * sizeof(float);
  // A super-block's codes, s and m of sub-block j and `group` (Byte: uint8_t or const uint8_t).
  template <class Byte>
  static Byte* SubBlockCodes(Byte* block, int j, int group) {
    return block + (j * kPanelGroups + group) * kSubBlockCodeBytes;
  }
  template <class Byte>
  static auto* Scales(Byte* block, int j, int group) {
    return Factors(block + kScalesOffset) + (j * kPanelGroups + group) * kPanelGroupRows;
  }
  template <class Byte>
  static auto* Mins(Byte* block, int j, int group) {
    return Factors(block + kMinsOffset) + (j * kPanelGroups + group) * kPanelGroupRows;
  }
  static float* Factors(uint8_t* bytes) { return reinterpret_cast<float*>(bytes); }
  static const float* Factors(const uint8_t* bytes) { return reinterpret_cast<const float*>(bytes); }

  // Where sub-block j's element 0 (and, for 32-element sub-blocks, element 16 relative to it) sits
  // in a token's Q8_K codes: ggml's order, or the permuted one a type's tiles pack (C::XOffset,
  // C::kXHi).
  static constexpr int XOffset(int j) {
    if constexpr (requires { C::XOffset(0); }) {
      return C::XOffset(j);
    } else {
      return C::kSubBlockElems * j;
    }
  }
  static constexpr int XHi() {
    if constexpr (requires { C::kXHi; }) {
      return C::kXHi;
    } else {
      return 16;
    }
  }

  // Fills a super-block's s and m lanes of `group`: factors(w, s, m) writes row w's s_j and m_j
  // for every sub-block j; lanes of rows past n_valid get 0.
  template <class F>
  static void PackFactors(const Block* const* src, int n_valid, int64_t b, int group, uint8_t* block, F factors) {
    for (int k = 0; k < kPanelGroupRows; ++k) {
      float s[kSubBlocks] = {}, m[kSubBlocks] = {};
      if (PanelRow(k) < n_valid) factors(src[PanelRow(k)][b], s, m);
      for (int j = 0; j < kSubBlocks; ++j) {
        Scales(block, j, group)[k] = s[j];
        Mins(block, j, group)[k] = m[j];
      }
    }
  }

  static std::vector<float>& SubBlockSums() {
    static thread_local std::vector<float> sums;  // [n_tokens, n_blocks, kSubBlocks] sum(x_j)
    return sums;
  }

  static void PrepareTokens(const TileArgs& a, int64_t n_blocks) {
    constexpr int kSumsPerSubBlock = C::kSubBlockElems / 16;  // bsums cover 16 codes each
    std::vector<float>& sums = SubBlockSums();
    sums.resize(static_cast<size_t>(a.n_tokens) * n_blocks * kSubBlocks);
    for (int t = 0; t < a.n_tokens; ++t) {
      const BlockQ8_K* x = Q8KTokenBlocks(a, t);
      for (int64_t b = 0; b < n_blocks; ++b) {
        for (int j = 0; j < kSubBlocks; ++j) {
          int32_t sum = 0;
          for (int i = 0; i < kSumsPerSubBlock; ++i) sum += x[b].bsums[kSumsPerSubBlock * j + i];
          sums[(t * n_blocks + b) * kSubBlocks + j] = static_cast<float>(sum);
        }
      }
    }
  }

  static void PackGroup(const TileArgs& a, int row, int n_valid, int group, int64_t n_blocks, uint8_t* panel) {
    const Block* src[kPanelGroupRows];
    for (int j = 0; j < kPanelGroupRows; ++j) src[j] = WeightBlocks<Block>(a, row + (j < n_valid ? j : 0));
    for (int64_t b = 0; b < n_blocks; ++b) {
      C::PackSuperBlock(src, n_valid, b, group, panel + b * kBlockBytes);
      if (b + 2 < n_blocks) {  // the rows' next super-blocks, ahead of this walk
        for (int j = 0; j < n_valid; ++j) {
          for (size_t off = 0; off < sizeof(Block); off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(&src[j][b + 2]) + off, _MM_HINT_T0);
          }
        }
      }
    }
  }

  template <int G, int T>
  static void Sums(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, PanelPrefetch& prefetch,
                   __m512 (&acc)[G][T]) {
    const float* sums = SubBlockSums().data();
    const BlockQ8_K* x[T];
    for (int t = 0; t < T; ++t) {
      x[t] = Q8KTokenBlocks(a, t0 + t);
      for (int g = 0; g < G; ++g) acc[g][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < n_blocks; ++b) {
      prefetch.Step();
      const uint8_t* block = panel + b * kBlockBytes;
      __m512 sb[G][T];  // the super-block's sum before d_x
      for (int j = 0; j < kSubBlocks; ++j) {
        const int8_t* xj[T];
        __m512i dot[G][T];
        for (int t = 0; t < T; ++t) {
          xj[t] = x[t][b].qs + XOffset(j);
          for (int g = 0; g < G; ++g) dot[g][t] = _mm512_setzero_si512();
        }
        PanelBlockDots<G, T, kQuads>(SubBlockCodes(block, j, 0), kSubBlockCodeBytes, xj, dot, XHi());
        for (int g = 0; g < G; ++g) {
          const __m512 ws = _mm512_load_ps(Scales(block, j, g));
          for (int t = 0; t < T; ++t) {
            sb[g][t] = j == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot[g][t]), ws)
                              : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][t]), ws, sb[g][t]);
          }
        }
      }
      for (int j = 0; j < kSubBlocks; ++j) {
        for (int g = 0; g < G; ++g) {
          const __m512 wm = _mm512_load_ps(Mins(block, j, g));
          for (int t = 0; t < T; ++t) {
            sb[g][t] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(sums[((t0 + t) * n_blocks + b) * kSubBlocks + j]), sb[g][t]);
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512 dx = _mm512_set1_ps(x[t][b].d);
        for (int g = 0; g < G; ++g) acc[g][t] = _mm512_fmadd_ps(sb[g][t], dx, acc[g][t]);
      }
    }
  }
};

// P supplies:
//   kBlockElems, kGroupBlockBytes     weight block size; packed bytes per block and group
//   PrepareTokens(a, n_blocks)        per-call token data (gathered once per token block)
//   PackGroup(a, row, n_valid, group, n_blocks, panel)
//                                     rows row .. row + n_valid - 1 as group `group` of the panel
//                                     (block b at panel + b * kPanelGroups * kGroupBlockBytes)
//   Sums<G, T>(a, panel, n_blocks, t0, prefetch, acc)
//                                     acc[g][t] = sum over the blocks for tokens t0 + t, calling
//                                     prefetch.Step() once per block
template <class P, int G, int T>
void PanelTokens(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, int r0, int n_rows,
                 PanelPrefetch& prefetch) {
  __m512 acc[G][T];
  P::template Sums<G, T>(a, panel, n_blocks, t0, prefetch, acc);
  const __m512i natural = _mm512_setr_epi32(PanelRow(0), PanelRow(1), PanelRow(2), PanelRow(3), PanelRow(4),
                                            PanelRow(5), PanelRow(6), PanelRow(7), PanelRow(8), PanelRow(9),
                                            PanelRow(10), PanelRow(11), PanelRow(12), PanelRow(13), PanelRow(14),
                                            PanelRow(15));
  for (int g = 0; g < G; ++g) {
    const int rows_here = std::min(kPanelGroupRows, n_rows - g * kPanelGroupRows);
    const __mmask16 mask = static_cast<__mmask16>((1u << rows_here) - 1);
    for (int t = 0; t < T; ++t) {
      _mm512_mask_storeu_ps(a.y + (t0 + t) * a.y_stride + r0 + g * kPanelGroupRows, mask,
                            _mm512_permutexvar_ps(natural, acc[g][t]));
    }
  }
}

template <class P, int G>
void DispatchPanelTokens(const TileArgs& a, const uint8_t* panel, int64_t n_blocks, int t0, int n_tokens, int r0,
                         int n_rows, PanelPrefetch& prefetch) {
  switch (n_tokens) {
    case 1: return PanelTokens<P, G, 1>(a, panel, n_blocks, t0, r0, n_rows, prefetch);
    case 2: return PanelTokens<P, G, 2>(a, panel, n_blocks, t0, r0, n_rows, prefetch);
    case 3: return PanelTokens<P, G, 3>(a, panel, n_blocks, t0, r0, n_rows, prefetch);
    default: return PanelTokens<P, G, 4>(a, panel, n_blocks, t0, r0, n_rows, prefetch);
  }
}

// Bytes of one panel (kPanelRows rows, the last one possibly ragged) over n_blocks blocks.
template <class P>
constexpr size_t PanelBytes(int64_t n_blocks) {
  return static_cast<size_t>(n_blocks) * kPanelGroups * P::kGroupBlockBytes;
}

// Kernel::panel of weight type P (kKept false): every row of `a` (any count) times every token
// (any count), packing each panel into per-thread scratch first. Kernel::packed_panels (kKept
// true): the same with the panels packed once (PackPanels), a.w at the first row's panel.
template <class P, bool kKept = false>
void RunPanels(const TileArgs& a) {
  const int64_t n_blocks = a.cols / P::kBlockElems;
  const size_t panel_bytes = PanelBytes<P>(n_blocks);
  P::PrepareTokens(a, n_blocks);
  static thread_local hwy::AlignedFreeUniquePtr<uint8_t[]> scratch;
  static thread_local int64_t scratch_blocks = 0;
  if (!kKept && n_blocks > scratch_blocks) {
    scratch = hwy::AllocateAligned<uint8_t>(panel_bytes);
    KVS_CHECK(scratch != nullptr && reinterpret_cast<uintptr_t>(scratch.get()) % 64 == 0);
    scratch_blocks = n_blocks;
  }
  if constexpr (kKept) KVS_CHECK(reinterpret_cast<uintptr_t>(a.w) % 64 == 0);
  for (int r0 = 0; r0 < a.n_rows; r0 += kPanelRows) {
    const int n_rows = std::min(kPanelRows, a.n_rows - r0);
    const int groups = (n_rows + kPanelGroupRows - 1) / kPanelGroupRows;
    const uint8_t* panel = scratch.get();
    if constexpr (kKept) {
      panel = a.w + static_cast<size_t>(r0 / kPanelRows) * panel_bytes;
    } else {
      for (int g = 0; g < groups; ++g) {
        P::PackGroup(a, r0 + g * kPanelGroupRows, std::min(kPanelGroupRows, n_rows - g * kPanelGroupRows), g,
                     n_blocks, scratch.get());
      }
    }
    // The next panel (its weight rows, contiguous after this one's, or its kept bytes) is
    // prefetched over this one's blocks.
    PanelPrefetch prefetch;
    const int next_rows = std::min(kPanelRows, a.n_rows - r0 - n_rows);
    const int token_groups = (a.n_tokens + kPanelTokens - 1) / kPanelTokens;
    if (next_rows > 0) {
      prefetch.next = kKept ? reinterpret_cast<const char*>(panel + panel_bytes)
                            : reinterpret_cast<const char*>(a.w + (r0 + n_rows) * a.w_row_bytes);
      prefetch.end = prefetch.next + (kKept ? panel_bytes : next_rows * a.w_row_bytes);
      const int64_t lines = (prefetch.end - prefetch.next + 63) / 64;
      prefetch.per_step = static_cast<int>((lines + token_groups * n_blocks - 1) / (token_groups * n_blocks));
    }
    for (int t0 = 0; t0 < a.n_tokens; t0 += kPanelTokens) {
      const int n_tokens = std::min(kPanelTokens, a.n_tokens - t0);
      static_assert(kPanelGroups == 2);
      if (groups == 2) {
        DispatchPanelTokens<P, 2>(a, panel, n_blocks, t0, n_tokens, r0, n_rows, prefetch);
      } else {
        DispatchPanelTokens<P, 1>(a, panel, n_blocks, t0, n_tokens, r0, n_rows, prefetch);
      }
    }
  }
}

// Kernel::pack_panels of weight type P: rows [0, n_rows) at w (GGUF layout) into dst, one panel
// after another (PanelBytes each; a ragged last panel's missing group is zeros).
template <class P>
void PackPanels(const uint8_t* w, size_t w_row_bytes, int64_t n_rows, int64_t cols, uint8_t* dst) {
  KVS_CHECK(reinterpret_cast<uintptr_t>(dst) % 64 == 0);
  TileArgs a{};
  a.w = w;
  a.w_row_bytes = w_row_bytes;
  a.cols = cols;
  const int64_t n_blocks = cols / P::kBlockElems;
  const size_t panel_bytes = PanelBytes<P>(n_blocks);
  for (int64_t r0 = 0; r0 < n_rows; r0 += kPanelRows) {
    uint8_t* panel = dst + static_cast<size_t>(r0 / kPanelRows) * panel_bytes;
    const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n_rows - r0));
    if (rows < kPanelRows) std::memset(panel, 0, panel_bytes);
    a.w = w + r0 * w_row_bytes;  // (PackGroup's rows are relative to a.w: row counts stay int)
    for (int g = 0; g * kPanelGroupRows < rows; ++g) {
      P::PackGroup(a, g * kPanelGroupRows, std::min(kPanelGroupRows, rows - g * kPanelGroupRows), g, n_blocks, panel);
    }
  }
}

// `kernel` with its many-token path: RunPanels over P.
template <class P>
constexpr Kernel WithPanels(Kernel kernel) {
  kernel.panel = &RunPanels<P>;
  return kernel;
}

// The Kernel fields of a type whose panels are kept (packed once, at load).
template <class P>
constexpr void KeepPanels(Kernel& kernel) {
  kernel.panel_bytes = [](int64_t n_rows, int64_t cols) {
    return static_cast<size_t>((n_rows + kPanelRows - 1) / kPanelRows) * PanelBytes<P>(cols / P::kBlockElems);
  };
  kernel.pack_panels = &PackPanels<P>;
  kernel.packed_panels = &RunPanels<P, true>;
  kernel.panel_rows = kPanelRows;
}
#endif  // KVS_ISA_AVX512

}  // namespace kvsparse::matmul::HWY_NAMESPACE

#endif  // KVS_OPS_MATMUL_PANEL_INL_H_ toggle
