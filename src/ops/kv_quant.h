// int8 KV rows: symmetric quantization per (token, kv head) row of head_dim values.
//   scale = max|x| / 127,  q = round_half_even(x / scale) in [-127, 127],  x ≈ q * scale.
// A row of zeros gets scale 0 and q = 0. The fast kernels (ops::) and their scalar twins (ref::)
// produce bit-identical q and scales.
//
// int8 KIVI keys (KvStorage::kInt8Kivi): the same symmetric code, but one scale per column
// (channel) over a group of rows (the tokens of one page): scale[c] = max_r |x[r, c]| / 127.
// Keys have a few channels with large magnitude for every token (KIVI, Liu et al. 2024), so a
// per-channel scale keeps the other channels' resolution. |x - q * scale| <= scale / 2.
//
// fp8 KV rows (KvStorage::kFp8E4M3, kFp8E5M2): one scale per row as int8,
//   scale = max|x| / kFp8Max (448 e4m3, 57344 e5m2),  code = fp8(x / scale) rounded to nearest even.
// e4m3 is OCP's "FN" variant (bias 7, no infinities; 0x7F / 0xFF are NaN), e5m2 IEEE-like (bias
// 15); neither's NaN or infinity is ever produced: values saturate at the largest finite one.
// The per-row scale puts each row's largest value at the top of the range, so the code's relative
// precision serves the rest: per element, |x - scale * fp8(code)| <= max(|x| * 2^-(M+1),
// scale * 2^-(bias+M)) -- half a unit in the last place, or half the subnormal step (M = 3 e4m3,
// 2 e5m2). Encoding runs once per stored value and is scalar; decoding is the kernels' hot path:
// an fp8 code widened to f16 bits (Fp8ToF16Bits) converts exactly with the f16 instruction.
#pragma once

#include <cstdint>

#include "kvsparse/dtype.h"
#include "kvsparse/kv_types.h"

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

// fp8 codes (format: kFp8E4M3 or kFp8E5M2).
inline constexpr float kFp8E4M3Max = 448.f;
inline constexpr float kFp8E5M2Max = 57344.f;
inline float Fp8Max(KvStorage format) { return format == KvStorage::kFp8E4M3 ? kFp8E4M3Max : kFp8E5M2Max; }
// The code's sign and magnitude moved into f16 bits: e5m2 is f16's top byte; e4m3's exponent
// lands in f16's with bias 15 instead of 7, so the f16 reads value / 256 (subnormals included).
inline uint16_t Fp8ToF16Bits(KvStorage format, uint8_t code) {
  if (format == KvStorage::kFp8E5M2) return static_cast<uint16_t>(code << 8);
  return static_cast<uint16_t>(((code & 0x80) << 8) | ((code & 0x7F) << 7));
}
inline float DecodeFp8(KvStorage format, uint8_t code) {
  return F16ToF32(Fp8ToF16Bits(format, code)) * (format == KvStorage::kFp8E4M3 ? 256.f : 1.f);
}
// y's nearest code (ties to even), saturating at +-Fp8Max; NaN encodes as 0.
uint8_t EncodeFp8(KvStorage format, float y);
// x: [n_rows, row_len] f32 -> codes: [n_rows, row_len], scales: [n_rows] (a row of zeros: scale 0, codes 0).
void QuantizeKvRowsFp8(KvStorage format, const float* x, int64_t n_rows, int row_len, uint8_t* codes,
                       float* scales);
// codes: [n_rows, row_len], scales: [n_rows] -> x: [n_rows, row_len] f32 = scale * fp8(code).
void DequantizeKvRowsFp8(KvStorage format, const uint8_t* codes, const float* scales, int64_t n_rows,
                         int row_len, float* x);

// Low-bit KIVI codes (KvStorage::kInt4Kivi, kInt2Kivi): asymmetric with a zero point, as KIVI
// (Liu et al., ICML 2024) quantizes. Over a group (K: one channel's values over a page's tokens;
// V: `group` consecutive channels of one (token, kv head) row, 32 in KIVI's code) its min and max give
//   min16 = f16(min), scale16 = f16((max - min16) / (2^bits - 1)),
//   code = round((x - min16) / scale16) clamped to [0, 2^bits - 1],  x ~ min16 + scale16 * code;
// scale and min are stored in f16 (half the metadata bytes; KIVI keeps them in the model's f16)
// and the codes are computed from the rounded pair, so the error stays within about scale / 2
// (a max that f16 rounding pushes past the last code adds at most max_code * 2^-11 * scale).
// A constant group has scale 0 and codes 0 (exact up to min's f16 rounding). Codes are packed low
// bits first: value i of a row is in byte i * bits / 8 at bit (i * bits) % 8, so a row of n values
// (n a multiple of 8 / bits) takes n * bits / 8 bytes and every (token, kv head) row starts on a byte.
// Scalar: quantization runs once per page (K) or token (V); kernels unpack codes (UnpackCodes)
// and apply scale and min while packing.
// x: [n_rows, row_len] -> packed: [n_rows, row_len * bits / 8], scales / mins: [n_rows, row_len / group]
// (group divides row_len and fills whole bytes).
void QuantizeKvRowsAsym(int bits, const float* x, int64_t n_rows, int row_len, int group, uint8_t* packed,
                        f16_bits* scales, f16_bits* mins);
void DequantizeKvRowsAsym(int bits, const uint8_t* packed, const f16_bits* scales, const f16_bits* mins,
                          int64_t n_rows, int row_len, int group, float* x);
// x: [n_rows, row_len] -> packed: [n_rows, row_len * bits / 8], scales / mins: [row_len] (one per column).
void QuantizeKvColumnsAsym(int bits, const float* x, int64_t n_rows, int row_len, uint8_t* packed, f16_bits* scales,
                           f16_bits* mins);
void DequantizeKvColumnsAsym(int bits, const uint8_t* packed, const f16_bits* scales, const f16_bits* mins,
                             int64_t n_rows, int row_len, float* x);
// n codes of a packed row -> codes[n], one byte each.
void UnpackCodes(int bits, const uint8_t* packed, int n, uint8_t* codes);
}  // namespace ops

namespace ref {
void QuantizeKvRowsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* scales);
void DequantizeKvRowsInt8(const int8_t* q, const float* scales, int64_t n_rows, int row_len, float* x);
void QuantizeKvColumnsInt8(const float* x, int64_t n_rows, int row_len, int8_t* q, float* channel_scales);
void DequantizeKvColumnsInt8(const int8_t* q, const float* channel_scales, int64_t n_rows, int row_len, float* x);
}  // namespace ref

}  // namespace kvsparse
