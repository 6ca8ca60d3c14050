#pragma once
// Decode attention of one sequence's query heads over its n cached rows, written once against a vector traits
// struct V (vec.h: Avx2, vec_avx512.h: Avx512) and instantiated in the translation unit compiled for each ISA
// (decode_attention.cpp, attention_avx512.cpp). Each kv head's group of query heads shares its rows (a GQA group,
// or all of DeepSeek-V4's heads over its shared K=V rows). Rows are fp32, or bf16 (T = uint16_t) widened in
// registers as they are loaded, and are found through an offset per row, so a paged cache is read in place at its
// own width. Rows are visited in order, all kv heads of a row at once, the rows ahead fetched by software (a
// sequence's blocks lie anywhere, which no hardware prefetcher follows): each row comes from memory once.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/bf16.h"
#include "cpu/simd.h"
#include "cpu/vec_load.h"

namespace deepinfer {
namespace attn {

// scale * (q[h] . row r) in lane h * R + r, for HP heads q [HP, D] and R = 8 / HP rows, row r at base + rows[r] (D
// elements): eight accumulators, each row vector loaded once for all HP heads (HP 4 needs 6 loads per 8 FMAs
// where one head over 8 rows needs 9), then the 8 sums at once (halves folded to 8 lanes, three rounds of hadd)
// instead of a horizontal sum each.
template <class V, int HP, class T>
__m256 dot_block(const float* q, const T* base, const int64_t* rows, int64_t D, float scale) {
  constexpr int R = 8 / HP;
  typename V::reg acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = V::zero();
  int64_t d = 0;
  for (; d + V::LANES <= D; d += V::LANES) {
    typename V::reg qv[HP];
    for (int h = 0; h < HP; ++h) qv[h] = V::load(q + h * D + d);
    for (int r = 0; r < R; ++r) {
      const typename V::reg k = load_elems<V>(base + rows[r] + d);
      for (int h = 0; h < HP; ++h) acc[h * R + r] = V::fma(qv[h], k, acc[h * R + r]);
    }
  }
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = V::fold8(acc[i]);  // unrolled: acc stays in registers (see weighted_sum)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  alignas(32) float tail[8] = {};
  for (; d < D; ++d)
    for (int h = 0; h < HP; ++h)
      for (int r = 0; r < R; ++r) tail[h * R + r] += q[h * D + d] * to_float(base[rows[r] + d]);
  sums = _mm256_add_ps(sums, _mm256_load_ps(tail));
  return _mm256_mul_ps(sums, _mm256_set1_ps(scale));
}

// HP blocks of dot_block over rows [b R, b R + R) (lane h * R + r) -> s[h]: head h's scores on the 8 rows (lane
// b R + r), in place: a transpose of HP x HP elements of R lanes.
template <int HP>
void scores_by_head(__m256* s) {
  if constexpr (HP == 2) {
    const __m256 a = s[0], b = s[1];
    s[0] = _mm256_permute2f128_ps(a, b, 0x20);
    s[1] = _mm256_permute2f128_ps(a, b, 0x31);
  }
  if constexpr (HP == 4) {
    const __m256d s0 = _mm256_castps_pd(s[0]), s1 = _mm256_castps_pd(s[1]), s2 = _mm256_castps_pd(s[2]),
                  s3 = _mm256_castps_pd(s[3]);
    const __m256d t0 = _mm256_unpacklo_pd(s0, s1), t1 = _mm256_unpackhi_pd(s0, s1);
    const __m256d t2 = _mm256_unpacklo_pd(s2, s3), t3 = _mm256_unpackhi_pd(s2, s3);
    s[0] = _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x20));
    s[1] = _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x20));
    s[2] = _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x31));
    s[3] = _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x31));
  }
}

// Rows [j0, j1) (row j at base + rows[j], width elements) fetched towards L1 ahead of their use. Templated on V
// like everything here, so each ISA's translation unit keeps its own copy (one symbol compiled for AVX-512 would
// otherwise be free to replace the AVX2 one).
template <class V, class T>
void prefetch_rows(const T* base, const int64_t* rows, int64_t j0, int64_t j1, int64_t width) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t e = 0; e < width * static_cast<int64_t>(sizeof(T)); e += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + rows[j]) + e, _MM_HINT_T0);
}

// p[0, n) = softmax over p and an optional sink logit (-inf: none), in place; false when every logit
// is -inf (no rows and no sink), which leaves p unnormalised. Templated on V only so that each ISA's
// translation unit keeps its own copy (see prefetch_rows).
template <class V>
bool softmax_with_sink(float* p, int64_t n, float sink) {
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

// out[h][d0, d0 + DR LANES) (+)= sum_{j < n} p[h * ldp + j] row j[...] (row j at values + rows[j]) for HP heads at
// once, added to out unless first: each value vector is loaded once for all HP heads, and HP * DR accumulators
// stay in registers across the rows. Every output sums its rows in order, however they are split into calls.
template <class V, int HP, int DR, class T>
void weighted_sum(const float* p, int64_t ldp, int64_t n, const T* values, const int64_t* rows, int64_t D, int64_t d0,
                  float* out, bool first) {
  typename V::reg acc[HP][DR];
#pragma GCC unroll 16
  for (int h = 0; h < HP; ++h)
#pragma GCC unroll 16
    for (int r = 0; r < DR; ++r) acc[h][r] = first ? V::zero() : V::load(out + h * D + d0 + r * V::LANES);
  for (int64_t j = 0; j < n; ++j) {
    typename V::reg v[DR];
    for (int r = 0; r < DR; ++r) v[r] = load_elems<V>(values + rows[j] + d0 + r * V::LANES);
    for (int h = 0; h < HP; ++h) {
      const typename V::reg w = V::broadcast(p + h * ldp + j);
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
template <class V, int HP, class T>
void weighted_sum_heads(const float* p, int64_t ldp, int64_t n, const T* values, const int64_t* rows, int64_t D,
                        float* out, bool first) {
  constexpr int DR = V::PV_DIMS;
  int64_t d0 = 0;
  for (; d0 + DR * V::LANES <= D; d0 += DR * V::LANES)
    weighted_sum<V, HP, DR>(p, ldp, n, values, rows, D, d0, out, first);
  for (; d0 + V::LANES <= D; d0 += V::LANES) weighted_sum<V, HP, 1>(p, ldp, n, values, rows, D, d0, out, first);
  for (int h = 0; h < HP; ++h)
    for (int64_t d = d0; d < D; ++d) {
      float s = first ? 0.0f : out[h * D + d];
      for (int64_t j = 0; j < n; ++j) s += p[h * ldp + j] * to_float(values[rows[j] + d]);
      out[h * D + d] = s;
    }
}

// p[h * n + j + i] = score of head h (q [HP, D]) on row at[i], for HP heads and the 8 rows at[0, 8) (those with
// j + i < n kept): one vector store per head (a scalar scatter of each block's sums took a third of this kernel's
// time outside the dot products, Zen 3).
template <class V, int HP, class T>
void score_heads(const float* q, const T* keys, const int64_t* at, int64_t j, int64_t n, int64_t D, float scale,
                 float* p) {
  __m256 s[HP];
#pragma GCC unroll 4
  for (int b = 0; b < HP; ++b) s[b] = dot_block<V, HP>(q, keys, at + b * (8 / HP), D, scale);
  scores_by_head<HP>(s);
#pragma GCC unroll 4
  for (int h = 0; h < HP; ++h) {
    if (j + 8 <= n) {
      _mm256_storeu_ps(p + h * n + j, s[h]);
      continue;
    }
    alignas(32) float last[8];
    _mm256_store_ps(last, s[h]);
    std::copy(last, last + (n - j), p + h * n + j);
  }
}

// The scores of heads [h0, h1) (one kv head's group) on the 8 rows at[0, 8): four heads at a time, then two, then one.
template <class V, class T>
void score_group(const float* q, int64_t h0, int64_t h1, const T* keys, const int64_t* at, int64_t j, int64_t n,
                 int64_t D, float scale, float* p) {
  int64_t h = h0;
  for (; h + 4 <= h1; h += 4) score_heads<V, 4>(q + h * D, keys, at, j, n, D, scale, p + h * n);
  for (; h + 2 <= h1; h += 2) score_heads<V, 2>(q + h * D, keys, at, j, n, D, scale, p + h * n);
  for (; h < h1; ++h) score_heads<V, 1>(q + h * D, keys, at, j, n, D, scale, p + h * n);
}

// Attention of kv_heads * group query heads q [kv_heads * group, D] over n rows, query head h on kv head h / group:
// kv head g's key j at keys + rows[j] + g D and its value at values + rows[j] + g D (D elements each; the same
// pointer for a shared K=V) -> out [kv_heads * group, D] = softmax(scale q keys^T, with sink logit sinks[h] when
// sinks is not null) values; p: kv_heads * group * n floats of scratch. A head with no rows and no sink gets zeros.
template <class V, class T>
void attend_heads(const float* q, int64_t kv_heads, int64_t group, const T* keys, const T* values,
                  const int64_t* rows, int64_t n, int64_t D, float scale, const float* sinks, float* p, float* out) {
  // Keys fetched two steps of 8 ahead, values one chunk of 16 rows (8 KiB of a 4 x 64 bf16 cache) ahead: 8, 16, 32
  // and 64 rows ahead measured alike within this host's noise (Zen 3, batch 1 and 16 at 2k context).
  constexpr int64_t AHEAD = 16, VALUE_ROWS = 16;
  const int64_t H = kv_heads * group, width = kv_heads * D;
  for (int64_t j = 0; j < n; j += 8) {
    int64_t at[8];  // past the end, row n - 1 stands in (its scores are not kept)
    for (int i = 0; i < 8; ++i) at[i] = rows[std::min(j + i, n - 1)];
    prefetch_rows<V>(keys, rows, std::min(j + AHEAD, n), std::min(j + AHEAD + 8, n), width);
    for (int64_t g = 0; g < kv_heads; ++g)
      score_group<V>(q, g * group, (g + 1) * group, keys + g * D, at, j, n, D, scale, p);
  }
  for (int64_t h = 0; h < H; ++h)
    if (!softmax_with_sink<V>(p + h * n, n, sinks ? sinks[h] : -INFINITY)) std::fill(p + h * n, p + (h + 1) * n, 0.0f);
  if (n == 0) std::fill(out, out + H * D, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += VALUE_ROWS) {
    const int64_t m = std::min(VALUE_ROWS, n - j0);
    prefetch_rows<V>(values, rows, std::min(j0 + VALUE_ROWS, n), std::min(j0 + 2 * VALUE_ROWS, n), width);
    for (int64_t g = 0; g < kv_heads; ++g) {
      int64_t h = g * group;
      for (; h + V::PV_HEADS <= (g + 1) * group; h += V::PV_HEADS)
        weighted_sum_heads<V, V::PV_HEADS>(p + h * n + j0, n, m, values + g * D, rows + j0, D, out + h * D, j0 == 0);
      for (; h < (g + 1) * group; ++h)
        weighted_sum_heads<V, 1>(p + h * n + j0, n, m, values + g * D, rows + j0, D, out + h * D, j0 == 0);
    }
  }
}

}  // namespace attn
}  // namespace deepinfer
