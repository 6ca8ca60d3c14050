#include "cpu/decoder_layers.h"

#include "cpu/scratch.h"

namespace deepinfer {

DecoderLayersStatus decoder_layers(const std::vector<DecoderLayer>& layers, const void* x, void* out,
                                   const DecodeBatch& batch, bool bf16, int num_threads) {
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
  return status;
}

}  // namespace deepinfer
