#pragma once
// Decode attention on the CPU: one query row per sequence, each key read once for every query head that shares
// it, in place in the paged cache: widened to fp32 in registers (attention_kernel.h), or (bf16 on AVX512-BF16
// CPUs, attention_avx512bf16.cpp) multiplied as bf16 pairs.
//
// DeepSeek-V4 decode attention (tilelang_ops/v4_decode_attention.py states the math; its torch
// reference spends most of its ~1.8 ms per medium-model layer at batch 16 on copies and dispatch).
// One query row per sequence, H heads over one shared K=V set: the sequence's valid window rows and
// compressed entries, widened to fp32 once and read by every head; the per-head sink joins the softmax.
#include <cstdint>

#include "cpu/cpu_features.h"

namespace deepinfer {

// q [B, H, D], ring [B, W, D], comp [B, K, D] (all float, or all bf16 when bf16), ring_len [B] int64,
// comp_valid [B, K] uint8, sinks [H] fp32 -> out [B, H, D] in q's type (zero where nothing is valid).
void v4_decode_attention(const void* q, const void* ring, const int64_t* ring_len, const void* comp,
                         const uint8_t* comp_valid, const float* sinks, float scale, void* out, bool bf16, int64_t B,
                         int64_t H, int64_t D, int64_t W, int64_t K, int num_threads);

// Paged GQA decode (Llama / Qwen3 layers): q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D];
// block_tables [B, max_blocks] int64; context_lens [B] int64 (>= 1: the new token's key is stored
// already). Head h attends over keys [0, context_lens[b]) of kv head h / (H / Hkv) -> out [B, H, D].
// All tensors float, or all bf16 when bf16 (out rounded once). isa: a path decode_attention_runs.
void paged_decode_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, float scale, void* out, bool bf16, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, int num_threads, Isa isa);

// Whether paged_decode_attention has an isa path for these inputs on this CPU: AVX2 and AVX512 compute in fp32;
// AVX512_BF16 takes bf16 with D a multiple of 32.
bool decode_attention_runs(Isa isa, bool bf16, int64_t D);

// The fastest path that runs (AVX512_BF16, else AVX512, else AVX2).
Isa decode_attention_isa(bool bf16, int64_t D);

}  // namespace deepinfer
