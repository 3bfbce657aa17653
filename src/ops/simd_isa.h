// Compile-time choice of the integer/float kernel family. Exactly one KVS_ISA_* is 1.
// The build uses -march=native by default, so this follows the build machine's CPU.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__FMA__) && defined(__F16C__)
#define KVS_ISA_AVX512VNNI 1
#define KVS_ISA_AVX2 0
#define KVS_ISA_SCALAR 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_ISA_AVX512VNNI 0
#define KVS_ISA_AVX2 1
#define KVS_ISA_SCALAR 0
#else
#define KVS_ISA_AVX512VNNI 0
#define KVS_ISA_AVX2 0
#define KVS_ISA_SCALAR 1
#endif

#if !KVS_ISA_SCALAR
// GCC 12 flags the deliberately undefined upper halves inside cast/insert intrinsics.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace kvsparse::simd {

// int32 lanes per integer vector (and f32 lanes per float vector) of the chosen family.
#if KVS_ISA_AVX512VNNI
inline constexpr int kLanes = 16;
#else
inline constexpr int kLanes = 8;
#endif

// 256-bit u8 x s8 dot-accumulate (vpdpbusd) for the AVX2 family: the VEX form (AVX-VNNI) or
// the EVEX form (AVX512-VNNI + VL on CPUs whose 512-bit path is not selected).
#if KVS_ISA_AVX2 && defined(__AVXVNNI__)
#define KVS_DPBUSD256(acc, u8, s8) _mm256_dpbusd_avx_epi32((acc), (u8), (s8))
#elif KVS_ISA_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVS_DPBUSD256(acc, u8, s8) _mm256_dpbusd_epi32((acc), (u8), (s8))
#endif

// Whether u8 x s8 dot products run through VNNI (vpdpbusd), which needs one unsigned operand.
#if KVS_ISA_AVX512VNNI || defined(KVS_DPBUSD256)
inline constexpr bool kHasVnni = true;
#else
inline constexpr bool kHasVnni = false;
#endif

}  // namespace kvsparse::simd
