#pragma once
// Decode attention of one query group over n cached rows, written once against a vector traits struct V
// (vec.h: Avx2, vec_avx512.h: Avx512) and instantiated in the translation unit compiled for each ISA
// (decode_attention.cpp, attention_avx512.cpp). G query heads share the rows (a GQA group, or all of
// DeepSeek-V4's heads over its shared K=V rows), so each key row is read once for all G heads.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/simd.h"

namespace deepinfer {
namespace attn {

// out[i] = scale * (q . keys[i]) for 8 rows of keys (row i at keys + i * ld, D wide): one accumulator per
// row, then the 8 sums at once (halves folded to 8 lanes, three rounds of hadd) instead of a horizontal sum per row.
template <class V>
void dot8(const float* q, const float* keys, int64_t D, int64_t ld, float scale, float* out) {
  typename V::reg acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = V::zero();
  int64_t d = 0;
  for (; d + V::LANES <= D; d += V::LANES) {
    const typename V::reg qv = V::load(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = V::fma(qv, V::load(keys + i * ld + d), acc[i]);
  }
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = V::fold8(acc[i]);  // unrolled: acc stays in registers (see weighted_sum)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  alignas(32) float tail[8] = {};
  for (; d < D; ++d)
    for (int i = 0; i < 8; ++i) tail[i] += q[d] * keys[i * ld + d];
  sums = _mm256_add_ps(sums, _mm256_load_ps(tail));
  _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

// p[0, n) = softmax over p and an optional sink logit (-inf: none), in place; false when every logit
// is -inf (no rows and no sink), which leaves p unnormalised.
inline bool softmax_with_sink(float* p, int64_t n, float sink) {
  // Eight running maxima: one chain through all n would wait out the max latency on every logit. A NaN
  // logit is passed over (max_ps returns its second operand), as std::max(m, NaN) does.
  __m256 mv = _mm256_set1_ps(sink);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(p + j), mv);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = sink;
  for (float v : lanes) m = std::max(m, v);
  for (; j < n; ++j) m = std::max(m, p[j]);
  if (m == -INFINITY) return false;
  mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  const __m256 denom = _mm256_set1_ps(sum + std::exp(sink - m));
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, _mm256_div_ps(_mm256_loadu_ps(p + j), denom));
  for (; j < n; ++j) p[j] /= sum + std::exp(sink - m);
  return true;
}

// out[h][d0, d0 + DR LANES) = sum_j p[h][j] values[j][...] (row j at values + j * ld) for HP heads at once:
// each value vector is loaded once for all HP heads, and HP * DR accumulators stay in registers across all j.
template <class V, int HP, int DR>
void weighted_sum(const float* p, int64_t n, const float* values, int64_t D, int64_t ld, int64_t d0, float* out) {
  typename V::reg acc[HP][DR];
  for (int h = 0; h < HP; ++h)
    for (int r = 0; r < DR; ++r) acc[h][r] = V::zero();
  for (int64_t j = 0; j < n; ++j) {
    typename V::reg v[DR];
    for (int r = 0; r < DR; ++r) v[r] = V::load(values + j * ld + d0 + r * V::LANES);
    for (int h = 0; h < HP; ++h) {
      const typename V::reg w = V::broadcast(p + h * n + j);
      for (int r = 0; r < DR; ++r) acc[h][r] = V::fma(w, v[r], acc[h][r]);
    }
  }
  // Unrolled, so every access to acc has constant indices and the compiler keeps it in registers (rolled, all
  // HP * DR accumulators were stored to the stack at every j, which made the loop store-bound).
#pragma GCC unroll 16
  for (int h = 0; h < HP; ++h)
#pragma GCC unroll 16
    for (int r = 0; r < DR; ++r) V::store(out + h * D + d0 + r * V::LANES, acc[h][r]);
}

// HP heads' outputs over all D: register blocks of DR vectors, then single vectors, then scalars.
template <class V, int HP>
void weighted_sum_heads(const float* p, int64_t n, const float* values, int64_t D, int64_t ld, float* out) {
  constexpr int DR = 4;
  int64_t d0 = 0;
  for (; d0 + DR * V::LANES <= D; d0 += DR * V::LANES) weighted_sum<V, HP, DR>(p, n, values, D, ld, d0, out);
  for (; d0 + V::LANES <= D; d0 += V::LANES) weighted_sum<V, HP, 1>(p, n, values, D, ld, d0, out);
  for (int h = 0; h < HP; ++h)
    for (int64_t d = d0; d < D; ++d) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += p[h * n + j] * values[j * ld + d];
      out[h * D + d] = s;
    }
}

// G heads q [G, D] over n rows keys, values [n, D] fp32, row j at keys / values + j * ld (the same pointer for a
// shared K=V) -> out [G, D]
// = softmax(scale q keys^T, with sink logit sinks[h] when sinks is not null) values; p: G * n floats of
// scratch. A head with no rows and no sink gets zeros.
template <class V>
void attend_group(const float* q, int64_t G, const float* keys, const float* values, int64_t n, int64_t D,
                  int64_t ld, float scale, const float* sinks, float* p, float* out) {
  for (int64_t h = 0; h < G; ++h) {
    float* ph = p + h * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) dot8<V>(q + h * D, keys + j * ld, D, ld, scale, ph + j);
    for (; j < n; ++j) ph[j] = dot(q + h * D, keys + j * ld, D) * scale;
    if (!softmax_with_sink(ph, n, sinks ? sinks[h] : -INFINITY)) std::fill(ph, ph + n, 0.0f);
  }
  int64_t h = 0;
  for (; h + V::PV_HEADS <= G; h += V::PV_HEADS)
    weighted_sum_heads<V, V::PV_HEADS>(p + h * n, n, values, D, ld, out + h * D);
  for (; h < G; ++h) weighted_sum_heads<V, 1>(p + h * n, n, values, D, ld, out + h * D);
}

}  // namespace attn
}  // namespace deepinfer
