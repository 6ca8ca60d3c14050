#include "cpu/decode_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "cpu/attention_kernel.h"
#include "cpu/bf16.h"
#include "cpu/cpu_features.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "cpu/vec.h"

namespace deepinfer {

// attention_avx512.cpp: attention_kernel.h compiled for AVX-512.
void attend_group_avx512(const float* q, int64_t G, const float* keys, const float* values, int64_t n, int64_t D,
                         int64_t ld, float scale, const float* sinks, float* p, float* out);
// attention_avx512bf16.cpp: one sequence on bf16 q and caches, keys never widened.
size_t paged_sequence_avx512bf16_bytes(int64_t H, int64_t D, int64_t max_keys);
void paged_sequence_avx512bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                               int64_t n, float scale, uint16_t* out, int64_t H, int64_t Hkv, int64_t D,
                               int64_t block_size, char* work);

namespace {

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, float,
                          const float*, float*, float*);

// The fp32 instantiation for isa (AVX512 or AVX2).
AttendFn attend_fn(Isa isa) { return isa == Isa::AVX512 ? attend_group_avx512 : attn::attend_group<Avx2>; }

// Sequences [b0, b1) of paged_decode_attention on the AVX512_BF16 path.
void paged_sequences_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          const int64_t* block_tables, const int64_t* context_lens, float scale, uint16_t* out,
                          int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int64_t b0,
                          int64_t b1) {
  Scratch<char> work(ScratchUse::DECODE_ATTENTION, paged_sequence_avx512bf16_bytes(H, D, max_blocks * block_size));
  for (int64_t b = b0; b < b1; ++b)
    paged_sequence_avx512bf16(q + b * H * D, k_cache, v_cache, block_tables + b * max_blocks,
                              std::min(context_lens[b], max_blocks * block_size), scale, out + b * H * D, H, Hkv, D,
                              block_size, work.data());
}

// V4 sequence b: gathers its valid keys into kv [n, D] fp32, then all H heads over it (K = V). work: (W + K) * D +
// H * (2 * D + W + K) floats.
void attend_sequence(AttendFn attend, const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                     const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t b,
                     int64_t H, int64_t D, int64_t W, int64_t K, float* work) {
  float* kv = work;               // [n, D]
  float* qf = kv + (W + K) * D;   // [H, D]
  float* acc = qf + H * D;        // [H, D]
  float* p = acc + H * D;         // [H, n]
  int64_t n = 0;
  for (int64_t w = 0; w < std::min(ring_len[b], W); ++w, ++n) load_row(ring, (b * W + w) * D, D, bf16, &kv[n * D]);
  for (int64_t k = 0; k < K; ++k)
    if (comp_valid[b * K + k]) load_row(comp, (b * K + k) * D, D, bf16, &kv[n++ * D]);
  load_row(q, b * H * D, H * D, bf16, qf);
  attend(qf, H, kv, kv, n, D, D, scale, sinks, p, acc);
  store_row(out, b * H * D, H * D, bf16, acc);
}

}  // namespace

void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads) {
  // Sequences split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = threads_for(B * H * (W + K) * D, num_threads, 1 << 22);
  const AttendFn attend = attend_fn(decode_attention_isa(false, D));
  parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
    Scratch<float> work(ScratchUse::DECODE_ATTENTION, (W + K) * D + H * (2 * D + W + K));
    for (int64_t b = b0; b < b1; ++b)
      attend_sequence(attend, q, ring, ring_len, comp, comp_valid, sinks, scale, out, bf16, b, H, D, W, K, work.data());
  });
}

bool decode_attention_runs(Isa isa, bool bf16, int64_t D) {
  if (isa == Isa::AVX512_BF16) return bf16 && D % 32 == 0 && isa_supported(isa);
  return (isa == Isa::AVX2 || isa == Isa::AVX512) && isa_supported(isa);
}

Isa decode_attention_isa(bool bf16, int64_t D) {
  for (Isa isa : {Isa::AVX512_BF16, Isa::AVX512})
    if (decode_attention_runs(isa, bf16, D)) return isa;
  return Isa::AVX2;
}

namespace {

// Keys or values of one sequence's first n positions, heads' elements [h0, h0 + width) of each row (row: Hkv * D
// elements) -> dst [n, width] fp32. All heads: a cache block's rows are one contiguous run, widened in one loop.
void widen_heads(const void* cache, bool bf16, const int64_t* table, int64_t n, int64_t block_size, int64_t row,
                 int64_t h0, int64_t width, float* dst) {
  for (int64_t j = 0; j < n; j += block_size) {
    const int64_t src = table[j / block_size] * block_size * row + h0, rows = std::min(block_size, n - j);
    if (width == row) {
      load_row(cache, src, rows * row, bf16, dst + j * row);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) load_row(cache, src + r * row, width, bf16, dst + (j + r) * width);
  }
}

}  // namespace

// AVX2 / AVX512, task (b, part): sequence b's kv heads [g0, g1) (all of them when there are as many sequences as
// threads; with fewer, the heads are split so every thread has work: at batch 1 a layer's attention on one of two
// threads cost as much as its 2 MB o_proj on both). Their keys and values widened to fp32 once, then each kv head's
// H / Hkv query heads at once, reading its keys at a stride of (g1 - g0) * D.
void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int num_threads, Isa isa) {
  const int64_t group = H / Hkv, max_keys = max_blocks * block_size, row = Hkv * D;
  const int threads = threads_for(B * H * max_keys * D, num_threads);
  if (isa == Isa::AVX512_BF16)
    return parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
      paged_sequences_bf16(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                           static_cast<const uint16_t*>(v_cache), block_tables, context_lens, scale,
                           static_cast<uint16_t*>(out), H, Hkv, D, block_size, max_blocks, b0, b1);
    });
  const AttendFn attend = attend_fn(isa);
  const int64_t parts = B >= threads ? 1 : std::min<int64_t>(Hkv, (threads + B - 1) / B);
  parallel_ranges(B * parts, threads, [&](int64_t t0, int64_t t1) {
    // This thread's buffers (no zeroing: only what a task writes is read): keys, values [max_keys, Hkv, D] (at
    // most), q, out [H, D], p [group, max_keys].
    Scratch<float> work(ScratchUse::DECODE_ATTENTION, 2 * max_keys * row + 2 * H * D + group * max_keys);
    float *keys = work.data(), *values = keys + max_keys * row, *qf = values + max_keys * row, *acc = qf + H * D;
    float* p = acc + H * D;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / parts, g0 = Hkv * (t % parts) / parts, g1 = Hkv * (t % parts + 1) / parts;
      const int64_t n = std::min(context_lens[b], max_keys), width = (g1 - g0) * D, q_elems = (g1 - g0) * group * D;
      widen_heads(k_cache, bf16, block_tables + b * max_blocks, n, block_size, row, g0 * D, width, keys);
      widen_heads(v_cache, bf16, block_tables + b * max_blocks, n, block_size, row, g0 * D, width, values);
      load_row(q, (b * H + g0 * group) * D, q_elems, bf16, qf);
      for (int64_t g = 0; g < g1 - g0; ++g)
        attend(qf + g * group * D, group, keys + g * D, values + g * D, n, D, width, scale, nullptr, p, acc + g * group * D);
      store_row(out, (b * H + g0 * group) * D, q_elems, bf16, acc);
    }
  });
}

}  // namespace deepinfer
