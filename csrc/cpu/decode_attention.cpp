#include "cpu/decode_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/attention_kernel.h"
#include "cpu/bf16.h"
#include "cpu/cpu_features.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "cpu/vec.h"

namespace deepinfer {

// attention_avx512.cpp: attention_kernel.h compiled for AVX-512, on fp32 and on bf16 rows.
void attend_heads_avx512(const float* q, int64_t kv_heads, int64_t group, const float* keys, const float* values,
                         const int64_t* rows, int64_t n, int64_t D, float scale, const float* sinks, float* p,
                         float* out);
void attend_heads_avx512(const float* q, int64_t kv_heads, int64_t group, const uint16_t* keys, const uint16_t* values,
                         const int64_t* rows, int64_t n, int64_t D, float scale, const float* sinks, float* p,
                         float* out);
// attention_avx512bf16.cpp: one sequence on bf16 q and caches, keys never widened.
size_t paged_sequence_avx512bf16_bytes(int64_t H, int64_t D, int64_t max_keys);
void paged_sequence_avx512bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                               int64_t n, float scale, uint16_t* out, int64_t H, int64_t Hkv, int64_t D, int64_t row,
                               int64_t block_size, char* work);

namespace {

template <class T>
using AttendFn = void (*)(const float*, int64_t, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, float,
                          const float*, float*, float*);

// The instantiation for isa (AVX512 or AVX2) on rows of T (float, or uint16_t: bf16).
template <class T>
AttendFn<T> attend_fn(Isa isa) {
  if (isa == Isa::AVX512) return attend_heads_avx512;
  return attn::attend_heads<Avx2, T>;
}

// The tasks of paged_decode_attention: (sequence b, its kv heads [g0, g1)). A task is a whole sequence when the
// sequences share out evenly over the threads, or are many; otherwise each sequence's kv heads are split into
// threads / gcd(B, threads) parts (as far as it has kv heads), so the tasks share out evenly: at batch 1 a layer's
// attention on one of two threads cost as much as its 2 MB o_proj on both, and at batch 3 and 2k context two
// threads took 9.2 ms over 16 layers with whole sequences (two on one thread) against 6.6 split.
struct HeadSplit {
  int64_t B, Hkv, parts;

  HeadSplit(int64_t batch, int64_t kv_heads, int threads)
      : B(batch), Hkv(kv_heads),
        parts(B >= 4 * threads ? 1 : std::min<int64_t>(Hkv, threads / std::gcd<int64_t>(B, threads))) {}
  int64_t tasks() const { return B * parts; }
  int64_t b(int64_t task) const { return task / parts; }
  int64_t g0(int64_t task) const { return Hkv * (task % parts) / parts; }
  int64_t g1(int64_t task) const { return Hkv * (task % parts + 1) / parts; }
};

// paged_decode_attention on the AVX512_BF16 path.
void paged_sequences_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          const int64_t* block_tables, const int64_t* context_lens, float scale, uint16_t* out,
                          int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                          int threads) {
  const int64_t group = H / Hkv, max_keys = max_blocks * block_size;
  const HeadSplit split(B, Hkv, threads);
  parallel_ranges(split.tasks(), threads, [&](int64_t t0, int64_t t1) {
    Scratch<char> work(ScratchUse::DECODE_ATTENTION, paged_sequence_avx512bf16_bytes(H, D, max_keys));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = split.b(t), g0 = split.g0(t), g1 = split.g1(t), first = (b * H + g0 * group) * D;
      paged_sequence_avx512bf16(q + first, k_cache + g0 * D, v_cache + g0 * D, block_tables + b * max_blocks,
                                std::min(context_lens[b], max_keys), scale, out + first, (g1 - g0) * group, g1 - g0, D,
                                Hkv * D, block_size, work.data());
    }
  });
}

// V4 sequence b: gathers its valid keys into kv [n, D] fp32, then all H heads over it (K = V). work: W + K row
// offsets (int64), then (W + K) * D + H * (2 * D + W + K) floats.
void attend_sequence(AttendFn<float> attend, const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                     const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t b,
                     int64_t H, int64_t D, int64_t W, int64_t K, int64_t* work) {
  int64_t* rows = work;                                // [n]
  float* kv = reinterpret_cast<float*>(rows + W + K);  // [n, D]
  float* qf = kv + (W + K) * D;                        // [H, D]
  float* acc = qf + H * D;                             // [H, D]
  float* p = acc + H * D;                              // [H, n]
  int64_t n = 0;
  for (int64_t w = 0; w < std::min(ring_len[b], W); ++w, ++n) load_row(ring, (b * W + w) * D, D, bf16, &kv[n * D]);
  for (int64_t k = 0; k < K; ++k)
    if (comp_valid[b * K + k]) load_row(comp, (b * K + k) * D, D, bf16, &kv[n++ * D]);
  for (int64_t j = 0; j < n; ++j) rows[j] = j * D;
  load_row(q, b * H * D, H * D, bf16, qf);
  attend(qf, 1, H, kv, kv, rows, n, D, scale, sinks, p, acc);
  store_row(out, b * H * D, H * D, bf16, acc);
}

}  // namespace

void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads) {
  // Sequences split across threads only when each gets enough work to beat the wake-up cost.
  const int threads = threads_for(B * H * (W + K) * D, num_threads, 1 << 22);
  const AttendFn<float> attend = attend_fn<float>(decode_attention_isa(false, D));
  parallel_ranges(B, threads, [&](int64_t b0, int64_t b1) {
    Scratch<int64_t> work(ScratchUse::DECODE_ATTENTION, W + K + ((W + K) * D + H * (2 * D + W + K) + 1) / 2);
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

// AVX2 / AVX512 on rows of T, one HeadSplit task at a time, read in place through its rows' offsets.
template <class T>
void paged_sequences(const void* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                     const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H, int64_t Hkv,
                     int64_t D, int64_t block_size, int64_t max_blocks, int threads, Isa isa) {
  const int64_t group = H / Hkv, max_keys = max_blocks * block_size, row = Hkv * D;
  const AttendFn<T> attend = attend_fn<T>(isa);
  const HeadSplit split(B, Hkv, threads);
  parallel_ranges(split.tasks(), threads, [&](int64_t t0, int64_t t1) {
    // This thread's buffers (no zeroing: only what a task writes is read): the offsets of a sequence's rows
    // [max_keys] (int64), then q, out [H, D] and p [H, max_keys] (fp32).
    Scratch<int64_t> work(ScratchUse::DECODE_ATTENTION, max_keys + (2 * H * D + H * max_keys + 1) / 2);
    int64_t* rows = work.data();
    float *qf = reinterpret_cast<float*>(rows + max_keys), *acc = qf + H * D, *p = acc + H * D;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = split.b(t), g0 = split.g0(t), g1 = split.g1(t);
      const int64_t n = std::min(context_lens[b], max_keys), q_elems = (g1 - g0) * group * D;
      const int64_t* table = block_tables + b * max_blocks;
      for (int64_t j = 0; j < n; ++j) rows[j] = (table[j / block_size] * block_size + j % block_size) * row;
      load_row(q, (b * H + g0 * group) * D, q_elems, bf16, qf);
      attend(qf, g1 - g0, group, k_cache + g0 * D, v_cache + g0 * D, rows, n, D, scale, nullptr, p, acc);
      store_row(out, (b * H + g0 * group) * D, q_elems, bf16, acc);
    }
  });
}

}  // namespace

void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int num_threads, Isa isa) {
  const int threads = threads_for(B * H * max_blocks * block_size * D, num_threads);
  if (isa == Isa::AVX512_BF16)
    return paged_sequences_bf16(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                                static_cast<const uint16_t*>(v_cache), block_tables, context_lens, scale,
                                static_cast<uint16_t*>(out), B, H, Hkv, D, block_size, max_blocks, threads);
  if (bf16)
    return paged_sequences(q, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache),
                           block_tables, context_lens, scale, out, true, B, H, Hkv, D, block_size, max_blocks, threads,
                           isa);
  paged_sequences(q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), block_tables,
                  context_lens, scale, out, false, B, H, Hkv, D, block_size, max_blocks, threads, isa);
}

}  // namespace deepinfer
