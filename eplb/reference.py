"""A straightforward re-implementation of DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB),
written loop by loop the way the original is, so that it is an honest baseline for ``eplb.bench`` and
an independent oracle for the reference-compatible mode of ``eplb.policy`` in the tests.

Same contract as ``eplb.policy.rebalance_experts`` (weight [L, E] -> phy2log [L, R], log2phy, logcnt),
no input checks, no options.
"""
from __future__ import annotations

import torch


def _lpt_packing(weight: torch.Tensor, num_packs: int):
    """weight [X, n] -> pack [X, n], rank_in_pack [X, n]; n / num_packs items per pack, heaviest item
    first into the lightest pack that still has room (Python loop per row and per item)."""
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        ar = torch.arange(n).expand(rows, n)
        return ar.clone(), torch.zeros(rows, n, dtype=torch.int64)
    order = weight.float().sort(dim=-1, descending=True, stable=True).indices
    pack = torch.full((rows, n), -1, dtype=torch.int64)
    rank = torch.full((rows, n), -1, dtype=torch.int64)
    for i in range(rows):
        loads = [0] * num_packs
        counts = [0] * num_packs
        for item in order[i].tolist():
            open_packs = [p for p in range(num_packs) if counts[p] < per_pack]
            p = min(open_packs, key=loads.__getitem__)
            pack[i, item] = p
            rank[i, item] = counts[p]
            loads[p] += weight[i, item]  # a float32 tensor after the first item, as in the original
            counts[p] += 1
    return pack, rank


def _replicate(weight: torch.Tensor, num_phy: int):
    """weight [X, n] -> phy2log [X, num_phy], replica rank [X, num_phy], count [X, n]: one extra replica
    at a time to the expert with the highest load per replica."""
    rows, n = weight.shape
    phy2log = torch.arange(num_phy).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    cnt = torch.ones(rows, n, dtype=torch.int64)
    ar = torch.arange(rows)
    for i in range(n, num_phy):
        best = (weight / cnt).max(dim=-1).indices
        phy2log[:, i] = best
        rank[:, i] = cnt[ar, best]
        cnt[ar, best] += 1
    return phy2log, rank, cnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1)).expand(perm.shape))
    return inv


def _hierarchical(weight, num_phy, num_groups, num_nodes, num_gpus):
    L, E = weight.shape
    gsz, gpn = E // num_groups, num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    gpack, grank = _lpt_packing(weight.unflatten(-1, (num_groups, gsz)).sum(-1), num_nodes)
    log2mlog = (((gpack * gpn + grank) * gsz).unsqueeze(-1) + torch.arange(gsz)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    w_mlog = weight.gather(-1, mlog2log).view(-1, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate(w_mlog, num_phy // num_nodes)
    w_phy = (w_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank = _lpt_packing(w_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(L, num_nodes, -1) + torch.arange(0, E, E // num_nodes).view(1, -1, 1)).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(L, -1)
    logcnt = mlogcnt.view(L, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def reference_rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
    """DeepSeek's policy: hierarchical when groups divide over nodes, else global."""
    L, E = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    X = int(logcnt.max())
    log2phy = torch.full((L, E, X), -1, dtype=torch.int64)
    log2phy.view(L, -1).scatter_(-1, phy2log * X + rank, torch.arange(num_replicas).expand(L, -1))
    return phy2log, log2phy, logcnt
