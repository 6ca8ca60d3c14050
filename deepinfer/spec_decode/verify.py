"""Verification of drafts against the target model: lossless, and token-identical to decoding without drafts.

Every emitted token is the sampler's draw for its output position: argmax(z + G(seed, position)) over the
tokens the filter keeps (tilelang_ops.sampling; greedy rows: argmax of the logits). The draw depends only on
the sequence's seed, the position and the target distribution, so verifying a draft is a comparison: accept
it while it equals the target's draw at its position, and emit the target's draw at the first mismatch (or
after the last draft). Plain decoding would have drawn exactly these tokens, so the output does not depend
on how many drafts were proposed or verified. For a draft proposed as one token (every drafter here), the
chance of acceptance is p(d), the same as rejection sampling's min(1, p(d) / q(d)) with q the point mass
on d; docs/benchmarks.md compares the measured rate with that expectation."""
import torch

from deepinfer.layers.sampler import Sampler, SamplingBatch, finite_rows


def target_tokens(logits: torch.Tensor, params_row: SamplingBatch, drafts: list[int]) -> torch.Tensor:
    """logits [N, V] fp32 for N consecutive output positions of one sequence (params_row: its one row,
    offsets = the first position; drafts: the N - 1 tokens between them, which the logits processors and
    the grammar of later positions see as outputs) -> [N] int64: the sampler's draw at each position."""
    n, p = logits.shape[0], params_row
    rows = None
    if p.logits_rows is not None and p.logits_rows[0] is not None:
        ctx, outputs = p.logits_rows[0]
        rows = [(ctx, outputs + drafts[:j]) for j in range(n)]
    at_positions = SamplingBatch(p.temperature.expand(n), p.top_k.expand(n), p.top_p.expand(n), p.min_p.expand(n),
                                 p.seeds * n, p.offsets + torch.arange(n, dtype=torch.int64), -1, rows)
    grammar = p.grammars[0] if p.grammars is not None else None
    return Sampler().draw(logits, at_positions, None if grammar is None else grammar.masks_along(drafts))


def verify_sequence(logits: torch.Tensor, drafts: list[int], params_row: SamplingBatch) -> list[int]:
    """logits [1 + l, V] for the query rows of one sequence (last real token, then l drafts).
    Returns the accepted drafts plus one target token; where the logits are not finite (or the processors
    masked every token) at the first rejected position, only the accepted drafts, or [-1] if none: plain
    decoding would emit the same tokens and fail at that position."""
    if not bool(finite_rows(logits).all()):
        return [-1]
    target = target_tokens(logits.float(), params_row, drafts).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    if target[accepted] < 0:
        return drafts[:accepted] or [-1]
    return drafts[:accepted] + [target[accepted]]
