#pragma once
// Every decoder layer of a Qwen3-MoE model at decode in one call: per layer the fused attention half
// (attention_block.h) and the fused MoE half (moe_block.h). Called per layer from Python, the two halves'
// dispatch (argument checks, tensor views, the calls themselves) cost ~100 us a layer: 7% of a batch-1
// step of the medium model on one thread. Each layer runs the same kernels, so the results are the same bits.
#include <cstdint>
#include <vector>

#include "cpu/attention_block.h"
#include "cpu/moe_block.h"

namespace deepinfer {

// One layer's weights, and this step's expert-load counter and logical -> physical map (moe_block's).
struct DecoderLayer {
  const AttentionBlock* attention = nullptr;
  const MoeBlock* moe = nullptr;
  int64_t* counts = nullptr;
  const int64_t* log2phy = nullptr;
};

// Where decoder_layers stopped: layer -1 when every layer ran; otherwise the failing layer, with its
// attention status (OK when its MoE half failed: a mapped expert out of range).
struct DecoderLayersStatus {
  int layer = -1;
  AttentionBlockStatus attention = AttentionBlockStatus::OK;
};

// x [T, hidden] -> out [T, hidden] through the layers in order (x is not written); the batch and dtype as
// attention_block's, shared by every layer. On failure out is unspecified and the earlier layers' KV stays
// stored, as when the unfused path raises in a later layer.
DecoderLayersStatus decoder_layers(const std::vector<DecoderLayer>& layers, const void* x, void* out,
                                   const DecodeBatch& batch, bool bf16, int num_threads);

}  // namespace deepinfer
