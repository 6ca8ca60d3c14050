"""Expert load statistics: tokens routed to each logical expert, per layer, over the last W steps.

The engine calls ``record(layer, topk_ids)`` from every MoE layer's forward and ``end_step()`` once per
engine step. Counting is a ``scatter_add_`` into a tensor on the router's device, so recording never
waits for the device (``torch.bincount`` would: it reads the maximum id back to size its output).
"""
from __future__ import annotations

import numpy as np
import torch


class ExpertLoadRecorder:
    """Ring buffer [W + 1, L, E] of token counts (int64): W completed steps plus slot ``pos``, which
    accumulates the step in progress."""

    def __init__(self, num_layers: int, num_experts: int, window: int, device=None):
        """Counts live on ``device`` (put it where the router runs); sizes must be positive integers."""
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.num_layers, self.num_experts, self.window = int(num_layers), int(num_experts), int(window)
        self.buf = torch.zeros(self.window + 1, self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        self.pos = 0          # ring slot of the step in progress
        self.filled = 0       # completed steps held (<= window)
        self.steps = 0        # completed steps ever recorded
        self._rows, self._rows_pos = (), -1  # buf[pos] by layer, as views (step_counts)
        # buf[pos] and its flat form by pos, as views made once: indexing buf costs ~10 us a step on the caches a
        # batch-1 decode step's weight stream has just emptied.
        self._slots, self._flat = self.buf.unbind(0), self.buf.view(self.window + 1, -1).unbind(0)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add the routing of one forward: topk_ids [T, k] logical expert ids in [0, E) for layer."""
        flat = topk_ids.reshape(-1).to(device=self.buf.device, dtype=torch.int64)
        self.step_counts(layer).scatter_add_(0, flat, torch.ones_like(flat))

    def step_rows(self) -> torch.Tensor:
        """[L, E] the step in progress' counts of every layer (a view; row l is step_counts(l))."""
        return self._slots[self.pos]

    def step_flat(self) -> torch.Tensor:
        """[L * E] step_rows() layer after layer (a view), for a kernel that counts every layer in one call."""
        return self._flat[self.pos]

    def step_counts(self, layer: int) -> torch.Tensor:
        """[E] the step in progress' counts for layer, a view a fused MoE kernel adds to. The views are made once
        per step: indexing buf per layer cost ~3 us, 16 times in a batch-1 decode step of ~16 ms."""
        if self._rows_pos != self.pos:
            self._rows, self._rows_pos = self.step_rows().unbind(0), self.pos
        return self._rows[layer]

    def end_step(self) -> None:
        """Close the current step; the oldest step leaves the window."""
        self.pos = (self.pos + 1) % (self.window + 1)
        self.step_rows().zero_()
        self.filled = min(self.filled + 1, self.window)
        self.steps += 1

    def discard_step(self) -> None:
        """Forget what the step in progress has counted (profiling forwards that served no request)."""
        self.step_rows().zero_()

    def window_load(self) -> torch.Tensor:
        """[W_filled, L, E] completed steps, oldest first (the step in progress is not included)."""
        idx = (torch.arange(self.pos - self.filled, self.pos) % (self.window + 1)).to(self.buf.device)
        return self.buf.index_select(0, idx)

    def total(self) -> torch.Tensor:
        """[L, E] tokens per expert summed over the completed steps in the window."""
        return self.window_load().sum(0)

    def dump(self, path: str) -> None:
        """Write the window to an .npz: load [W_filled, L, E] plus num_layers, num_experts, window, steps."""
        np.savez(path, load=self.window_load().cpu().numpy(), num_layers=self.num_layers,
                 num_experts=self.num_experts, window=self.window, steps=self.steps)

    @classmethod
    def load(cls, path: str, device=None) -> "ExpertLoadRecorder":
        """Rebuild a recorder from ``dump`` output (its window holds the dumped steps)."""
        load, meta = load_stats(path)
        rec = cls(meta["num_layers"], meta["num_experts"], meta["window"], device=device)
        n = load.shape[0]
        rec.buf[:n] = torch.from_numpy(load).to(rec.buf.device)
        rec.pos, rec.filled, rec.steps = n, n, meta["steps"]
        return rec


def load_stats(path: str):
    """Read a ``dump`` file -> (load int64 array [S, L, E], meta dict); ValueError if malformed."""
    with np.load(path) as f:
        missing = [k for k in ("load", "num_layers", "num_experts", "window", "steps") if k not in f]
        if missing:
            raise ValueError(f"stats file {path} lacks {missing}")
        load = f["load"]
        meta = {k: int(f[k]) for k in ("num_layers", "num_experts", "window", "steps")}
    if load.ndim != 3 or load.shape[1:] != (meta["num_layers"], meta["num_experts"]) or load.shape[0] > meta["window"]:
        raise ValueError(f"stats file {path}: load shape {load.shape} does not match "
                         f"num_layers={meta['num_layers']}, num_experts={meta['num_experts']}, window={meta['window']}")
    return load.astype(np.int64), meta
