// Kernel families: the SIMD code paths this binary holds, one of which runs.
//
// Every fast kernel (matmul per weight type, quantization, attention, attention scores, KV
// quantization, vector ops) is compiled once per family, each for its own target, and the best
// family the CPU can run is chosen once, at the first kernel call:
//   scalar  plain C++ (the x86-64 baseline; also what other CPUs get)
//   avx2    AVX2 + FMA + F16C (+ BMI2): Haswell / Zen 1 and later
//   avx512  AVX-512 F/BW/DQ/VL + VNNI: Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 and later
// KVSPARSE_ISA=scalar|avx2|avx512 in the environment, SetIsa() or the CLI's --isa lower (or
// restore) the choice. Changing the family while kernels run on other threads is not allowed:
// choose at start-up (tests switch between kernel calls).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvsparse/status.h"

namespace kvsparse {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512".
const char* IsaName(Isa isa);
// Parses a family name (as IsaName writes it); the error lists the valid names.
StatusOr<Isa> ParseIsa(std::string_view name);

// Families compiled into this binary, ascending (a -DKVS_NATIVE=ON build holds one).
std::vector<Isa> CompiledIsas();
// Whether this CPU can run `isa`'s kernels.
bool CpuSupportsIsa(Isa isa);
// Families compiled in and runnable here, ascending; the last one is the default.
std::vector<Isa> SupportedIsas();
// The family the kernels run now.
Isa ActiveIsa();
// The SIMD features of this CPU that the families use, e.g. "sse4.2 avx2 fma f16c avx512f ...".
std::string CpuFeatureList();
// One line for logs and reports: "avx512 (compiled: scalar, avx2, avx512; CPU: sse4.2 avx2 ...)".
std::string IsaSummary();

// Optional instructions inside a family: the avx512 family computes bf16 KV's q.k with
// AVX512_BF16 dot products (vdpbf16ps: Cooper Lake, Sapphire Rapids, Zen 4 and later) where the
// CPU has them. KVSPARSE_BF16_DOTS=0 in the environment or SetBf16Dots(false) keep bf16 KV on the
// f32 path (tests compare the two; a benchmark measures both).
bool CpuHasBf16Dots();
// Whether the avx512 family's kernels use bf16 dot products now (the CPU has them, not turned off).
bool Bf16DotsEnabled();
// Turns them on (only where the CPU has them) or off; like SetIsa, between kernel calls.
void SetBf16Dots(bool enabled);

// Makes `isa` the active family. InvalidArgument (naming what the CPU has and which families
// can run) when it is not compiled in or the CPU lacks it; the active family is then unchanged.
Status SetIsa(Isa isa);
// Applies KVSPARSE_ISA if it is set (Ok and no change when it is not). The kernels apply it by
// themselves at their first call, falling back to the default with a warning when it is bad;
// front ends call this first to turn a bad value into a clear error instead.
Status SetIsaFromEnvironment();

}  // namespace kvsparse
