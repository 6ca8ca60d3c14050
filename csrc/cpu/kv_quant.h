#pragma once
// Rows of a quantised KV pool (DeepSeek-V4's compressed entries and sliding-window ring), gathered and
// dequantised or quantised and scattered on the CPU, bit for bit what the torch references compute
// (deepinfer/formats/fp8.py and fp4.py have the formats and rounding rules). As torch ops each call costs
// 70-350 us at decode sizes, some 50 calls a step on the medium DeepSeek-V4: more than the rows they move.
#include <cstdint>

namespace deepinfer {

// FP8: E4M3 bytes [rows, D] + one fp32 scale per row. NVFP4: packed E2M1 [rows, D/2] (element 2j in the low
// nibble) + E4M3 scale bytes per 16 values, times a per-tensor fp32 scale. MXFP4: the same with E8M0 scale
// bytes per 32 values.
enum class KvFormat : int { FP8 = 0, NVFP4 = 1, MXFP4 = 2 };

// out [n, D] (fp32 or bf16) = pool rows rows[n] dequantised, each value one fp32 product rounded once to the
// output dtype; rows[i] < 0 gives a zero row. data / scales are the pool's [rows, ...] arrays.
void kv_load_rows(const uint8_t* data, const void* scales, const int64_t* rows, int64_t n, int64_t D, KvFormat fmt,
                  float tensor_scale, void* out, bool out_bf16, int num_threads);

// Pool rows rows[n] = x [n, D] (fp32 or bf16) quantised. Returns false, writing nothing, when x holds a NaN or
// an infinity (no format can encode them; the references raise).
bool kv_store_rows(const void* x, bool x_bf16, const int64_t* rows, int64_t n, int64_t D, KvFormat fmt,
                   float tensor_scale, uint8_t* data, void* scales, int num_threads);

}  // namespace deepinfer
