#pragma once
// Vector traits the GEMM kernel (gemm_kernel.h) is written against: one kernel source, one traits
// struct per instruction set. Each struct is defined in the translation unit compiled for its ISA
// (Avx512 under a `#pragma GCC target` in gemm_avx512.cpp), so no wider instruction leaks into code
// that runs on a CPU without it.
#include <immintrin.h>

#include <cstdint>

#include "cpu/simd.h"

namespace deepinfer {

struct Avx2 {
  using reg = __m256;
  using xtype = float;
  using xreg = reg;
  using wreg = reg;
  static constexpr int LANES = 8;
  // Tile shapes measured best with 16 ymm registers: a GEMV keeps 8 weight streams in flight; small M
  // shares 4 widened weight vectors across 2 rows; larger M shares 3 across 4 rows (12 accumulators +
  // 3 weights + 1 input). The wide path's outer products take 6 weight rows (12 accumulators).
  static constexpr int GEMV_C = 8, SMALL_R = 2, SMALL_C = 4, BIG_R = 4, BIG_C = 3, WIDE_N = 6;
  // Decode attention's weighted sum (attention_kernel.h): heads sharing each loaded value vector, with PV_DIMS
  // vectors of dims each (8 accumulators + 2 values + 1 weight). A bf16 value vector costs three uops to widen on
  // the FP pipes the FMAs use: 4 heads x 2 vectors spend 6 of them per 8 FMAs, 2 heads x 4 vectors spent 12.
  static constexpr int PV_HEADS = 4, PV_DIMS = 2;

  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static xreg load_x(const float* p) { return load(p); }
  static float x_at(const float* x, int64_t i) { return x[i]; }
  static reg load_bf16(const uint16_t* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static float sum(reg v) { return hsum(v); }
  static __m256 fold8(reg v) { return v; }  // lanes added down to 8, in a fixed order
};

// Packed weights (pair_tile in gemm_kernel.h) on AVX2, which has no bf16 products: a panel row is 16 columns x
// a pair of k (64 bytes), taken one k at a time (PAIR_STEPS 2): step 0 widens the even-k halves (a shift), step 1
// the odd-k halves (a mask), and each row of x adds x[k] (a broadcast) times them by an FMA. x stays fp32, and each
// column sums its k in order whatever the rows: batch-invariant as the tiles are.
struct Avx2Pairs : Avx2 {
  struct wreg {
    __m256 v[2];  // one k's columns 0-7 and 8-15
  };
  static constexpr int PANEL_VECS = 2, PAIR_STEPS = 2;
  // Rows of x per pass over the panels: 6 rows x 1 panel hold 12 accumulators, 2 weight vectors and one
  // broadcast, and every weight vector widened serves 6 FMAs: 6 / 5 / 4 rows ran 98 / 93 / 90 GFLOP/s against 60
  // for 4 rows that added each pair's two products first (mul + fma + add per 16 products; Zen 3, one thread, hot,
  // K 1024). One row reads 4 panels at once and prefetches each panel's own stream near_prefetch bytes ahead into
  // L1: cold weights on 2 MiB pages read 1.1-1.2x faster than with 2 panels and whole panels prefetched ahead
  // into L2, at about a plain sum's rate (Zen 3, two threads). Two rows read 2 panels the same way (8 accumulators):
  // experts of 2 rows, cold, 15-17 -> 19-20 GB/s at one thread and 27-28 -> 31-32 at two against one panel with
  // whole panels prefetched into L2 (Zen 3, runs alternated); at 3-4 rows two panels (or the near prefetch on one)
  // read slower, and one panel stays.
  static constexpr int PAIR_ROWS = 6;
  static constexpr int pair_cols(int rows) { return rows <= 1 ? 4 : rows == 2 ? 2 : 1; }
  static constexpr int64_t near_prefetch(int rows) { return rows <= 2 ? 512 : 0; }

  // The panel row at p, widened: its even k (step 0) or its odd k (step 1).
  static wreg load_pair(const uint16_t* p, int step) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    if (step == 0)
      return {{_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))}};
    return {{_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))}};
  }
  static xreg broadcast_pair(const float* p, int step) { return _mm256_broadcast_ss(p + step); }
  static reg fma_pair(xreg x, const wreg& w, int v, reg acc) { return _mm256_fmadd_ps(x, w.v[v], acc); }
};

}  // namespace deepinfer
