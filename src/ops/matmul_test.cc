// ops::MatMul (SIMD, threaded, quantized activations) against ref::MatMul, its scalar twin, on
// random non-zero inputs and ragged shapes, once per kernel family (include/kvsparse/isa.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvsparse/dtype.h"
#include "kvsparse/ops.h"
#include "ops/ops_test_util.h"
#include "support/per_isa_test.h"

namespace kvsparse {
namespace {

using testing::QuantizeMatrix;
using testing::RandomFloats;

// w packed into the active family's kept panels (ops::PackPanels), with the buffer that holds
// them; panels == nullptr where the family keeps none for w.type.
struct KeptPanels {
  std::unique_ptr<void, decltype(&std::free)> buffer{nullptr, &std::free};
  WeightView view;
  explicit KeptPanels(const WeightView& w, int threads) : view(w) {
    const size_t bytes = ops::PanelBytes(w);
    if (bytes == 0) return;
    buffer.reset(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    view = ops::PackPanels(w, buffer.get(), threads);
  }
};

// The activation type the fast path quantizes x to for a given weight type (nullopt: none).
std::optional<DType> ActivationType(DType weight) {
  switch (weight) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1:
    case DType::kIQ4_NL:
    case DType::kMXFP4: return DType::kQ8_0;
    case DType::kQ2_K:
    case DType::kQ3_K:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kIQ4_XS: return DType::kQ8_K;
    default: return std::nullopt;
  }
}

// x after the fast path's activation quantization (quantize + dequantize), [n_tokens, cols].
std::vector<float> RoundTripActivations(DType weight, const std::vector<float>& x, int64_t n_tokens, int64_t cols) {
  auto act = ActivationType(weight);
  if (!act) return x;
  std::vector<float> out(x.size());
  std::vector<uint8_t> buf(DTypeRowBytes(*act, cols));
  for (int64_t t = 0; t < n_tokens; ++t) {
    ref::QuantizeRow(*act, x.data() + t * cols, buf.data(), cols);
    ref::DequantizeRow(*act, buf.data(), out.data() + t * cols, cols);
  }
  return out;
}

struct Case {
  DType type;
  int64_t rows, cols, n_tokens;
  int threads;
  bool random_bits = false;  // weights: random block bits (RandomBitsMatrix), not quantized floats
};

std::string Describe(const Case& c) {
  return std::string(DTypeName(c.type)) + " rows=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols) +
         " n_tokens=" + std::to_string(c.n_tokens) + " threads=" + std::to_string(c.threads) +
         (c.random_bits ? " random bits" : "");
}

void CheckOutputs(const Case& c, const std::vector<uint8_t>& w_data, const std::vector<float>& x,
                  const std::vector<float>& x_rt, const std::vector<float>& y, const std::vector<float>& y_exact,
                  const std::vector<float>& y_raw);

// Checks ops::MatMul against two references:
//  1. ref::MatMul on the quantize-dequantized activations: only f32 rounding may differ
//     (the integer dot products are exact), so the tolerance is 2e-5 of sum |w x|.
//  2. ref::MatMul on the raw activations: the difference is bounded by the activation
//     quantization error, sum_c |w_c| * max_err(x_c).
void CheckCase(const Case& c, uint32_t seed) {
  SCOPED_TRACE(Describe(c));
  const std::vector<uint8_t> w_data =
      c.random_bits ? testing::RandomBitsMatrix(c.type, c.rows, c.cols, seed)
                    : QuantizeMatrix(c.type, RandomFloats(c.rows * c.cols, seed, 0.5f), c.rows, c.cols);
  const WeightView w{c.type, w_data.data(), c.rows, c.cols};
  const std::vector<float> x = RandomFloats(c.n_tokens * c.cols, seed + 1, 2.f);
  const std::vector<float> x_rt = RoundTripActivations(c.type, x, c.n_tokens, c.cols);

  std::vector<float> y(c.n_tokens * c.rows, -1.f);  // [n_tokens, rows]
  ops::MatMul(w, x.data(), c.n_tokens, y.data(), c.threads);
  std::vector<float> y_exact(y.size()), y_raw(y.size());
  ref::MatMul(w, x_rt.data(), c.n_tokens, y_exact.data());
  ref::MatMul(w, x.data(), c.n_tokens, y_raw.data());
  CheckOutputs(c, w_data, x, x_rt, y, y_exact, y_raw);

  // Kept panels (where the family keeps them): the same bounds, and with 5+ tokens the very
  // bits of the per-call panels (same layout, same sums); 1..4 tokens read them instead of the
  // rows.
  const KeptPanels kept(w, c.threads);
  if (kept.view.panels == nullptr) return;
  SCOPED_TRACE("kept panels");
  std::vector<float> y_kept(y.size(), -1.f);
  ops::MatMul(kept.view, x.data(), c.n_tokens, y_kept.data(), c.threads);
  CheckOutputs(c, w_data, x, x_rt, y_kept, y_exact, y_raw);
  if (c.n_tokens > 4) EXPECT_EQ(y_kept, y);
}

void CheckOutputs(const Case& c, const std::vector<uint8_t>& w_data, const std::vector<float>& x,
                  const std::vector<float>& x_rt, const std::vector<float>& y, const std::vector<float>& y_exact,
                  const std::vector<float>& y_raw) {
  std::vector<float> w_deq(c.cols);
  const size_t row_bytes = DTypeRowBytes(c.type, c.cols);
  int failures = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    ref::DequantizeRow(c.type, w_data.data() + r * row_bytes, w_deq.data(), c.cols);
    for (int64_t t = 0; t < c.n_tokens && failures < 5; ++t) {
      double magnitude = 0.0, quant_bound = 0.0;
      for (int64_t col = 0; col < c.cols; ++col) {
        const double xv = x[t * c.cols + col];
        magnitude += std::fabs(w_deq[col] * xv);
        quant_bound += std::fabs(w_deq[col]) * std::fabs(x_rt[t * c.cols + col] - xv);
      }
      const float got = y[t * c.rows + r];
      const double tol_exact = 2e-5 * magnitude + 1e-6;
      if (std::fabs(got - y_exact[t * c.rows + r]) > tol_exact) {
        ++failures;
        ADD_FAILURE() << "row " << r << " token " << t << ": got " << got << " want " << y_exact[t * c.rows + r]
                      << " (tol " << tol_exact << ")";
      }
      const double tol_raw = quant_bound * 1.001 + tol_exact;
      if (std::fabs(got - y_raw[t * c.rows + r]) > tol_raw) {
        ++failures;
        ADD_FAILURE() << "row " << r << " token " << t << ": got " << got << " vs unquantized " << y_raw[t * c.rows + r]
                      << " (tol " << tol_raw << ")";
      }
    }
  }
}

// Every rows x cols x n_tokens combination; threads cycle through 1..3; weights alternate between
// quantized floats and random block bits (block types).
void RunShapes(DType type, const std::vector<int64_t>& rows_list, const std::vector<int64_t>& col_sizes,
               const std::vector<int64_t>& token_counts, uint32_t seed) {
  int threads = 1;
  for (int64_t rows : rows_list) {
    for (int64_t cols : col_sizes) {
      for (int64_t n_tokens : token_counts) {
        CheckCase({type, rows, cols, n_tokens, threads, DTypeBlockSize(type) > 1 && seed % 2 == 1}, seed++);
        threads = threads % 3 + 1;
      }
    }
  }
}

// Rows: one, a partial tile, several tiles plus a ragged one. Tokens: decode (1), the few-token
// strips (2..4), a ragged token tile (5) and many tiles (17, 64). Where the avx512 family has a
// panel kernel (Q8_0, Q3_K..Q6_K), 5+ tokens take it: 17 rows are a panel with a one-row second
// group, 33 a full panel and a one-row one, and 5 and 17 tokens end on a one-token group.
const std::vector<int64_t> kRows = {1, 3, 17, 33};
const std::vector<int64_t> kTokens = {1, 2, 3, 4, 5, 17, 64};

// Q8_0 / Q4_0 (32-element blocks): odd and even block counts. The avx512 kernels pair blocks
// (odd counts end on a padded half step), and their decode (n_tokens = 1) reads the full packed
// layout up to 8 KiB per token (2730 columns) and the compact one beyond: 2048 and 2080 (65
// blocks) take the full layout, 2816, 4096, 4128 (129 blocks) and 5632 the compact one.
void RunQ8ActivationShapes(DType type) {
  RunShapes(type, kRows, {32, 96, 288}, kTokens, 1000);
  RunShapes(type, {1, 3, 17}, {2048, 2080, 2816, 4096, 4128, 5632}, {1, 2, 5}, 2000);
}

class MatMulTest : public testing::PerIsaTest {};

TEST_P(MatMulTest, Q8_0MatchesReference) { RunQ8ActivationShapes(DType::kQ8_0); }
TEST_P(MatMulTest, Q4_0MatchesReference) { RunQ8ActivationShapes(DType::kQ4_0); }
TEST_P(MatMulTest, Q4_1MatchesReference) { RunQ8ActivationShapes(DType::kQ4_1); }
TEST_P(MatMulTest, Q5_0MatchesReference) { RunQ8ActivationShapes(DType::kQ5_0); }
TEST_P(MatMulTest, Q5_1MatchesReference) { RunQ8ActivationShapes(DType::kQ5_1); }
TEST_P(MatMulTest, IQ4_NLMatchesReference) { RunQ8ActivationShapes(DType::kIQ4_NL); }
TEST_P(MatMulTest, MXFP4MatchesReference) { RunQ8ActivationShapes(DType::kMXFP4); }

// 256-element super-blocks: 1, 3 and 11 (odd), 16 and 22 of them.
void RunSuperBlockShapes(DType type) {
  RunShapes(type, kRows, {256, 768}, kTokens, 3000);
  RunShapes(type, {1, 3, 17}, {2816, 4096, 5632}, {1, 2, 5}, 4000);
}
TEST_P(MatMulTest, Q2_KMatchesReference) { RunSuperBlockShapes(DType::kQ2_K); }
TEST_P(MatMulTest, Q3_KMatchesReference) { RunSuperBlockShapes(DType::kQ3_K); }
TEST_P(MatMulTest, Q4_KMatchesReference) { RunSuperBlockShapes(DType::kQ4_K); }
TEST_P(MatMulTest, Q5_KMatchesReference) { RunSuperBlockShapes(DType::kQ5_K); }
TEST_P(MatMulTest, Q6_KMatchesReference) { RunSuperBlockShapes(DType::kQ6_K); }
TEST_P(MatMulTest, IQ4_XSMatchesReference) { RunSuperBlockShapes(DType::kIQ4_XS); }
// Float weights: vector tails (1, 7, 33, 1000) and K chunks of 512 columns (1000, 1040).
const std::vector<int64_t> kFloatCols = {1, 7, 16, 33, 96, 288, 1000, 1040};
TEST_P(MatMulTest, F32MatchesReference) { RunShapes(DType::kF32, kRows, kFloatCols, kTokens, 5000); }
TEST_P(MatMulTest, F16MatchesReference) { RunShapes(DType::kF16, kRows, kFloatCols, kTokens, 6000); }
TEST_P(MatMulTest, BF16MatchesReference) { RunShapes(DType::kBF16, kRows, kFloatCols, kTokens, 7000); }

// Many row tiles per thread, a ragged row tail and more tokens than one L2 token block.
TEST_P(MatMulTest, LargeShapesCrossTokenBlocks) {
  uint32_t seed = 77;
  // (Every quantized type: on avx512 this is 2 threads x 2+ panels each, the last ragged.)
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1, DType::kIQ4_NL, DType::kQ2_K,
                     DType::kQ3_K, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kIQ4_XS, DType::kMXFP4, DType::kF16}) {
    CheckCase({type, 130, 2048, 200, 2}, seed++);
  }
}

// ScoreMatrix (the attention kernel's QK blocks) against its scalar twin: ragged row counts (odd:
// a single-row tail), key counts around the 16-key block and inner dimensions around its padding.
TEST_P(MatMulTest, ScoreMatrixMatchesReference) {
  uint32_t seed = 90;
  for (int64_t n_rows : {1, 2, 7, 65}) {
    for (int64_t n_keys : {1, 15, 16, 17, 300}) {
      for (int dim : {1, 5, 16, 64, 100, 512}) {
        const auto rows = testing::RandomFloats(n_rows * dim, seed++),
                   keys = testing::RandomFloats(n_keys * dim, seed++);
        std::vector<float> got(n_rows * n_keys, -1.f), want(n_rows * n_keys);
        ops::ScoreMatrix(rows.data(), n_rows, keys.data(), n_keys, dim, got.data(), 1 + static_cast<int>(seed % 3));
        ref::ScoreMatrix(rows.data(), n_rows, keys.data(), n_keys, dim, want.data());
        for (int64_t r = 0; r < n_rows; ++r) {
          for (int64_t t = 0; t < n_keys; ++t) {
            double magnitude = 0;
            for (int c = 0; c < dim; ++c) magnitude += std::fabs(rows[r * dim + c] * keys[t * dim + c]);
            // f32 sums of dim products: within dim units of rounding of the magnitude.
            ASSERT_NEAR(got[r * n_keys + t], want[r * n_keys + t], dim * 0x1p-24 * magnitude + 1e-7)
                << n_rows << "x" << n_keys << " dim " << dim << " at " << r << ", " << t;
          }
        }
      }
    }
  }
}

// ScoreMatrixInt8 (the sparse-prefill estimates' int8 products): within its stated bound of the
// exact products, and bit for bit the scalar family's (its twin) on the same inputs. Ragged row
// counts around the 4-row groups, keys around the 16-key block, dims around the 16-code padding.
TEST_P(MatMulTest, Int8ScoreMatrixMatchesTwinWithinBound) {
  if (!ops::Int8ScoresAvailable()) GTEST_SKIP() << IsaName(GetParam()) << " has no integer dots";
  uint32_t seed = 120;
  for (int64_t n_rows : {1, 3, 4, 7, 65}) {
    for (int64_t n_keys : {1, 15, 16, 17, 300}) {
      for (int dim : {1, 5, 16, 64, 100, 128}) {
        const auto rows = testing::RandomFloats(n_rows * dim, seed++);
        const auto keys = testing::RandomFloats(n_keys * dim, seed++);
        std::vector<float> got(n_rows * n_keys, -1.f), twin(n_rows * n_keys, -2.f), exact(n_rows * n_keys);
        ops::Int8Keys packed;
        ops::QuantizeKeysInt8(keys.data(), n_keys, dim, &packed, 1 + static_cast<int>(seed % 3));
        ops::ScoreMatrixInt8(rows.data(), n_rows, packed, got.data(), 1 + static_cast<int>(seed % 2));
        {
          testing::IsaGuard guard;
          ASSERT_TRUE(SetIsa(Isa::kScalar).ok());
          ops::Int8Keys scalar_keys;
          ops::QuantizeKeysInt8(keys.data(), n_keys, dim, &scalar_keys, 1);
          ops::ScoreMatrixInt8(rows.data(), n_rows, scalar_keys, twin.data(), 1);
        }
        ref::ScoreMatrix(rows.data(), n_rows, keys.data(), n_keys, dim, exact.data());
        ASSERT_EQ(got, twin) << n_rows << "x" << n_keys << " dim " << dim;
        for (int64_t r = 0; r < n_rows; ++r) {
          float r_max = 0.f;
          for (int c = 0; c < dim; ++c) r_max = std::max(r_max, std::fabs(rows[r * dim + c]));
          for (int64_t t = 0; t < n_keys; ++t) {
            float k_max = 0.f;
            double r_abs = 0, k_abs = 0;
            for (int c = 0; c < dim; ++c) {
              k_max = std::max(k_max, std::fabs(keys[t * dim + c]));
              r_abs += std::fabs(rows[r * dim + c]);
              k_abs += std::fabs(keys[t * dim + c]);
            }
            const double step_r = r_max / 127.0, step_k = k_max / 127.0;
            const double bound = r_abs * step_k / 2 + k_abs * step_r / 2 + dim * step_r * step_k / 4;
            ASSERT_NEAR(got[r * n_keys + t], exact[r * n_keys + t], bound * 1.001 + 1e-6)
                << n_rows << "x" << n_keys << " dim " << dim << " at " << r << ", " << t;
          }
        }
      }
    }
  }
}

TEST_P(MatMulTest, EmptyShapesDoNothing) {
  const std::vector<float> x(64, 1.f);
  std::vector<float> y(4, 7.f);
  ops::MatMul(WeightView{DType::kF32, x.data(), 0, 16}, x.data(), 1, y.data(), 2);
  ops::MatMul(WeightView{DType::kF32, x.data(), 4, 16}, x.data(), 0, y.data(), 2);
  EXPECT_EQ(y[0], 7.f);
}

// MatMulMany runs several products in one region: each job's output is MatMul's, bit for bit,
// with mixed types, ragged row counts, jobs sharing an input (packed once) and kept panels.
TEST_P(MatMulTest, ManyProductsEqualSeparateOnes) {
  const int64_t cols = 512;
  const DType types[] = {DType::kQ4_K, DType::kQ8_0, DType::kQ5_0, DType::kQ6_K, DType::kF16, DType::kF32};
  const int64_t row_counts[] = {67, 5, 256, 1, 130, 33};
  for (int64_t n_tokens : {1, 3, 9}) {
    for (int threads : {1, 2, 3}) {
      std::vector<std::vector<uint8_t>> data;
      std::vector<std::unique_ptr<KeptPanels>> kept;
      std::vector<WeightView> views;
      std::vector<std::vector<float>> inputs = {RandomFloats(n_tokens * cols, 11), RandomFloats(n_tokens * cols, 12)};
      for (size_t j = 0; j < std::size(types); ++j) {
        data.push_back(QuantizeMatrix(types[j], RandomFloats(row_counts[j] * cols, 20 + static_cast<uint32_t>(j)),
                                      row_counts[j], cols));
        views.push_back(WeightView{types[j], data.back().data(), row_counts[j], cols});
      }
      kept.push_back(std::make_unique<KeptPanels>(views[1], threads));  // Q8_0's kept panels, where kept
      views.push_back(kept.back()->view);
      std::vector<ops::MatMulJob> jobs;
      std::vector<std::vector<float>> outputs(views.size()), separate(views.size());
      for (size_t j = 0; j < views.size(); ++j) {
        const float* x = inputs[j % 2 == 0 || j == 3 ? 0 : 1].data();  // jobs 0, 2, 3, 4, 6 share input 0
        outputs[j].assign(static_cast<size_t>(n_tokens * views[j].rows), -1.f);
        separate[j].assign(outputs[j].size(), -2.f);
        jobs.push_back(ops::MatMulJob{&views[j], x, n_tokens, outputs[j].data()});
        ops::MatMul(views[j], x, n_tokens, separate[j].data(), threads);
      }
      ops::MatMulMany(jobs, threads);
      for (size_t j = 0; j < views.size(); ++j) {
        EXPECT_EQ(outputs[j], separate[j]) << "job " << j << " (" << DTypeName(views[j].type) << ", "
                                           << views[j].rows << " rows) n_tokens " << n_tokens << " threads "
                                           << threads;
      }
    }
  }
}

TEST_P(MatMulTest, ResultDoesNotDependOnThreadCount) {
  const int64_t rows = 67, cols = 512;
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kF16, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1,
                     DType::kQ2_K, DType::kQ3_K, DType::kQ5_K, DType::kQ6_K, DType::kIQ4_NL, DType::kIQ4_XS,
                     DType::kMXFP4}) {
    for (int64_t n_tokens : {1, 3, 9}) {
      const std::vector<float> w_f32 = RandomFloats(rows * cols, 5);
      const std::vector<uint8_t> w_data = QuantizeMatrix(type, w_f32, rows, cols);
      const std::vector<float> x = RandomFloats(n_tokens * cols, 6);
      std::vector<float> y1(rows * n_tokens), y2(rows * n_tokens), y3(rows * n_tokens);
      const WeightView w{type, w_data.data(), rows, cols};
      ops::MatMul(w, x.data(), n_tokens, y1.data(), 1);
      ops::MatMul(w, x.data(), n_tokens, y2.data(), 2);
      ops::MatMul(w, x.data(), n_tokens, y3.data(), 3);
      EXPECT_EQ(y1, y2) << DTypeName(type) << " n_tokens " << n_tokens;
      EXPECT_EQ(y1, y3) << DTypeName(type) << " n_tokens " << n_tokens;
      const KeptPanels kept(w, 2);  // (threads split kept panels by whole panels)
      if (kept.view.panels == nullptr) continue;
      ops::MatMul(kept.view, x.data(), n_tokens, y2.data(), 2);
      ops::MatMul(kept.view, x.data(), n_tokens, y3.data(), 3);
      ops::MatMul(kept.view, x.data(), n_tokens, y1.data(), 1);
      EXPECT_EQ(y1, y2) << DTypeName(type) << " kept panels, n_tokens " << n_tokens;
      EXPECT_EQ(y1, y3) << DTypeName(type) << " kept panels, n_tokens " << n_tokens;
    }
  }
}

// Panels kept by one family are ignored by another: MatMul reads the rows then, as if there were
// none (tests and --isa switch families after a model packed its weights).
TEST(MatMulKeptPanels, OtherFamiliesReadTheRows) {
  testing::IsaGuard guard;
  const int64_t rows = 40, cols = 256, n_tokens = 6;
  const std::vector<uint8_t> w_data = QuantizeMatrix(DType::kQ8_0, RandomFloats(rows * cols, 11), rows, cols);
  const WeightView w{DType::kQ8_0, w_data.data(), rows, cols};
  const KeptPanels kept(w, 1);
  if (kept.view.panels == nullptr) GTEST_SKIP() << "the active family (" << IsaName(ActiveIsa()) << ") keeps no panels";
  const std::vector<float> x = RandomFloats(n_tokens * cols, 12);
  for (Isa isa : SupportedIsas()) {
    ASSERT_TRUE(SetIsa(isa).ok());
    if (ops::PanelBytes(w) > 0) continue;  // (the family that packed them)
    std::vector<float> want(rows * n_tokens), got(rows * n_tokens);
    ops::MatMul(w, x.data(), n_tokens, want.data(), 1);
    ops::MatMul(kept.view, x.data(), n_tokens, got.data(), 1);
    EXPECT_EQ(got, want) << IsaName(isa);
  }
}

KVS_INSTANTIATE_PER_ISA(MatMulTest);

}  // namespace
}  // namespace kvsparse
