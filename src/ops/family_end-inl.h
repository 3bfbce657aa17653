// Closes a family region (see simd_family.h). No include guard: included once per foreach_target pass.
#if HWY_TARGET == HWY_AVX3 && defined(__clang__)
#pragma clang attribute pop
#else
#if HWY_TARGET == HWY_AVX3
#pragma GCC pop_options
#endif
HWY_AFTER_NAMESPACE();
#endif
