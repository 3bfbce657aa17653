// Kernel family selection (include/kvsparse/isa.h) on top of Highway's dynamic dispatch: the
// active family is the best target Highway may choose after DisableTargets() removed the ones
// above it; a probe compiled per family reports which one really runs.
#include "kvsparse/isa.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <string>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/isa.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "ops/simd_family.h"

#include "ops/family_begin-inl.h"
namespace kvsparse::isa_internal::HWY_NAMESPACE {
int64_t CompiledTarget() { return HWY_TARGET; }
}  // namespace kvsparse::isa_internal::HWY_NAMESPACE
#include "ops/family_end-inl.h"

#if HWY_ONCE
namespace kvsparse {
namespace isa_internal {

HWY_EXPORT(CompiledTarget);

std::atomic<bool> g_initialized{false};

namespace {

// Highway target of each family in this binary.
int64_t TargetOf(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return HWY_AVX3;
    case Isa::kAvx2: return HWY_AVX2;
    case Isa::kScalar: break;
  }
  return HWY_STATIC_TARGET == HWY_EMU128 ? HWY_EMU128 : HWY_SCALAR;
}

Isa IsaOfTarget(int64_t target) {
  if (target == HWY_AVX3) return Isa::kAvx512;
  if (target == HWY_AVX2) return Isa::kAvx2;
  return Isa::kScalar;
}

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

// Targets the CPU supports, read once before any DisableTargets (which changes the answer).
int64_t CpuTargets() {
  static const int64_t targets = hwy::SupportedTargets();
  return targets;
}

std::atomic<bool> g_bf16_dots{false};  // set by Initialize, SetBf16Dots

bool CpuHasVnni() {
#if HWY_ARCH_X86
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Highway's view of the CPU is taken (CpuTargets) before the first family is applied.
void Apply(Isa isa) {
  const int64_t target = TargetOf(isa);
  // Every target better (a lower bit) than the chosen one, and AVX3 without VNNI.
  int64_t disabled = target - 1;
  if (!CpuHasVnni()) disabled |= HWY_AVX3;
  hwy::DisableTargets(disabled);
}

std::mutex& Mutex() {
  static std::mutex mutex;
  return mutex;
}

Isa BestSupported() {
  Isa best = Isa::kScalar;
  for (Isa isa : kAllIsas)
    if (CpuSupportsIsa(isa)) best = isa;
  return best;
}

}  // namespace

std::string NamesOf(const std::vector<Isa>& isas) {
  std::string names;
  for (Isa isa : isas) names += std::string(names.empty() ? "" : ", ") + IsaName(isa);
  return names;
}

void Initialize() {
  std::lock_guard<std::mutex> lock(Mutex());
  if (g_initialized.load(std::memory_order_relaxed)) return;
  CpuTargets();
  Isa isa = BestSupported();
  if (const char* env = std::getenv("KVSPARSE_ISA"); env != nullptr && *env != '\0') {
    StatusOr<Isa> wanted = ParseIsa(env);
    if (wanted.ok() && CpuSupportsIsa(*wanted)) {
      isa = *wanted;
    } else {
      std::fprintf(stderr, "kvsparse: ignoring KVSPARSE_ISA=%s (runnable here: %s); using %s\n", env,
                   NamesOf(SupportedIsas()).c_str(), IsaName(isa));
    }
  }
  Apply(isa);
  const char* bf16_env = std::getenv("KVSPARSE_BF16_DOTS");
  g_bf16_dots.store(CpuHasBf16Dots() && !(bf16_env != nullptr && std::string_view(bf16_env) == "0"),
                    std::memory_order_relaxed);
  g_initialized.store(true, std::memory_order_release);
}

}  // namespace isa_internal

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

StatusOr<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : isa_internal::kAllIsas)
    if (name == IsaName(isa)) return isa;
  return InvalidArgumentError("unknown kernel family '" + std::string(name) + "': expected scalar, avx2 or avx512");
}

std::vector<Isa> CompiledIsas() {
  std::vector<Isa> isas;
  for (Isa isa : isa_internal::kAllIsas)
    if ((HWY_TARGETS & isa_internal::TargetOf(isa)) != 0) isas.push_back(isa);
  return isas;
}

bool CpuSupportsIsa(Isa isa) {
  if ((HWY_TARGETS & isa_internal::TargetOf(isa)) == 0) return false;
  if (isa == Isa::kScalar) return true;
  if ((isa_internal::CpuTargets() & isa_internal::TargetOf(isa)) == 0) return false;
  return isa != Isa::kAvx512 || isa_internal::CpuHasVnni();
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  for (Isa isa : CompiledIsas())
    if (CpuSupportsIsa(isa)) isas.push_back(isa);
  return isas;
}

Isa ActiveIsa() { return isa_internal::IsaOfTarget(KVS_DISPATCH(isa_internal::CompiledTarget)()); }

#if HWY_ARCH_X86
namespace {
enum CpuidRegister { kEax, kEbx, kEcx, kEdx };
bool CpuidBit(unsigned leaf, unsigned subleaf, CpuidRegister reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3]) == 0) return false;
  return (r[reg] >> bit) & 1u;
}
}  // namespace
#endif

std::string CpuFeatureList() {
  std::string list;
#if HWY_ARCH_X86
  __builtin_cpu_init();
  auto add = [&list](bool has, const char* name) {
    if (has) list += std::string(list.empty() ? "" : " ") + name;
  };
  add(__builtin_cpu_supports("sse4.2"), "sse4.2");
  add(__builtin_cpu_supports("avx2"), "avx2");
  add(__builtin_cpu_supports("fma"), "fma");
  // f16c and avxvnni by CPUID: clang 14's __builtin_cpu_supports does not know them.
  add(CpuidBit(1, 0, kEcx, 29), "f16c");
  add(__builtin_cpu_supports("avx512f"), "avx512f");
  add(__builtin_cpu_supports("avx512bw"), "avx512bw");
  add(__builtin_cpu_supports("avx512dq"), "avx512dq");
  add(__builtin_cpu_supports("avx512vl"), "avx512vl");
  add(__builtin_cpu_supports("avx512vnni"), "avx512vnni");
  add(CpuidBit(7, 1, kEax, 4), "avxvnni");
  add(__builtin_cpu_supports("avx512bf16"), "avx512bf16");
#endif
  return list.empty() ? "no SIMD extensions used by kvsparse" : list;
}

std::string IsaSummary() {
  return std::string(IsaName(ActiveIsa())) + " (compiled: " + isa_internal::NamesOf(CompiledIsas()) +
         "; CPU: " + CpuFeatureList() + ")";
}

Status SetIsa(Isa isa) {
  isa_internal::EnsureInitialized();
  if (!CpuSupportsIsa(isa)) {
    const bool compiled = (HWY_TARGETS & isa_internal::TargetOf(isa)) != 0;
    return InvalidArgumentError(
        std::string("kernel family '") + IsaName(isa) + "' " +
        (compiled ? "needs CPU features this machine lacks" : "is not compiled into this build (KVS_NATIVE=ON builds one)") +
        "; this CPU has: " + CpuFeatureList() + "; families that run here: " +
        isa_internal::NamesOf(SupportedIsas()));
  }
  std::lock_guard<std::mutex> lock(isa_internal::Mutex());
  isa_internal::Apply(isa);
  return Status::Ok();
}

bool CpuHasBf16Dots() {
#if HWY_ARCH_X86
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool Bf16DotsEnabled() {
  isa_internal::EnsureInitialized();
  return isa_internal::g_bf16_dots.load(std::memory_order_relaxed);
}

void SetBf16Dots(bool enabled) {
  isa_internal::EnsureInitialized();
  isa_internal::g_bf16_dots.store(enabled && CpuHasBf16Dots(), std::memory_order_relaxed);
}

Status SetIsaFromEnvironment() {
  const char* env = std::getenv("KVSPARSE_ISA");
  if (env == nullptr || *env == '\0') return Status::Ok();
  StatusOr<Isa> isa = ParseIsa(env);
  if (!isa.ok()) return InvalidArgumentError("KVSPARSE_ISA: " + isa.status().message());
  Status status = SetIsa(*isa);
  if (!status.ok()) return InvalidArgumentError("KVSPARSE_ISA=" + std::string(env) + ": " + status.message());
  return Status::Ok();
}

}  // namespace kvsparse
#endif  // HWY_ONCE
