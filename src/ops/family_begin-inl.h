// Opens a family region (see simd_family.h). No include guard: included once per foreach_target pass.
#if HWY_TARGET == HWY_AVX3 && defined(__clang__)
// The avx512 family also uses VNNI (vpdpbusd), which Highway's AVX3 target does not enable. Clang
// applies one target attribute per function, so the region's attribute names AVX3's features and
// VNNI together (Highway's HWY_BEFORE_NAMESPACE would push AVX3's alone).
#pragma clang attribute push(__attribute__((target(HWY_TARGET_STR ",avx512vnni"))), apply_to = function)
#else
HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3
// The avx512 family also uses VNNI (vpdpbusd), which Highway's AVX3 target does not enable.
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
#endif
#if HWY_TARGET == HWY_AVX3 && HWY_TARGET == HWY_STATIC_TARGET && defined(__AVX512F__) && !defined(__AVX512VNNI__)
#error "KVS_NATIVE=ON on a CPU with AVX-512 but without VNNI: build without it (the default dispatched build)"
#endif
