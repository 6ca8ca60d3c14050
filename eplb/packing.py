"""One row family of the EPLB policy (eplb/policy.py): n local experts into m packs (GPUs or nodes) of k
slots, for all rows at once. Replica counts (from scratch, or sticky to a previous plan), the initial
packing (the reference's greedy or rounds), then the improvements of eplb/refine.py."""
from __future__ import annotations

import numpy as np

from eplb.align import _align
from eplb.refine import _F, _argsort_rows, _objective, _polish, _refine, _repair_duplicates


# ----------------------------------------------------------------------------------------------------
# one row family: n local experts into m packs of k slots


def _plan_rows(wt, m, k, opts, prev=None) -> np.ndarray:
    """wt [rows, n, S] loads; prev [rows, m*k] local ids or -1. Returns the grid [rows, m, k] of local ids."""
    rows, n, _ = wt.shape
    w = wt.sum(-1)
    cnt, extra = _replicate(w, m * k, m if opts.avoid_duplicates else 0)
    unit = wt / cnt[..., None].astype(_F)                                     # per-replica load [rows, n, S]
    grid = _pack_scratch(w, cnt, extra, unit, m, k, opts)
    if prev is None:
        return grid
    prev = prev.reshape(rows, m, k)
    goal = _objective(grid, unit) * (1 + 1e-6 + opts.move_tolerance)
    cnt = _sticky_counts(prev, cnt, w, goal, m if opts.avoid_duplicates else 0)
    unit = wt / cnt[..., None].astype(_F)
    sticky = _pack_from(prev, cnt, unit, opts)
    if opts.avoid_duplicates:
        sticky = _repair_duplicates(sticky, unit)
    if opts.refine:                                                            # only until scratch's balance
        sticky = _refine(sticky, unit, max(opts.max_refine_iters, 2 * m), opts.avoid_duplicates, goal)
    keep = _objective(sticky, unit) <= goal                                    # no worse than from scratch
    return np.where(keep[:, None, None], sticky, _align(grid, prev))


def _sticky_counts(prev, cnt, w, goal, cap) -> np.ndarray:
    """Replica counts that change as few slots as possible: start from the previous counts and, while an
    expert's load per replica exceeds ``goal``, give it a replica taken from the expert that can spare
    one most easily. Rows whose previous grid is incomplete, or that cannot be fixed, take ``cnt``."""
    rows, m, k = prev.shape
    n = cnt.shape[1]
    r = np.arange(rows)
    flat = prev.reshape(rows, -1)
    c = np.bincount((np.where(flat >= 0, flat, n) + (n + 1) * r[:, None]).ravel(),
                    minlength=rows * (n + 1)).reshape(rows, n + 1)[:, :n]
    ok = (c >= 1).all(1) & (c.sum(1) == m * k)
    for _ in range(n):
        unit = w / np.maximum(c, 1).astype(_F)
        hot = unit.argmax(1)
        need = ok & (unit[r, hot] > goal)
        if not need.any():
            break
        spare = np.where(c >= 2, w / np.maximum(c - 1, 1).astype(_F), np.inf)   # its load after giving one
        spare[r, hot] = np.inf
        donor = spare.argmin(1)
        fixable = (spare[r, donor] <= goal) & ((c[r, hot] < cap) if cap else True)
        ok &= ~need | fixable
        go = np.flatnonzero(need & fixable)
        c[go, hot[go]] += 1
        c[go, donor[go]] -= 1
    return np.where(ok[:, None], c, cnt)


def _replicate(w, slots, cap):
    """Give ``slots - n`` extra replicas, each to the expert with the largest load per replica.

    w [rows, n] float32; cap (0 = none) bounds the replicas of one expert.
    Returns cnt [rows, n] and extra [rows, slots - n], the expert of each extra replica in pick order.
    The per-row greedy is optimal for the largest load per replica; rows advance together.
    """
    rows, n = w.shape
    cnt = np.ones((rows, n), np.int64)
    extra = np.empty((rows, slots - n), np.int64)
    cur = w.copy()
    r = np.arange(rows)
    if cap == 1:
        cur[:] = -np.inf
    for i in range(slots - n):
        e = cur.argmax(1)                                                      # first index on ties
        extra[:, i] = e
        cnt[r, e] += 1
        cur[r, e] = w[r, e] / cnt[r, e].astype(_F)
        if cap:
            cur[r, e] = np.where(cnt[r, e] >= cap, -np.inf, cur[r, e])
    return cnt, extra


def _pack_scratch(w, cnt, extra, unit, m, k, opts) -> np.ndarray:
    """Pack the replicas (base experts, then extras in pick order, as the reference lists them)."""
    rows, n = w.shape
    ids = np.concatenate([np.broadcast_to(np.arange(n), (rows, n)), extra], 1)
    if k == 1:                                                                 # any order balances equally;
        return ids.reshape(rows, m, 1).copy()                                 # the reference keeps this one
    if opts.packing == "greedy":
        iw = np.take_along_axis(w, ids, 1) / np.take_along_axis(cnt, ids, 1).astype(_F)
        order = _argsort_rows(iw, descending=True)                             # the reference's order
        ids, iw = np.take_along_axis(ids, order, 1), np.take_along_axis(iw, order, 1)
        grid = _fill(np.full((rows, m, k), -1), np.zeros((rows, m), _F), ids, iw, opts.avoid_duplicates)
    else:
        # heaviest first and, among equal loads, by expert: the replicas of an expert stay adjacent
        u = w / cnt.astype(_F)
        experts = _argsort_rows(u, descending=True)
        ids = np.repeat(experts.ravel(), np.take_along_axis(cnt, experts, 1).ravel()).reshape(rows, m * k)
        grid = _pack_rounds(ids, np.take_along_axis(u, ids, 1), m, k, opts.avoid_duplicates)
    return _polish(grid, unit, opts)


def _pack_rounds(ids, iw, m, k, avoid_dup) -> np.ndarray:
    """Items sorted heaviest first; round j gives every pack one item, heaviest item to lightest pack.

    Replicas of an expert are adjacent and number at most m, so only the expert cut by a round
    boundary can meet itself: its replicas in the new round take the lightest packs it is not in yet,
    and the other items keep their order, so no duplicate is ever created.
    """
    rows = ids.shape[0]
    base = (np.arange(rows) * m)[:, None]
    grid = np.empty((k, rows, m), np.int64)                                    # slot-major, for flat writes
    load = np.zeros((rows, m), _F)
    for j in range(k):
        packs = _argsort_rows(load)
        item = ids[:, j * m:(j + 1) * m]
        cut = np.flatnonzero(item[:, 0] == ids[:, j * m - 1]) if avoid_dup and j else ()
        if len(cut):                                                           # rows whose boundary cuts an expert
            e = item[cut, :1]
            c2 = np.cumprod(item[cut] == e, 1).sum(1, keepdims=True)            # its replicas this round
            free = np.take_along_axis(grid[j - 1, cut] != e, packs[cut], 1)      # a block spans <= 2 rounds
            first = free & (np.cumsum(free, 1) <= c2)
            packs[cut] = np.take_along_axis(packs[cut], np.argsort(~first, 1, kind="stable"), 1)
        flat = (packs + base).ravel()
        grid[j].ravel()[flat] = item.ravel()
        load.ravel()[flat] += iw[:, j * m:(j + 1) * m].ravel()
    return np.ascontiguousarray(grid.transpose(1, 2, 0))


def _fill(grid, load, ids, iw, avoid_dup) -> np.ndarray:
    """Put items (in the given order) one by one into the lightest pack with a free slot (-1).

    grid [rows, m, k] (-1 = free), load [rows, m], ids / iw [rows, F] (id -1 = no item).
    Ties go to the first pack and each pack fills its lowest free slot, as the reference does.
    A pack already holding the expert is skipped when avoid_dup, unless no other pack is free.
    """
    r = np.arange(grid.shape[0])
    for j in range(ids.shape[1]):
        e, wj = ids[:, j], iw[:, j]
        free = grid == -1
        open_ = free.any(2)
        cand = np.where(open_, load, np.inf)
        if avoid_dup:
            clash = (grid == e[:, None, None]).any(2)
            cand = np.where(clash & (open_ & ~clash).any(1, keepdims=True), np.inf, cand)
        p = cand.argmin(1)
        act = e >= 0
        slot = free[r, p].argmax(1)
        grid[r[act], p[act], slot[act]] = e[act]
        load[r[act], p[act]] += wj[act]
    return grid


def _pack_from(prev, cnt, unit, opts) -> np.ndarray:
    """Start from the previous grid: keep up to cnt[e] replicas of each expert (those on the lightest
    packs), free the other slots and fill them with the replicas still missing, heaviest first."""
    rows, m, k = prev.shape
    n = cnt.shape[1]
    r = np.arange(rows)[:, None]
    u = unit.sum(-1)
    flat = prev.reshape(rows, -1)
    su = np.where(flat >= 0, np.take_along_axis(u, flat.clip(0), 1), 0)
    slot_load = np.repeat(su.reshape(rows, m, k).sum(2), k, 1)
    key = np.where(flat >= 0, flat, n)
    o = np.argsort(slot_load, 1, kind="stable")
    o = np.take_along_axis(o, np.argsort(np.take_along_axis(key, o, 1), 1, kind="stable"), 1)
    se = np.take_along_axis(key, o, 1)                                        # experts, lightest pack first
    want = np.take_along_axis(np.append(cnt, np.zeros((rows, 1), np.int64), 1), se, 1)
    keep_sorted = (se < n) & (_occurrence(se) < want)
    keep = np.zeros_like(keep_sorted)
    keep[r, o] = keep_sorted
    kept = np.zeros((rows, n + 1), np.int64)
    np.add.at(kept, (r, np.where(keep, flat, n)), 1)
    need = cnt - kept[:, :n]
    ids, iw = _ragged_items(need, u)
    grid = np.where(keep, flat, -1).reshape(rows, m, k)
    load = np.where(keep, su, 0).reshape(rows, m, k).sum(2).astype(_F)
    return _fill(grid, load, ids, iw, opts.avoid_duplicates)


def _occurrence(sorted_keys) -> np.ndarray:
    """For rows of sorted keys, the index of each element within its run of equal keys."""
    pos = np.broadcast_to(np.arange(sorted_keys.shape[1]), sorted_keys.shape)
    start = np.ones(sorted_keys.shape, bool)
    start[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
    return pos - np.maximum.accumulate(np.where(start, pos, 0), 1)


def _ragged_items(need, u):
    """need [rows, n] replicas to add per expert -> ids, weights [rows, F], heaviest first, -1 padded."""
    rows, n = need.shape
    per_row = need.sum(1)
    width = int(per_row.max(initial=0))
    ids = np.full((rows, width), -1, np.int64)
    e = np.repeat(np.tile(np.arange(n), rows), need.ravel())
    row = np.repeat(np.arange(rows), per_row)
    col = np.arange(e.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    ids[row, col] = e
    iw = np.where(ids >= 0, np.take_along_axis(u, ids.clip(0), 1), -np.inf)
    order = np.argsort(-iw, 1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(iw, order, 1)
