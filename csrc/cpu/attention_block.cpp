#include "cpu/attention_block.h"

#include "cpu/decode_attention.h"
#include "cpu/norm_rope.h"
#include "cpu/scratch.h"

namespace deepinfer {

AttentionBlockStatus attention_block(const AttentionBlock& b, const void* x, void* out, const DecodeBatch& batch,
                                     bool bf16, int num_threads) {
  const int64_t T = batch.T, max_blocks = batch.max_blocks;
  const int64_t *context_lens = batch.context_lens, *block_tables = batch.block_tables;
  for (int64_t t = 0; t < T; ++t) {
    if (context_lens[t] < 1 || context_lens[t] > max_blocks * b.block_size) return AttentionBlockStatus::BAD_CONTEXT_LEN;
    for (int64_t i = 0; i < (context_lens[t] + b.block_size - 1) / b.block_size; ++i)
      if (block_tables[t * max_blocks + i] < 0 || block_tables[t * max_blocks + i] >= b.num_blocks)
        return AttentionBlockStatus::BAD_BLOCK;
  }
  const int64_t D = b.head_dim, q_width = b.heads * D, qkv_width = (b.heads + 2 * b.kv_heads) * D;
  const size_t elem = bf16 ? 2 : 4;
  // This thread's buffers, each written whole before it is read: h [T, hidden], qkv [T, qkv_width], q and attn
  // [T, q_width], in x's type.
  Scratch<char> work(ScratchUse::ATTENTION_BLOCK, T * (b.hidden + qkv_width + 2 * q_width) * elem);
  char* h = work.data();
  char* qkv = h + T * b.hidden * elem;
  char* q = qkv + T * qkv_width * elem;
  char* attn = q + T * q_width * elem;
  rms_norm(x, b.hidden, b.norm_w, h, T, b.hidden, b.eps, bf16, num_threads);
  with_weights(b.qkv, b.qkv_bias, b.fp32_weights, [&](auto w, auto bias) {
    linear_bf16(h, w, bias, qkv, bf16, T, b.hidden, qkv_width, b.qkv_mode, num_threads);
  });
  if (!qk_norm_rope_store(qkv, qkv_width, T, b.heads, b.kv_heads, D, b.q_norm, b.k_norm, b.qk_eps, b.cos, b.sin,
                          b.num_positions, batch.positions, b.k_cache, b.v_cache, b.num_blocks * b.block_size, batch.slots,
                          q, bf16, num_threads))
    return AttentionBlockStatus::BAD_POSITION_OR_SLOT;
  paged_decode_attention(q, b.k_cache, b.v_cache, block_tables, context_lens, b.scale, attn, bf16, T,
                         b.heads, b.kv_heads, D, b.block_size, max_blocks, num_threads,
                         decode_attention_isa(bf16, D));
  with_weights(b.o, b.o_bias, b.fp32_weights, [&](auto w, auto bias) {
    linear_bf16(attn, w, bias, out, bf16, T, q_width, b.hidden, b.o_mode, num_threads);
  });
  return AttentionBlockStatus::OK;
}

}  // namespace deepinfer
