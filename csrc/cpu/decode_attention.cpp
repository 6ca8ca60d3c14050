#include "cpu/decode_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/attention_kernel.h"
#include "cpu/bf16.h"
#include "cpu/cpu_features.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "cpu/vec.h"

namespace deepinfer {

// attention_avx512.cpp: attention_kernel.h compiled for AVX-512.
void attend_group_avx512(const float* q, int64_t G, const float* keys, const float* values, int64_t n, int64_t D,
                         float scale, const float* sinks, float* p, float* out);

namespace {

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, float, const float*,
                          float*, float*);

// The widest instantiation this CPU runs.
AttendFn attend_fn() {
  return isa_supported(Isa::AVX512) ? attend_group_avx512 : attn::attend_group<Avx2>;
}

// V4 sequence b: gathers its valid keys into kv [n, D] fp32, then all H heads over it (K = V).
void attend_sequence(AttendFn attend, const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                     const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t b,
                     int64_t H, int64_t D, int64_t W, int64_t K, std::vector<float>& kv, std::vector<float>& work) {
  int64_t n = 0;
  for (int64_t w = 0; w < std::min(ring_len[b], W); ++w, ++n) load_row(ring, (b * W + w) * D, D, bf16, &kv[n * D]);
  for (int64_t k = 0; k < K; ++k)
    if (comp_valid[b * K + k]) load_row(comp, (b * K + k) * D, D, bf16, &kv[n++ * D]);
  float* qf = work.data();     // [H, D]
  float* acc = qf + H * D;     // [H, D]
  float* p = acc + H * D;      // [H, n]
  load_row(q, b * H * D, H * D, bf16, qf);
  attend(qf, H, kv.data(), kv.data(), n, D, scale, sinks, p, acc);
  store_row(out, b * H * D, H * D, bf16, acc);
}

}  // namespace

void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads) {
  // Sequences split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = threads_for(B * H * (W + K) * D, num_threads, 1 << 22);
  const AttendFn attend = attend_fn();
  parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
    std::vector<float> kv(static_cast<size_t>((W + K) * D)), work(static_cast<size_t>(H * (2 * D + W + K)));
    for (int64_t b = b0; b < b1; ++b)
      attend_sequence(attend, q, ring, ring_len, comp, comp_valid, sinks, scale, out, bf16, b, H, D, W, K, kv, work);
  });
}

// Task b: sequence b's keys and values, widened block by block (each block's rows of all kv heads are one
// contiguous run, which the hardware prefetcher streams) into fp32 [Hkv, n, D] buffers; then each kv head's
// H / Hkv query heads at once.
void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int num_threads) {
  const int64_t group = H / Hkv, max_keys = max_blocks * block_size, row = Hkv * D;
  const int threads = threads_for(B * H * max_keys * D, num_threads, 1 << 20);
  const AttendFn attend = attend_fn();
  parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
    std::vector<float> keys(static_cast<size_t>(Hkv * max_keys * D)), values(keys.size());
    std::vector<float> qf(static_cast<size_t>(H * D)), p(static_cast<size_t>(group * max_keys)), acc(qf.size());
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = std::min(context_lens[b], max_keys);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t src = (block_tables[b * max_blocks + j / block_size] * block_size + j % block_size) * row;
        for (int64_t g = 0; g < Hkv; ++g) {
          load_row(k_cache, src + g * D, D, bf16, &keys[(g * n + j) * D]);
          load_row(v_cache, src + g * D, D, bf16, &values[(g * n + j) * D]);
        }
      }
      load_row(q, b * H * D, H * D, bf16, qf.data());
      for (int64_t g = 0; g < Hkv; ++g)
        attend(&qf[g * group * D], group, &keys[g * n * D], &values[g * n * D], n, D, scale, nullptr, p.data(),
               &acc[g * group * D]);
      store_row(out, b * H * D, H * D, bf16, acc.data());
    }
  });
}

}  // namespace deepinfer
