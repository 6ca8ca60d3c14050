#include "cpu/gemm_bf16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/simd.h"

namespace deepinfer {
namespace {

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// An R x C tile of out: rows m0.. of x against weight rows n0.. . R*C independent FMA chains hide
// the FMA latency, and C weight streams in flight keep the memory system busy.
template <int R, int C>
void tile(const float* x, const uint16_t* w, float* out, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  // Software prefetch of the next column block: the hardware prefetcher alone tracks too few of
  // these parallel row streams (measured ~6 vs ~9 GB/s on the 2-core AVX2 machines).
  const bool prefetch = n0 + 2 * C <= N;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    if (prefetch && (k & 31) == 0)
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + C + c) * K + k), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) wv[c] = load_bf16x8(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t kk = k; kk < K; ++kk) s += x[(m0 + r) * K + kk] * from_bf16(w[(n0 + c) * K + kk]);
      out[(m0 + r) * N + n0 + c] = s;
    }
}

// Weight rows [n0, n0+C) stay in L1 while every row block of x passes over them.
template <int R, int C>
void column_block(const float* x, const uint16_t* w, float* out, int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<R, C>(x, w, out, m, n0, K, N);
  for (; m < M; ++m) tile<1, C>(x, w, out, m, n0, K, N);
}

template <int R, int C>
void columns(const float* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) column_block<R, C>(x, w, out, M, n, K, N);
  for (; n < n1; ++n) column_block<R, 1>(x, w, out, M, n, K, N);
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
template <int R, int A>
void stream_rows(const float* x, const uint16_t* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * A <= K; k += 8 * A) {
      const char* ahead = reinterpret_cast<const char*>(row + k) + STREAM_PREFETCH;
      if ((k * 2) % 64 == 0 && ahead < end) _mm_prefetch(ahead, _MM_HINT_T0);  // once per line
      for (int a = 0; a < A; ++a) {
        __m256 wv = load_bf16x8(row + k + 8 * a);
        for (int r = 0; r < R; ++r)
          acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * a), wv, acc[r][a]);
      }
    }
    for (; k + 8 <= K; k += 8) {
      __m256 wv = load_bf16x8(row + k);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      __m256 v = acc[r][0];
      for (int a = 1; a < A; ++a) v = _mm256_add_ps(v, acc[r][a]);
      float s = hsum(v);
      for (int64_t kk = k; kk < K; ++kk) s += x[r * K + kk] * from_bf16(row[kk]);
      out[r * N + n] = s;
    }
  }
}

// Tile shapes measured best on AVX2 (16 ymm registers): a GEMV keeps 8 weight streams in flight;
// small M shares 4 widened weight vectors across 2 rows; larger M shares 3 across 4 rows (12
// accumulators + 3 weights + 1 input = all 16 registers). Up to 3 rows of x over short weight rows
// stream the weights instead (at 4 rows the tiles read as fast, and 12 accumulators would spill).
void gemm_range(const float* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  if (K <= STREAM_MAX_K) {
    if (M == 1) return stream_rows<1, 4>(x, w, out, K, N, n0, n1);
    if (M == 2) return stream_rows<2, 4>(x, w, out, K, N, n0, n1);
    if (M == 3) return stream_rows<3, 4>(x, w, out, K, N, n0, n1);
  }
  if (M == 1) return columns<1, 8>(x, w, out, M, K, N, n0, n1);
  if (M < 4) return columns<2, 4>(x, w, out, M, K, N, n0, n1);
  columns<4, 3>(x, w, out, M, K, N, n0, n1);
}

// From 16 rows on, the GEMM is compute-bound and the dot-product tiles above spend a
// widening (2 vector ops) per 4 FMAs and a horizontal sum per output. The wide path instead widens
// each block of WIDE_N weight rows once into an fp32 panel and runs outer products: x transposed into
// groups of 16 rows ([K][16], two ymm per k), each weight broadcast from the panel (a load, no ALU op)
// against both, so the FP pipes do nothing but FMAs (12 accumulators + 2 inputs + 1 broadcast).
constexpr int64_t WIDE_MIN_ROWS = 10;
// Transposing x costs about what the tiles spend on ~150 columns (M=16, K=1024: 128 columns 0.9x,
// 256 columns 1.3x the tiles' speed), so narrower outputs stay on the tiles.
constexpr int64_t WIDE_MIN_COLS = 256;
constexpr int WIDE_N = 6;
constexpr int64_t GROUP = 16;

// x [M, K] -> [ceil(M/16)][K][16], rows past M zero; written in order, from 16 sequential read streams.
std::vector<float> transpose_x(const float* x, int64_t M, int64_t K) {
  int64_t groups = (M + GROUP - 1) / GROUP;
  std::vector<float> xt(static_cast<size_t>(groups * K * GROUP));
  float* dst = xt.data();
  for (int64_t g = 0; g < groups; ++g) {
    int64_t rows = std::min(GROUP, M - g * GROUP);
    const float* src = x + g * GROUP * K;
    for (int64_t k = 0; k < K; ++k, dst += GROUP) {
      for (int64_t r = 0; r < rows; ++r) dst[r] = src[r * K + k];
      for (int64_t r = rows; r < GROUP; ++r) dst[r] = 0.0f;
    }
  }
  return xt;
}

// One 16-row group against the WIDE_N panel rows -> acc_out[n][row]. next: the following WIDE_N bf16
// weight rows (contiguous, WIDE_N * 2 bytes per k) or null; fetched into cache during these FMAs, as
// widening them straight from memory would stall on every line.
void wide_tile(const float* xt, const float* panel, int64_t K, float (*acc_out)[GROUP], const char* next) {
  constexpr int V = GROUP / 8;
  __m256 acc[WIDE_N][V];
  for (int j = 0; j < WIDE_N; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (next && (k & 15) == 0)  // 16 k = 16 * WIDE_N * 2 bytes = 3 lines of the next rows
      for (int i = 0; i < 3; ++i) _mm_prefetch(next + k * WIDE_N * 2 + 64 * i, _MM_HINT_T0);
    __m256 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(xt + k * GROUP + 8 * v);
    for (int j = 0; j < WIDE_N; ++j) {
      __m256 b = _mm256_broadcast_ss(panel + j * K + k);
      for (int v = 0; v < V; ++v) acc[j][v] = _mm256_fmadd_ps(xv[v], b, acc[j][v]);
    }
  }
  for (int j = 0; j < WIDE_N; ++j)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_out[j] + 8 * v, acc[j][v]);
}

void widen_rows(const uint16_t* w, float* panel, int64_t rows, int64_t K) {
  int64_t i = 0;
  for (; i + 8 <= rows * K; i += 8) _mm256_storeu_ps(panel + i, load_bf16x8(w + i));
  for (; i < rows * K; ++i) panel[i] = from_bf16(w[i]);
}

void wide_range(const float* xt, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  // Zero-initialised: a short last block leaves stale but finite rows, whose outputs are dropped.
  std::vector<float> panel(static_cast<size_t>(WIDE_N) * K, 0.0f);
  float acc[WIDE_N][GROUP];
  for (int64_t n = n0; n < n1; n += WIDE_N) {
    int64_t cols = std::min<int64_t>(WIDE_N, n1 - n);
    widen_rows(w + n * K, panel.data(), cols, K);
    for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
      int64_t rows = std::min(GROUP, M - m0);
      const bool prefetch = m0 == 0 && n + 2 * WIDE_N <= N;
      wide_tile(xt + m0 * K, panel.data(), K, acc,
                prefetch ? reinterpret_cast<const char*>(w + (n + WIDE_N) * K) : nullptr);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) out[(m0 + r) * N + n + j] = acc[j][r];
    }
  }
}

// act[i] = silu(min(g, limit)) * clamp(u, -limit, limit) for gate_up = [g | u] (I each); act may alias
// gate_up's start. The min/max operand order keeps a NaN input NaN, as std::min / std::max do.
void swiglu_row(const float* gate_up, float* act, int64_t I, float limit) {
  const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    __m256 g = _mm256_min_ps(hi, _mm256_loadu_ps(gate_up + i));
    __m256 u = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(gate_up + I + i)));
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(silu, u));
  }
  for (; i < I; ++i) {
    float g = std::min(gate_up[i], limit), u = std::min(std::max(gate_up[I + i], -limit), limit);
    act[i] = g / (1.0f + std::exp(-g)) * u;
  }
}

}  // namespace

void gemm_bf16(const float* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N,
               int num_threads) {
  // Whole 16-row groups, and a last partial one of at least WIDE_MIN_ROWS rows (its zero padding
  // costs less than the tiles), go the wide path; a shorter remainder goes through the tiles.
  int64_t wide = N < WIDE_MIN_COLS ? 0 : M % GROUP >= WIDE_MIN_ROWS ? M : M / GROUP * GROUP;
  std::vector<float> xt = transpose_x(x, wide, K);
  auto range = [&](int64_t n0, int64_t n1) {
    if (wide > 0) wide_range(xt.data(), w, out, wide, K, N, n0, n1);
    if (wide < M) gemm_range(x + wide * K, w, out + wide * N, M - wide, K, N, n0, n1);
  };
  // Split N across threads only when each gets enough work to beat the wake-up cost.
  int threads = (N * K >= (1 << 20)) ? std::max(1, num_threads) : 1;
  if (threads == 1) return range(0, N);
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t chunk = ((N + T - 1) / T + 23) / 24 * 24;  // whole column blocks of every tile shape
    range(std::min<int64_t>(N, t * chunk), std::min<int64_t>(N, (t + 1) * chunk));
  }
}

void linear_bf16(const void* x, const uint16_t* w, const uint16_t* bias, void* out, bool bf16_io, int64_t M,
                 int64_t K, int64_t N, int num_threads) {
  std::vector<float> xf, of;
  const float* xp = static_cast<const float*>(x);
  float* op = static_cast<float*>(out);
  if (bf16_io) {
    xf.resize(static_cast<size_t>(M * K));
    load_row(x, 0, M * K, true, xf.data());
    xp = xf.data();
    of.resize(static_cast<size_t>(M * N));
    op = of.data();
  }
  gemm_bf16(xp, w, op, M, K, N, num_threads);
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) op[m * N + n] += from_bf16(bias[n]);
  if (bf16_io) store_row(out, 0, M * N, true, op);
}

void expert_swiglu_bf16(const float* x, const uint16_t* w13, const uint16_t* w2, float* y, float* scratch,
                        int64_t M, int64_t H, int64_t I, float limit, int num_threads) {
  gemm_bf16(x, w13, scratch, M, H, 2 * I, num_threads);
  // scratch rows are [gate | up]; compact silu(gate) * up into the first I columns of each row
  // (row m's output lands on rows already consumed, so the compaction is safe in place).
  for (int64_t m = 0; m < M; ++m) swiglu_row(scratch + m * 2 * I, scratch + m * I, I, limit);
  gemm_bf16(scratch, w2, y, M, I, H, num_threads);
}

// Cost of an expert in units of one row's FMAs: reading its weights costs about as much as this many
// rows of compute at decode sizes (bandwidth ~8 GB/s against ~30 GFLOP/s on the 2-core AVX2 machines).
constexpr int64_t EXPERT_READ_ROWS = 4;

void grouped_experts_bf16(const float* x, const int64_t* offsets, int64_t num_experts, const uint16_t* w13,
                          const uint16_t* w2, float* y, int64_t H, int64_t I, float limit, int num_threads) {
  std::vector<int64_t> active, cost_end;  // experts with rows; running cost after each
  int64_t max_rows = 0, total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    active.push_back(e);
    total += rows + EXPERT_READ_ROWS;
    cost_end.push_back(total);
    max_rows = std::max(max_rows, rows);
  }
  // Whole experts per thread (not columns of each GEMM): one fork/join per layer instead of two per
  // expert, and each thread streams its experts' weights from start to end.
  int threads = static_cast<int>(std::min<int64_t>(std::max(1, num_threads), static_cast<int64_t>(active.size())));
  auto run = [&](int t, int T) {
    std::vector<float> scratch(static_cast<size_t>(max_rows) * 2 * I);
    for (size_t i = 0; i < active.size(); ++i) {
      int64_t mid = cost_end[i] - (offsets[active[i] + 1] - offsets[active[i]] + EXPERT_READ_ROWS) / 2;
      if (mid * T / total != t) continue;  // the thread whose share holds this expert's midpoint
      int64_t e = active[i];
      expert_swiglu_bf16(x + offsets[e] * H, w13 + e * 2 * I * H, w2 + e * H * I, y + offsets[e] * H,
                         scratch.data(), offsets[e + 1] - offsets[e], H, I, limit, 1);
    }
  };
  if (threads <= 1) return run(0, 1);
#pragma omp parallel num_threads(threads)
  run(omp_get_thread_num(), omp_get_num_threads());
}

}  // namespace deepinfer
