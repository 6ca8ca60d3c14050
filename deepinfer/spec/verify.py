"""Verification of drafts against the target model, lossless.

Greedy rows accept drafts while they equal the target's argmax. Sampled rows use rejection
sampling for a deterministic proposal (q = point mass on the draft d): accept d with probability
min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(0, p - q) normalised, i.e. p
without d. After the last accepted draft the target's own distribution gives the bonus token, so
every emitted token is distributed exactly as the target's."""
import torch

from deepinfer.layers.sampler import SamplingBatch, finite_rows
from tilelang_ops.sampling import filter_ref


def target_probs(logits: torch.Tensor, params_row: SamplingBatch) -> torch.Tensor:
    """logits [N, V] fp32, one row of parameters for all N -> the sampler's distribution [N, V]: softmax of
    the scaled logits over the tokens the sampling op's filter keeps (its Gumbel-max draw samples exactly this)."""
    n = logits.shape[0]
    p = params_row
    z, keep = filter_ref(logits, p.temperature.expand(n), p.top_k.expand(n), p.top_p.expand(n), p.min_p.expand(n))
    return z.masked_fill(~keep, float("-inf")).softmax(-1)


def verify_sequence(logits: torch.Tensor, drafts: list[int], params_row: SamplingBatch, generator,
                    engine_generator) -> list[int]:
    """logits [1 + l, V] for the query rows of one sequence (last real token, then l drafts).
    Returns the accepted drafts plus one target token, or [-1] if the logits are not finite."""
    if not bool(finite_rows(logits).all()):
        return [-1]
    if float(params_row.temperature[0]) == 0:
        target = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return drafts[:accepted] + [target[accepted]]
    probs = target_probs(logits, params_row)
    gen = generator or engine_generator
    for j, d in enumerate(drafts):
        if torch.rand((), generator=gen) < probs[j, d]:
            continue
        residual = probs[j].clone()
        residual[d] = 0
        return drafts[:j] + [_draw(residual, gen)]
    return drafts + [_draw(probs[-1], gen)]


def _draw(p: torch.Tensor, gen) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=gen))
