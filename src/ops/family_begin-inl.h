// Opens a family region (see simd_family.h). No include guard: included once per foreach_target pass.
HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3
// The avx512 family also uses VNNI (vpdpbusd), which Highway's AVX3 target does not enable.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#if HWY_TARGET == HWY_STATIC_TARGET && defined(__AVX512F__) && !defined(__AVX512VNNI__)
#error "KVS_NATIVE=ON on a CPU with AVX-512 but without VNNI: build without it (the default dispatched build)"
#endif
#endif
