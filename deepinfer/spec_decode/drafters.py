"""Drafters behind one interface:

    propose(batch: DraftBatch) -> (tokens [R, k] int64, confidences [R, k] fp64)
    observe(seq_ids, verified, accepted)   per sequence, drafts verified / accepted in the last step

and optionally after_step(engine, batch, results), called after every engine step (the MTP drafter
drafts there, from that step's hidden states). Every drafter proposes deterministically (a point mass):
verification accepts a draft exactly when it equals the sampler's own draw at its position (verify.py)."""
from functools import cached_property

import torch


class DraftBatch:
    """The running sequences a step drafts for. histories (prompt + output tokens) and keys (the prompt,
    which identifies a request) are copied out of the C++ scheduler only if a drafter reads them."""

    def __init__(self, scheduler, seq_ids: list[int]):
        self.scheduler, self.seq_ids = scheduler, seq_ids

    @cached_property
    def _seqs(self):
        return [self.scheduler.sequence(i) for i in self.seq_ids]

    @cached_property
    def histories(self) -> list[list[int]]:
        return [list(s.token_ids) for s in self._seqs]

    @cached_property
    def keys(self) -> list[tuple]:
        return [tuple(h[:s.num_prompt_tokens]) for h, s in zip(self.histories, self._seqs)]


def check_proposal(tokens: torch.Tensor, conf: torch.Tensor, rows: int, k: int, vocab: int) -> None:
    """A drafter's output must have the agreed shape, valid ids and confidences in [0, 1]."""
    if tuple(tokens.shape) != (rows, k) or tuple(conf.shape) != (rows, k):
        raise ValueError(f"drafter returned tokens {tuple(tokens.shape)} / confidences {tuple(conf.shape)}, "
                         f"expected ({rows}, {k})")
    if not torch.isfinite(conf).all() or (conf < 0).any() or (conf > 1).any():
        raise ValueError("drafter returned confidences that are non-finite or outside [0, 1]")
    if rows and ((tokens < 0).any() or (tokens >= vocab).any()):
        raise ValueError("drafter returned token ids outside the vocabulary")


class NgramDrafter:
    """Prompt lookup: finds the latest earlier occurrence of the history's last n tokens
    (n = max_n down to min_n) and proposes the k tokens that followed it. Confidence per position
    is the acceptance rate measured so far at that position (starts at `prior`)."""

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1, prior: float = 0.5):
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self.accepted = torch.full((k,), prior)
        self.offered = torch.ones(k)

    def propose(self, batch: DraftBatch):
        histories = batch.histories
        tokens = torch.zeros(len(histories), self.k, dtype=torch.int64)
        found = torch.zeros(len(histories), dtype=torch.bool)
        for row, hist in enumerate(histories):
            match = self._lookup(hist)
            if match:
                tokens[row, :len(match)] = torch.tensor(match)
                found[row] = True
        rate = (self.accepted / self.offered).clamp(0, 1)
        conf = torch.where(found[:, None], rate.expand(len(histories), self.k), torch.zeros(()))
        return tokens, conf.double()

    def _lookup(self, hist: list[int]) -> list[int]:
        for n in range(min(self.max_n, len(hist) - 1), self.min_n - 1, -1):
            suffix = hist[-n:]
            for start in range(len(hist) - n - 1, -1, -1):
                if hist[start:start + n] == suffix:
                    follow = hist[start + n:start + n + self.k]
                    return follow + [follow[-1]] * (self.k - len(follow))
        return []

    def observe(self, seq_ids, verified: list[int], accepted: list[int]) -> None:
        """Updates the per-position acceptance rates."""
        for v, a in zip(verified, accepted):
            self.offered[:v] += 1
            self.accepted[:min(a, v)] += 1


class ReplayDrafter:
    """For benchmarks: proposes a known reference continuation (keyed by prompt), each position
    replaced by a random token with probability 1 - acceptance, so the per-position acceptance is
    known and the confidences (= acceptance) are calibrated. acceptance 0 proposes random tokens."""

    def __init__(self, k: int, references: dict, acceptance: float, vocab_size: int, seed: int = 0):
        if not 0 <= acceptance <= 1:
            raise ValueError(f"speculative acceptance must be in [0, 1], got {acceptance!r}")
        self.k, self.references, self.acceptance, self.vocab = k, references, acceptance, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, batch: DraftBatch):
        histories, keys = batch.histories, batch.keys
        tokens = torch.randint(0, self.vocab, (len(histories), self.k), generator=self.generator)
        keep = torch.rand(len(histories), self.k, generator=self.generator) < self.acceptance
        conf = torch.full((len(histories), self.k), float(self.acceptance), dtype=torch.float64)
        for row, (hist, key) in enumerate(zip(histories, keys)):
            ref = self.references.get(key)
            if ref is None:
                conf[row] = 0.0
                continue
            done = len(hist) - len(key)
            follow = torch.tensor((list(ref[done:done + self.k]) + [0] * self.k)[:self.k])
            tokens[row] = torch.where(keep[row], follow, tokens[row])
        return tokens, conf

    def observe(self, seq_ids, verified, accepted) -> None:
        """Confidences are given, not learned."""
