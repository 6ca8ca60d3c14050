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

// log of 8 positive normal lanes within ~2 ulp of std::log (Cephes' logf): x = m 2^e with m in [sqrt(1/2),
// sqrt(2)), log x = e log 2 + log m, log m a degree-10 polynomial of m - 1, so results near 0 keep their
// relative accuracy. Zero, negative, subnormal, inf and NaN lanes are not handled.
inline __m256 log8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_or_ps(_mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF))),
                          _mm256_set1_ps(0.5f));  // x = m 2^e, m in [1/2, 1)
  const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(low, one));
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(low, m)), one);  // m - 1, m doubled where below sqrt(1/2)
  const __m256 m2 = _mm256_mul_ps(m, m);
  __m256 p = _mm256_set1_ps(7.0376836292e-2f);
  for (float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                  2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    p = _mm256_fmadd_ps(p, m, _mm256_set1_ps(c));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, m), m2);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), m2, y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

}  // namespace deepinfer
