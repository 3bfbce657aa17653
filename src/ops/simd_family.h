// How a kernel file is compiled once per family (include/kvsparse/isa.h) with Highway's
// foreach_target mechanism, and how its entry points dispatch:
//
//   #include <std headers and project headers>   // all of them, before the first family region
//   #undef HWY_TARGET_INCLUDE
//   #define HWY_TARGET_INCLUDE "ops/foo.cc"        // this file, re-included once per family
//   #include <hwy/foreach_target.h>
//   #include <hwy/highway.h>
//   #include "ops/simd_family.h"
//   #include "ops/family_begin-inl.h"              // target pragmas of the current family
//   namespace kvsparse::ops::HWY_NAMESPACE { ... #if KVS_ISA_AVX512 ... #elif KVS_ISA_AVX2 ... }
//   #include "ops/family_end-inl.h"
//   #if HWY_ONCE
//   namespace kvsparse::ops { HWY_EXPORT(FooImpl); void Foo(...) { KVS_DISPATCH(FooImpl)(...); } }
//   #endif
//
// Family code is compiled under `#pragma GCC target` (never -m flags), and headers are included
// before the first region, so std:: templates and shared inline functions keep the baseline
// target: nothing outside a family's namespace can hold instructions a CPU might lack.
// GCC does not define __AVX2__ etc. inside such regions: family code tests KVS_ISA_* instead.
#pragma once

#include <atomic>

#include <hwy/highway.h>

// Which family the current foreach_target pass compiles (expanded lazily, so they follow
// HWY_TARGET through every pass). Highway's AVX3 target plus VNNI is the avx512 family;
// AVX3_DL and the SSE targets are disabled in CMakeLists.txt.
#define KVS_ISA_AVX512 (HWY_TARGET == HWY_AVX3)
#define KVS_ISA_AVX2 (HWY_TARGET == HWY_AVX2)
#define KVS_ISA_SCALAR (HWY_TARGET != HWY_AVX3 && HWY_TARGET != HWY_AVX2)

namespace kvsparse::isa_internal {

extern std::atomic<bool> g_initialized;
// Chooses the default family (or KVSPARSE_ISA's) once; see isa.h.
void Initialize();
inline void EnsureInitialized() {
  if (!g_initialized.load(std::memory_order_acquire)) Initialize();
}

}  // namespace kvsparse::isa_internal

// The active family's version of FUNC (exported with HWY_EXPORT), e.g. KVS_DISPATCH(DotImpl)(a, b, n).
// FUNC may be qualified (quant::FooImpl). With a single family (KVS_NATIVE=ON) Highway's
// HWY_DYNAMIC_DISPATCH would prefix it with the target namespace; its one-entry table is used instead.
#if (HWY_TARGETS & (HWY_TARGETS - 1)) == 0
#define KVS_DISPATCH(FUNC) (::kvsparse::isa_internal::EnsureInitialized(), *(HWY_DISPATCH_TABLE(FUNC)[0]))
#else
#define KVS_DISPATCH(FUNC) (::kvsparse::isa_internal::EnsureInitialized(), HWY_DYNAMIC_DISPATCH(FUNC))
#endif
