"""Expert-parallel load balancing: which logical expert each physical expert slot holds.

`rebalance_experts` keeps DeepSeek EPLB's contract and its two policies:

* hierarchical (``num_groups % num_nodes == 0``): pack expert groups onto nodes so nodes get equal load,
  replicate the heavy experts inside each node, then pack each node's replicas onto its GPUs;
* global (otherwise): replicate over all slots and pack onto all GPUs.

Shapes: L layers, E logical experts, R physical slots (``num_replicas``), G GPUs with R / G slots each,
slot s lives on GPU s // (R / G). Internally every problem is a set of independent *rows* (one per layer,
or per layer and node); a row places ``n`` local experts into ``m`` packs (GPUs or nodes) of ``k`` slots,
and all rows are solved together with numpy array operations, never a Python loop per layer.

Beyond the reference (each a keyword, all on by default):

* ``avoid_duplicates``: never two replicas of one expert on one GPU. The reference can put both copies of
  an expert on the same GPU, which wastes a slot: that GPU still carries the expert's whole load.
* ``packing="rounds"`` plus ``refine``: a fast initial packing (one item per GPU per round, heaviest
  items to the lightest GPUs) followed by pairwise swaps between heavy and light GPUs that strictly lower
  the pair's maximum, instead of the reference's one-item-at-a-time greedy.
* ``prev_phy2log``: the current placement. A plan that starts from it (only replica-count changes and
  improving swaps) is kept for every row where it is at least as balanced as planning from scratch;
  elsewhere the from-scratch plan is relabelled (GPUs and slots renamed, which costs no balance) so that
  as many slots as possible keep their expert. Fewer slots change, so fewer weights are moved.
* ``weight`` of shape [S, L, E] (per-step loads): replica counts and the first packing use the sums,
  the swaps then minimise sum over steps of the busiest GPU's load, so peaks and not only totals count.

Reference-compatible mode: ``avoid_duplicates=False, refine=False, packing="greedy"``
(``REFERENCE_FLAGS``) reproduces DeepSeek's eplb.py placement exactly, including its float32
arithmetic, its stable descending sort and first-index tie breaking.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

REFERENCE_FLAGS = dict(avoid_duplicates=False, refine=False, packing="greedy")

_F = np.float32  # the reference works in float32; matching it keeps tie breaking identical


@dataclass(frozen=True)
class _Opts:
    avoid_duplicates: bool
    refine: bool
    packing: str
    max_refine_iters: int
    move_tolerance: float = 0.0


# ----------------------------------------------------------------------------------------------------
# entry point


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                      avoid_duplicates: bool = True, refine: bool = True, packing: str = "rounds",
                      prev_phy2log=None, move_tolerance: float = 0.0, policy: str = "auto",
                      max_refine_iters: int = 8, peak_steps: int = 32):
    """Plan the placement of ``num_replicas`` physical experts.

    weight: [L, E] load per logical expert, or [S, L, E] per-step loads (peak-aware planning; more than
        ``peak_steps`` steps are summed into that many consecutive groups to bound the work).
    prev_phy2log: optional [L, R] current placement to stay close to.
    move_tolerance: with prev_phy2log, a layer keeps the plan built from the previous placement when its
        busiest GPU carries at most (1 + move_tolerance) times the from-scratch plan's (0: never worse).
    avoid_duplicates, refine, packing: see the module docstring; ``**REFERENCE_FLAGS`` gives DeepSeek's
        placement exactly. max_refine_iters bounds the swap passes.
    policy: "auto" (hierarchical iff num_groups % num_nodes == 0, as DeepSeek), "hierarchical"
        (ValueError when the groups do not divide over the nodes) or "global".
    Returns phy2log [L, R] int64, log2phy [L, E, max_replicas] int64 padded with -1 (slots of each
    expert in ascending order), logcnt [L, E] int64.
    """
    wt = _check_weight(weight)
    if not isinstance(peak_steps, int) or peak_steps <= 0:
        raise ValueError(f"peak_steps must be a positive integer, got {peak_steps!r}")
    if wt.shape[2] > peak_steps:                                               # bound the per-step work:
        edges = np.linspace(0, wt.shape[2], peak_steps + 1).astype(int)[:-1]   # sum consecutive steps
        wt = np.add.reduceat(wt, edges, axis=2)
    L, E, _ = wt.shape
    hier = _check_config(E, num_replicas, num_groups, num_nodes, num_gpus, policy)
    if not (0 <= move_tolerance < 1):
        raise ValueError(f"move_tolerance must be in [0, 1), got {move_tolerance!r}")
    opts = _Opts(bool(avoid_duplicates), bool(refine), _check_packing(packing), int(max_refine_iters),
                 float(move_tolerance))
    prev = None if prev_phy2log is None else _check_prev(prev_phy2log, L, E, num_replicas)
    groups, nodes = (num_groups, num_nodes) if hier else (1, 1)
    if opts.avoid_duplicates and num_replicas // num_gpus > E // nodes:
        raise ValueError(f"num_replicas={num_replicas}: {num_replicas // num_gpus} slots per GPU exceed the "
                         f"{E // nodes} experts a GPU can choose from, so duplicates are unavoidable; "
                         "pass avoid_duplicates=False")
    phy2log = _rebalance(wt, num_replicas, groups, nodes, num_gpus, opts, prev)
    return _outputs(phy2log, E)


# ----------------------------------------------------------------------------------------------------
# input checks: every message names the offending argument


def _check_weight(weight) -> np.ndarray:
    """weight [L, E] or [S, L, E] -> float32 array [L, E, S] (S = 1 for 2-D input)."""
    w = weight.detach().cpu().double().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight, float)
    if w.ndim not in (2, 3) or 0 in w.shape:
        raise ValueError("weight must be a non-empty [layers, experts] or [steps, layers, experts] array, "
                         f"got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight contains non-finite values (nan or inf)")
    if (w < 0).any():
        raise ValueError("weight contains negative loads")
    w = w[None] if w.ndim == 2 else w
    return np.ascontiguousarray(w.transpose(1, 2, 0)).astype(_F)


def _check_config(E, R, groups, nodes, gpus, policy) -> bool:
    """Validate the sizes; return True when the hierarchical policy applies."""
    for name, v in (("num_replicas", R), ("num_groups", groups), ("num_nodes", nodes), ("num_gpus", gpus)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if policy not in ("auto", "hierarchical", "global"):
        raise ValueError(f"policy must be 'auto', 'hierarchical' or 'global', got {policy!r}")
    if R < E:
        raise ValueError(f"num_replicas={R} is smaller than the {E} logical experts (each needs a slot)")
    if R % gpus:
        raise ValueError(f"num_replicas={R} is not a multiple of num_gpus={gpus}")
    if E % groups:
        raise ValueError(f"num_groups={groups} does not divide the {E} experts")
    hier = policy == "hierarchical" or (policy == "auto" and groups % nodes == 0)
    if not hier:
        return False
    if groups % nodes:
        raise ValueError(f"num_groups={groups} is not a multiple of num_nodes={nodes} (hierarchical policy)")
    if gpus % nodes:
        raise ValueError(f"num_gpus={gpus} is not a multiple of num_nodes={nodes}")
    return True


def _check_packing(packing: str) -> str:
    """The packing name, or ValueError."""
    if packing not in ("rounds", "greedy"):
        raise ValueError(f"packing must be 'rounds' or 'greedy', got {packing!r}")
    return packing


def _check_prev(prev, L, E, R) -> np.ndarray:
    """prev_phy2log -> int64 array [L, R] of ids in [0, E), or ValueError."""
    p = prev.detach().cpu().numpy() if isinstance(prev, torch.Tensor) else np.asarray(prev)
    if p.shape != (L, R):
        raise ValueError(f"prev_phy2log has shape {p.shape}, expected (layers, num_replicas) = {(L, R)}")
    if not np.issubdtype(p.dtype, np.integer) or p.min() < 0 or p.max() >= E:
        raise ValueError(f"prev_phy2log must hold integer expert ids in [0, {E})")
    return p.astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# hierarchical driver (global = one node, one group)


def _rebalance(wt, R, groups, nodes, gpus, opts, prev) -> np.ndarray:
    """wt [L, E, S] -> phy2log [L, R]: groups onto nodes, then each node's experts onto its GPUs.

    With a previous plan two layouts compete per layer: the fresh group layout with its nodes renamed
    to match the previous one (each node row then stays close to its previous contents, and is never
    worse than that row planned from scratch), and the previous group layout kept as it is (moving a
    group moves all its experts), which wins wherever its GPUs are at least as balanced.
    """
    L, E, _ = wt.shape
    fresh = _place_groups(wt, groups, nodes, opts)                             # [L, nodes, gpn]
    if prev is None:
        return _place_experts(wt, fresh, R, gpus, opts, None)
    gprev = _prev_groups(prev, groups, nodes, E)
    valid = (gprev >= 0).all((1, 2))
    renamed = np.where(valid[:, None, None], _align(fresh, gprev), fresh)
    a = _place_experts(wt, renamed, R, gpus, opts, prev)
    if nodes == 1:
        return a
    b = _place_experts(wt, np.where(valid[:, None, None], gprev, renamed), R, gpus, opts, prev)
    goal = _layer_objective(wt, _place_experts(wt, fresh, R, gpus, opts, None), gpus)
    keep = valid & (_layer_objective(wt, b, gpus) <= goal * (1 + 1e-6 + opts.move_tolerance))
    return np.where(keep[:, None], b, a)


def _place_experts(wt, node_groups, R, gpus, opts, prev) -> np.ndarray:
    """Given the groups of each node [L, nodes, gpn], plan every node's GPUs; -> phy2log [L, R]."""
    L, E, _ = wt.shape
    nodes, gpn = node_groups.shape[1:]
    gsz, n_node = E // (nodes * gpn), E // nodes
    mlog2log = (node_groups[..., None] * gsz + np.arange(gsz)).reshape(L, nodes, n_node)
    rows_w = np.take_along_axis(wt, mlog2log.reshape(L, E)[..., None], 1).reshape(L * nodes, n_node, -1)
    rows_prev = None if prev is None else _local_prev(prev, mlog2log)
    grid = _plan_rows(rows_w, gpus // nodes, R // gpus, opts, rows_prev)      # [L*nodes, m, k] local ids
    return np.take_along_axis(mlog2log.reshape(L * nodes, n_node), grid.reshape(L * nodes, -1), 1).reshape(L, R)


def _layer_objective(wt, phy2log, gpus) -> np.ndarray:
    """Per layer: sum over steps of the busiest GPU's load, each expert's load split over its replicas."""
    L, E, S = wt.shape
    cnt = np.bincount((phy2log + E * np.arange(L)[:, None]).ravel(), minlength=L * E).reshape(L, E)
    unit = wt / np.maximum(cnt, 1)[..., None]
    return np.take_along_axis(unit, phy2log[..., None], 1).reshape(L, gpus, -1, S).sum(2).max(1).sum(-1)


def _place_groups(wt, groups, nodes, opts) -> np.ndarray:
    """Groups per node [L, nodes, groups // nodes], listed in slot order within the node."""
    L, E, _ = wt.shape
    gw = wt.sum(-1).reshape(L, groups, E // groups).sum(-1)[..., None]        # node level uses totals
    group_opts = _Opts(False, opts.refine, opts.packing, opts.max_refine_iters, opts.move_tolerance)
    return _plan_rows(gw, nodes, groups // nodes, group_opts)


def _prev_groups(prev, groups, nodes, E) -> np.ndarray:
    """The group layout the previous plan implies, [L, nodes, gpn]; -1 rows where it is not hierarchical."""
    L, R = prev.shape
    node_of_slot = np.arange(R) // (R // nodes)
    g = prev // (E // groups)
    home = np.full((L, groups), -1)
    np.maximum.at(home, (np.arange(L)[:, None], g), node_of_slot)              # some node holding the group
    spread = np.zeros((L, groups), bool)
    np.logical_or.at(spread, (np.arange(L)[:, None], g), node_of_slot != np.take_along_axis(home, g, 1))
    out = np.full((L, nodes, groups // nodes), -1)
    order = np.argsort(home, 1, kind="stable")
    sizes_ok = (np.sort(home, 1).reshape(L, nodes, -1) == np.arange(nodes)[:, None]).all((1, 2))
    ok = sizes_ok & ~spread.any(1)                                             # every node exactly gpn whole groups
    out[ok] = order[ok].reshape(-1, nodes, groups // nodes)
    return out


def _local_prev(prev, mlog2log) -> np.ndarray:
    """Previous node slices in each node's local expert ids; -1 where the expert now lives elsewhere."""
    L, nodes, n_node = mlog2log.shape
    E = nodes * n_node
    log2local = np.empty((L, E), np.int64)
    node_of = np.empty((L, E), np.int64)
    np.put_along_axis(log2local, mlog2log.reshape(L, E), np.tile(np.arange(n_node), nodes)[None].repeat(L, 0), 1)
    np.put_along_axis(node_of, mlog2log.reshape(L, E), np.repeat(np.arange(nodes), n_node)[None].repeat(L, 0), 1)
    sl = prev.reshape(L, nodes, -1)
    here = np.take_along_axis(node_of, prev, 1).reshape(sl.shape) == np.arange(nodes)[:, None]
    local = np.take_along_axis(log2local, prev, 1).reshape(sl.shape)
    return np.where(here, local, -1).reshape(L * nodes, -1)


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


# ----------------------------------------------------------------------------------------------------
# improving a packing: duplicate repair and pairwise swaps


def _polish(grid, unit, opts) -> np.ndarray:
    """grid [rows, m, k] -> duplicates repaired (if asked), then swap-refined (if asked)."""
    if opts.avoid_duplicates:
        grid = _repair_duplicates(grid, unit)
    if opts.refine:
        grid = _refine(grid, unit, opts.max_refine_iters, opts.avoid_duplicates)
    return grid


def _pack_loads(grid, unit) -> np.ndarray:
    """[rows, m, k] grid -> per-pack per-step loads [rows, m, S]."""
    rows = grid.shape[0]
    return unit[np.arange(rows)[:, None, None], grid].sum(2)


def _objective(grid, unit) -> np.ndarray:
    """Per row: sum over steps of the busiest pack's load (the max pack load when S == 1)."""
    return _pack_loads(grid, unit).max(1).sum(-1)


def _first_duplicates(grid):
    """Rows holding an expert twice in one pack, and for each such row the first (pack, expert)."""
    rows, m, k = grid.shape
    n = int(grid.max()) + 1
    keys = np.sort((grid + (np.arange(m) * n)[:, None]).reshape(rows, -1), 1)  # one sort, not one per pack
    same = keys[:, 1:] == keys[:, :-1]
    bad = np.flatnonzero(same.any(1))
    key = keys[bad, same[bad].argmax(1)]
    return bad, key // n, key % n


def _repair_duplicates(grid, unit) -> np.ndarray:
    """Swap the second copy of a duplicated expert with the item elsewhere that unbalances the least.

    One duplicate per row per pass; a row with no legal swap falls back to the round-robin layout
    (experts in order, item i to pack i mod m), which is duplicate-free whenever cnt <= m.
    """
    rows, m, k = grid.shape
    u = unit.sum(-1)
    for _ in range(m * k):
        bad, p, e = _first_duplicates(grid)
        if bad.size == 0:
            return grid
        g = grid[bad]
        a = ((g[np.arange(bad.size), p] == e[:, None]).cumsum(1) == 2).argmax(1)  # slot of the second copy
        grid[bad] = _best_swap_for(g, u[bad], p, a, e)
    bad = _first_duplicates(grid)[0]
    grid[bad] = _round_robin(grid[bad])
    return grid


def _best_swap_for(g, u, p, a, e) -> np.ndarray:
    """Move item (p, a) of expert e [rows] to the best legal (q, b); rows with none become round-robin."""
    rows, m, k = g.shape
    r = np.arange(rows)
    w = u[r[:, None, None], g]                                                  # [rows, m, k]
    load = w.sum(2)
    d = w[r, p, a][:, None, None] - w                                          # load leaving pack p
    score = np.maximum(load[r, p][:, None, None] - d, load[..., None] + d)
    legal = ~(g == e[:, None, None]).any(2, keepdims=True)                      # q must not hold e
    in_p = (g[..., None] == g[r, p][:, None, None, :]).any(3)                   # item already in p
    legal = legal & ~in_p
    legal[r, p] = False
    score = np.where(legal, score, np.inf).reshape(rows, -1)
    best = score.argmin(1)
    q, b = best // k, best % k
    ok = np.isfinite(score[r, best])
    out = g.copy()
    out[r[ok], p[ok], a[ok]], out[r[ok], q[ok], b[ok]] = g[r[ok], q[ok], b[ok]], g[r[ok], p[ok], a[ok]]
    if (~ok).any():
        out[~ok] = _round_robin(g[~ok])
    return out


def _round_robin(g) -> np.ndarray:
    """[rows, m, k]: the same items, expert-sorted, item i to pack i mod m (no duplicates if cnt <= m)."""
    rows, m, k = g.shape
    items = np.sort(g.reshape(rows, -1), 1)
    return items.reshape(rows, k, m).transpose(0, 2, 1).copy()


def _refine(grid, unit, iters, avoid_dup, goal=None) -> np.ndarray:
    """Pairwise swaps between heavy and light packs of grid [rows, m, k] until no swap helps.

    Packs are sorted by load and paired (heaviest with lightest, ...); the pairing shifts every pass so
    that a stuck heavy pack meets other partners. With one step every pair's maximum only goes down, so
    the busiest pack never gets busier; with S steps only the best swap per row is taken and only if it
    lowers sum over steps of the busiest pack.
    With ``goal`` [rows] (planning from the previous placement) every swap is a weight move: only packs
    above the goal swap, rows stop once their maximum is <= goal, and rows still above it get a second
    phase in which the busiest pack alone meets every other pack in turn.
    """
    rows, m, k = grid.shape
    if m < 2:
        return grid
    if unit.shape[-1] > 1:
        return _refine_peaks(grid, unit, iters, avoid_dup)
    u = unit[..., 0]
    tol = 1e-6 * u.sum(1) / m + 1e-30                                         # ignore float noise
    # no packing beats the average, nor the heaviest replica plus the k - 1 lightest: rows there are done
    items = u[np.arange(rows)[:, None], grid.reshape(rows, -1)]
    lightest = np.partition(items, k - 2, 1)[:, :k - 1].sum(1) if k > 1 else 0
    bound = np.maximum(items.max(1) + lightest, items.sum(1) / m) + tol
    if goal is not None:
        bound = np.maximum(bound, goal)
    # rows lead, so that row subsets are cheap gathers; passes see [k, rows, m] views (small axes lead,
    # which numpy reduces fast); int16 ids halve the memory traffic
    gR = np.ascontiguousarray(grid.transpose(0, 2, 1), dtype=np.int16 if u.shape[1] < 2 ** 15 else np.int64)
    _swap_phase(gR, u, bound, tol, avoid_dup, goal, iters, min(2, m // 2) if goal is None else m // 2, False)
    if goal is not None:
        _swap_phase(gR, u, bound, tol, avoid_dup, goal, 4 * m, m - 1, True)
    return np.ascontiguousarray(gR.transpose(0, 2, 1), dtype=np.int64)


def _swap_phase(gR, u, bound, tol, avoid_dup, goal, passes, patience, single) -> None:
    """Run swap passes on the rows of gR [rows, k, m] (in place) whose busiest pack is above ``bound``;
    a row leaves after ``patience`` passes without a lower maximum, or when it reaches the bound."""
    rows = gR.shape[0]
    active = np.flatnonzero(np.take_along_axis(u, gR.reshape(rows, -1), 1).reshape(gR.shape).sum(1).max(1) > bound)
    stale = np.zeros(rows, np.int64)
    best = np.full(rows, np.inf)
    for it in range(passes):
        if active.size == 0:
            return
        sub = gR[active]
        top = _swap_pass(sub.transpose(1, 0, 2), u[active], it, tol[active], avoid_dup,
                         None if goal is None else goal[active], single)
        gR[active] = sub
        stale[active] = np.where(top < best[active] - tol[active], 0, stale[active] + 1)
        best[active] = np.minimum(best[active], top)
        active = active[(stale[active] < patience) & (best[active] > bound[active])]


def _argsort_rows(x, descending=False) -> np.ndarray:
    """Stable argsort of each row of a non-negative float32 [rows, m] array (ties: lower index first).

    numpy sorts values several times faster than it argsorts them, so the column index rides in the
    low bits of an integer key (the bits of a non-negative float32 order like its value).
    """
    m = x.shape[1]
    bits = np.ascontiguousarray(x, dtype=_F).view(np.uint32)
    bits = ~bits if descending else bits
    keys = (bits.astype(np.uint64) << np.uint64(32)) | np.arange(m, dtype=np.uint64)
    keys.sort(1)
    return (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _pairs(load, shift, single=False):
    """Pack indices [rows, P] of the P = m // 2 heaviest packs and of the partners they meet this pass
    (the i-th heaviest meets the (i + shift) mod P-th lightest); single: only the heaviest pack, meeting
    the (shift mod (m - 1))-th lightest."""
    order = _argsort_rows(load)
    m = load.shape[1]
    if single:
        return order[:, -1:], order[:, [shift % (m - 1)]]
    return order[:, ::-1][:, :m // 2], order[:, (np.arange(m // 2) + shift) % (m // 2)]


def _swap_pass(gT, u, shift, tol, avoid_dup, goal=None, single=False):
    """One pass on gT [k, rows, m] (in place) with per-replica loads u [rows, n].

    Swapping heavy item a with light item b moves d = w_a - w_b across; the pair's maximum drops by
    min(d, gap - d), so that is the gain to maximise. Returns each row's new maximum pack load.
    Gathers go through flat indices and np.take: numpy's mixed slice/array indexing is far slower.
    """
    k, rows, m = gT.shape
    n = u.shape[1]
    w = np.take(u.ravel(), gT + (np.arange(rows) * n)[:, None])               # [k, rows, m]
    load = w.sum(0)
    heavy, light = _pairs(load, shift, single)
    P = heavy.shape[1]
    fh, fl = (heavy + (np.arange(rows) * m)[:, None]).ravel(), (light + (np.arange(rows) * m)[:, None]).ravel()
    lh, ll = load.ravel()[fh].reshape(rows, P), load.ravel()[fl].reshape(rows, P)
    wf, gf = w.reshape(k, -1), gT.reshape(k, -1)
    wh, wl = np.take(wf, fh, 1), np.take(wf, fl, 1)                           # [k, rows * P]
    if avoid_dup:
        # a heavy item already in the light pack, or a light item already in the heavy one, may not
        # move: an infinite weight on the item makes every swap with it a loss (cheaper than a mask)
        eq = np.take(gf, fh, 1)[:, None] == np.take(gf, fl, 1)[None, :]
        wh = np.where(eq.any(1), -np.inf, wh).astype(_F)
        wl = np.where(eq.any(0), np.inf, wl).astype(_F)
    d = (wh[:, None] - wl[None, :]).reshape(k, k, rows, P)
    gain = np.minimum(d, (lh - ll) - d).reshape(k * k, rows, P)
    top = gain.max(0)
    take = top > tol[:, None]
    if goal is not None:                                                       # each swap moves two experts:
        take &= lh > goal[:, None]                                             # only packs over the goal swap
    rr, pp = np.nonzero(take)
    best = np.take(gain.reshape(k * k, -1), rr * P + pp, 1).argmax(0)         # only where a swap is taken
    ha, lb, ia, ib = heavy[rr, pp], light[rr, pp], best // k, best % k
    gT[ia, rr, ha], gT[ib, rr, lb] = gT[ib, rr, lb], gT[ia, rr, ha]
    # a pair's maximum after the pass is its heavy load minus the gain taken; an odd pack out stays put
    new_max = (lh - np.where(take, top, 0)).max(1)
    if m > 2 * P:                                                              # packs outside the pairs
        new_max = np.maximum(new_max, np.sort(load, 1)[:, m - P - 1])
    return new_max


def _refine_peaks(grid, unit, iters, avoid_dup) -> np.ndarray:
    """Per-step variant of _refine: grid [rows, m, k], unit [rows, n, S]; one best swap per row and pass."""
    rows, m, k = grid.shape
    tol = 1e-6 * unit.sum((1, 2)) / m + 1e-30
    active = np.arange(rows)
    stale = np.zeros(rows, np.int64)
    for it in range(iters):
        g = grid[active]
        moved = _peak_swap(g, unit[active], it % (m // 2), tol[active], avoid_dup)
        grid[active] = g
        stale[active] = np.where(moved, 0, stale[active] + 1)
        active = active[stale[active] < min(3, m // 2)]
        if active.size == 0:
            break
    return grid


def _legal(gh, gl, avoid_dup):
    """[rows, P, k, k]: may heavy item a and light item b swap without a duplicate on either side?"""
    if not avoid_dup:
        return True
    eq = gh[..., :, None] == gl[..., None, :]
    return ~eq.any(3)[..., :, None] & ~eq.any(2)[..., None, :]


def _peak_swap(g, unit, shift, tol, avoid_dup) -> np.ndarray:
    """Per-step variant: the single swap (over all pairs) that most lowers sum_t max_p load[p, t]."""
    rows, m, k = g.shape
    r = np.arange(rows)[:, None]
    w = unit[r[..., None], g]                                                   # [rows, m, k, S]
    load = w.sum(2)
    heavy, light = _pairs(load.sum(-1), shift)
    P = heavy.shape[1]
    d = w[r, heavy][:, :, :, None] - w[r, light][:, :, None, :]                # [rows, P, k, k, S]
    gain = _peak_gain(load, heavy, light, load[r, heavy][:, :, None, None], load[r, light][:, :, None, None], d)
    gain = np.where(_legal(g[r, heavy], g[r, light], avoid_dup), gain, 0).reshape(rows, -1)
    flat = gain.argmax(1)
    take = np.zeros((rows, P), bool)
    take[np.arange(rows), flat // (k * k)] = gain[np.arange(rows), flat] > tol
    _apply(g, heavy, light, np.broadcast_to((flat % (k * k))[:, None], (rows, P)), take)
    return take.any(1)


def _apply(g, heavy, light, best, take):
    """Swap item best // k of each heavy pack with item best % k of its partner where take."""
    k = g.shape[2]
    rr, pp = np.nonzero(take)
    ha, lb, ia, ib = heavy[rr, pp], light[rr, pp], best[rr, pp] // k, best[rr, pp] % k
    g[rr, ha, ia], g[rr, lb, ib] = g[rr, lb, ib], g[rr, ha, ia]


def _peak_gain(load, heavy, light, lh, ll, d) -> np.ndarray:
    """Decrease of sum_t max_p load[p, t] if one pair swaps, [rows, P, k, k]; other packs held fixed."""
    rows, m, S = load.shape
    top = np.argsort(-load, 1, kind="stable")[:, :3]                            # [rows, 3, S] busiest packs
    topv = np.take_along_axis(load, top, 1)
    h, l_ = heavy[..., None, None], light[..., None, None]                      # [rows, P, 1, 1]
    rest = np.full(heavy.shape + (S,), 0, _F)
    done = np.zeros(heavy.shape + (S,), bool)
    for j in range(min(3, m)):
        tj = top[:, j][:, None, :]
        pick = ~done & (tj != h[..., 0, 0, None]) & (tj != l_[..., 0, 0, None])
        rest = np.where(pick, topv[:, j][:, None, :], rest)
        done |= pick
    rest = rest[:, :, None, None, :]
    before = np.maximum(np.maximum(lh, ll), rest).sum(-1)
    after = np.maximum(np.maximum(lh - d, ll + d), rest).sum(-1)
    return before - after


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


# ----------------------------------------------------------------------------------------------------
# outputs


def _outputs(phy2log, E):
    """phy2log [L, R] -> (phy2log, log2phy [L, E, X] padded -1 with ascending slots, logcnt [L, E])."""
    L, R = phy2log.shape
    logcnt = np.bincount((phy2log + E * np.arange(L)[:, None]).ravel(), minlength=L * E).reshape(L, E)
    keys = np.sort((phy2log << 32) | np.arange(R), 1)                          # slots grouped by expert
    order, experts = keys & 0xFFFFFFFF, keys >> 32
    rank = _occurrence(experts)
    X = int(logcnt.max())
    log2phy = np.full((L, E, X), -1, np.int64)
    log2phy[np.arange(L)[:, None], experts, rank] = order
    return torch.from_numpy(phy2log.astype(np.int64)), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
