#pragma once
// A Qwen3-MoE model's decode step in one call: the embedding rows of the step's tokens, per layer the fused
// attention half (attention_block.h) and the fused MoE half (moe_block.h), and optionally the final norm, the
// LM head and the greedy tokens. Called per layer from Python, the two halves' dispatch (argument checks, tensor
// views, the calls themselves) cost ~100 us a layer: 7% of a batch-1 step of the medium model on one thread; the
// step's remaining Python (the embedding, the layers' argument lists, the sampler) ~0.3 ms of a 10 ms step at two
// threads, on caches the weight stream has just emptied. Each part runs the kernel the unfused path calls, so
// the results are the same bits.
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu/attention_block.h"
#include "cpu/gemm_bf16.h"
#include "cpu/moe_block.h"

namespace deepinfer {

// One layer's weights and its logical -> physical expert map (moe_block's log2phy, or null).
struct DecoderLayer {
  const AttentionBlock* attention = nullptr;
  const MoeBlock* moe = nullptr;
  const int64_t* log2phy = nullptr;
};

// The model's final RMSNorm (norm_w [hidden], the activations' dtype) and LM head (lm_head [vocab, hidden] bf16,
// or fp32 when fp32_weights, on `mode`) after the last layer: each logit rounded to the activations' dtype and kept
// in fp32, the bits of the unfused lm_head(norm(h)).float().
struct DecodeHead {
  const void* norm_w = nullptr;
  float eps = 0.0f;
  const void* lm_head = nullptr;
  bool fp32_weights = false;
  int64_t vocab = 0;
  GemmMode mode;
};

// What stays the same from step to step: embed [embed_rows, hidden] in the activations' dtype, the layers, the
// head (if any).
struct DecoderStack {
  const void* embed = nullptr;
  int64_t embed_rows = 0;
  std::vector<DecoderLayer> layers;
  std::optional<DecodeHead> head;
};

// Where a step stopped: bad_row >= 0 when ids[bad_row] is outside the embedding (nothing ran); layer >= 0 for
// the failing layer, with its attention status (OK when its MoE half failed: a mapped expert out of range).
struct DecodeStatus {
  int64_t bad_row = -1;
  int layer = -1;
  AttentionBlockStatus attention = AttentionBlockStatus::OK;
  bool ok() const { return bad_row < 0 && layer < 0; }
};

// One decode step from token ids [T] int64: out [T, hidden] = the last layer's output; with the head also
// logits [T, vocab] fp32 of it, and with tokens (needs the head) tokens [T] int64 = each logits row's first
// argmax, -1 for a row with NaN or inf (greedy_tokens). counts: every layer's expert-load counters (int64) in
// layer order, each layer's E_logical after the previous layer's, added to; or null. On failure out, logits and
// tokens are unspecified and the earlier layers' KV stays stored, as when the unfused path raises in a later
// layer.
DecodeStatus decode_step(const DecoderStack& stack, const int64_t* ids, int64_t* counts, const DecodeBatch& batch,
                         bool bf16, int num_threads, void* out, float* logits = nullptr, int64_t* tokens = nullptr);

}  // namespace deepinfer
