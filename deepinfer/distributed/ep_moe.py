"""Expert-parallel MoE: each DP rank holds the routed experts of its physical slots only; every MoE
layer dispatches tokens to the ranks owning their slots and combines the results, with
all_to_all_single collectives of uneven splits (gloo on CPU, NCCL on GPU).

Per layer and step, three collectives, joined by every rank even with zero tokens:
  1. counts:   [W] rows this rank sends to each rank (equal splits of one int64 each);
  2. dispatch: one row per (token, destination rank): the hidden vector followed by the token's k local
               slot ids (-1 where the slot lives elsewhere) and k weights (0 there), packed as bytes so
               one collective carries both. A token routed to two slots of one rank travels once.
  3. combine:  one row per received (token, rank): the weighted sum of that rank's experts for it;
               the origin sums the rows of all ranks (index_add in rank order).
"""
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.layers.moe import FusedMoE


class EPStats:
    """Accumulated over a session: seconds inside all-to-alls, bytes sent to other ranks, calls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.a2a_s, self.bytes_sent, self.calls = 0.0, 0, 0


class ExpertParallel:
    """One per MoE layer. rank owns slots [rank * slots_per_rank, (rank + 1) * slots_per_rank);
    top_k and dtype (of the hidden rows on the wire) fix the row width, which every rank must agree
    on even when it sends nothing."""

    def __init__(self, rank: int, world_size: int, slots_per_rank: int, top_k: int, dtype: torch.dtype,
                 group, stats: EPStats):
        self.rank, self.world_size, self.per, self.top_k = rank, world_size, slots_per_rank, top_k
        self.dtype, self.group, self.stats = dtype, group, stats

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: FusedMoE) -> torch.Tensor:
        """x [T, H]; ids [T, k] physical slots (global); weights [T, k]; experts: this rank's slots
        only -> [T, H] = sum_k weights * expert(x), as the single-process FusedMoE computes it."""
        if x.dtype != self.dtype:
            return self.run(x.to(self.dtype), ids, weights, experts).to(x.dtype)
        send_tok, send_counts, payload = self._pack(x, ids, weights)
        recv_counts = self._a2a(send_counts.to(x.device), None, None, count=False).cpu()  # NCCL: device tensors
        recv = self._a2a(payload, recv_counts.tolist(), send_counts.tolist())
        rx, rids, rw = self._unpack(recv, x.shape[1], x.dtype)
        partial = local_experts(rx, rids, rw, experts)
        back = self._a2a(partial, send_counts.tolist(), recv_counts.tolist())
        return torch.zeros_like(x).index_add_(0, send_tok, back)

    def dummy(self, experts: FusedMoE) -> None:
        """Joins this layer's collectives with zero tokens of its own (a rank with nothing to run this
        step). It still serves the rows other ranks route to its experts."""
        x = torch.zeros(0, experts.gate_up_proj.shape[2], dtype=self.dtype, device=experts.gate_up_proj.device)
        ids = torch.zeros(0, self.top_k, dtype=torch.int64, device=x.device)
        self.run(x, ids, ids.float(), experts)

    def _pack(self, x, ids, weights):
        """-> send_tok [N] (token of each outgoing row, grouped by destination rank), send_counts [W],
        payload uint8 [N, H * itemsize + 8k] (hidden row, k local slot ids as fp32, k weights fp32)."""
        T = x.shape[0]
        dest = torch.div(ids, self.per, rounding_mode="floor")                     # [T, k] owning rank
        hit = torch.zeros(T, self.world_size, dtype=torch.bool, device=x.device).scatter_(1, dest, True)
        rank_tok = hit.t().nonzero()                                             # [N, 2] rank-major
        send_rank, send_tok = rank_tok[:, 0], rank_tok[:, 1]
        send_counts = hit.sum(0).to(torch.int64).cpu()
        mine = dest[send_tok] == send_rank[:, None]                              # [N, k]
        local = torch.where(mine, ids[send_tok] - send_rank[:, None] * self.per, -1)
        w = torch.where(mine, weights[send_tok].float(), 0.0)
        # fp32 holds slot ids exactly (< 2**24), so ids and weights share one meta block.
        meta = torch.cat([local.float(), w], dim=1)
        payload = torch.cat([x[send_tok].contiguous().view(torch.uint8), meta.view(torch.uint8)], dim=1)
        return send_tok, send_counts, payload

    def _unpack(self, recv, hidden_size: int, dtype):
        """uint8 [M, H * itemsize + 8k] -> x [M, H], local ids [M, k] (int64, -1 none), weights [M, k]."""
        nb = hidden_size * torch.empty(0, dtype=dtype).element_size()
        rx = recv[:, :nb].contiguous().view(dtype)
        meta = recv[:, nb:].clone().view(torch.float32)  # a fresh, aligned copy (small)
        k = meta.shape[1] // 2
        return rx, meta[:, :k].long(), meta[:, k:]

    def _a2a(self, t: torch.Tensor, out_splits, in_splits, count: bool = True) -> torch.Tensor:
        """all_to_all_single with uneven row splits (None: one row per rank)."""
        rows = sum(out_splits) if out_splits is not None else self.world_size
        out = t.new_empty((rows, *t.shape[1:]))
        start = time.perf_counter()
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
        self.stats.a2a_s += time.perf_counter() - start
        if count:
            row_bytes = math.prod(t.shape[1:]) * t.element_size()
            off_rank = sum(in_splits) - in_splits[self.rank]
            self.stats.bytes_sent += off_rank * row_bytes
            self.stats.calls += 1
        return out


def local_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: FusedMoE) -> torch.Tensor:
    """x [M, H]; ids [M, k] local slot ids with -1 for slots elsewhere; weights [M, k]
    -> [M, H] = sum over valid k of weights * expert(x), grouped as FusedMoE's forward groups."""
    k = ids.shape[1]
    flat = ids.flatten()
    pair = (flat >= 0).nonzero().squeeze(1)                                   # valid (row, k) pairs
    slots = flat[pair]
    order = slots.argsort(stable=True)
    pair = pair[order]
    token = pair // k
    rows = experts._run_experts(x[token], torch.bincount(slots, minlength=experts.num_experts))
    rows *= weights.flatten()[pair, None].to(rows.dtype)
    return torch.zeros_like(x).index_add_(0, token, rows.to(x.dtype))


def shard_experts(experts: FusedMoE, slots: range) -> FusedMoE:
    """The experts holding only the given slots (in order), so local slot i = slots[i]."""
    idx = torch.tensor(list(slots))
    E, two_i, H = experts.gate_up_proj.shape
    local = FusedMoE(len(slots), H, two_i // 2, experts.gate_up_proj.dtype, experts.limit)
    local.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[idx].clone(), requires_grad=False)
    local.down_proj = nn.Parameter(experts.down_proj.data[idx].clone(), requires_grad=False)
    local.packed = experts.packed
    return local
