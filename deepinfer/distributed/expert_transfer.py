"""EPLB across ranks: the group agrees on a new placement (same load, same deterministic policy on every
rank) and expert weights move between rank processes following `eplb.placement.plan_transfers`.

Each rank holds only its own slots, so a transfer (src, dst) is one of: both local (an index copy),
src here and dst elsewhere (a send), or dst here and src elsewhere (a receive). Per layer, all sends
travel in one all_to_all_single with uneven splits; rows between a pair of ranks go in ascending dst
order, which both sides derive from the same transfer list. Sources are read before any slot is
written, because a slot may be both a source and a destination."""
import torch
import torch.distributed as dist

from eplb.placement import plan_transfers


def exchange_experts(slot_weights: list[dict], old_phy2log, new_phy2log, rank: int, world_size: int,
                     group=None) -> tuple[int, int]:
    """slot_weights[l]: name -> local tensor [R / world_size, ...] of layer l, updated in place.
    old/new [L, R]. Returns (slots rewritten on this rank, of them received from another rank).
    Every rank must call it with the same plans (it joins one collective per layer)."""
    transfers, _ = plan_transfers(old_phy2log, new_phy2log, world_size)
    per = torch.as_tensor(old_phy2log).shape[-1] // world_size
    written = received = 0
    for weights, layer in zip(slot_weights, transfers):
        w, r = _exchange_layer(weights, layer, rank, world_size, per, group)
        written, received = written + w, received + r
    return written, received


def _exchange_layer(weights: dict, layer: list, rank: int, world: int, per: int, group) -> tuple[int, int]:
    """One layer's transfers (src_slot, dst_slot) with global slot ids."""
    owner = lambda slot: slot // per  # noqa: E731
    sends = sorted((owner(d), d, s) for s, d in layer if owner(s) == rank and owner(d) != rank)
    recvs = sorted((owner(s), d, s) for s, d in layer if owner(d) == rank and owner(s) != rank)
    local = [(s, d) for s, d in layer if owner(s) == rank and owner(d) == rank]
    names = sorted(weights)
    payload = _pack(weights, names, [s - rank * per for _, _, s in sends])
    local_rows = _pack(weights, names, [s - rank * per for s, _ in local])
    send_splits = [sum(1 for q, _, _ in sends if q == p) for p in range(world)]
    recv_splits = [sum(1 for q, _, _ in recvs if q == p) for p in range(world)]
    out = payload.new_empty(sum(recv_splits), payload.shape[1])
    dist.all_to_all_single(out, payload, recv_splits, send_splits, group=group)
    _unpack_into(weights, names, local_rows, [d - rank * per for _, d in local])
    _unpack_into(weights, names, out, [d - rank * per for _, d, _ in recvs])
    return len(local) + len(recvs), len(recvs)


def _pack(weights: dict, names: list[str], slots: list[int]) -> torch.Tensor:
    """-> uint8 [len(slots), row bytes]: each slot's tensors, in `names` order, as raw bytes (a copy)."""
    idx = torch.tensor(slots, dtype=torch.int64)
    parts = [weights[n].index_select(0, idx).reshape(len(slots), weights[n][0].numel()).contiguous()
             .view(torch.uint8) for n in names]
    return torch.cat(parts, dim=1) if parts else torch.empty(len(slots), 0, dtype=torch.uint8)


def _unpack_into(weights: dict, names: list[str], rows: torch.Tensor, slots: list[int]) -> None:
    """Writes packed rows [N, row bytes] into the given local slots."""
    start = 0
    for n in names:
        w = weights[n]
        nbytes = w[0].numel() * w.element_size()
        for i, slot in enumerate(slots):
            w[slot].copy_(rows[i, start:start + nbytes].clone().view(w.dtype).view(w.shape[1:]))
        start += nbytes
