#include "cpu/sampling.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// First index of the row's maximum, or -1 when any value is NaN or inf. Eight lanes each keep their
// first maximum (strict >), then the lowest index among the lanes that hold the overall maximum.
int64_t row_argmax(const float* row, int64_t V) {
  __m256 best = _mm256_set1_ps(-INFINITY), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256i arg = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  const int64_t vector_end = V <= INT32_MAX ? V / 8 * 8 : 0;  // lane indices are 32-bit
  int64_t v = 0;
  for (; v < vector_end; v += 8, idx = _mm256_add_epi32(idx, step)) {
    const __m256 x = _mm256_loadu_ps(row + v);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ));
    const __m256 better = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, x, better);
    arg = _mm256_blendv_epi8(arg, idx, _mm256_castps_si256(better));
  }
  if (_mm256_movemask_ps(finite) != 0xff) return -1;
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_arg[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_arg), arg);
  float top = -INFINITY;  // lanes that saw no value hold -inf and are passed over
  int64_t at = 0;
  for (int l = 0; l < 8; ++l)
    if (lane_best[l] > top || (lane_best[l] == top && lane_arg[l] < at)) {
      top = lane_best[l];
      at = lane_arg[l];
    }
  for (; v < V; ++v) {
    if (!std::isfinite(row[v])) return -1;
    if (row[v] > top) {
      top = row[v];
      at = v;
    }
  }
  return at;
}

}  // namespace

void greedy_tokens(const float* logits, int64_t B, int64_t V, int64_t* tokens, int num_threads) {
  parallel_ranges(B, threads_for(B * V, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tokens[b] = row_argmax(logits + b * V, V);
  });
}

void apply_token_mask(float* logits, const int32_t* bitmask, int64_t B, int64_t V, int num_threads) {
  const int64_t W = (V + 31) / 32;
  parallel_ranges(B, threads_for(B * V, num_threads, 1 << 20), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* row = logits + b * V;
      for (int64_t w = 0; w < W; ++w) {
        // Grammar rows are mostly all-clear words and free rows all-set ones: both skip the bit loop.
        const uint32_t bits = static_cast<uint32_t>(bitmask[b * W + w]);
        const int64_t n = std::min<int64_t>(32, V - 32 * w);
        float* x = row + 32 * w;
        if (bits == 0xffffffffu) continue;
        if (bits == 0) {
          std::fill(x, x + n, -INFINITY);
          continue;
        }
        for (int64_t j = 0; j < n; ++j) x[j] = ((bits >> j) & 1u) ? x[j] : -INFINITY;  // a blend, no branch
      }
    }
  });
}

}  // namespace deepinfer
