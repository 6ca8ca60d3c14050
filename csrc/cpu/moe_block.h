#pragma once
// The second half of a Qwen3-MoE decoder layer in one call: residual add, RMSNorm, softmax top-k router,
// expert-load counting and logical -> physical mapping (EPLB), the experts, and the second residual add.
// In Python these are ~20 ops and module calls per layer; at decode batch sizes their dispatch, run on
// caches the weight stream has just flushed, cost a sixth of a batch-1 step. Rounding follows the torch
// modules it replaces (deepinfer/models/llama.py DecoderLayer, qwen3_moe.py SparseMoeBlock) step by step.
#include <cstdint>
#include <vector>

#include "cpu/gemm_bf16.h"

namespace deepinfer {

struct MoeBlock {
  int64_t H = 0, I = 0;            // hidden, expert intermediate size
  const void* norm_w = nullptr;    // [H] post-attention RMSNorm weight (activation dtype)
  float eps = 0.0f;
  bool fp32_weights = false;       // gate, w13 and w2 fp32 (an fp32 model's), not bf16
  const void* gate = nullptr;      // [E_logical, H] router
  int64_t num_logical = 0, top_k = 0;
  bool renorm = false;             // norm_topk_prob
  GemmMode gate_mode;
  int64_t num_physical = 0;
  const void* w13 = nullptr;       // [E, 2I, H]
  const void* w2 = nullptr;        // [E, H, I]
  // Kernel id (kernel_mode) of the grouped kernel by the busiest expert's rows: entry i for 2^i.. rows, the
  // last for all above.
  std::vector<int> expert_isa;
  bool invariant = false;
  bool packed = false;             // w13, w2 in bf16 pairs (pack_bf16_pairs)
};

// out [T, H] = x1 + round(moe(rms_norm(x1))) with x1 = round(x + a); x, a, out all fp32 or all bf16 (bf16); out
// may be x. counts [E_logical]: the expert-load counter (int64) to add to, or null; log2phy [E_logical]: the
// physical slot of each logical expert, or null (identity). Returns false when a mapped expert id lies outside
// [0, num_physical): counts are then untouched and out is unspecified.
bool moe_block(const MoeBlock& b, int64_t* counts, const int64_t* log2phy, const void* x, const void* a, void* out,
               int64_t T, bool bf16, int num_threads);

}  // namespace deepinfer
