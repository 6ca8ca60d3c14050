#include "cpu/decode_step.h"

#include <cstring>
#include <vector>

#include "cpu/bf16.h"
#include "cpu/norm_rope.h"
#include "cpu/sampling.h"
#include "cpu/scratch.h"

namespace deepinfer {
namespace {

// logits [T, vocab] fp32 = head.lm_head(rms_norm(h)), each rounded to the activations' dtype (linear_bf16's
// single rounding) on the thread that computed its columns.
void run_head(const DecodeHead& head, const void* h, float* logits, int64_t T, int64_t hidden, bool bf16,
              int num_threads) {
  std::vector<char> normed(T * hidden * (bf16 ? 2 : 4));
  rms_norm(h, hidden, head.norm_w, normed.data(), T, hidden, head.eps, bf16, num_threads);
  const int64_t V = head.vocab;
  auto round = [&](int64_t t0, int64_t t1, int64_t n0, int64_t n1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = logits + t * V;
      int64_t n = n0;
      for (; n + 8 <= n1; n += 8) _mm256_storeu_ps(row + n, round_to8(_mm256_loadu_ps(row + n), true));
      for (; n < n1; ++n) row[n] = round_to(row[n], true);
    }
  };
  with_weights(head.lm_head, nullptr, head.fp32_weights, [&](auto w, auto) {
    gemm_bf16(normed.data(), bf16, w, logits, T, hidden, V, head.mode, num_threads, bf16 ? OutputDone(round) : nullptr);
  });
}

// x [T, hidden] = embed[ids]; returns the first row whose id is outside [0, rows), or -1 (x then complete).
int64_t embed_rows(const DecoderStack& stack, const int64_t* ids, void* x, int64_t T, int64_t row_bytes) {
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= stack.embed_rows) return t;
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(static_cast<char*>(x) + t * row_bytes, static_cast<const char*>(stack.embed) + ids[t] * row_bytes,
                row_bytes);
  return -1;
}

}  // namespace

DecodeStatus decode_step(const DecoderStack& stack, const int64_t* ids, int64_t* counts, const DecodeBatch& batch,
                         bool bf16, int num_threads, void* out, float* logits, int64_t* tokens) {
  DecodeStatus status;
  const int64_t hidden = stack.layers.at(0).attention->hidden, row_bytes = hidden * (bf16 ? 2 : 4);
  Scratch<char> x(ScratchUse::LAYER_INPUT, batch.T * row_bytes), a(ScratchUse::LAYER_ATTENTION, batch.T * row_bytes);
  status.bad_row = embed_rows(stack, ids, x.data(), batch.T, row_bytes);
  if (status.bad_row >= 0) return status;
  // The residual stream lives in out from the first MoE half on (moe_block may write over its x).
  const void* in = x.data();
  for (size_t l = 0; l < stack.layers.size(); ++l, in = out) {
    const DecoderLayer& layer = stack.layers[l];
    status.attention = attention_block(*layer.attention, in, a.data(), batch, bf16, num_threads);
    if (status.attention != AttentionBlockStatus::OK ||
        !moe_block(*layer.moe, counts, layer.log2phy, in, a.data(), out, batch.T, bf16, num_threads)) {
      status.layer = static_cast<int>(l);
      return status;
    }
    if (counts) counts += layer.moe->num_logical;
  }
  if (!stack.head) return status;
  run_head(*stack.head, out, logits, batch.T, hidden, bf16, num_threads);
  if (tokens) greedy_tokens(logits, batch.T, stack.head->vocab, tokens, num_threads);
  return status;
}

}  // namespace deepinfer
