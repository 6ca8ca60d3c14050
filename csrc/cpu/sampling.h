#pragma once
// Greedy sampling in one pass over the logits: torch's finiteness check (amax, amin) and argmax read a
// [B, V] fp32 tensor three times, ~3% of a batch-64 decode step of the medium Qwen3-MoE at two threads.
#include <cstdint>

namespace deepinfer {

// tokens[b] = the first index of row b's maximum (torch.argmax's tie rule), or -1 when the row holds a
// NaN or an infinity. logits [B, V] fp32, rows V apart.
void greedy_tokens(const float* logits, int64_t B, int64_t V, int64_t* tokens, int num_threads);

// tilelang_ops.sampling.sample_ref's draw (its module docstring has the rule): per row temperature, top-k,
// top-p, min-p and the seeded Gumbel-max draw over the kept tokens; greedy (argmax of the raw logits) where
// temperature <= 0; -1 for a row with no logit above -inf. The hashed uniforms are the reference's bit for
// bit and the winning scores' logs the C library's; the masses' exps are exp8's (simd.h, ~2 ulp) and top-p sums
// them per bin of z, so a draw can differ only where two scores tie within an ulp or a top-p sum meets its target
// within rounding. Per 32k-token row at one thread (Zen 3): 0.10-0.14 ms with temperature alone (~0.02 ms on a
// peaked row: tokens 20 below the top need no noise), 0.05-0.3 ms with filters (top-p on flat rows the most).
// logits [B, V] fp32 finite or -inf; per-row parameters [B]; tokens [B].
void sample_tokens(const float* logits, int64_t B, int64_t V, const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p, const int64_t* seeds, const int64_t* offsets,
                   int64_t* tokens, int num_threads);

// Logprobs as torch's log_softmax over the raw logits gives them (vLLM's raw logprobs): per row b with tokens[b] >= 0,
// token_logprob[b] = logp(tokens[b]) with logp(v) = (logits[b, v] - max) - log(sum exp(logits[b] - max)), rank[b] = 1 +
// the tokens of greater logp, and top_ids / top_logprobs [b, 0..n) the n greatest in descending order, lower id first
// among equals (n 0: none). Rows with tokens[b] < 0 (non-finite logits) are left as they are. The exps are
// exp8's (~2 ulp), summed in double in a fixed order, so a logprob is within a few ulp of the log-sum of the exact
// one (torch's fp32 log_softmax drifts further at 32000 tokens). logits [B, V] finite where tokens >= 0; n <= V.
void token_logprobs(const float* logits, int64_t B, int64_t V, const int64_t* tokens, int64_t n, float* token_logprob,
                    int64_t* rank, int64_t* top_ids, float* top_logprobs, int num_threads);

// The draw scores every token with vector logs first and only the best few with the C library's
// (sampling.cpp, gumbel_argmax); it is exact while the vector Gumbel noise stays within kGumbelError of the
// library's. The largest difference over all 2^23 uniforms, for the tests to hold against that bound.
constexpr float kGumbelError = 1e-5f;
float gumbel_approx_error();

// Structured outputs: logits[b, v] = -inf where bit v % 32 of bitmask[b, v / 32] is clear (xgrammar's
// layout). logits [B, V] fp32, bitmask [B, ceil(V / 32)] int32.
void apply_token_mask(float* logits, const int32_t* bitmask, int64_t B, int64_t V, int num_threads);

}  // namespace deepinfer
