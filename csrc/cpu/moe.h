#pragma once
// A routed MoE layer's experts in one call: tokens grouped by expert (a stable counting sort), each group
// through its SwiGLU expert (grouped_experts_bf16), and the weighted outputs summed back per token. In
// torch the grouping and the sum are ~15 ops per layer, a tenth of a batch-1 decode step.
#include <cstdint>

#include "cpu/gemm_bf16.h"

namespace deepinfer {

// y [T, H] fp32 = sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]), summed in fp32 in increasing
// expert id (the order of torch's index_add_ over expert-sorted rows). x and
// weights fp32, or bf16 when bf16; ids int64 in [0, E). Experts with skip[e] != 0 (skip may be null) add
// nothing: the caller adds them. W, w13, w2, limit, mode as grouped_experts_bf16. Returns false, touching
// nothing, when an id lies outside [0, E).
template <class W>
bool moe_experts_bf16(const void* x, const int64_t* ids, const void* weights, bool bf16, int64_t T, int64_t k,
                      int64_t E, const uint8_t* skip, const W* w13, const W* w2, float* y, int64_t H, int64_t I,
                      float limit, GemmMode mode, int num_threads);

}  // namespace deepinfer
