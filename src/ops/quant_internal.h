// Internal helpers shared by the quantizers, dequantizers and quantized matmul kernels.
#pragma once

#include <cstdint>

#include "kvsparse/dtype.h"

// The reference quantizers round every product to f32 before adding (no fused multiply-add),
// so their bytes do not depend on compiler contraction settings or the target's FMA support.
// (Clang only contracts within one expression; the code keeps products in separate statements.)
#if defined(__GNUC__) && !defined(__clang__)
#define KVS_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define KVS_NO_FP_CONTRACT
#endif

namespace kvsparse::quant {

// ggml's nearest_int (round half to even; |x| < 2^22).
int NearestInt(float x);

// Unpacks the 6-bit scale and min of sub-block j (0..7) from a Q4_K `scales` array.
void GetScaleMinK4(int j, const uint8_t* scales, uint8_t* scale, uint8_t* min);
// Packs 8 six-bit scales and mins into the 12-byte layout GetScaleMinK4 reads; `scales` must be zeroed.
void PackScaleMinK4(const uint8_t* scale, const uint8_t* min, uint8_t* scales);

// Scalar reference (de)quantizers; n is a multiple of the block size.
void QuantizeRowQ8_0Ref(const float* x, BlockQ8_0* y, int64_t n);
void QuantizeRowQ4_0Ref(const float* x, BlockQ4_0* y, int64_t n);
void QuantizeRowQ8_KRef(const float* x, BlockQ8_K* y, int64_t n);
void QuantizeRowQ4_KRef(const float* x, BlockQ4_K* y, int64_t n);
void DequantizeRowQ8_0Ref(const BlockQ8_0* x, float* y, int64_t n);
void DequantizeRowQ4_0Ref(const BlockQ4_0* x, float* y, int64_t n);
void DequantizeRowQ4_KRef(const BlockQ4_K* x, float* y, int64_t n);
void DequantizeRowQ8_KRef(const BlockQ8_K* x, float* y, int64_t n);
// quantize_ref_legacy.cc
void QuantizeRowQ4_1Ref(const float* x, BlockQ4_1* y, int64_t n);
void QuantizeRowQ5_0Ref(const float* x, BlockQ5_0* y, int64_t n);
void QuantizeRowQ5_1Ref(const float* x, BlockQ5_1* y, int64_t n);
void DequantizeRowQ4_1Ref(const BlockQ4_1* x, float* y, int64_t n);
void DequantizeRowQ5_0Ref(const BlockQ5_0* x, float* y, int64_t n);
void DequantizeRowQ5_1Ref(const BlockQ5_1* x, float* y, int64_t n);
// quantize_ref_kquants.cc
void QuantizeRowQ2_KRef(const float* x, BlockQ2_K* y, int64_t n);
void QuantizeRowQ3_KRef(const float* x, BlockQ3_K* y, int64_t n);
void QuantizeRowQ5_KRef(const float* x, BlockQ5_K* y, int64_t n);
void QuantizeRowQ6_KRef(const float* x, BlockQ6_K* y, int64_t n);
void QuantizeRowIQ4_NLRef(const float* x, BlockIQ4_NL* y, int64_t n);
void QuantizeRowMXFP4Ref(const float* x, BlockMXFP4* y, int64_t n);
void QuantizeRowIQ4_XSRef(const float* x, BlockIQ4_XS* y, int64_t n);
void DequantizeRowQ2_KRef(const BlockQ2_K* x, float* y, int64_t n);
void DequantizeRowQ3_KRef(const BlockQ3_K* x, float* y, int64_t n);
void DequantizeRowQ5_KRef(const BlockQ5_K* x, float* y, int64_t n);
void DequantizeRowQ6_KRef(const BlockQ6_K* x, float* y, int64_t n);
void DequantizeRowIQ4_NLRef(const BlockIQ4_NL* x, float* y, int64_t n);
void DequantizeRowMXFP4Ref(const BlockMXFP4* x, float* y, int64_t n);
void DequantizeRowIQ4_XSRef(const BlockIQ4_XS* x, float* y, int64_t n);

}  // namespace kvsparse::quant

// The fast quantizers of each kernel family are declared in quantize-inl.h.
