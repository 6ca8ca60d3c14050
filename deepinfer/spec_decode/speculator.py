"""Speculative decoding in the engine: before each step every running sequence gets drafts, the
C++ MTPVarlen greedy picks how many of each to verify on this machine's measured step-time curve,
and after the forward verify.py decides what is accepted (the scheduler rolls back the rest)."""
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from deepinfer import _C, platform
from deepinfer.config import dataclass_from_dict
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.layers.sampler import Sampler
from deepinfer.spec_decode.drafters import DraftBatch, NgramDrafter, ReplayDrafter, check_proposal
from deepinfer.spec_decode.mtp import MTPDrafter
from deepinfer.spec_decode.verify import verify_sequence

logger = logging.getLogger("deepinfer")


@dataclass
class SpecConfig:
    """LLM(speculative={...}): method "ngram" | "replay" | "mtp"; num_draft_tokens k in 1..16;
    verify "greedy" (MTPVarlen) or "all" (every draft); replay: acceptance, references
    {prompt token tuple: continuation}; mtp: calibrate (fit per-position confidence temperatures to the
    measured acceptance)."""

    method: str
    num_draft_tokens: int
    verify: str = "greedy"
    acceptance: float = 0.75
    references: dict | None = None
    seed: int = 0
    calibrate: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "SpecConfig":
        cfg = dataclass_from_dict(cls, d, "speculative")
        if cfg.method not in ("ngram", "replay", "mtp"):
            raise ValueError(f"LLM(speculative={{'method': {cfg.method!r}}}) must be mtp, ngram or replay")
        if not isinstance(cfg.num_draft_tokens, int) or not 1 <= cfg.num_draft_tokens <= 16:
            raise ValueError(f"LLM(speculative={{'num_draft_tokens': {cfg.num_draft_tokens!r}}}) must be in 1..16")
        if cfg.verify not in ("greedy", "all"):
            raise ValueError(f"LLM(speculative={{'verify': {cfg.verify!r}}}) must be 'greedy' or 'all'")
        return cfg


@dataclass
class SpecDecodingStats:
    """vLLM's speculative-decoding counters since the engine started: num_drafts counts verifications of a
    sequence with at least one draft, num_draft_tokens / num_accepted_tokens the drafts sent / accepted, and
    per draft position j (0 = first draft) the drafts verified there and accepted there. A draft is accepted
    only when every draft before it was, so position j's rate is the chance that j + 1 drafts survive."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_draft_tokens_per_pos = [0] * self.num_spec_tokens
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, verified: int, accepted: int) -> None:
        if verified == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        for j in range(verified):
            self.num_draft_tokens_per_pos[j] += 1
            self.num_accepted_tokens_per_pos[j] += j < accepted

    def acceptance_per_position(self) -> list[float | None]:
        """Accepted / verified at each draft position; None where no draft was verified there."""
        return [a / d if d else None for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 (the target's own token) + accepted drafts per draft event."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def prepare_model(model, cfg: SpecConfig) -> None:
    """Before the cache is laid out: models with position-indexed rings keep k + 1 extra positions so
    rejected drafts can be rolled back, and an MTP drafter gets its own ring."""
    if hasattr(model, "max_backtracking"):
        model.max_backtracking = cfg.num_draft_tokens + 1
    if cfg.method == "mtp" and hasattr(model, "mtp_enabled"):
        model.mtp_enabled = True


class Speculator:
    def __init__(self, cfg: SpecConfig, engine):
        if not getattr(engine.model, "supports_draft_rollback", False):
            raise ValueError(f"LLM(speculative=...): {type(engine.model).__name__} cannot roll back rejected "
                             "drafts yet (state it keeps per sequence would keep them)")
        self.cfg, self.k = cfg, cfg.num_draft_tokens
        self.drafter = self._make_drafter(cfg, engine)
        self.varlen = _C.MTPVarlen(step_time_curve(engine, self.k))
        self.schedule_seconds = 0.0
        self.stats = SpecDecodingStats(self.k)

    @staticmethod
    def _make_drafter(cfg: SpecConfig, engine):
        if cfg.method == "ngram":
            return NgramDrafter(cfg.num_draft_tokens)
        if cfg.method == "replay":
            refs = {tuple(k): list(v) for k, v in (cfg.references or {}).items()}
            return ReplayDrafter(cfg.num_draft_tokens, refs, cfg.acceptance, engine.vocab_size, cfg.seed)
        if not len(getattr(engine.model, "mtp", ())):
            raise ValueError("LLM(speculative={'method': 'mtp'}): this checkpoint has no MTP layers "
                             "(no mtp.* tensors) to draft with")
        return MTPDrafter(cfg.num_draft_tokens, engine.model, cfg.calibrate)

    def prepare(self, engine) -> None:
        """Proposes drafts for every running sequence and hands the verified prefix to the scheduler."""
        ids = list(engine.scheduler.running_ids())
        if not ids:
            return
        tokens, conf = self.drafter.propose(DraftBatch(engine.scheduler, ids))
        check_proposal(tokens, conf, len(ids), self.k, engine.vocab_size)
        start = time.perf_counter()
        lens = self.varlen.schedule(conf.numpy()) if self.cfg.verify == "greedy" else [self.k] * len(ids)
        self.schedule_seconds += time.perf_counter() - start
        for seq_id, row, n in zip(ids, tokens.tolist(), lens):
            grammar = engine.seqs[seq_id].grammar
            if grammar is not None:  # a draft the grammar refuses could never be accepted
                n = grammar.valid_prefix(row[:n])
            engine.scheduler.set_drafts(seq_id, row[:n])

    def verify(self, batch, logits: torch.Tensor, states, sampling) -> list[list[int]]:
        """logits [sum(1 + l_r), V] -> per sequence accepted drafts + one target token."""
        qsl = batch.query_start_loc.tolist()
        out, verified, accepted = [], [], []
        for i, state in enumerate(states):
            lo, hi = qsl[i], qsl[i + 1]
            drafts = batch.input_ids[lo + 1:hi].tolist()
            row = sampling.row(i)
            toks = verify_sequence(logits[lo:hi], drafts, row)
            out.append(toks)
            verified.append(len(drafts))
            accepted.append(max(0, len(toks) - 1))
            self.stats.observe(verified[-1], accepted[-1])
        self.drafter.observe(batch.seq_ids, verified, accepted)
        return out

    @staticmethod
    def token_logprobs(batch, logits: torch.Tensor, tokens: list[list[int]], n: int):
        """Logprobs of every emitted token, from the verify row that scored it (token j of sequence i comes
        from row query_start_loc[i] + j). -> (SamplerOutput over the tokens flattened in sequence order,
        each sequence's first index in it)."""
        qsl = batch.query_start_loc.tolist()
        rows = [qsl[i] + j for i, toks in enumerate(tokens) for j in range(len(toks))]
        firsts = list(itertools.accumulate([0] + [len(t) for t in tokens]))[:-1]
        flat = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64)
        return Sampler.logprobs(logits, flat, n, rows), firsts

    def after_step(self, engine, batch, results) -> None:
        """Lets a drafter that works from the step's hidden states (MTP) draft for the next step."""
        hook = getattr(self.drafter, "after_step", None)
        if hook is not None:
            hook(engine, batch, results)


def step_time_curve(engine, k: int) -> "_C.StepTimeCurve":
    """ms per decode step against query tokens, measured on this engine (cached on disk by model,
    dtype, threads, shape, CPU and extension build: a kernel change never reuses a stale curve); the
    C++ side forces it monotone."""
    cfg = engine.config
    points = [q for q in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if q <= cfg.max_num_seqs * (k + 1)]
    path = platform.cache_path("step_curves", os.path.abspath(cfg.model), str(cfg.dtype), cfg.num_threads,
                               cfg.batch_invariant, points)
    if os.path.exists(path):
        with open(path) as f:
            ms = json.load(f)
    else:
        ms = [_time_forward(engine, q) for q in points]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(ms, f)
    logger.info("step-time curve (query tokens: ms): %s", dict(zip(points, [round(m, 2) for m in ms])))
    return _C.StepTimeCurve([float(p) for p in points], ms)


@torch.inference_mode()
def _time_forward(engine, tokens: int, repeats: int = 3) -> float:
    """Best of `repeats` forwards of `tokens` one-token sequences writing to block 0 (the engine
    profiles before any request owns a block)."""
    meta = AttentionMetadata(
        is_prefill=False, positions=torch.zeros(tokens, dtype=torch.int64),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), query_start_loc=torch.arange(tokens + 1),
        context_lens=torch.ones(tokens, dtype=torch.int64), block_tables=torch.zeros(tokens, 1, dtype=torch.int64),
        state_slots=torch.zeros(tokens, dtype=torch.int64), block_size=engine.config.block_size,
        max_query_len=1, max_context_len=1)
    ids = torch.ones(tokens, dtype=torch.int64)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine.model.forward_logits(ids, meta)
        best = min(best, time.perf_counter() - start)
    return 1000 * best
