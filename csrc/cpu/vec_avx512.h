#pragma once
// AVX-512 traits for gemm_kernel.h. Include only below `#pragma GCC target("avx512f,avx512bw,avx512vl")`
// (gemm_avx512*.cpp): these functions must not be compiled into code that runs on AVX2-only CPUs.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace deepinfer {

struct Avx512 {
  using reg = __m512;
  using xtype = float;
  using xreg = reg;
  using wreg = reg;
  static constexpr int LANES = 16;
  // 32 zmm registers: the big tile shares 6 weight vectors across 4 rows (24 accumulators + 6 + 1),
  // the wide path's outer products take 12 weight rows (12 accumulators of one 16-row group).
  static constexpr int GEMV_C = 8, SMALL_R = 2, SMALL_C = 4, BIG_R = 4, BIG_C = 6, WIDE_N = 12;
  static constexpr int PV_HEADS = 4, PV_DIMS = 4;  // 16 accumulators + 4 values + 1 weight

  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static xreg load_x(const float* p) { return load(p); }
  static float x_at(const float* x, int64_t i) { return x[i]; }
  static reg load_bf16(const uint16_t* p) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static __m256 fold8(reg v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // Halves added pairwise down to 8 lanes, then the AVX2 order: fixed for any input.
  static float sum(reg v) {
    __m256 h = fold8(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

// AVX512-BF16: vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's sum into an fp32 lane, twice the
// products per instruction of widening the weights and FMA-ing fp32, with no widening ops at all. x must be
// bf16 as well (rounded once per GEMM; exact when the activations are bf16 to begin with). Dot products
// only: no outer-product (wide) path. Include below a target pragma with avx512bf16 (gemm_avx512bf16.cpp),
// with cpu/bf16.h included above it.
struct Avx512Bf16 : Avx512 {
  using xtype = uint16_t;
  using xreg = __m512bh;
  using wreg = __m512bh;
  static constexpr int LANES = 32;  // k per step: 16 pairs
  static constexpr int WIDE_N = 0;
  // Packed weights (pair_tile): rows of x per pass over the panels (8 rows x 3 panels: 24 accumulators), and
  // panels per tile: as many as the registers hold beside R rows' accumulators (32 zmm: R * C + C + 1), at most
  // 8 panel streams (one row, K 512-1024, from memory: 8 panels read 1.1-1.4x faster than 1 or 2).
  static constexpr int PAIR_ROWS = 8;
  static constexpr int pair_cols(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 6 : rows <= 6 ? 4 : 3; }
  // Prefetch whole panels ahead into L2 (gemm_kernel.h, pair_tile), as measured best on a Zen 4.
  static constexpr int64_t near_prefetch(int) { return 0; }

  static xreg load_x(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static wreg load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  // Packed weights: a panel row's pairs in one step (vdpbf16ps adds both products of a pair at once).
  static constexpr int PAIR_STEPS = 1;
  static wreg load_pair(const uint16_t* p, int) { return load_bf16(p); }
  // The pair p[0], p[1] in every lane (packed weights' x operand).
  static xreg broadcast_pair(const uint16_t* p, int) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static reg fma(xreg x, wreg w, reg acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static constexpr int PANEL_VECS = 1;  // one vector of sums per packed panel
  static reg fma_pair(xreg x, wreg w, int, reg acc) { return fma(x, w, acc); }
  static float x_at(const uint16_t* x, int64_t i) { return from_bf16(x[i]); }
};

}  // namespace deepinfer
