// int8 KV rows: symmetric quantization per (token, kv head) row of head_dim values.
//   scale = max|x| / 127,  q = round_half_even(x / scale) in [-127, 127],  x ≈ q * scale.
// A row of zeros gets scale 0 and q = 0. The fast kernels (ops::) and their scalar twins (ref::)
// produce bit-identical q and scales.
#pragma once

#include <cstdint>

namespace kvsparse {

namespace ops {
// x: [n_rows, row_len] f32 -> q: [n_rows, row_len] int8, scales: [n_rows] f32.
void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales);
// q: [n_rows, row_len], scales: [n_rows] -> x: [n_rows, row_len] f32 = q * scale.
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x);
}  // namespace ops

namespace ref {
void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales);
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x);
}  // namespace ref

}  // namespace kvsparse
