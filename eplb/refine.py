"""Improving a packing of the EPLB policy (eplb/policy.py): duplicate repair, pairwise swaps between heavy and
light packs that strictly lower their maximum, and swaps against per-step peaks. Shapes: grid [rows, m, k]
of item ids, unit [rows, items] loads."""
from __future__ import annotations

import numpy as np

_F = np.float32  # the reference works in float32; matching it keeps tie breaking identical


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
