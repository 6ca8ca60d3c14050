"""Sampling: greedy, temperature, top-k, top-p, min-p with per-sequence seeds, plus logprobs.

Sampled rows go through tilelang_ops' "sample" op (the TileLang kernel on CUDA, on the CPU the C++ kernel
cpu_ops.sample, checked token for token against the torch reference), so both draw by the one documented
rule. A row whose logits are not finite gets token -1: output processing ends that request with
finish_reason "error" and the rest of the batch carries on."""
from dataclasses import dataclass

import torch

from deepinfer.layers import cpu_ops
from deepinfer.layers.logits_processors import apply_processors
from deepinfer.layers.structured_output import apply_bitmask, batch_bitmask
from tilelang_ops.dispatch import get_op


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, B rows.
    temperature, top_p, min_p [B] fp32; top_k [B] int64 (<= 0 disables);
    seeds: per row the sequence's sampling seed, an int64 (LLMEngine.sequence_seed);
    offsets [B] int64: tokens the sequence has generated so far;
    num_logprobs: max top logprobs requested in the batch (-1: none);
    logits_rows: per row (LogitsContext, output token ids) for a row with logits processors, else None;
    None for the whole batch when no row has any (layers/logits_processors.py);
    grammars: per row its SequenceGrammar or None, None when no row has structured outputs."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: list
    offsets: torch.Tensor
    num_logprobs: int
    logits_rows: list | None = None
    grammars: list | None = None

    def row(self, i: int) -> "SamplingBatch":
        """The parameters of row i alone."""
        return SamplingBatch(self.temperature[i:i + 1], self.top_k[i:i + 1], self.top_p[i:i + 1],
                             self.min_p[i:i + 1], [self.seeds[i]], self.offsets[i:i + 1], self.num_logprobs,
                             None if self.logits_rows is None else self.logits_rows[i:i + 1],
                             None if self.grammars is None else self.grammars[i:i + 1])

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    """tokens [B] int64 (-1 on failure); token_logprob [B] and token_rank [B] (1 = most likely)
    of the sampled token; topk_ids / topk_logprobs [B, n] or None. prompt: for a prefill that scores prompt tokens
    (ModelRunner.execute's `prompt`), cpu_ops.token_logprobs' four tensors over those rows."""

    tokens: torch.Tensor
    token_logprob: torch.Tensor | None
    token_rank: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    prompt: tuple | None = None


class Sampler:
    def __init__(self):
        self.sample = get_op("sample")

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] fp32."""
        logits = logits.float()
        if self.plain_greedy(batch) and logits.is_contiguous() and logits.device.type == "cpu":
            return SamplerOutput(cpu_ops.greedy_tokens(logits), None, None, None, None)  # one pass, not four
        finite = finite_rows(logits)
        if not bool(finite.all()):
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        tokens = self.draw(logits, batch)
        tokens = torch.where(finite, tokens, torch.full_like(tokens, -1))
        return self.logprobs(logits, tokens, batch.num_logprobs)

    @staticmethod
    def plain_greedy(batch: SamplingBatch) -> bool:
        """Whether every row's token is the argmax of its raw logits (cpu_ops.greedy_tokens' rule) and nothing else
        is wanted: greedy, no logprobs, logits processors or grammars."""
        return batch.all_greedy and batch.num_logprobs < 0 and batch.logits_rows is None and batch.grammars is None

    def draw(self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] fp32, finite -> [B] int64 tokens drawn from the processed logits; -1 where nothing is
        left to draw. bitmask [B, ceil(V/32)] int32: the tokens structured outputs allow (default: from
        batch.grammars)."""
        if bitmask is None and batch.grammars is not None:
            bitmask = batch_bitmask(batch.grammars, logits.shape[1])
        if batch.logits_rows is None and bitmask is None:
            return logits.argmax(-1) if batch.all_greedy else self._sample(logits, batch)
        scores = logits.clone() if batch.logits_rows is None else apply_processors(logits, batch.logits_rows)
        if bitmask is not None:
            apply_bitmask(scores, bitmask)
        tokens = scores.argmax(-1) if batch.all_greedy else self._sample(scores, batch)
        return torch.where(scores.amax(-1) > float("-inf"), tokens, torch.full_like(tokens, -1))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A row's draw depends only on (its sequence's seed, tokens generated so far), so a sequence
        reproduces whatever else shares the batch, and speculative verification can recompute it
        (spec_decode/verify.py). Greedy rows: argmax."""
        seeds = torch.tensor(batch.seeds, dtype=torch.int64)
        return self.sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, seeds, batch.offsets)

    @staticmethod
    def logprobs(logits, tokens, n, rows=None) -> SamplerOutput:
        """logits [R, V] fp32 (raw, as vLLM reports them), tokens [B] scored by logits rows [B] (default: all
        rows, R = B); n top logprobs (-1: none, and logits are not touched). The kernel the one-call decode steps
        use too (cpu_ops.token_logprobs); a row whose token is -1 (failed) gets logprob 0 and rank 0."""
        if n < 0:
            return SamplerOutput(tokens, None, None, None, None)
        if rows is not None:
            logits = logits[rows]
        return SamplerOutput(tokens, *cpu_ops.token_logprobs(logits.float().contiguous(), tokens.contiguous(), n))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] bool: no NaN or inf in the row. A row is finite iff its max and min are (amax and amin
    propagate NaN): two vectorised reductions instead of isfinite's [R, V] bool tensor (measured 0.24 vs
    6.1 ms at 64 x 32000 on one thread, 4% of a batch-64 decode step of the medium Qwen3-MoE)."""
    return torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1))
