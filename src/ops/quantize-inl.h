// The fast activation quantizers of one kernel family (defined in quantize.cc), for the family's
// packing code: include it inside a family region (see simd_family.h), after dtype.h.
#if defined(KVS_OPS_QUANTIZE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVS_OPS_QUANTIZE_INL_H_
#undef KVS_OPS_QUANTIZE_INL_H_
#else
#define KVS_OPS_QUANTIZE_INL_H_
#endif

namespace kvsparse::quant::HWY_NAMESPACE {

// Quantizes one block of 32 floats exactly like QuantizeRowQ8_0Ref; writes q[32] and returns the
// f16 block scale.
f16_bits QuantizeBlockQ8_0(const float* x, int8_t* q);
// Quantizes n floats to Q8_K exactly like QuantizeRowQ8_KRef.
void QuantizeRowQ8_K(const float* x, BlockQ8_K* y, int64_t n);

}  // namespace kvsparse::quant::HWY_NAMESPACE

#endif  // KVS_OPS_QUANTIZE_INL_H_ toggle
