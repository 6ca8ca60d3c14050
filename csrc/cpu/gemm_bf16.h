#pragma once
// Small-M GEMM with bf16 weights and fp32 activations/accumulation: out[M,N] = x[M,K] @ w[N,K]^T.
// torch's bf16 matmul on CPUs without bf16 instructions converts through a slow generic path
// (~8 GFLOP/s); here each weight row is widened once (bf16 -> fp32 is a 16-bit shift) and reused for
// every row of x while it sits in L1, so decode-sized M stays memory-bound at the weight-read rate.
// From ~10 rows and 256 outputs on (batched decode) it is compute-bound instead: weight blocks are
// widened once into fp32 panels that outer-product tiles read with nothing but FMAs on the FP pipes
// (~1.5x the FLOP rate). On CPUs with bf16 instructions torch's oneDNN GEMM can be faster: the
// caller (deepinfer/layers/gemm_plan.py) measures both and picks per shape. An fp32 model's fp32 weights run
// the same tiles and panels (no widening), where torch's fp32 GEMM repacks the weights on every call.
#include <cstdint>
#include <functional>

#include "cpu/cpu_features.h"

namespace deepinfer {

// How a GEMM runs: the vector ISA of the kernel; whether every M uses one reduction order
// (batch-invariant: dot-product tiles only, no streaming or outer-product paths); and, for the fp32
// ISAs, whether 10+ rows go through fp32 weight panels (outer products) instead of the tiles. Which
// of those two is faster depends on the CPU and shape (at 64 rows, K 1024, one Zen 3 thread: panels 88,
// tiles 62 GFLOP/s), so the GEMM plan times both.
struct GemmMode {
  Isa isa = Isa::AVX2;
  bool invariant = false;
  bool panels = false;
  bool packed = false;  // w in bf16 pairs (pack_bf16_pairs); AVX512_BF16, or AVX2 without panels
};

// A kernel's id as the plan names it (cpu_features()["gemm_isas"]): its Isa, plus KERNEL_PANELS for
// the panel form.
constexpr int KERNEL_PANELS = 16;
inline GemmMode kernel_mode(int id, bool invariant, bool packed = false) {
  return GemmMode{static_cast<Isa>(id & (KERNEL_PANELS - 1)), invariant, (id & KERNEL_PANELS) != 0, packed};
}

// Whether stream_rows (gemm_kernel.h) prefetches weights in software; defined in gemm_bf16.cpp, as the
// ISA translation units must not define non-template code (the linker would keep one ISA's copy).
bool stream_prefetch();
// Whether packed weights are read one panel at a time for up to 4 rows of x (gemm_kernel.h, pair_cols): by default
// where the engine's weights sit on 2 MiB pages (deepinfer/memory.py: wherever transparent huge pages are not off).
// Either way each output's sum is the same; set_single_panel_stream overrides the default, returns the old value.
bool single_panel_stream();
bool set_single_panel_stream(bool on);

constexpr int64_t GEMM_GROUP = 16;  // rows of x per outer-product group (the wide path)
// AMX tiles (gemm_amx.cpp): 16 rows, of 32 bf16 (64 bytes) each.
constexpr int64_t AMX_TILE_ROWS = 16, AMX_TILE_K = 32;
// Packed weights (pair_tile in gemm_kernel.h): output columns per panel (one AVX-512 vector of fp32 sums, two
// AVX2 vectors).
constexpr int64_t PAIR_BLOCK = 16;
// Up to this many rows a GEMM streams its weights from memory: gemm_bf16 gives each thread one column range,
// and the packed tiles prefetch only inside it (pair_columns).
constexpr int64_t STREAM_MAX_ROWS = 4;

// w [N, K] bf16 <-> wp [N/PAIR_BLOCK][K/2][PAIR_BLOCK][2] (N a multiple of PAIR_BLOCK, K even): the layout
// GemmMode::packed reads. unpack: wp -> w.
void pack_bf16_pairs(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool unpack);

// Called with each finished block of the output, out[m0:m1, n0:n1], on the thread that computed it.
using OutputDone = std::function<void(int64_t m0, int64_t m1, int64_t n0, int64_t n1)>;

// out[M,N] fp32 = x[M,K] @ w[N,K]^T; x fp32, or bf16 when x_bf16 (read as it is by the bf16-pair ISAs, which
// round fp32 x to bf16 first; widened for the others). done (if set) sees every output element once, in blocks,
// while their results are still in L2. W: uint16_t for bf16 weights; float for fp32 ones (an fp32 model's), which
// run the fp32 ISAs' kernels (AVX2, AVX-512), row-major.
template <class W>
void gemm_bf16(const void* x, bool x_bf16, const W* w, float* out, int64_t M, int64_t K, int64_t N, GemmMode mode,
               int num_threads, const OutputDone& done = nullptr);

// out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N] of w's dtype, or null), accumulated in fp32; x and out are both fp32,
// or both bf16 when bf16_io (widened on entry, rounded to nearest even once on exit: torch's
// `F.linear(x.float(), w.float(), b.float()).to(bf16)` without its three conversion passes). W as gemm_bf16's.
template <class W>
void linear_bf16(const void* x, const W* w, const W* bias, void* out, bool bf16_io, int64_t M, int64_t K, int64_t N,
                 GemmMode mode, int num_threads);

// f(a, b) with two weight addresses (a matrix and its bias, or two matrices; either may be null) typed as what
// they hold: fp32 (float) when fp32_weights, else bf16 (uint16_t). For weights held untyped by the fused blocks
// and the bindings.
template <class F>
void with_weights(const void* a, const void* b, bool fp32_weights, F f) {
  if (fp32_weights) f(static_cast<const float*>(a), static_cast<const float*>(b));
  else f(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b));
}

// All experts of one MoE layer: rows [offsets[e], offsets[e+1]) of x (sorted by expert) go through
// SwiGLU expert e: (silu(min(g, limit)) * clamp(u, -limit, limit)) w2^T with [g | u] = x w13^T
// (limit = +inf: plain SwiGLU; finite: DeepSeek-V4's swiglu_limit). w13 [E, 2I, H] and w2 [E, H, I]
// bf16, or fp32 (W as gemm_bf16's); x, y [S, H] fp32. Experts with skip[e] != 0 (skip may be null) are left to the
// caller: their rows of y are not written.
template <class W>
void grouped_experts_bf16(const float* x, const int64_t* offsets, int64_t num_experts, const uint8_t* skip,
                          const W* w13, const W* w2, float* y, int64_t H, int64_t I, float limit, GemmMode mode,
                          int num_threads);

}  // namespace deepinfer
