#pragma once
// DeepSeek-V4's manifold-constrained hyper-connections (mHC) for one block, fused per token: on the
// medium model at batch 16 the same math as ~25 torch ops cost 0.8-1.2 ms per call (0.2-0.3 ms here),
// nearly all of it dispatch.
// Streams are float or bf16 (raw bits); the mixing parameters and outputs post/comb are fp32.
#include <cstdint>

namespace deepinfer {

// streams [T, N, D]; fn [(2+N)N, N*D], base [(2+N)N], scale [3] (fp32) -> post [T, N],
// comb [T, N, N] (Sinkhorn-projected), collapsed [T, D] in the streams' type.
void hc_pre(const void* streams, bool bf16, const float* fn, const float* base, const float* scale, int64_t T,
            int64_t N, int64_t D, int sinkhorn_iters, float hc_eps, float norm_eps, float* post, float* comb,
            void* collapsed, int num_threads);

// out [T, N, D] = post (x) block_out + comb^T @ streams, every operand and result rounded to the
// streams' type as torch's elementwise ops and matmul in that dtype would.
void hc_merge(const void* block_out, const void* streams, bool bf16, const float* post, const float* comb,
              int64_t T, int64_t N, int64_t D, void* out, int num_threads);

}  // namespace deepinfer
