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

from eplb.align import _align
from eplb.packing import _occurrence, _plan_rows
from eplb.refine import _F

REFERENCE_FLAGS = dict(avoid_duplicates=False, refine=False, packing="greedy")

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
