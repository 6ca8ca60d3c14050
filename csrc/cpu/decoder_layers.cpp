#include "cpu/decoder_layers.h"

#include <vector>

#include "cpu/bf16.h"
#include "cpu/norm_rope.h"
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
  auto round = [&](int64_t n0, int64_t n1) {
    for (int64_t t = 0; t < T; ++t) {
      float* row = logits + t * V;
      int64_t n = n0;
      for (; n + 8 <= n1; n += 8) _mm256_storeu_ps(row + n, round_to8(_mm256_loadu_ps(row + n), true));
      for (; n < n1; ++n) row[n] = round_to(row[n], true);
    }
  };
  gemm_bf16(normed.data(), bf16, head.lm_head, logits, T, hidden, V, head.mode, num_threads,
            bf16 ? ColumnsDone(round) : nullptr);
}

}  // namespace

DecoderLayersStatus decoder_layers(const std::vector<DecoderLayer>& layers, const void* x, void* out,
                                   const DecodeBatch& batch, bool bf16, int num_threads, const DecodeHead* head,
                                   float* logits) {
  DecoderLayersStatus status;
  if (layers.empty()) return status;
  const int64_t hidden = layers[0].attention->hidden;
  Scratch<char> a(ScratchUse::LAYER_ATTENTION, batch.T * hidden * (bf16 ? 2 : 4));
  // The residual stream lives in out from the first MoE half on (moe_block may write over its x).
  const void* in = x;
  for (size_t l = 0; l < layers.size(); ++l, in = out) {
    const DecoderLayer& layer = layers[l];
    status.attention = attention_block(*layer.attention, in, a.data(), batch, bf16, num_threads);
    if (status.attention != AttentionBlockStatus::OK ||
        !moe_block(*layer.moe, layer.counts, layer.log2phy, in, a.data(), out, batch.T, bf16, num_threads)) {
      status.layer = static_cast<int>(l);
      return status;
    }
  }
  if (head) run_head(*head, out, logits, batch.T, hidden, bf16, num_threads);
  return status;
}

}  // namespace deepinfer
