#pragma once
// The first half of a Llama / Qwen3 decoder layer at decode (one query per sequence) in one call:
// RMSNorm, the fused QKV projection, per-head q/k RMSNorm and rotary with the KV-cache store, paged GQA
// attention and the output projection. In Python these are five wrappers and module calls per layer whose
// dispatch, on caches the weight stream has just flushed, cost as much as the attention itself at batch 1.
// Each step is the kernel the unfused path calls (norm_rope.h, gemm_bf16.h, decode_attention.h), so
// the results are the same bits.
#include <cstdint>

#include "cpu/gemm_bf16.h"

namespace deepinfer {

struct AttentionBlock {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  const void* norm_w = nullptr;  // [hidden] input RMSNorm weight (activation dtype)
  float eps = 0.0f;
  bool fp32_weights = false;       // qkv, o and their biases fp32 (an fp32 model's), not bf16
  const void* qkv = nullptr;       // [(heads + 2 kv_heads) head_dim, hidden]
  const void* qkv_bias = nullptr;  // or null
  GemmMode qkv_mode;
  const void* q_norm = nullptr;  // [head_dim] (activation dtype) or null: no q/k norm
  const void* k_norm = nullptr;
  float qk_eps = 0.0f;
  const float* cos = nullptr;  // [num_positions, head_dim] fp32
  const float* sin = nullptr;
  int64_t num_positions = 0;
  void* k_cache = nullptr;  // [num_blocks, block_size, kv_heads, head_dim] (activation dtype)
  void* v_cache = nullptr;
  int64_t num_blocks = 0, block_size = 0;
  const void* o = nullptr;       // [hidden, heads head_dim]
  const void* o_bias = nullptr;  // or null
  GemmMode o_mode;
  float scale = 0.0f;
};

enum class AttentionBlockStatus : int { OK, BAD_POSITION_OR_SLOT, BAD_CONTEXT_LEN, BAD_BLOCK };

// A decode step's T tokens, one per sequence: token t at positions[t], its key and value stored at slots[t],
// attending over its sequence's first context_lens[t] cached keys through block_tables [T, max_blocks].
struct DecodeBatch {
  int64_t T = 0;
  const int64_t* positions = nullptr;
  const int64_t* slots = nullptr;
  const int64_t* block_tables = nullptr;
  int64_t max_blocks = 0;
  const int64_t* context_lens = nullptr;
};

// out [T, hidden] = o(attention(rope(norm(qkv(rms_norm(x)))))) for the batch's tokens. x and out fp32, or bf16
// when bf16. Nothing is written when a position, slot, context length or block id it would read is out of range.
AttentionBlockStatus attention_block(const AttentionBlock& b, const void* x, void* out, const DecodeBatch& batch,
                                     bool bf16, int num_threads);

}  // namespace deepinfer
