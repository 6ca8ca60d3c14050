#pragma once
// Every decoder layer of a Qwen3-MoE model at decode in one call: per layer the fused attention half
// (attention_block.h) and the fused MoE half (moe_block.h). Called per layer from Python, the two halves'
// dispatch (argument checks, tensor views, the calls themselves) cost ~100 us a layer: 7% of a batch-1
// step of the medium model on one thread. Each layer runs the same kernels, so the results are the same bits.
#include <cstdint>
#include <vector>

#include "cpu/attention_block.h"
#include "cpu/gemm_bf16.h"
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

// The model's final RMSNorm (norm_w [hidden], the activations' dtype) and LM head (lm_head [vocab, hidden] bf16
// on `mode`) after the last layer: each logit rounded to the activations' dtype and kept in fp32, the bits of
// the unfused lm_head(norm(h)).float(). Joining the layers' call spares a batch-1 step two more calls from
// Python, whose code runs on caches cold from the weight stream.
struct DecodeHead {
  const void* norm_w = nullptr;
  float eps = 0.0f;
  const uint16_t* lm_head = nullptr;
  int64_t vocab = 0;
  GemmMode mode;
};

// x [T, hidden] -> out [T, hidden] through the layers in order (x is not written); the batch and dtype as
// attention_block's, shared by every layer; with a head, also logits [T, vocab] fp32 from out. On failure
// out and logits are unspecified and the earlier layers' KV stays stored, as when the unfused path raises in
// a later layer.
DecoderLayersStatus decoder_layers(const std::vector<DecoderLayer>& layers, const void* x, void* out,
                                   const DecodeBatch& batch, bool bf16, int num_threads,
                                   const DecodeHead* head = nullptr, float* logits = nullptr);

}  // namespace deepinfer
