"""Relabelling a fresh EPLB plan onto the previous one (eplb/policy.py): GPUs and their slots are
interchangeable, so renaming them costs no balance and keeps as many slots as possible on their expert."""
from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------------------------------
# relabelling a fresh plan onto the previous one (free: GPUs and slots are interchangeable)


def _align(grid, prev) -> np.ndarray:
    """Permute packs, then slots within packs, of grid [rows, m, k] to agree with prev as much as possible."""
    rows, m, k = grid.shape
    r = np.arange(rows)
    overlap = (grid[:, :, None, :, None] == prev[:, None, :, None, :]).sum((3, 4))  # [rows, new, old]
    used = np.zeros((rows, m), bool)
    new_at_old = np.empty((rows, m), np.int64)
    for i in np.argsort(-overlap.max(2), 1, kind="stable").T:                 # surest matches first
        j = np.where(used, -1, overlap[r, i]).argmax(1)
        new_at_old[r, j] = i
        used[r, j] = True
    g = np.take_along_axis(grid, new_at_old[..., None], 1).reshape(rows * m, k)
    return _align_slots(g, prev.reshape(rows * m, k)).reshape(rows, m, k)


def _align_slots(a, b) -> np.ndarray:
    """Reorder each row of a [N, k] so that items also in b [N, k] sit at b's positions."""
    N, k = a.shape
    n = np.arange(N)
    out = np.full_like(a, -1)
    claimed = np.zeros_like(a, bool)
    for j in range(k):
        match = (a == b[:, j, None]) & ~claimed
        hit = match.any(1)
        src = match.argmax(1)
        out[n[hit], j] = a[n[hit], src[hit]]
        claimed[n[hit], src[hit]] = True
    holes = np.argsort(out != -1, 1, kind="stable")                            # empty positions first
    rest = np.take_along_axis(a, np.argsort(claimed, 1, kind="stable"), 1)    # unclaimed items first
    fill = np.arange(k) < (~claimed).sum(1, keepdims=True)
    rows_, cols = np.nonzero(fill)
    out[rows_, holes[rows_, cols]] = rest[rows_, cols]
    return out
