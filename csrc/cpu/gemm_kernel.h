#pragma once
// The bf16-weight GEMM kernel, written once against a vector traits struct V (vec.h: Avx2,
// vec_avx512.h: Avx512 and Avx512Bf16) and instantiated in the translation unit compiled for each ISA.
// V::xtype is what x holds (float, or bf16 for the bf16 dot-product ISA); V::fma(x, w, acc) adds
// V::LANES products of x and w into acc's fp32 lanes.
// Everything here is a template, so the instantiations of different ISAs never share a symbol.
// gemm_bf16.cpp holds what does not depend on the ISA (splitting rows and threads, SwiGLU, experts).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/gemm_bf16.h"

namespace deepinfer {
namespace kernel {

// How far ahead the tiles prefetch weights, in column blocks, and into L2 (T1), not L1: a T0 prefetch one
// block ahead holds an L1 miss buffer per line, and on a Zen 4 (AVX512-BF16 tiles, one thread, experts of
// the medium Qwen3-MoE cycling through DRAM) only some 10 GB/s arrived; two blocks ahead into L2 read
// 17-21 GB/s and ran 4-8 rows per expert 1.7-2x faster (306 -> 181 us per expert at 8 rows).
constexpr int TILE_PREFETCH_BLOCKS = 2;

// An R x C tile of out: rows m0.. of x against weight rows n0.. . R*C independent FMA chains hide
// the FMA latency, and C weight streams in flight keep the memory system busy. Each output sums
// lane j of k = j mod LANES, then the lanes in a fixed order, then the tail: the same order for any
// R and C, which makes the tiles alone batch-invariant.
template <class V, int R, int C>
void tile(const typename V::xtype* x, const uint16_t* w, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  typename V::reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  int64_t k = 0;
  // Software prefetch TILE_PREFETCH_BLOCKS column blocks ahead: the hardware prefetcher alone tracks too
  // few of these parallel row streams (measured ~6 vs ~9 GB/s on the 2-core AVX2 machines).
  const bool prefetch = n0 + (TILE_PREFETCH_BLOCKS + 1) * C <= N;
  const uint16_t* ahead = w + (n0 + TILE_PREFETCH_BLOCKS * C) * K;
  for (; k + V::LANES <= K; k += V::LANES) {
    typename V::wreg wv[C];
    if (prefetch && (k & 31) == 0)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(ahead + c * K + k), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) wv[c] = V::load_bf16(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      typename V::xreg xv = V::load_x(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = V::fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = V::sum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += V::x_at(x, (m0 + r) * K + kk) * from_bf16(w[(n0 + c) * K + kk]);
      out[(m0 + r) * N + n0 + c] = s;
    }
}

// Weight rows [n0, n0+C) stay in L1 while every row block of x passes over them.
template <class V, int R, int C>
void column_block(const typename V::xtype* x, const uint16_t* w, float* out, int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<V, R, C>(x, w, out, m, n0, K, N);
  for (; m < M; ++m) tile<V, 1, C>(x, w, out, m, n0, K, N);
}

template <class V, int R, int C>
void columns(const typename V::xtype* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) column_block<V, R, C>(x, w, out, M, n, K, N);
  for (; n < n1; ++n) column_block<V, R, 1>(x, w, out, M, n, K, N);
}

// Weight rows of at most this many elements (2 KB of bf16) are read one after another by stream_rows,
// as one sequential stream: the tiles' C rows in parallel read short rows slower (measured on the
// medium-V4 experts, K = 512 / 1024 with 1-3 rows each: the stream reads 1.15-1.3x faster; 4 KB rows
// read as fast either way).
constexpr int64_t STREAM_MAX_K = 1024;
// Software prefetch distance of stream_rows in bytes (1 KB beat 256 B and 4 KB, within noise).
constexpr int64_t STREAM_PREFETCH = 1024;

// Weight rows [n0, n1) one at a time, front to back, each against all R rows of x; A accumulators per
// row of x hide the FMA latency.
template <class V, int R, int A>
void stream_rows(const typename V::xtype* x, const uint16_t* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int L = V::LANES;
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  const bool prefetch = stream_prefetch();
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    typename V::reg acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
    int64_t k = 0;
    for (; k + L * A <= K; k += L * A) {
      // Every line this step reads, STREAM_PREFETCH ahead (one step is 1-4 lines, by the ISA's width).
      const char* ahead = reinterpret_cast<const char*>(row + k) + STREAM_PREFETCH;
      for (int line = 0; prefetch && line < L * A * 2; line += 64)
        if (ahead + line < end) _mm_prefetch(ahead + line, _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        typename V::wreg wv = V::load_bf16(row + k + L * a);
        for (int r = 0; r < R; ++r) acc[r][a] = V::fma(V::load_x(x + r * K + k + L * a), wv, acc[r][a]);
      }
    }
    for (; k + L <= K; k += L) {
      typename V::wreg wv = V::load_bf16(row + k);
      for (int r = 0; r < R; ++r) acc[r][0] = V::fma(V::load_x(x + r * K + k), wv, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      typename V::reg v = acc[r][0];
      for (int a = 1; a < A; ++a) v = V::add(v, acc[r][a]);
      float s = V::sum(v);
      for (int64_t kk = k; kk < K; ++kk) s += V::x_at(x, r * K + kk) * from_bf16(row[kk]);
      out[r * N + n] = s;
    }
  }
}

// Dot-product paths by M. Up to 3 rows of x over short weight rows stream the weights instead (at 4
// rows the tiles read as fast, and their accumulators would spill). invariant: tiles only.
template <class V>
void gemm_range(const typename V::xtype* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1, bool invariant) {
  if (K <= STREAM_MAX_K && !invariant) {
    if (M == 1) return stream_rows<V, 1, 4>(x, w, out, K, N, n0, n1);
    if (M == 2) return stream_rows<V, 2, 4>(x, w, out, K, N, n0, n1);
    if (M == 3) return stream_rows<V, 3, 4>(x, w, out, K, N, n0, n1);
  }
  if (M == 1) return columns<V, 1, V::GEMV_C>(x, w, out, M, K, N, n0, n1);
  if (M < V::BIG_R) return columns<V, V::SMALL_R, V::SMALL_C>(x, w, out, M, K, N, n0, n1);
  columns<V, V::BIG_R, V::BIG_C>(x, w, out, M, K, N, n0, n1);
}

// One 16-row group of transposed x (xt [K][GEMM_GROUP]) against the WIDE_N panel rows ->
// acc_out[n][row]. next: the following WIDE_N bf16 weight rows (contiguous) or null; fetched into
// cache during these FMAs, as widening them straight from memory would stall on every line.
template <class V>
void wide_tile(const float* xt, const float* panel, int64_t K, float (*acc_out)[GEMM_GROUP], const char* next) {
  constexpr int G = GEMM_GROUP / V::LANES, WN = V::WIDE_N;
  constexpr int LINES = (16 * WN * 2 + 63) / 64;  // lines of the next rows per 16 k
  typename V::reg acc[WN][G];
  for (int j = 0; j < WN; ++j)
    for (int g = 0; g < G; ++g) acc[j][g] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (next && (k & 15) == 0)
      for (int i = 0; i < LINES; ++i) _mm_prefetch(next + k * WN * 2 + 64 * i, _MM_HINT_T0);
    typename V::reg xv[G];
    for (int g = 0; g < G; ++g) xv[g] = V::load(xt + k * GEMM_GROUP + V::LANES * g);
    for (int j = 0; j < WN; ++j) {
      typename V::reg b = V::broadcast(panel + j * K + k);
      for (int g = 0; g < G; ++g) acc[j][g] = V::fma(xv[g], b, acc[j][g]);
    }
  }
  for (int j = 0; j < WN; ++j)
    for (int g = 0; g < G; ++g) V::store(acc_out[j] + V::LANES * g, acc[j][g]);
}

template <class V>
void widen_rows(const uint16_t* w, float* panel, int64_t rows, int64_t K) {
  int64_t i = 0;
  for (; i + V::LANES <= rows * K; i += V::LANES) V::store(panel + i, V::load_bf16(w + i));
  for (; i < rows * K; ++i) panel[i] = from_bf16(w[i]);
}

// Outer-product path for whole 16-row groups: each block of WIDE_N weight rows is widened once into
// an fp32 panel, and every group of x passes over it with nothing but FMAs on the FP pipes.
template <class V>
void wide_range(const float* xt, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  constexpr int WN = V::WIDE_N;
  // Zero-initialised: a short last block leaves stale but finite rows, whose outputs are dropped.
  std::vector<float> panel(static_cast<size_t>(WN) * K, 0.0f);
  float acc[WN][GEMM_GROUP];
  for (int64_t n = n0; n < n1; n += WN) {
    int64_t cols = std::min<int64_t>(WN, n1 - n);
    widen_rows<V>(w + n * K, panel.data(), cols, K);
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_GROUP) {
      int64_t rows = std::min(GEMM_GROUP, M - m0);
      const bool prefetch = m0 == 0 && n + 2 * WN <= N;
      wide_tile<V>(xt + m0 * K, panel.data(), K, acc,
                   prefetch ? reinterpret_cast<const char*>(w + (n + WN) * K) : nullptr);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) out[(m0 + r) * N + n + j] = acc[j][r];
    }
  }
}

// Output columns [n0, n1): the first `wide` rows (whole groups, transposed in xt) by outer products,
// the rest by dot-product tiles. ISAs without outer products (WIDE_N 0) take wide = 0.
template <class V>
void gemm_columns(const typename V::xtype* x, const float* xt, int64_t wide, const uint16_t* w, float* out, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, bool invariant) {
  if constexpr (V::WIDE_N > 0)
    if (wide > 0) wide_range<V>(xt, w, out, wide, K, N, n0, n1);
  if (wide < M) gemm_range<V>(x + wide * K, w, out + wide * N, M - wide, K, N, n0, n1, invariant);
}

}  // namespace kernel
}  // namespace deepinfer
