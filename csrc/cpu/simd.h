#pragma once
// Helpers shared by the CPU kernels: vector ones (AVX2 + FMA; the extension is built with -march=native) and
// round_up.
#include <immintrin.h>

#include <cstdint>

namespace deepinfer {

// v rounded up to a multiple of to (> 0).
inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// Sum of the 8 lanes, in a fixed order.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four 8-lane accumulators: the FMA latency is hidden and the sum order is fixed for any n.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= n; k += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8 * u), _mm256_loadu_ps(b + k + 8 * u), acc[u]);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// exp of 8 lanes within ~2 ulp of std::exp (x clamped to [-87.3, 88.4]: beyond, the result is ~1e-38 or
// inf, as exp's own under/overflow; NaN stays NaN): 2^n times a degree-6 polynomial of 2^f, x log2(e) = n + f,
// |f| <= 1/2. The scalar libm call costs ~15 ns, as much as reading 100 bytes of weights.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(_mm256_min_ps(x, hi), lo), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.0f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
  return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // min/max drop NaN: put it back
}

}  // namespace deepinfer
