#pragma once
// Vector helpers shared by the CPU kernels (AVX2 + FMA; the extension is built with -march=native).
#include <immintrin.h>

#include <cstdint>

namespace deepinfer {

// Four 8-lane accumulators: the FMA latency is hidden and the sum order is fixed for any n.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= n; k += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8 * u), _mm256_loadu_ps(b + k + 8 * u), acc[u]);
  __m256 v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

}  // namespace deepinfer
