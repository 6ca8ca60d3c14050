"""Sampling: greedy, temperature, top-k, top-p, min-p with per-request seeds, plus logprobs.

A row whose logits are not finite gets token -1: output processing ends that request with
finish_reason "error" and the rest of the batch carries on."""
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, B rows.
    temperature, top_p, min_p [B] fp32; top_k [B] int64 (<= 0 disables);
    generators: per row a torch.Generator for seeded requests, else None (engine generator);
    num_logprobs: max top logprobs requested in the batch (-1: none)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list
    num_logprobs: int

    def row(self, i: int) -> "SamplingBatch":
        """The parameters of row i alone."""
        return SamplingBatch(self.temperature[i:i + 1], self.top_k[i:i + 1], self.top_p[i:i + 1],
                             self.min_p[i:i + 1], [self.generators[i]], self.num_logprobs)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    """tokens [B] int64 (-1 on failure); token_logprob [B] and token_rank [B] (1 = most likely)
    of the sampled token; topk_ids / topk_logprobs [B, n] or None."""

    tokens: torch.Tensor
    token_logprob: torch.Tensor | None
    token_rank: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [B, V] fp32."""
        logits = logits.float()
        finite = torch.isfinite(logits).all(-1)
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        tokens = logits.argmax(-1) if batch.all_greedy else self._sample(logits, batch)
        tokens = torch.where(finite, tokens, torch.full_like(tokens, -1))
        return self._logprobs(logits, tokens, batch.num_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = batch.temperature == 0
        scaled = logits / torch.where(greedy, 1.0, batch.temperature)[:, None]
        probs = _filter(scaled, batch).softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p, and lets each
        # seeded request use its own generator for its own row.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(-1)
        return torch.where(greedy, logits.argmax(-1), sampled)

    @staticmethod
    def _logprobs(logits, tokens, n) -> SamplerOutput:
        if n < 0:
            return SamplerOutput(tokens, None, None, None, None)
        logp = logits.log_softmax(-1)
        token_logprob = logp.gather(1, tokens.clamp(min=0)[:, None])
        rank = 1 + (logp > token_logprob).sum(-1)
        top = logp.topk(n, dim=-1) if n > 0 else None
        return SamplerOutput(tokens, token_logprob[:, 0], rank, top and top.indices, top and top.values)


def _filter(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks tokens with -inf in vLLM's order: min-p on the full distribution, then top-k, then
    top-p on what is left (renormalised). The most likely token always stays."""
    sorted_logits, sorted_idx = scaled.sort(-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    rank = torch.arange(scaled.shape[-1])[None, :]
    k = torch.where(batch.top_k > 0, batch.top_k, scaled.shape[-1])
    drop = (rank >= k[:, None]) | (sorted_probs < batch.min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    kept = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (kept.cumsum(-1) - kept) >= batch.top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)
