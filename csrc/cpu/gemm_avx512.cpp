// The GEMM kernel instantiated for AVX-512. Every header with non-template code is included above the
// target pragma, so only this file's own instantiations use AVX-512; gemm_bf16.cpp calls them only on
// CPUs that have it (cpu_features.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/gemm_bf16.h"
#include "cpu/simd.h"

#pragma GCC push_options
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*, which -Wmaybe-uninitialized misreads.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Generic tuning: see gemm_avx512bf16.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,tune=generic")
#include "cpu/gemm_kernel.h"
#include "cpu/vec_avx512.h"

namespace deepinfer {

template <class W>
void gemm_columns_avx512(const float* x, const float* xt, int64_t wide, const W* w, float* out, int64_t M, int64_t K,
                         int64_t N, int64_t n0, int64_t n1, bool invariant) {
  kernel::gemm_columns<Avx512>(x, xt, wide, w, out, M, K, N, n0, n1, invariant);
}

template void gemm_columns_avx512(const float*, const float*, int64_t, const uint16_t*, float*, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, bool);
template void gemm_columns_avx512(const float*, const float*, int64_t, const float*, float*, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, bool);

}  // namespace deepinfer
#pragma GCC pop_options
