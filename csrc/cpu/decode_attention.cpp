#include "cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

namespace deepinfer {
namespace {

// Sequence b: gathers its valid keys into kv [n, D] fp32, then each head's softmax-weighted sum.
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
    float m = sinks[h];
    for (int64_t j = 0; j < n; ++j) {
      p[j] = dot(qf, &kv[j * D], D) * scale;
      m = std::max(m, p[j]);
    }
    float denom = std::exp(sinks[h] - m);
    std::fill(acc, acc + D, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      p[j] = std::exp(p[j] - m);
      denom += p[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const float wj = p[j] / denom;
      for (int64_t d = 0; d < D; ++d) acc[d] += wj * kv[j * D + d];
    }
    store_row(out, (b * H + h) * D, D, bf16, acc);
  }
}

}  // namespace

void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads) {
  // Sequences split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = B * H * (W + K) * D >= (1 << 22) ? std::max(1, std::min<int>(num_threads, B)) : 1;
  parallel_for(threads, threads, [&](int64_t part) {
    std::vector<float> kv(static_cast<size_t>((W + K) * D)), work(static_cast<size_t>(2 * D + W + K));
    int64_t b0, b1;
    split_range(B, threads, part, &b0, &b1);
    for (int64_t b = b0; b < b1; ++b)
      attend_sequence(q, ring, ring_len, comp, comp_valid, sinks, scale, out, bf16, b, H, D, W, K, kv, work);
  });
}

}  // namespace deepinfer
