#include "cpu/norm_rope.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// Sum of v[i]^2 in fp64 over 8 lanes (four lanes per accumulator), then the lanes and the tail in order.
double sum_squares(const float* v, int64_t n) {
  __m256d acc[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc[0], acc[1]));
  double sq = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) sq += static_cast<double>(v[i]) * v[i];
  return sq;
}

// v[0..n) = w * round(v * rsqrt(mean(v^2) + eps)) in place (fp32 values of the dtype); w fp32 or null.
void norm_in_place(float* v, const float* w, int64_t n, float eps, bool bf16) {
  const float r = 1.0f / std::sqrt(static_cast<float>(sum_squares(v, n) / n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 y = round_to8(_mm256_mul_ps(_mm256_loadu_ps(v + i), rv), bf16);
    if (w) y = round_to8(_mm256_mul_ps(_mm256_loadu_ps(w + i), y), bf16);
    _mm256_storeu_ps(v + i, y);
  }
  for (; i < n; ++i) {
    float y = round_to(v[i] * r, bf16);
    v[i] = w ? round_to(w[i] * y, bf16) : y;
  }
}

// dst[0, n) = src rounded to the dtype.
void round_row(const float* src, int64_t n, bool bf16, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, round_to8(_mm256_loadu_ps(src + i), bf16));
  for (; i < n; ++i) dst[i] = round_to(src[i], bf16);
}

// round(round(a * c) + round(b * s)) of 8 lanes, each product and the sum rounded to the dtype.
__m256 rotate8(__m256 a, __m256 c, __m256 b, __m256 s, bool bf16) {
  return round_to8(_mm256_add_ps(round_to8(_mm256_mul_ps(a, c), bf16), round_to8(_mm256_mul_ps(b, s), bf16)), bf16);
}

// Rotate-half rotary embedding of v [D] in place, cos/sin already rounded to the dtype:
// round(round(v * c) + round(rotate_half(v) * s)), the three roundings of torch's bf16 ops.
void rope_in_place(float* v, const float* c, const float* s, int64_t D, bool bf16, float* tmp) {
  const int64_t half = D / 2;
  if (half % 8)
    for (int64_t i = 0; i < D; ++i) {
      const float rot = i < half ? -v[i + half] : v[i - half];
      tmp[i] = round_to(round_to(v[i] * c[i], bf16) + round_to(rot * s[i], bf16), bf16);
    }
  else
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 lo = _mm256_loadu_ps(v + i), hi = _mm256_loadu_ps(v + half + i);
      const __m256 neg_hi = _mm256_sub_ps(_mm256_setzero_ps(), hi);
      _mm256_storeu_ps(tmp + i, rotate8(lo, _mm256_loadu_ps(c + i), neg_hi, _mm256_loadu_ps(s + i), bf16));
      _mm256_storeu_ps(tmp + half + i,
                       rotate8(hi, _mm256_loadu_ps(c + half + i), lo, _mm256_loadu_ps(s + half + i), bf16));
    }
  std::memcpy(v, tmp, D * sizeof(float));
}

std::vector<float> widen(const void* p, int64_t n, bool bf16) {
  std::vector<float> out(p ? n : 0);
  if (p) load_row(p, 0, n, bf16, out.data());
  return out;
}

}  // namespace

void rms_norm(const void* x, int64_t x_stride, const void* w, void* out, int64_t rows, int64_t n, float eps,
              bool bf16, int num_threads) {
  const std::vector<float> wf = widen(w, n, bf16);
  const int parts = threads_for(rows * n, num_threads);
  parallel_ranges(rows, parts, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(n);
    for (int64_t r = r0; r < r1; ++r) {
      load_row(x, r * x_stride, n, bf16, v.data());
      norm_in_place(v.data(), w ? wf.data() : nullptr, n, eps, bf16);
      store_row(out, r * n, n, bf16, v.data());
    }
  });
}

bool qk_norm_rope_store(const void* qkv, int64_t qkv_stride, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                        const void* q_w, const void* k_w, float eps, const float* cos, const float* sin,
                        int64_t num_positions, const int64_t* positions, void* k_cache, void* v_cache,
                        int64_t num_slots, const int64_t* slots, void* q_out, bool bf16, int num_threads) {
  for (int64_t t = 0; t < T; ++t)
    if (positions[t] < 0 || positions[t] >= num_positions || slots[t] < 0 || slots[t] >= num_slots) return false;
  const std::vector<float> qw = widen(q_w, D, bf16), kw = widen(k_w, D, bf16);
  const int64_t kv_row = Hkv * D;
  const int parts = threads_for(T * (H + 2 * Hkv) * D, num_threads);
  parallel_ranges(T, parts, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(D), s(D), v(D), tmp(D);
    for (int64_t t = t0; t < t1; ++t) {
      // The tables rounded to the dtype, as torch's cos.to(q.dtype).
      round_row(cos + positions[t] * D, D, bf16, c.data());
      round_row(sin + positions[t] * D, D, bf16, s.data());
      const int64_t row = t * qkv_stride;
      for (int64_t h = 0; h < H + Hkv; ++h) {  // q heads, then k heads
        const bool is_q = h < H;
        load_row(qkv, row + h * D, D, bf16, v.data());
        const std::vector<float>& w = is_q ? qw : kw;
        if ((is_q ? q_w : k_w) != nullptr) norm_in_place(v.data(), w.data(), D, eps, bf16);
        rope_in_place(v.data(), c.data(), s.data(), D, bf16, tmp.data());
        if (is_q) store_row(q_out, (t * H + h) * D, D, bf16, v.data());
        else store_row(k_cache, slots[t] * kv_row + (h - H) * D, D, bf16, v.data());
      }
      const size_t elem = bf16 ? 2 : 4;  // v is stored as it came out of the projection
      std::memcpy(static_cast<char*>(v_cache) + slots[t] * kv_row * elem,
                  static_cast<const char*>(qkv) + (row + (H + Hkv) * D) * elem, kv_row * elem);
    }
  });
  return true;
}

void rope_interleaved(const void* x, int64_t T, int64_t R, int64_t D, int64_t rd, const float* cos, const float* sin,
                      bool inverse, void* out, bool bf16, int num_threads) {
  const int64_t elt = bf16 ? 2 : 4, nope = D - rd;
  parallel_ranges(T * R, threads_for(T * R * D, num_threads), [&](int64_t lo, int64_t hi) {
    std::vector<float> v(rd), o(rd);
    for (int64_t row = lo; row < hi; ++row) {
      std::memcpy(static_cast<char*>(out) + row * D * elt, static_cast<const char*>(x) + row * D * elt, nope * elt);
      load_row(x, row * D + nope, rd, bf16, v.data());
      const float* c = cos + (row / R) * rd;
      const float* s = sin + (row / R) * rd;
      for (int64_t i = 0; i < rd; i += 2) {
        const float s0 = inverse ? -s[i] : s[i], s1 = inverse ? -s[i + 1] : s[i + 1];
        o[i] = v[i] * c[i] + (-v[i + 1]) * s0;
        o[i + 1] = v[i + 1] * c[i + 1] + v[i] * s1;
      }
      store_row(out, row * D + nope, rd, bf16, o.data());
    }
  });
}

}  // namespace deepinfer
