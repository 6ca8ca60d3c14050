#pragma once
// The GEMM kernel, written once against a vector traits struct V (vec.h: Avx2, vec_avx512.h: Avx512 and
// Avx512Bf16) and instantiated in the translation unit compiled for each ISA.
// V::xtype is what x holds (float, or bf16 for the bf16 dot-product ISA); V::fma(x, w, acc) adds
// V::LANES products of x and w into acc's fp32 lanes. Weights W are bf16 (uint16_t, widened as they are read),
// or fp32 (float: an fp32 model's, for the fp32 ISAs' dot-product tiles and panels).
// Everything here is a template, so the instantiations of different ISAs never share a symbol.
// gemm_bf16.cpp holds what does not depend on the ISA (splitting rows and threads, SwiGLU, experts).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/gemm_bf16.h"
#include "cpu/vec_load.h"

namespace deepinfer {
namespace kernel {

// How far ahead the tiles prefetch weights, in column blocks, and into L2 (T1), not L1: a T0 prefetch one
// block ahead holds an L1 miss buffer per line, and on a Zen 4 (AVX512-BF16 tiles, one thread, experts of
// the medium Qwen3-MoE cycling through DRAM) only some 10 GB/s arrived; two blocks ahead into L2 read
// 17-21 GB/s and ran 4-8 rows per expert 1.7-2x faster (306 -> 181 us per expert at 8 rows).
constexpr int TILE_PREFETCH_BLOCKS = 2;

// Elements of W per 64-byte cache line.
template <class W>
constexpr int64_t LINE_ELEMS = 64 / sizeof(W);

// An R x C tile of out: rows m0.. of x against weight rows n0.. . R*C independent FMA chains hide
// the FMA latency, and C weight streams in flight keep the memory system busy. Each output sums
// lane j of k = j mod LANES, then the lanes in a fixed order, then the tail: the same order for any
// R and C, which makes the tiles alone batch-invariant.
template <class V, int R, int C, class W>
void tile(const typename V::xtype* x, const W* w, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  typename V::reg acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  int64_t k = 0;
  // Software prefetch TILE_PREFETCH_BLOCKS column blocks ahead: the hardware prefetcher alone tracks too
  // few of these parallel row streams (measured ~6 vs ~9 GB/s on the 2-core AVX2 machines).
  const bool prefetch = n0 + (TILE_PREFETCH_BLOCKS + 1) * C <= N;
  const W* ahead = w + (n0 + TILE_PREFETCH_BLOCKS * C) * K;
  for (; k + V::LANES <= K; k += V::LANES) {
    typename V::wreg wv[C];
    if (prefetch && k % LINE_ELEMS<W> == 0)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(ahead + c * K + k), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) wv[c] = load_elems<V>(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      typename V::xreg xv = V::load_x(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = V::fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = V::sum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += V::x_at(x, (m0 + r) * K + kk) * to_float(w[(n0 + c) * K + kk]);
      out[(m0 + r) * N + n0 + c] = s;
    }
}

// Weight rows [n0, n0+C) stay in L1 while every row block of x passes over them.
template <class V, int R, int C, class W>
void column_block(const typename V::xtype* x, const W* w, float* out, int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<V, R, C>(x, w, out, m, n0, K, N);
  for (; m < M; ++m) tile<V, 1, C>(x, w, out, m, n0, K, N);
}

template <class V, int R, int C, class W>
void columns(const typename V::xtype* x, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) column_block<V, R, C>(x, w, out, M, n, K, N);
  for (; n < n1; ++n) column_block<V, R, 1>(x, w, out, M, n, K, N);
}

// Weight rows of at most this many bytes (K 1024 of bf16) are read one after another by stream_rows,
// as one sequential stream: the tiles' C rows in parallel read short rows slower (measured on the
// medium-V4 experts, K = 512 / 1024 with 1-3 rows each: the stream reads 1.15-1.3x faster; 4 KB rows
// read as fast either way).
constexpr int64_t STREAM_MAX_ROW_BYTES = 2048;
// Software prefetch distance of stream_rows in bytes (1 KB beat 256 B and 4 KB, within noise).
constexpr int64_t STREAM_PREFETCH = 1024;

// Weight rows [n0, n1) one at a time, front to back, each against all R rows of x; A accumulators per
// row of x hide the FMA latency.
template <class V, int R, int A, class W>
void stream_rows(const typename V::xtype* x, const W* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int L = V::LANES;
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  const bool prefetch = stream_prefetch();
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    typename V::reg acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
    int64_t k = 0;
    for (; k + L * A <= K; k += L * A) {
      // Every line this step reads, STREAM_PREFETCH ahead (one step is 1-8 lines, by the ISA's width and W).
      const char* ahead = reinterpret_cast<const char*>(row + k) + STREAM_PREFETCH;
      for (int line = 0; prefetch && line < L * A * static_cast<int>(sizeof(W)); line += 64)
        if (ahead + line < end) _mm_prefetch(ahead + line, _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        typename V::wreg wv = load_elems<V>(row + k + L * a);
        for (int r = 0; r < R; ++r) acc[r][a] = V::fma(V::load_x(x + r * K + k + L * a), wv, acc[r][a]);
      }
    }
    for (; k + L <= K; k += L) {
      typename V::wreg wv = load_elems<V>(row + k);
      for (int r = 0; r < R; ++r) acc[r][0] = V::fma(V::load_x(x + r * K + k), wv, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      typename V::reg v = acc[r][0];
      for (int a = 1; a < A; ++a) v = V::add(v, acc[r][a]);
      float s = V::sum(v);
      for (int64_t kk = k; kk < K; ++kk) s += V::x_at(x, r * K + kk) * to_float(row[kk]);
      out[r * N + n] = s;
    }
  }
}

// Dot-product paths by M. Up to 3 rows of x over short weight rows stream the weights instead (at 4
// rows the tiles read as fast, and their accumulators would spill). invariant: tiles only.
template <class V, class W>
void gemm_range(const typename V::xtype* x, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1, bool invariant) {
  if (K * static_cast<int64_t>(sizeof(W)) <= STREAM_MAX_ROW_BYTES && !invariant) {
    if (M == 1) return stream_rows<V, 1, 4>(x, w, out, K, N, n0, n1);
    if (M == 2) return stream_rows<V, 2, 4>(x, w, out, K, N, n0, n1);
    if (M == 3) return stream_rows<V, 3, 4>(x, w, out, K, N, n0, n1);
  }
  if (M == 1) return columns<V, 1, V::GEMV_C>(x, w, out, M, K, N, n0, n1);
  if (M < V::BIG_R) return columns<V, V::SMALL_R, V::SMALL_C>(x, w, out, M, K, N, n0, n1);
  columns<V, V::BIG_R, V::BIG_C>(x, w, out, M, K, N, n0, n1);
}

// One 16-row group of transposed x (xt [K][GEMM_GROUP]) against the WIDE_N panel rows ->
// acc_out[n][row]. next: the following WIDE_N weight rows (contiguous, of WBYTES-byte elements) or null;
// fetched into cache during these FMAs, as widening them straight from memory would stall on every line.
template <class V, int WBYTES>
void wide_tile(const float* xt, const float* panel, int64_t K, float (*acc_out)[GEMM_GROUP], const char* next) {
  constexpr int G = GEMM_GROUP / V::LANES, WN = V::WIDE_N;
  constexpr int LINES = (16 * WN * WBYTES + 63) / 64;  // lines of the next rows per 16 k
  // Every loop over acc unrolled, so all its accesses have constant indices and it stays in registers: with any
  // of them rolled, AVX2 stored all 12 accumulators at every k (31 against 87 GFLOP/s at 64 rows, K 1024, Zen 3).
  typename V::reg acc[WN][G];
#pragma GCC unroll 16
  for (int j = 0; j < WN; ++j)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) acc[j][g] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (next && (k & 15) == 0)
      for (int i = 0; i < LINES; ++i) _mm_prefetch(next + k * WN * WBYTES + 64 * i, _MM_HINT_T0);
    typename V::reg xv[G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) xv[g] = V::load(xt + k * GEMM_GROUP + V::LANES * g);
#pragma GCC unroll 16
    for (int j = 0; j < WN; ++j) {
      typename V::reg b = V::broadcast(panel + j * K + k);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) acc[j][g] = V::fma(xv[g], b, acc[j][g]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < WN; ++j)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) V::store(acc_out[j] + V::LANES * g, acc[j][g]);
}

// Weight rows [0, rows) into the fp32 panel: bf16 widened, fp32 copied.
template <class V, class W>
void widen_rows(const W* w, float* panel, int64_t rows, int64_t K) {
  int64_t i = 0;
  for (; i + V::LANES <= rows * K; i += V::LANES) V::store(panel + i, load_elems<V>(w + i));
  for (; i < rows * K; ++i) panel[i] = to_float(w[i]);
}

// Outer-product path for whole 16-row groups: each block of WIDE_N weight rows is widened once into
// an fp32 panel, and every group of x passes over it with nothing but FMAs on the FP pipes.
template <class V, class W>
void wide_range(const float* xt, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
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
      wide_tile<V, sizeof(W)>(xt + m0 * K, panel.data(), K, acc,
                              prefetch ? reinterpret_cast<const char*>(w + (n + WN) * K) : nullptr);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) out[(m0 + r) * N + n + j] = acc[j][r];
    }
  }
}

// How far ahead a tile of several panels prefetches, in panels (rounded up to whole tiles): one row over 8 panels
// from memory read 19-23 GB/s at 6-8 panels ahead against 18-21 at 16 (Zen 4, one thread, C++ harness, runs
// alternated).
constexpr int64_t PAIR_PREFETCH_PANELS = 6;

// Weights in bf16 pairs (pack_bf16_pairs): each block of PAIR_BLOCK output columns is one panel
// [K/2][PAIR_BLOCK][2], so one vector holds the block's weights for a pair of k and each row of x adds in
// its pair as a broadcast (in V::PAIR_STEPS steps: both k at once, or one after the other). Outputs need no
// horizontal sums (at 8 rows and K 512-1024 these cost a third of the dot-product tiles' time), and R rows of x
// share every weight vector: with 8 rows in one pass the experts of the medium Qwen3-MoE ran 1.3x faster than
// the dot-product tiles from memory, 1.4x in cache (Zen 4, one thread). Each lane sums its column's pairs in k
// order, whatever R and C: batch-invariant. A panel's PAIR_BLOCK sums take V::PANEL_VECS vectors. end: the block
// where prefetching stops (pair_columns).
template <class V, int R, int C>
void pair_tile(const typename V::xtype* x, const uint16_t* w, float* out, int64_t m0, int64_t b0, int64_t K,
               int64_t N, int64_t end) {
  constexpr int P = V::PANEL_VECS, WIDTH = PAIR_BLOCK / P;
  typename V::reg acc[R][C * P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C * P; ++c) acc[r][c] = V::zero();
  const int64_t panel = PAIR_BLOCK * K;  // elements per block
  const uint16_t* p = w + b0 * panel;
  // Far (V::near_prefetch(R) 0): the panels of the tile PAIR_PREFETCH_PANELS or more panels on, fetched into L2
  // while the first row block passes (later row blocks find the panels in L2). Near: each panel's own stream
  // V::near_prefetch(R) bytes ahead, into L1. Neither past `end`. One panel at a time on 2 MiB pages is one
  // sequential stream, which the hardware prefetchers follow alone.
  constexpr int64_t distance = V::near_prefetch(R);
  constexpr bool near = distance > 0;
  constexpr int64_t tiles_ahead = near ? 0 : (PAIR_PREFETCH_PANELS + C - 1) / C;
  const bool prefetch = m0 == 0 && (C > 1 || !single_panel_stream()) &&
                        (near || b0 + (tiles_ahead + 1) * C <= end);
  const char* ahead = reinterpret_cast<const char*>(p + tiles_ahead * C * panel) + distance;
  const char* stop = reinterpret_cast<const char*>(w + end * panel);
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    typename V::wreg wv[C];
    for (int c = 0; c < C && prefetch; ++c) {
      const char* line = ahead + (c * panel + kp * 2 * PAIR_BLOCK) * sizeof(uint16_t);
      if (!near) _mm_prefetch(line, _MM_HINT_T1);
      else if (line < stop) _mm_prefetch(line, _MM_HINT_T0);
    }
    for (int step = 0; step < V::PAIR_STEPS; ++step) {
      for (int c = 0; c < C; ++c) wv[c] = V::load_pair(p + c * panel + kp * 2 * PAIR_BLOCK, step);
      for (int r = 0; r < R; ++r) {
        typename V::xreg xv = V::broadcast_pair(x + (m0 + r) * K + 2 * kp, step);
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < P; ++v) acc[r][c * P + v] = V::fma_pair(xv, wv[c], v, acc[r][c * P + v]);
      }
    }
  }
  // Unrolled, so every access to acc has constant indices and the compiler keeps it in registers (with this loop
  // rolled, AVX2's 8 accumulators were stored and reloaded at every pair of k).
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C * P; ++c) V::store(out + (m0 + r) * N + b0 * PAIR_BLOCK + c * WIDTH, acc[r][c]);
}

// On 2 MiB pages (single_panel_stream) up to 4 rows read one panel after another instead: one sequential stream,
// no software prefetch, read 1.05-1.15x faster at 1-2 rows than 8 panels in parallel, and 1.0-1.25x at 3-4
// (Zen 4, one thread, K 1024 and 512, cold). From 6 rows the products are the bound, and one panel at a time
// ran 1.2-1.5x slower.
constexpr int SINGLE_PANEL_MAX_ROWS = 4;

// Rows [m0, m0 + R) over column blocks [b0, b1), C blocks per tile, the rest in tiles of C/2, C/4, ..., 1: a
// thread's short share (9 or 12 blocks of 1024 or 1536 outputs on two threads) keeps several panel streams
// in flight instead of reading its last blocks one panel at a time. end: as pair_tile's.
template <class V, int R, int C>
void pair_blocks(const typename V::xtype* x, const uint16_t* w, float* out, int64_t m0, int64_t K, int64_t N,
                 int64_t b0, int64_t b1, int64_t end) {
  int64_t b = b0;
  for (; b + C <= b1; b += C) pair_tile<V, R, C>(x, w, out, m0, b, K, N, end);
  if constexpr (C > 1) pair_blocks<V, R, C / 2>(x, w, out, m0, K, N, b, b1, end);
}

// pair_blocks for R = rows (R..V::PAIR_ROWS); C 0: as many blocks as the registers hold (V::pair_cols).
template <class V, int C, int R = 1>
void pair_rows(int64_t rows, const typename V::xtype* x, const uint16_t* w, float* out, int64_t m0, int64_t K,
               int64_t N, int64_t b0, int64_t b1, int64_t end) {
  if constexpr (R == 1)
    if (C == 0 && rows <= SINGLE_PANEL_MAX_ROWS && single_panel_stream())
      return pair_rows<V, 1>(rows, x, w, out, m0, K, N, b0, b1, end);
  if constexpr (R < V::PAIR_ROWS)
    if (rows > R) return pair_rows<V, C, R + 1>(rows, x, w, out, m0, K, N, b0, b1, end);
  pair_blocks<V, R, C ? C : V::pair_cols(R)>(x, w, out, m0, K, N, b0, b1, end);
}

// Output columns [n0, n1) (whole blocks) of packed weights. Up to V::PAIR_ROWS rows pass once over the
// weights; more rows take a group of blocks at a time, which stays in L2 while every row block passes. Up to
// STREAM_MAX_ROWS rows [n0, n1) is this thread's whole share (gemm_bf16) and the prefetches stay inside it;
// more rows come in short ranges claimed in turn, and prefetching on past a range's end fetches what this
// thread, or the other core of its L3, claims next (bounded by the range, batch 64 ran 5% slower at two threads).
template <class V>
void pair_columns(const typename V::xtype* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N,
                  int64_t n0, int64_t n1) {
  constexpr int64_t ROWS = V::PAIR_ROWS;
  const int64_t b0 = n0 / PAIR_BLOCK, b1 = n1 / PAIR_BLOCK, end = M <= STREAM_MAX_ROWS ? b1 : N / PAIR_BLOCK;
  if (M <= ROWS) return pair_rows<V, 0>(M, x, w, out, 0, K, N, b0, b1, end);
  constexpr int G = V::pair_cols(ROWS);
  // Row blocks of equal size, as far as M allows (8 rows: 4 + 4, not 6 + 2): a short block shares each widened
  // weight vector among fewer rows.
  const int64_t blocks = (M + ROWS - 1) / ROWS, rows = (M + blocks - 1) / blocks;
  for (int64_t b = b0; b < b1; b += G)
    for (int64_t m = 0; m < M; m += rows)
      pair_rows<V, G>(std::min(rows, M - m), x, w, out, m, K, N, b, std::min<int64_t>(b + G, b1), end);
}

// Output columns [n0, n1): the first `wide` rows (whole groups, transposed in xt) by outer products,
// the rest by dot-product tiles. ISAs without outer products (WIDE_N 0) take wide = 0.
template <class V, class W>
void gemm_columns(const typename V::xtype* x, const float* xt, int64_t wide, const W* w, float* out, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int64_t n1, bool invariant) {
  if constexpr (V::WIDE_N > 0)
    if (wide > 0) wide_range<V>(xt, w, out, wide, K, N, n0, n1);
  if (wide < M) gemm_range<V>(x + wide * K, w, out + wide * N, M - wide, K, N, n0, n1, invariant);
}

}  // namespace kernel
}  // namespace deepinfer
