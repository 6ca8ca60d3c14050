"""Turns a C++ ScheduledBatch into tensors, runs the model forward and the sampler."""
import dataclasses

import numpy as np
import torch

from deepinfer import _C
from deepinfer.layers import cpu_ops
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.layers.sampler import Sampler, SamplerOutput, SamplingBatch


# Prompt rows scored per slice: their fp32 logits (256 x a 128k vocabulary: 128 MiB) are made and dropped in turn.
SCORE_ROWS = 256


class ModelRunner:
    def __init__(self, model, block_size: int):
        self.model, self.block_size = model, block_size
        self.sampler = Sampler()
        self._drawn = getattr(model, "decode_drawn", None)  # optional: models that draw inside their decode call
        self._steps = getattr(model, "decode_steps", None)  # optional: and run decode steps back to back

    def prepare(self, batch) -> tuple[torch.Tensor, AttentionMetadata]:
        """ScheduledBatch -> (input_ids [T], metadata). The arrays come from C++ input prep."""
        # Maxima from the numpy arrays: each torch op on these few values costs more, and a decode step's Python
        # runs with caches the weight stream has just emptied.
        qsl_np, ctx_np = batch.query_start_loc, batch.context_lens
        qsl, ctx = torch.from_numpy(qsl_np).long(), torch.from_numpy(ctx_np).long()
        meta = AttentionMetadata(
            is_prefill=batch.type == _C.StepType.PREFILL,
            positions=torch.from_numpy(batch.positions),
            slot_mapping=torch.from_numpy(batch.slot_mapping),
            query_start_loc=qsl,
            context_lens=ctx,
            block_tables=torch.from_numpy(batch.block_tables).long(),
            state_slots=torch.from_numpy(batch.state_slots).long(),
            block_size=self.block_size,
            max_query_len=int(np.diff(qsl_np).max()),
            max_context_len=int(ctx_np.max()),
        )
        return torch.from_numpy(batch.input_ids), meta

    @torch.inference_mode()
    @cpu_ops.scratch_kept()
    def logits(self, batch) -> torch.Tensor:
        """[S, V] fp32 logits at the last token of each of the S sampled sequences (batch.sampled)."""
        input_ids, meta = self.prepare(batch)
        return self._logits(batch, input_ids, meta, _decodes_all(batch, meta))

    def _logits(self, batch, input_ids: torch.Tensor, meta: AttentionMetadata, decodes_all: bool) -> torch.Tensor:
        """logits(batch) from its prepared inputs; decodes_all: _decodes_all(batch, meta)."""
        if decodes_all:  # every row is a sampled last token
            return self.model.forward_logits(input_ids, meta)
        return self._sampled_logits(batch, self.model(input_ids, meta), meta)

    def _sampled_logits(self, batch, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, ...] -> [S, V] fp32 logits at the last token of each sampled sequence."""
        return self.model.compute_logits(hidden[meta.last_token_indices[torch.from_numpy(batch.sampled).bool()]])

    @torch.inference_mode()
    @cpu_ops.scratch_kept()
    def logits_all(self, batch) -> torch.Tensor:
        """[T, V] fp32 logits at every query token (verification needs each draft's position)."""
        input_ids, meta = self.prepare(batch)
        return self.model.forward_logits(input_ids, meta)

    @torch.inference_mode()
    @cpu_ops.scratch_kept()
    def execute(self, batch, sampling: SamplingBatch, prompt: tuple | None = None,
                sibling_rows: list[int] = ()) -> SamplerOutput:
        """The step's forward and draw. prompt: (rows [P], targets [P] int64, n) of a prefill: the logits at those
        rows score the target tokens (the next prompt tokens), token_logprobs' results in the output's `prompt`.
        sibling_rows [X]: sampled rows drawn once more each (parallel sampling), sampling's rows S.. S + X - 1."""
        input_ids, meta = self.prepare(batch)
        if prompt is None:
            logits, hidden = self._logits(batch, input_ids, meta, _decodes_all(batch, meta)), None
        else:
            hidden = self.model(input_ids, meta)
            logits = self._sampled_logits(batch, hidden, meta)
        if sibling_rows:
            logits = torch.cat([logits, logits[torch.tensor(sibling_rows)]])
        out = self.sampler(logits, sampling)
        return out if prompt is None else dataclasses.replace(out, prompt=self._score(hidden, *prompt))

    def _score(self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, n: int) -> tuple:
        """token_logprobs of targets [P] under the logits at hidden rows [P], SCORE_ROWS rows of logits at a time."""
        parts = [cpu_ops.token_logprobs(self.model.compute_logits(hidden[rows[i:i + SCORE_ROWS]]),
                                        targets[i:i + SCORE_ROWS], n) for i in range(0, len(rows), SCORE_ROWS)]
        return tuple(torch.cat(p) for p in zip(*parts))

    def draw(self, batch, sampling: tuple | None, num_logprobs: int = -1) -> SamplerOutput | None:
        """A decode step whose rows are all plain draws (greedy or sampled, with or without logprobs), drawn in the
        model's own call from the batch's arrays (decode_drawn; sampling: None for all greedy, else the rows' sampler
        arguments; num_logprobs: top logprobs per row, -1 none): no tensors built, no logits through Python. None where
        the model has no such call or cannot run this step in one (nothing ran)."""
        drawn = None if self._drawn is None else self._drawn(batch, sampling, num_logprobs)
        return None if drawn is None else drawn_output(*drawn)

    def decode_steps(self, scheduler, batch, max_steps: int, sampling: tuple | None, counts: torch.Tensor | None,
                     done: list, num_logprobs: int = -1) -> list | None:
        """`batch` and up to max_steps - 1 more decode steps, each drawn (greedy, or as the sampler draws with
        `sampling`: cpu_ops.decode_steps), scheduled and processed by the scheduler in the model's same call: done
        gets (batch, outputs, SamplerOutput of its logprobs, tokens left None) per step; counts [max_steps, ...]
        their expert counts (or None). Returns the sequences a last decode schedule evicted, or None where the model
        cannot (nothing ran)."""
        if self._steps is None:
            return None
        ran = []
        try:
            return self._steps(scheduler, batch, max_steps, sampling, counts, ran, num_logprobs)
        finally:
            done.extend((step, outputs, drawn_output(None, cpu_ops.step_logprobs(logprobs)))
                        for step, outputs, logprobs in ran)


def drawn_output(tokens: torch.Tensor | None, logprobs: tuple | None) -> SamplerOutput:
    """A drawn step's tokens and logprobs (cpu_ops.decode_drawn's pair) as the sampler's output."""
    return SamplerOutput(tokens, *(logprobs or (None,) * 4))


def _decodes_all(batch, meta: AttentionMetadata) -> bool:
    """One query per sequence, each sampled: a decode step's rows are its logits' rows."""
    return meta.max_query_len == 1 and bool(batch.sampled.all())
