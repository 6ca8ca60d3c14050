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
  // Decode attention's weighted sum (attention_kernel.h): heads sharing each loaded value vector, with 4
  // vectors of dims each (8 accumulators + 4 values + 1 weight).
  static constexpr int PV_HEADS = 2;

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

}  // namespace deepinfer
