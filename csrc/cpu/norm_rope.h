#pragma once
// The small per-token operations around attention, each one pass in C++: RMSNorm, and the attention
// inputs (per-head q/k RMSNorm, rotary embedding, KV-cache store). In torch each is 6-30 ops of a few
// microseconds; at decode batch sizes those dispatches cost a third of a step. Results match the torch
// implementations (deepinfer/layers/norm.py, rotary.py) rounding for rounding; only the sum of squares
// may differ in its last bit (it is accumulated in fp64 here).
#include <cstdint>

namespace deepinfer {

// out[r] = w * round(x[r] * rsqrt(mean(x[r]^2) + eps)) for `rows` rows of n (transformers' RMSNorm: the
// statistic in fp32, one rounding to the dtype, then the weight in the dtype). x, w and out are all fp32
// or all bf16 (bf16); w may be null (no weight). x rows are x_stride elements apart, out is dense.
void rms_norm(const void* x, int64_t x_stride, const void* w, void* out, int64_t rows, int64_t n, float eps,
              bool bf16, int num_threads);

// Attention inputs for T tokens from the fused projection qkv [T, (H + 2 Hkv) D] (rows qkv_stride apart):
// q = rope(norm_q(q)) -> q_out [T, H, D]; k = rope(norm_k(k)) and v go to the caches
// [slots, Hkv, D] at slots[t]. norm weights q_w, k_w [D] (null: no q/k norm); cos, sin [positions, D]
// fp32 (rotate-half form, rounded to the dtype before use as torch does); all activations fp32 or all
// bf16. Returns false, touching nothing, when a position or slot is out of range.
bool qk_norm_rope_store(const void* qkv, int64_t qkv_stride, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                        const void* q_w, const void* k_w, float eps, const float* cos, const float* sin,
                        int64_t num_positions, const int64_t* positions, void* k_cache, void* v_cache,
                        int64_t num_slots, const int64_t* slots, void* q_out, bool bf16, int num_threads);

// DeepSeek-V4's interleaved RoPE (deepinfer.layers.v4_attention.apply_rope, bit for bit): x [T, R, D] rows
// (fp32 or bf16), the rope on each row's trailing rd channels as pairs (2i, 2i+1) = (a, b) -> (a c - b s,
// b c + a s) in fp32 with c, s = cos / sin [T, rd] (each pair's two entries equal; sin negated when inverse),
// rounded once to the row's dtype; the first D - rd channels copied. out may not alias x.
void rope_interleaved(const void* x, int64_t T, int64_t R, int64_t D, int64_t rd, const float* cos, const float* sin,
                      bool inverse, void* out, bool bf16, int num_threads);

}  // namespace deepinfer
