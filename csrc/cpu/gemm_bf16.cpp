#include "cpu/gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/gemm_kernel.h"
#include "cpu/scratch.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "cpu/vec.h"

namespace deepinfer {

// gemm_avx512.cpp, gemm_avx512bf16.cpp: the same kernel compiled for AVX-512, and with bf16 dot products;
// gemm_amx.cpp: AMX tiles; pack_x_amx turns xb [Mp, Kp] (M, K rounded up to 16, 32; zero-padded) into the
// VNNI tiles xv [Mp/16][Kp/32][16][32] that gemm_columns_amx reads.
template <class W>
void gemm_columns_avx512(const float* x, const float* xt, int64_t wide, const W* w, float* out, int64_t M, int64_t K,
                         int64_t N, int64_t n0, int64_t n1, bool invariant);
void gemm_columns_avx512bf16(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1, bool invariant, bool packed);
void pack_x_amx(const uint16_t* xb, int64_t Mp, int64_t Kp, uint16_t* xv);
void gemm_columns_amx(const uint16_t* xv, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t Kp,
                      int64_t N, int64_t n0, int64_t n1);

// Whether stream_rows prefetches weights in software. On the AVX2-only EPYCs (Zen 3) it read 1.15-1.3x
// faster; on a Zen 4 (AVX-512) the hardware prefetchers alone stream the experts faster (one row, four
// experts of K 1024 / 512: 17.5-24.0 -> 21.8-29.4 GB/s, medians of builds run alternately; the LM head
// the same within noise), so CPUs with AVX-512 leave it to them.
bool stream_prefetch() {
  static const bool on = !cpu_features().avx512f;
  return on;
}

// On 4 KiB pages the hardware prefetchers stop at every page, and 8 panels read in parallel (software-prefetched)
// were 1.05-1.1x faster than one (Zen 4, one row); on 2 MiB pages one sequential stream is the faster (gemm_kernel.h).
// Not on the AVX2-only EPYCs (Zen 3), as for stream_prefetch: there the parallel, software-prefetched panels were
// faster on 2 MiB pages too (medium Qwen3-MoE, batch 1, one thread: 18.7 against 21.4 ms per decode step, blocks
// of steps alternated in one process).
// Atomic: set_single_panel_stream may run while another thread's GEMM reads it (either order gives the same bits).
std::atomic<bool>& single_panel_flag() {
  static std::atomic<bool> on([] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    const std::string modes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return cpu_features().avx512f && !modes.empty() && modes.find("[never]") == std::string::npos;
  }());
  return on;
}

bool single_panel_stream() { return single_panel_flag().load(std::memory_order_relaxed); }

bool set_single_panel_stream(bool on) { return single_panel_flag().exchange(on); }

namespace {

// From 16 rows on the GEMM is compute-bound, and the dot-product tiles spend a widening (2 vector ops)
// per 4 FMAs and a horizontal sum per output; the wide path (outer products over transposed x) does not.
constexpr int64_t WIDE_MIN_ROWS = 10;
// Transposing x costs about what the tiles spend on ~150 columns (M=16, K=1024: 128 columns 0.9x,
// 256 columns 1.3x the tiles' speed), so narrower outputs stay on the tiles.
constexpr int64_t WIDE_MIN_COLS = 256;
// Column tasks per thread: a thread that finishes early (the other core busy with torch or the OS)
// takes more of them, so one slow core does not hold up the whole GEMM. Up to STREAM_MAX_ROWS rows one
// contiguous range per thread, whose prefetches stay inside it, reads faster: every range start is a cold
// stream, and the last task claimed runs alone at one core's bandwidth (Zen 3, one row, two threads, cold
// weights, K 1024: N 1024 / 1536 read 0.74 / 0.78 of the two-thread read rate with 4 tasks per thread, 0.87 /
// 0.85 with one; N 4096 and 32000 the same within noise; medians of 6 runs alternated). One thread keeps one
// range whatever M: 4 ranges one after another made batch 64 (experts of 5+ rows) 3% slower.
constexpr int64_t COLUMN_TASKS_PER_THREAD = 4;
// Whole column blocks of every row-major tile shape (4, 6, 8, 12, 16); packed weights: whole panels (PAIR_BLOCK).
constexpr int64_t COLUMN_ALIGN = 48;
// fp32 results per output block when an OutputDone reads them back (linear_bf16's rounding to bf16): a quarter
// of L2, so they are read from L2, not memory (the LM head at 64 rows: 8 MB rounded after the GEMM in one pass
// on one thread cost 1.9 ms of its 23).
constexpr int64_t DONE_CHUNK_BYTES = 256 << 10;
// Rows of x per pass over the weights, in bytes of the x the kernel reads: every weight block is read from cache
// while all these rows pass, and the rows stay in L3 for the next block. With all of x in one pass (a 4096-token
// prefill: 16 MB of fp32 rows at K 1024) x came from memory for every block: the packed AVX2 tiles ran 40-57
// against 74-83 GFLOP/s in passes of 0.25-4 MB (Zen 3, one thread, M 4096, K 512-1024, N 1024-1536; runs
// alternated in one process). The weights are then read once per pass: 1 MB of fp32 x at K 1024 is 240 rows,
// over which one read of the weights is short.
constexpr int64_t ROW_PASS_X_BYTES = 1 << 20;
// Rows per pass are a multiple of this: whole 16-row groups (AMX tiles, the wide path's transposed x), split
// evenly into 6- and 8-row tiles.
constexpr int64_t ROW_PASS_ALIGN = 48;
// An AMX tile multiplies 16 rows of x whatever M is; below this many rows the bf16 dot products read the
// weights faster (1.1x at 1-2 rows, K 1024; AMX 1.3x faster at 3). The batch-invariant mode keeps AMX
// for every M: a row's tile products do not depend on the other rows.
constexpr int64_t AMX_MIN_ROWS = 3;

// x [M, K] -> [ceil(M/16)][K][16], rows past M zero; written in order, from 16 sequential read streams.
std::vector<float> transpose_x(const float* x, int64_t M, int64_t K) {
  int64_t groups = (M + GEMM_GROUP - 1) / GEMM_GROUP;
  std::vector<float> xt(static_cast<size_t>(groups * K * GEMM_GROUP));
  float* dst = xt.data();
  for (int64_t g = 0; g < groups; ++g) {
    int64_t rows = std::min(GEMM_GROUP, M - g * GEMM_GROUP);
    const float* src = x + g * GEMM_GROUP * K;
    for (int64_t k = 0; k < K; ++k, dst += GEMM_GROUP) {
      for (int64_t r = 0; r < rows; ++r) dst[r] = src[r * K + k];
      for (int64_t r = rows; r < GEMM_GROUP; ++r) dst[r] = 0.0f;
    }
  }
  return xt;
}

// x_bf16: x rounded to bf16 (for AVX512_BF16, [M, K]; for AMX, in VNNI tiles with k padded to xk). fp32 weights
// (W float) run the fp32 ISAs only, row-major (the bindings refuse any other mode for them).
template <class W>
void gemm_columns(GemmMode mode, Isa isa, const float* x, const uint16_t* x_bf16, int64_t xk, const float* xt,
                  int64_t wide, const W* w, float* out, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (isa == Isa::AMX) return gemm_columns_amx(x_bf16, w, out, M, K, xk, N, n0, n1);
    if (isa == Isa::AVX512_BF16)
      return gemm_columns_avx512bf16(x_bf16, w, out, M, K, N, n0, n1, mode.invariant, mode.packed);
    if (mode.packed && isa == Isa::AVX2) return kernel::pair_columns<Avx2Pairs>(x, w, out, M, K, N, n0, n1);
  }
  if (isa == Isa::AVX512) return gemm_columns_avx512(x, xt, wide, w, out, M, K, N, n0, n1, mode.invariant);
  kernel::gemm_columns<Avx2>(x, xt, wide, w, out, M, K, N, n0, n1, mode.invariant);
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

// One SwiGLU expert on M rows; scratch holds M * 2I floats.
template <class W>
void expert_swiglu(const float* x, const W* w13, const W* w2, float* y, float* scratch, int64_t M, int64_t H,
                   int64_t I, float limit, GemmMode mode) {
  gemm_bf16(x, false, w13, scratch, M, H, 2 * I, mode, 1);
  // scratch rows are [gate | up]; compact silu(gate) * up into the first I columns of each row
  // (row m's output lands on rows already consumed, so the compaction is safe in place).
  for (int64_t m = 0; m < M; ++m) swiglu_row(scratch + m * 2 * I, scratch + m * I, I, limit);
  gemm_bf16(scratch, false, w2, y, M, I, H, mode, 1);
}

}  // namespace

template <class W>
void gemm_bf16(const void* x, bool x_bf16, const W* w, float* out, int64_t M, int64_t K, int64_t N, GemmMode mode,
               int num_threads, const OutputDone& done) {
  // The row passes and column tasks below divide by M, N and K's bytes: an empty product is settled here (a step
  // can ask for the logits of no rows).
  if (M == 0 || N == 0 || K == 0) {
    std::fill(out, out + M * N, 0.0f);
    if (done && M > 0 && N > 0) done(0, M, 0, N);
    return;
  }
  const Isa isa = mode.isa == Isa::AMX && M < AMX_MIN_ROWS && !mode.invariant ? Isa::AVX512_BF16 : mode.isa;
  // bf16 products: no wide path, x rounded once
  const bool pairs = std::is_same_v<W, uint16_t> && (isa == Isa::AVX512_BF16 || isa == Isa::AMX);
  const bool tiles = isa == Isa::AMX;
  // fp32 rows, for the ISAs that read fp32: bf16 x widened (exact).
  std::vector<float> xf(x_bf16 && !pairs ? static_cast<size_t>(M * K) : 0);
  if (!xf.empty()) load_row(x, 0, M * K, true, xf.data());
  const float* xp = x_bf16 ? xf.data() : static_cast<const float*>(x);
  // Whole 16-row groups, and a last partial one of at least WIDE_MIN_ROWS rows (its zero padding
  // costs less than the tiles), go the wide path; a shorter remainder goes through the tiles.
  int64_t wide = N < WIDE_MIN_COLS || mode.invariant || !mode.panels || mode.packed || pairs ? 0
                 : M % GEMM_GROUP >= WIDE_MIN_ROWS          ? M
                                                            : M / GEMM_GROUP * GEMM_GROUP;
  std::vector<float> xt = transpose_x(xp, wide, K);
  // bf16 rows, for the pair ISAs: bf16 x as it is, unless AMX needs it padded with zeros (k and rows to
  // whole tiles) and in VNNI tiles.
  const int64_t xk = tiles ? round_up(K, AMX_TILE_K) : K, xm = tiles ? round_up(M, AMX_TILE_ROWS) : M;
  const bool copy_x = pairs && (tiles || !x_bf16);
  Scratch<uint16_t> xb(ScratchUse::GEMM_X, copy_x ? xm * xk : 0), xv(ScratchUse::GEMM_X_TILES, tiles ? xm * xk : 0);
  const uint16_t* xbp = pairs && !copy_x ? static_cast<const uint16_t*>(x) : nullptr;
  if (copy_x) {
    for (int64_t m = 0; m < M; ++m) {
      if (x_bf16) std::memcpy(xb.data() + m * xk, static_cast<const uint16_t*>(x) + m * K, K * sizeof(uint16_t));
      else store_row(xb.data(), m * xk, K, true, xp + m * K);
      std::fill(xb.data() + m * xk + K, xb.data() + (m + 1) * xk, uint16_t{0});
    }
    std::fill(xb.data() + M * xk, xb.data() + xm * xk, uint16_t{0});
    if (tiles) pack_x_amx(xb.data(), xm, xk, xv.data());
    xbp = tiles ? xv.data() : xb.data();
  }
  // out[m0:m1, n0:n1]; m0 a multiple of ROW_PASS_ALIGN, where every layout of x above starts a row group.
  auto block = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const int64_t wide_rows = std::clamp<int64_t>(wide - m0, 0, m1 - m0);
    gemm_columns(mode, isa, xp ? xp + m0 * K : nullptr, xbp ? xbp + m0 * xk : nullptr, xk,
                 wide_rows ? xt.data() + m0 * K : nullptr, wide_rows, w, out + m0 * N, m1 - m0, K, N, n0, n1);
    if (done) done(m0, m1, n0, n1);
  };
  const int64_t x_bytes = K * (pairs ? sizeof(uint16_t) : sizeof(float));
  const int64_t most = std::max<int64_t>(1, ROW_PASS_X_BYTES / x_bytes / ROW_PASS_ALIGN) * ROW_PASS_ALIGN;
  // Passes of about equal rows (256 rows: 144 + 112, not 240 + 16): each reads all the weights.
  const int64_t passes = (M + most - 1) / most, rows = std::min(M, round_up((M + passes - 1) / passes, ROW_PASS_ALIGN));
  const int64_t row_blocks = (M + rows - 1) / rows;
  // Split N across threads only when each gets enough work to beat the wake-up cost: 1M weights to stream, or
  // 4M multiply-adds (the rows of a prefill or a batch make a smaller weight worth splitting too).
  const int threads = threads_for(std::max(4 * N * K, M * N * K), num_threads, 1 << 22);
  const int64_t tasks = threads == 1 || M <= STREAM_MAX_ROWS ? threads : threads * COLUMN_TASKS_PER_THREAD;
  int64_t cols = (N + tasks - 1) / tasks;
  if (done) cols = std::min(cols, std::max<int64_t>(1, DONE_CHUNK_BYTES / (rows * sizeof(float))));
  cols = cols >= N ? N : round_up(cols, mode.packed ? PAIR_BLOCK : COLUMN_ALIGN);
  const int64_t col_blocks = (N + cols - 1) / cols;
  // Row-pass major: the threads share one pass of x while they split its columns.
  parallel_for(row_blocks * col_blocks, threads, [&](int64_t t) {
    const int64_t r = t / col_blocks, c = t % col_blocks;
    block(r * rows, std::min(M, (r + 1) * rows), c * cols, std::min(N, (c + 1) * cols));
  });
}

template void gemm_bf16(const void*, bool, const uint16_t*, float*, int64_t, int64_t, int64_t, GemmMode, int,
                        const OutputDone&);
template void gemm_bf16(const void*, bool, const float*, float*, int64_t, int64_t, int64_t, GemmMode, int,
                        const OutputDone&);

// In the packed order, one pair (4 bytes) at a time: the packed side is read or written sequentially, the rows
// side as PAIR_BLOCK row streams.
void pack_bf16_pairs(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool unpack) {
  int64_t packed = 0;  // element offset on the packed side
  for (int64_t n0 = 0; n0 < N; n0 += PAIR_BLOCK)
    for (int64_t k = 0; k < K; k += 2)
      for (int64_t n = n0; n < n0 + PAIR_BLOCK; ++n, packed += 2) {
        const int64_t row = n * K + k;  // element offset on the row-major side
        if (unpack) std::memcpy(dst + row, src + packed, 2 * sizeof(uint16_t));
        else std::memcpy(dst + packed, src + row, 2 * sizeof(uint16_t));
      }
}

template <class W>
void linear_bf16(const void* x, const W* w, const W* bias, void* out, bool bf16_io, int64_t M, int64_t K, int64_t N,
                 GemmMode mode, int num_threads) {
  Scratch<float> of(ScratchUse::LINEAR_OUT, bf16_io ? M * N : 0);  // bf16_io: the fp32 result
  float* op = bf16_io ? of.data() : static_cast<float*>(out);
  // Bias and rounding per output block, on the thread that computed it.
  auto finish = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (bias)
        for (int64_t n = n0; n < n1; ++n) op[m * N + n] += to_float(bias[n]);
      if (bf16_io) store_row(out, m * N + n0, n1 - n0, true, op + m * N + n0);
    }
  };
  gemm_bf16(x, bf16_io, w, op, M, K, N, mode, num_threads, bias || bf16_io ? OutputDone(finish) : nullptr);
}

template void linear_bf16(const void*, const uint16_t*, const uint16_t*, void*, bool, int64_t, int64_t, int64_t,
                          GemmMode, int);
template void linear_bf16(const void*, const float*, const float*, void*, bool, int64_t, int64_t, int64_t, GemmMode,
                          int);

template <class W>
void grouped_experts_bf16(const float* x, const int64_t* offsets, int64_t num_experts, const uint8_t* skip,
                          const W* w13, const W* w2, float* y, int64_t H, int64_t I, float limit, GemmMode mode,
                          int num_threads) {
  std::vector<int64_t> active;  // experts this kernel runs
  for (int64_t e = 0; e < num_experts; ++e)
    if (offsets[e + 1] > offsets[e] && !(skip && skip[e])) active.push_back(e);
  auto rows = [&](int64_t e) { return offsets[e + 1] - offsets[e]; };
  // Whole experts are the tasks (each streams its weights once, start to end), the busiest first so the
  // last ones claimed are the short ones that even out the threads' finish times.
  std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) { return rows(a) > rows(b); });
  // Each expert's [gate | up] scratch sits at its rows' offsets: no per-thread buffers, no zeroing.
  Scratch<float> scratch(ScratchUse::EXPERT_ACT, offsets[num_experts] * 2 * I);
  parallel_for(static_cast<int64_t>(active.size()), std::max(1, num_threads), [&](int64_t i) {
    int64_t e = active[i];
    expert_swiglu(x + offsets[e] * H, w13 + e * 2 * I * H, w2 + e * H * I, y + offsets[e] * H,
                  scratch.data() + offsets[e] * 2 * I, rows(e), H, I, limit, mode);
  });
}

template void grouped_experts_bf16(const float*, const int64_t*, int64_t, const uint8_t*, const uint16_t*,
                                   const uint16_t*, float*, int64_t, int64_t, float, GemmMode, int);
template void grouped_experts_bf16(const float*, const int64_t*, int64_t, const uint8_t*, const float*, const float*,
                                   float*, int64_t, int64_t, float, GemmMode, int);

}  // namespace deepinfer
