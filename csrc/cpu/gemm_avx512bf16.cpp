// The GEMM kernel instantiated for AVX-512 with bf16 dot products (vdpbf16ps). Every header with
// non-template code is included above the target pragma, so only this file's own instantiations use
// these instructions; gemm_bf16.cpp calls them only on CPUs that have AVX512-BF16 (cpu_features.cpp).
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
// Generic tuning, whatever -march=native says: GCC 12 tunes a Zen 4 as znver3, and under that tuning its
// register allocator kept the 4 x 6 tile's weight vectors in memory, reloading each per row of x (28 loads
// per 24 dot products instead of 10); the tiles then ran at 81 against 176 GFLOP/s (M 16, K 1024, hot).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,tune=generic")
#include "cpu/gemm_kernel.h"
#include "cpu/vec_avx512.h"

namespace deepinfer {

void gemm_columns_avx512bf16(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1, bool invariant, bool packed) {
  if (packed) return kernel::pair_columns<Avx512Bf16>(x, w, out, M, K, N, n0, n1);
  kernel::gemm_columns<Avx512Bf16>(x, nullptr, 0, w, out, M, K, N, n0, n1, invariant);
}

}  // namespace deepinfer
#pragma GCC pop_options
