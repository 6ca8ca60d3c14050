#include "cpu/decode_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// exp(x[j] - m) for j < n, in place; returns their sum.
float exp_shifted(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    _mm256_storeu_ps(x + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; j < n; ++j) sum += (x[j] = std::exp(x[j] - m));
  return sum;
}

// out[i] = scale * (q . keys[i]) for 8 rows of keys [8, D] (D a multiple of 8): one accumulator per row,
// then the 8 horizontal sums at once (three rounds of hadd), instead of a horizontal sum per row.
void dot8(const float* q, const float* keys, int64_t D, float scale, float* out) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + i * D + d), acc[i]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

// Dimensions of the value rows summed per pass, held in registers (8 of the 16 ymm registers).
constexpr int64_t PV_DIMS = 64;

// acc[0, 8 V) = sum_j p[j] * values[j * stride + (0, 8 V)], accumulated in V registers across all j.
template <int V>
void weighted_sum(const float* p, const float* values, int64_t n, int64_t stride, float* acc) {
  __m256 sum[V];
  for (int v = 0; v < V; ++v) sum[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_broadcast_ss(p + j);
    for (int v = 0; v < V; ++v) sum[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + j * stride + 8 * v), sum[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + 8 * v, sum[v]);
}

// One head: softmax(scale * keys q, with an optional sink logit) over n rows -> acc [D] = p values.
// keys and values are [n, D] fp32 (the same rows for V4's shared K=V); p holds n floats of scratch.
// A sink of -inf is no sink; with no rows and no sink the result is zero.
void attend_head(const float* qf, const float* keys, const float* values, int64_t n, int64_t D, float scale,
                 float sink, float* p, float* acc) {
  std::fill(acc, acc + D, 0.0f);
  int64_t j = 0;
  if (D % 8 == 0)
    for (; j + 8 <= n; j += 8) dot8(qf, keys + j * D, D, scale, p + j);
  for (; j < n; ++j) p[j] = dot(qf, keys + j * D, D) * scale;
  float m = sink;
  for (j = 0; j < n; ++j) m = std::max(m, p[j]);
  if (m == -INFINITY) return;
  const float denom = exp_shifted(p, n, m) + std::exp(sink - m);
  for (int64_t j = 0; j < n; ++j) p[j] /= denom;
  int64_t d0 = 0;
  for (; d0 + PV_DIMS <= D; d0 += PV_DIMS) weighted_sum<PV_DIMS / 8>(p, values + d0, n, D, acc + d0);
  for (; d0 + 8 <= D; d0 += 8) weighted_sum<1>(p, values + d0, n, D, acc + d0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = d0; d < D; ++d) acc[d] += p[j] * values[j * D + d];
}

// V4 sequence b: gathers its valid keys into kv [n, D] fp32, then each head's softmax-weighted sum.
void attend_sequence(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                     const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t b,
                     int64_t H, int64_t D, int64_t W, int64_t K, std::vector<float>& kv, std::vector<float>& work) {
  int64_t n = 0;
  for (int64_t w = 0; w < std::min(ring_len[b], W); ++w, ++n) load_row(ring, (b * W + w) * D, D, bf16, &kv[n * D]);
  for (int64_t k = 0; k < K; ++k)
    if (comp_valid[b * K + k]) load_row(comp, (b * K + k) * D, D, bf16, &kv[n++ * D]);
  float* qf = work.data();        // [D]
  float* p = qf + D;              // [n]
  float* acc = p + W + K;         // [D]
  for (int64_t h = 0; h < H; ++h) {
    load_row(q, (b * H + h) * D, D, bf16, qf);
    attend_head(qf, kv.data(), kv.data(), n, D, scale, sinks[h], p, acc);
    store_row(out, (b * H + h) * D, D, bf16, acc);
  }
}

}  // namespace

void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads) {
  // Sequences split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = threads_for(B * H * (W + K) * D, num_threads, 1 << 22);
  parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
    std::vector<float> kv(static_cast<size_t>((W + K) * D)), work(static_cast<size_t>(2 * D + W + K));
    for (int64_t b = b0; b < b1; ++b)
      attend_sequence(q, ring, ring_len, comp, comp_valid, sinks, scale, out, bf16, b, H, D, W, K, kv, work);
  });
}

// Task (b, g): sequence b's keys and values of kv head g, gathered through its block table into fp32
// [n, D] buffers, then the H / Hkv query heads of the group.
void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int num_threads) {
  const int64_t group = H / Hkv, max_keys = max_blocks * block_size;
  const int threads = threads_for(B * H * max_keys * D, num_threads, 1 << 20);
  parallel_ranges(B * Hkv, threads, [&](int64_t t0, int64_t t1) {
    std::vector<float> keys(static_cast<size_t>(max_keys * D)), values(keys.size());
    std::vector<float> qf(static_cast<size_t>(D)), p(static_cast<size_t>(max_keys)), acc(qf.size());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, g = t % Hkv, n = std::min(context_lens[b], max_keys);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t row = (block_tables[b * max_blocks + j / block_size] * block_size + j % block_size) * Hkv + g;
        load_row(k_cache, row * D, D, bf16, &keys[j * D]);
        load_row(v_cache, row * D, D, bf16, &values[j * D]);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        load_row(q, (b * H + h) * D, D, bf16, qf.data());
        attend_head(qf.data(), keys.data(), values.data(), n, D, scale, -INFINITY, p.data(), acc.data());
        store_row(out, (b * H + h) * D, D, bf16, acc.data());
      }
    }
  });
}

}  // namespace deepinfer
