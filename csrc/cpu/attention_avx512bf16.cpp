// Paged GQA decode attention on bf16 q and caches with bf16 dot products (vdpbf16ps), for CPUs with
// AVX512-BF16. The fp32 path (attention_kernel.h) widens every key and value vector and sums each score across
// lanes; at batch 64 widening and sums took ~70% of its time (Zen 4, perf, when it still widened into buffers).
// Here the keys stay bf16: 16 keys' rows are transposed as bf16 pairs, so one vector holds one pair of
// dimensions of 16 keys and each query head's pair is a broadcast operand: 16 scores per accumulator, no
// horizontal sums. Values are widened in registers as they are read. Headers with non-template code are
// included above the target pragma; decode_attention.cpp calls this only on CPUs that have AVX512-BF16.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/attention_kernel.h"
#include "cpu/bf16.h"
#include "cpu/simd.h"

#pragma GCC push_options
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*, which -Wmaybe-uninitialized misreads.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,tune=generic")
#include "cpu/vec_avx512.h"

namespace deepinfer {
namespace {

constexpr int KEYS = 16;   // keys per score vector: one per fp32 lane
constexpr int PAIRS = 16;  // bf16 pairs in a 512-bit load of a row (32 dimensions)
constexpr int HEADS = 4;   // query heads per pass: their accumulators (scores: 4, values: 4 x 4) stay in registers

// r[i] <- column i of the 16 x 16 matrix of 32-bit elements whose row j is r[j]: 32-bit then 64-bit
// interleaves transpose each 128-bit lane's 4 x 4 blocks, then two rounds of lane shuffles move the blocks.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // s[4a + c], lane L: rows 4a..4a+3 of column 4L + c.
  __m512i s[16];
  for (int a = 0; a < 16; a += 4) {
    s[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    s[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    s[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    s[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of lanes among s[c], s[4 + c], s[8 + c], s[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(s[c], s[4 + c], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0x88), y1 = _mm512_shuffle_i32x4(s[8 + c], s[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

inline __m512bh pair_of(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// p[h * ldp + j] = scale * (q[h] . key j) for HP heads q [HP, D] and the 16 keys at cache + rows[j] (D bf16 each).
template <int HP>
void score_keys(const uint16_t* cache, const int64_t* rows, const uint16_t* q, int64_t D, float scale, float* p,
                int64_t ldp) {
  __m512 acc[HP];
  for (int h = 0; h < HP; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < D; d0 += 2 * PAIRS) {
    __m512i r[KEYS];
    for (int j = 0; j < KEYS; ++j) r[j] = _mm512_loadu_si512(cache + rows[j] + d0);
    transpose16(r);  // r[i]: dimensions d0 + 2i, d0 + 2i + 1 of the 16 keys
    for (int i = 0; i < PAIRS; ++i)
      for (int h = 0; h < HP; ++h) acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)r[i], pair_of(q + h * D + d0 + 2 * i));
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int h = 0; h < HP; ++h) _mm512_storeu_ps(p + h * ldp, _mm512_mul_ps(acc[h], s));
}

void score_pass(int heads, const uint16_t* cache, const int64_t* rows, const uint16_t* q, int64_t D, float scale,
                float* p, int64_t ldp) {
  switch (heads) {
    case 1: return score_keys<1>(cache, rows, q, D, scale, p, ldp);
    case 2: return score_keys<2>(cache, rows, q, D, scale, p, ldp);
    case 3: return score_keys<3>(cache, rows, q, D, scale, p, ldp);
    default: return score_keys<HEADS>(cache, rows, q, D, scale, p, ldp);
  }
}

inline __m512 widen16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// out[h * D + (0, 16 DR)) = sum_{j < n} p[h * ldp + j] * value j for HP heads, value j's 16 DR dimensions at
// cache + rows[j] (bf16, widened in registers).
template <int HP, int DR>
void weigh_values(const float* p, int64_t ldp, int64_t n, const uint16_t* cache, const int64_t* rows, float* out,
                  int64_t D) {
  __m512 acc[HP][DR];
  for (int h = 0; h < HP; ++h)
    for (int r = 0; r < DR; ++r) acc[h][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[DR];
    for (int r = 0; r < DR; ++r) v[r] = widen16(cache + rows[j] + 16 * r);
    for (int h = 0; h < HP; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * ldp + j]);
      for (int r = 0; r < DR; ++r) acc[h][r] = _mm512_fmadd_ps(w, v[r], acc[h][r]);
    }
  }
  for (int h = 0; h < HP; ++h)
    for (int r = 0; r < DR; ++r) _mm512_storeu_ps(out + h * D + 16 * r, acc[h][r]);
}

template <int DR>
void value_pass(int heads, const float* p, int64_t ldp, int64_t n, const uint16_t* cache, const int64_t* rows,
                float* out, int64_t D) {
  switch (heads) {
    case 1: return weigh_values<1, DR>(p, ldp, n, cache, rows, out, D);
    case 2: return weigh_values<2, DR>(p, ldp, n, cache, rows, out, D);
    case 3: return weigh_values<3, DR>(p, ldp, n, cache, rows, out, D);
    default: return weigh_values<HEADS, DR>(p, ldp, n, cache, rows, out, D);
  }
}

// The 16 rows at cache + rows[j] (width elements each: the kv heads read) fetched towards L1 ahead of their use.
void prefetch_rows(const uint16_t* cache, const int64_t* rows, int64_t width) {
  for (int j = 0; j < KEYS; ++j)
    for (int64_t e = 0; e < width; e += 32)
      _mm_prefetch(reinterpret_cast<const char*>(cache + rows[j] + e), _MM_HINT_T1);
}

}  // namespace

size_t paged_sequence_avx512bf16_bytes(int64_t H, int64_t D, int64_t max_keys) {
  const int64_t padded = round_up(max_keys, KEYS);
  return padded * sizeof(int64_t) + (H * padded + H * D) * sizeof(float);
}

// One sequence of paged_decode_attention (decode_attention.h) with bf16 q, caches and out, D a multiple of 32, for
// Hkv of its kv heads (the caches' row holds `row` elements: all kv heads; k_cache and v_cache start at the first
// head read) and their H query heads (q and out: [H, D]); table: its block ids; work:
// paged_sequence_avx512bf16_bytes(H, D, >= n), 64-byte aligned.
void paged_sequence_avx512bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                               int64_t n, float scale, uint16_t* out, int64_t H, int64_t Hkv, int64_t D, int64_t row,
                               int64_t block_size, char* work) {
  const int64_t group = H / Hkv, width = Hkv * D, padded = round_up(n, KEYS);
  int64_t* rows = reinterpret_cast<int64_t*>(work);  // [padded] element offset of key j's row
  float* p = reinterpret_cast<float*>(rows + padded);  // [H, padded] scores, then probabilities
  float* acc = p + H * padded;                         // [H, D]
  // The last chunk's keys past n repeat key n - 1: finite rows whose scores are never read.
  for (int64_t j = 0; j < padded; ++j) {
    const int64_t t = std::min(j, n - 1);
    rows[j] = (table[t / block_size] * block_size + t % block_size) * row;
  }
  // Offsets of the rows at head g: rows[j] + g * D, applied by moving the cache base.
  for (int64_t c = 0; c < padded; c += KEYS) {
    if (c + KEYS < padded) prefetch_rows(k_cache, rows + c + KEYS, width);
    prefetch_rows(v_cache, rows + c, width);
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t h = g * group; h < (g + 1) * group; h += HEADS)
        score_pass(static_cast<int>(std::min<int64_t>(HEADS, (g + 1) * group - h)), k_cache + g * D, rows + c,
                   q + h * D, D, scale, p + h * padded + c, padded);
  }
  // n >= 1: never all -inf
  for (int64_t h = 0; h < H; ++h) attn::softmax_with_sink<Avx512>(p + h * padded, n, -INFINITY);
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t h = g * group; h < (g + 1) * group; h += HEADS) {
      const int heads = static_cast<int>(std::min<int64_t>(HEADS, (g + 1) * group - h));
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64)
        value_pass<4>(heads, p + h * padded, padded, n, v_cache + g * D + d0, rows, acc + h * D + d0, D);
      if (d0 < D) value_pass<2>(heads, p + h * padded, padded, n, v_cache + g * D + d0, rows, acc + h * D + d0, D);
    }
  store_row(out, 0, H * D, true, acc);
}

}  // namespace deepinfer
#pragma GCC pop_options
