// The GEMM kernel on AMX tiles: tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 bf16 tile into a
// 16 x 16 fp32 tile, 16x the products of one vdpbf16ps. The tiles compute out^T = w x^T: the first
// operand is 16 weight rows, read straight from w (rows are k-contiguous, as tiles want them); the
// second must hold k in pairs ("VNNI": row r = pairs k = 2r, 2r+1 of 16 columns), so x (small: the
// batch) is transposed into that layout once per GEMM, and the weights, the bulk of the bytes, stream
// untouched. Output tiles are transposed back on store. gemm_bf16.cpp calls this only on CPUs with AMX
// whose OS granted the tile state (cpu_features.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/gemm_bf16.h"
#include "cpu/scratch.h"

#pragma GCC push_options
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

namespace deepinfer {
namespace {

constexpr int TILE = AMX_TILE_ROWS;  // rows of every tile; columns of the fp32 output tile
constexpr int TILE_K = AMX_TILE_K;   // bf16 k per tile row (64 bytes)
constexpr int TILE_ELEMS = TILE * TILE_K;

// ldtilecfg's 64-byte layout: palette 1, then bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: out^T for (weight block, x group) (0, 0), (0, 1), (1, 0), (1, 1); 4-5: two blocks of 16
// weight rows; 6-7: two 16-row groups of x. The intrinsics below take these as literal numbers (they
// paste the tile register's name).
// The configuration is a static object: GCC's _tile_loadconfig tells the compiler it reads 8 bytes of
// its operand, so stores into a local config's other 56 bytes may be dropped as dead (a standalone
// harness written that way faulted in ldtilecfg).
void configure_tiles() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = TILE;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

// The 16 x 16 32-bit transpose of r (in place): r[c] = column c of the input rows.
void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // each 128-bit lane j now holds columns 4j.. of 4 rows
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// Output tiles of out^T (rows: output columns n.., columns: rows m.. of x), parked until enough have
// gathered to transpose into out at once. A vector load of a tile just stored waits for the store to
// commit, which waits on the weight loads still in flight, so transposing every block's tiles as they
// finish drained the weight stream 32 times per GEMM: 9% of the memory rate on the MoE shapes at 8 rows.
class PendingTiles {
 public:
  static constexpr int CAPACITY = 64;

  PendingTiles(float* out, int64_t M, int64_t N) : out_(out), M_(M), N_(N) {}

  // Where the tile for out[m.., n..] goes; full capacity flushes first.
  float* slot(int64_t m, int64_t n) {
    if (count_ == CAPACITY) flush();
    dest_[count_] = {m, n};
    return tiles_.data() + count_++ * TILE * TILE;
  }

  void flush() {
    for (int t = 0; t < count_; ++t) store_transposed(tiles_.data() + t * TILE * TILE, dest_[t].m, dest_[t].n);
    count_ = 0;
  }

 private:
  // One tile -> out[m.., n..], within M rows and N columns.
  void store_transposed(const float* acc, int64_t m, int64_t n) {
    __m512i r[16];
    for (int i = 0; i < TILE; ++i) r[i] = _mm512_load_si512(acc + i * TILE);
    transpose16(r);
    const int64_t cols = std::min<int64_t>(TILE, N_ - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int i = 0; i < TILE && m + i < M_; ++i) _mm512_mask_storeu_epi32(out_ + (m + i) * N_ + n, mask, r[i]);
  }

  struct Dest {
    int64_t m, n;
  };
  Scratch<float> tiles_{ScratchUse::AMX_TILES, CAPACITY * TILE * TILE};
  Dest dest_[CAPACITY];
  int count_ = 0;
  float* out_;
  int64_t M_, N_;
};

// Weight blocks [n, n + 16) and [n + 16, n + 32) (GN of them) against x groups g, g + 1 (GM of them),
// over all of k. w0, w1: the blocks' first rows, ws elements apart; xv: x in VNNI tiles.
template <int GN, int GM>
void block(const uint16_t* w0, const uint16_t* w1, int64_t ws, const uint16_t* xv, int64_t g, int64_t Kp,
           PendingTiles& out, int64_t n) {
  _tile_zero(0);
  if constexpr (GM == 2) _tile_zero(1);
  if constexpr (GN == 2) _tile_zero(2);
  if constexpr (GN == 2 && GM == 2) _tile_zero(3);
  const int64_t kblocks = Kp / TILE_K;
  const uint16_t* x0 = xv + g * kblocks * TILE_ELEMS;
  const uint16_t* x1 = x0 + kblocks * TILE_ELEMS;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(4, w0 + kb * TILE_K, ws * 2);
    if constexpr (GN == 2) _tile_loadd(5, w1 + kb * TILE_K, ws * 2);
    _tile_loadd(6, x0 + kb * TILE_ELEMS, 64);
    if constexpr (GM == 2) _tile_loadd(7, x1 + kb * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (GM == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (GN == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (GN == 2 && GM == 2) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t m = g * TILE;
  _tile_stored(0, out.slot(m, n), 64);
  if constexpr (GM == 2) _tile_stored(1, out.slot(m + TILE, n), 64);
  if constexpr (GN == 2) _tile_stored(2, out.slot(m, n + TILE), 64);
  if constexpr (GN == 2 && GM == 2) _tile_stored(3, out.slot(m + TILE, n + TILE), 64);
}

template <int GN>
void blocks_of_x(const uint16_t* w0, const uint16_t* w1, int64_t ws, const uint16_t* xv, int64_t Kp, PendingTiles& out,
                 int64_t M, int64_t n) {
  const int64_t groups = (M + TILE - 1) / TILE;
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) block<GN, 2>(w0, w1, ws, xv, g, Kp, out, n);
  if (g < groups) block<GN, 1>(w0, w1, ws, xv, g, Kp, out, n);
}

}  // namespace

void pack_x_amx(const uint16_t* xb, int64_t Mp, int64_t Kp, uint16_t* xv) {
  for (int64_t g = 0; g < Mp / TILE; ++g)
    for (int64_t k = 0; k < Kp; k += TILE_K) {
      __m512i r[16];
      for (int i = 0; i < TILE; ++i) r[i] = _mm512_loadu_si512(xb + (g * TILE + i) * Kp + k);
      transpose16(r);
      uint16_t* dst = xv + (g * (Kp / TILE_K) + k / TILE_K) * TILE_ELEMS;
      for (int i = 0; i < TILE; ++i) _mm512_storeu_si512(dst + i * TILE_K, r[i]);
    }
}

void gemm_columns_amx(const uint16_t* xv, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t Kp,
                      int64_t N, int64_t n0, int64_t n1) {
  configure_tiles();  // tile configuration is per thread: each range sets it
  AlignedVector<uint16_t> pad;
  PendingTiles pending(out, M, N);
  for (int64_t n = n0; n < n1; n += 2 * TILE) {
    const uint16_t* rows = w + n * K;
    int64_t stride = K;
    if (K != Kp || n + 2 * TILE > N) {  // a K tail, or rows past N: tiles read a zero-padded copy
      pad.assign(2 * TILE * Kp, 0);
      for (int64_t r = 0; r < 2 * TILE && n + r < N; ++r)
        std::memcpy(pad.data() + r * Kp, w + (n + r) * K, K * sizeof(uint16_t));
      rows = pad.data();
      stride = Kp;
    }
    if (n + TILE < n1) blocks_of_x<2>(rows, rows + TILE * stride, stride, xv, Kp, pending, M, n);
    else blocks_of_x<1>(rows, nullptr, stride, xv, Kp, pending, M, n);
  }
  pending.flush();
  _tile_release();  // the OS then skips saving 8 KB of tile state on this thread's context switches
}

}  // namespace deepinfer
#pragma GCC pop_options
