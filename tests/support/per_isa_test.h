// Runs a test once per kernel family this binary holds (include/kvsparse/isa.h), so the scalar,
// AVX2 and AVX-512 kernels are all checked on every host that can run them:
//
//   class MatMulTest : public testing::PerIsaTest {};
//   TEST_P(MatMulTest, MatchesScalarTwin) { ... }
//   KVS_INSTANTIATE_PER_ISA(MatMulTest);
//
// Fixtures with parameters of their own hold an IsaGuard and call KVS_SET_ISA_OR_SKIP(isa) in
// SetUp. A family the CPU cannot run is skipped with a message naming the CPU's features.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvsparse/isa.h"

// Makes `isa` the active kernel family, or skips the test when this CPU cannot run it.
#define KVS_SET_ISA_OR_SKIP(isa)                                                                        \
  do {                                                                                                  \
    if (!::kvsparse::CpuSupportsIsa(isa)) {                                                             \
      GTEST_SKIP() << "this CPU cannot run the " << ::kvsparse::IsaName(isa)                            \
                   << " kernels (it has: " << ::kvsparse::CpuFeatureList() << ")";                     \
    }                                                                                                   \
    const ::kvsparse::Status kvs_isa_status_ = ::kvsparse::SetIsa(isa);                                 \
    ASSERT_TRUE(kvs_isa_status_.ok()) << kvs_isa_status_.ToString();                                    \
    ASSERT_EQ(::kvsparse::ActiveIsa(), isa);                                                            \
  } while (0)

namespace kvsparse::testing {

// Restores the kernel family that was active when it was made.
class IsaGuard {
 public:
  IsaGuard() : previous_(ActiveIsa()) {}
  IsaGuard(const IsaGuard&) = delete;
  IsaGuard& operator=(const IsaGuard&) = delete;
  ~IsaGuard() { EXPECT_TRUE(SetIsa(previous_).ok()); }

 private:
  Isa previous_;
};

class PerIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override { KVS_SET_ISA_OR_SKIP(GetParam()); }

 private:
  IsaGuard guard_;
};

inline std::string IsaParamName(const ::testing::TestParamInfo<Isa>& info) { return IsaName(info.param); }

// Families for whole-model tests: every compiled one, but under the sanitizers (10x slower) only
// the best this CPU runs; the kernels' twins are checked family by family in the ops tests there.
inline std::vector<Isa> EndToEndFamilies() {
#ifdef KVS_SANITIZED
  return {SupportedIsas().back()};
#else
  return CompiledIsas();
#endif
}

}  // namespace kvsparse::testing

#define KVS_INSTANTIATE_PER_ISA(Suite)                                                  \
  INSTANTIATE_TEST_SUITE_P(Isa, Suite, ::testing::ValuesIn(::kvsparse::CompiledIsas()), \
                           ::kvsparse::testing::IsaParamName)
