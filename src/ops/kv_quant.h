// int8 KV rows: symmetric quantization per (token, kv head) row of head_dim values.
//   scale = max|x| / 127,  q = round_half_even(x / scale) in [-127, 127],  x ≈ q * scale.
// A row of zeros gets scale 0 and q = 0. The fast kernels (ops::) and their scalar twins (ref::)
// produce bit-identical q and scales.
//
// int8 KIVI keys (KvStorage::kInt8Kivi): the same symmetric code, but one scale per column
// (channel) over a group of rows (the tokens of one page): scale[c] = max_r |x[r, c]| / 127.
// Keys have a few channels with large magnitude for every token (KIVI, Liu et al. 2024), so a
// per-channel scale keeps the other channels' resolution. |x - q * scale| <= scale / 2.
#pragma once

#include <cstdint>

namespace kvsparse {

namespace ops {
// x: [n_rows, row_len] f32 -> q: [n_rows, row_len] int8, scales: [n_rows] f32.
void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales);
// q: [n_rows, row_len], scales: [n_rows] -> x: [n_rows, row_len] f32 = q * scale.
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x);
// x: [n_rows, row_len] f32 (row_len = n_kv_heads * head_dim) -> q: [n_rows, row_len] int8,
// channel_scales: [row_len] f32 (a column of zeros gets scale 0 and q = 0).
void QuantizeKvColumnsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales);
// q: [n_rows, row_len], channel_scales: [row_len] -> x: [n_rows, row_len] f32 = q * scale.
void DequantizeKvColumnsInt8(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x);
}  // namespace ops

namespace ref {
void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales);
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x);
void QuantizeKvColumnsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales);
void DequantizeKvColumnsInt8(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x);
}  // namespace ref

}  // namespace kvsparse
