#include "ops/packed_q8.h"

#include <cstring>

#include "kvsparse/dtype.h"
#include "ops/quant_internal.h"

namespace kvsparse::matmul {

namespace {

// Position in the step's q array of element e of the step's block j.
int PositionInStep(Q8Order order, int j, int e) {
  if (order == Q8Order::kQ4NibbleHalves && kStepBlocks == 2) {
    return (e < 16 ? 0 : 32) + j * 16 + (e & 15);
  }
  return j * 32 + e;
}

}  // namespace

void PackQ8Token(const float* x, int64_t cols, uint8_t* dst, int offset, Q8Order order) {
  const int64_t n_blocks = cols / kQK8_0;
  const int64_t n_steps = PackedSteps(cols);
  for (int64_t s = 0; s < n_steps; ++s) {
    uint8_t* step = dst + s * kStepBytes;
    int8_t* q = reinterpret_cast<int8_t*>(step);
    int32_t* init = reinterpret_cast<int32_t*>(step + kStepElems);
    float* scale = reinterpret_cast<float*>(step + kStepElems + sizeof(int32_t) * simd::kLanes);
    float block_scale[kStepBlocks];
    for (int j = 0; j < kStepBlocks; ++j) {
      const int64_t b = s * kStepBlocks + j;
      int8_t block_q[kQK8_0];
      if (b < n_blocks) {
        // The kernels multiply by the f16-rounded scale, exactly what a stored Q8_0 block holds.
        block_scale[j] = F16ToF32(quant::QuantizeBlockQ8_0(x + b * kQK8_0, block_q));
      } else {
        std::memset(block_q, 0, sizeof(block_q));
        block_scale[j] = 0.f;
      }
      if (order == Q8Order::kNatural) {
        std::memcpy(q + j * kQK8_0, block_q, kQK8_0);
      } else {
        for (int e = 0; e < kQK8_0; ++e) q[PositionInStep(order, j, e)] = block_q[e];
      }
    }
    for (int lane = 0; lane < simd::kLanes; ++lane) {
      const int8_t* group = q + 4 * lane;
      init[lane] = -offset * (group[0] + group[1] + group[2] + group[3]);
      // Lane `lane` covers positions 4*lane..4*lane+3, which all belong to one block.
      int owner = 0;
      for (int j = 0; j < kStepBlocks; ++j) {
        if (PositionInStep(order, j, 0) <= 4 * lane && 4 * lane < PositionInStep(order, j, 0) + 16) owner = j;
        if (PositionInStep(order, j, 16) <= 4 * lane && 4 * lane < PositionInStep(order, j, 16) + 16) owner = j;
      }
      scale[lane] = block_scale[owner];
    }
  }
}

void PackQ8TokenCompact(const float* x, int64_t cols, uint8_t* dst, Q8Order order) {
  const int64_t n_blocks = cols / kQK8_0;
  const int64_t n_steps = PackedSteps(cols);
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  float* scales = reinterpret_cast<float*>(dst + n_steps * kStepElems);
  for (int64_t b = 0; b < n_steps * kStepBlocks; ++b) {
    int8_t block_q[kQK8_0] = {};
    scales[b] = b < n_blocks ? F16ToF32(quant::QuantizeBlockQ8_0(x + b * kQK8_0, block_q)) : 0.f;
    int8_t* step_q = q + (b / kStepBlocks) * kStepElems;
    for (int e = 0; e < kQK8_0; ++e) step_q[PositionInStep(order, static_cast<int>(b % kStepBlocks), e)] = block_q[e];
  }
}

}  // namespace kvsparse::matmul
