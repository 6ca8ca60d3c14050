"""Runtime expert placement: where each logical expert's replicas live, which replica a token uses,
and how expert weights move when the plan changes.

Terms: L MoE layers, E logical experts (what the router picks), R physical slots (what holds weights),
G GPUs (expert-parallel ranks); rank g owns the contiguous slots [g * R/G, (g + 1) * R/G).
``phy2log[l, s]`` is the logical expert held by slot s of layer l.

Replica selection rule (deterministic, exactly even): within one ``map_to_physical`` call, the i-th
occurrence of logical expert e in ``topk_ids`` (row-major order: token by token, then by top-k
position) goes to replica ``i mod logcnt[e]``, replicas taken in ascending slot order. So an expert
with c replicas splits its tokens into c shares that differ by at most one, which is the even split
``moe_lb`` assumes.
"""
from __future__ import annotations

import json

import torch


class ExpertPlacement:
    """A placement of R physical slots over G GPUs for L layers.

    phy2log [L, R] (or [R] for one layer), num_gpus G with R % G == 0, num_experts E (default: max id + 1).
    Attributes: phy2log [L, R], log2phy [L, E, X] (slots of each expert ascending, -1 padded), primary [L, E]
    (log2phy[:, :, 0]: the only slot of experts without replicas) and primary_rows (its L rows),
    logcnt [L, E], num_layers, num_experts, num_physical, num_gpus, slots_per_gpu.
    """

    def __init__(self, phy2log, num_gpus: int, num_experts: int | None = None):
        """Validate phy2log (ValueError naming the problem) and build log2phy and logcnt."""
        p = torch.as_tensor(phy2log, dtype=torch.int64)
        p = p[None] if p.dim() == 1 else p
        if p.dim() != 2 or p.numel() == 0:
            raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(p.shape)}")
        L, R = p.shape
        E = int(p.max()) + 1 if num_experts is None else int(num_experts)
        if not isinstance(num_gpus, int) or num_gpus <= 0 or R % num_gpus:
            raise ValueError(f"num_gpus={num_gpus!r} must be a positive divisor of the {R} slots")
        if int(p.min()) < 0 or int(p.max()) >= E:
            raise ValueError(f"phy2log holds ids outside [0, {E}) (num_experts)")
        self.phy2log, self.num_gpus, self.num_experts = p.contiguous(), num_gpus, E
        self.num_layers, self.num_physical, self.slots_per_gpu = L, R, R // num_gpus
        self.logcnt = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, p, torch.ones_like(p))
        missing = (self.logcnt == 0).nonzero()
        if len(missing):
            l, e = missing[0].tolist()
            raise ValueError(f"phy2log: logical expert {e} has no slot in layer {l}")
        self.log2phy = _log2phy(p, self.logcnt)
        self.primary = self.log2phy[:, :, 0].contiguous()  # [L, E] each expert's first slot
        self.primary_rows = self.primary.unbind(0)          # its rows as views, made once (hot path)
        # Layers where every expert has one replica map by a single gather (the decode hot path without
        # redundant slots): ~8 small ops per MoE layer less.
        self.single = (self.logcnt == 1).all(dim=1).tolist()

    def to(self, device) -> "ExpertPlacement":
        """Move the maps to the device the router output lives on (map_to_physical does no host sync)."""
        for name in ("phy2log", "log2phy", "logcnt", "primary"):
            setattr(self, name, getattr(self, name).to(device))
        self.primary_rows = self.primary.unbind(0)
        return self

    def map_to_physical(self, topk_ids: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """topk_ids [T, k] logical ids -> [T, k] physical slot ids, by the rule in the module docstring."""
        if self.single[layer]:
            return self.primary_rows[layer][topk_ids.long()]
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        first = torch.searchsorted(sorted_ids, sorted_ids)                     # start of each expert's run
        occ = torch.empty_like(flat)
        occ[order] = torch.arange(flat.numel(), device=flat.device) - first
        replica = occ % self.logcnt[layer][flat]
        return self.log2phy[layer][flat, replica].view_as(topk_ids)

    def local_slots(self, rank: int) -> range:
        """The physical slots owned by expert-parallel rank ``rank``."""
        return range(rank * self.slots_per_gpu, (rank + 1) * self.slots_per_gpu)

    def to_json(self) -> dict:
        """The plan-file fields (see save_plan / load_plan)."""
        return {"phy2log": self.phy2log.cpu().tolist(), "num_gpus": self.num_gpus,
                "num_logical_experts": self.num_experts, "num_layers": self.num_layers,
                "num_replicas": self.num_physical}


def _log2phy(phy2log: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """[L, R] -> [L, E, max count], each expert's slots ascending, -1 padded."""
    L, R = phy2log.shape
    order = torch.argsort(phy2log, dim=1, stable=True)                          # slots grouped by expert
    experts = phy2log.gather(1, order)
    start = torch.searchsorted(experts, experts)
    rank = torch.arange(R).expand(L, R) - start
    out = torch.full((L, logcnt.shape[1], int(logcnt.max())), -1, dtype=torch.int64)
    out[torch.arange(L)[:, None], experts, rank] = order
    return out


# ----------------------------------------------------------------------------------------------------
# balance metric


def gpu_loads(load: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """load [..., L, E] tokens per logical expert, phy2log [L, R] -> tokens per GPU [..., L, G],
    each expert's load split evenly over its replicas."""
    p = torch.as_tensor(phy2log, dtype=torch.int64)
    p = p[None] if p.dim() == 1 else p
    load = torch.as_tensor(load).double()
    L, R = p.shape
    cnt = torch.zeros(L, load.shape[-1], dtype=torch.float64).scatter_add_(1, p, torch.ones(L, R, dtype=torch.float64))
    per_slot = (load / cnt).gather(-1, p.expand(load.shape[:-1] + (R,)))
    return per_slot.unflatten(-1, (num_gpus, R // num_gpus)).sum(-1)


def moe_lb(load, phy2log, num_gpus: int) -> torch.Tensor:
    """max / mean tokens per GPU: load [..., L, E], phy2log [L, R] -> [..., L] (1.0 is perfect; a layer
    with no tokens counts as 1.0)."""
    g = gpu_loads(load, phy2log, num_gpus)
    mean = g.mean(-1)
    return torch.where(mean > 0, g.max(-1).values / mean.clamp_min(1e-300), torch.ones_like(mean))


def moe_lb_total(load, phy2log, num_gpus: int) -> float:
    """One number for a whole model: sum over layers (and steps) of the busiest GPU's tokens divided by
    the sum of the mean; this weighs layers and steps by their work, as the step time does."""
    g = gpu_loads(load, phy2log, num_gpus)
    mean = g.mean(-1).sum()
    return float(g.max(-1).values.sum() / mean) if mean > 0 else 1.0


def identity_phy2log(num_layers: int, num_experts: int, num_replicas: int) -> torch.Tensor:
    """The plan an engine runs without EPLB: slot s holds expert s mod E (with R == E, expert s)."""
    return (torch.arange(num_replicas) % num_experts).expand(num_layers, num_replicas).clone()


# ----------------------------------------------------------------------------------------------------
# moving expert weights between plans


def plan_transfers(old_phy2log, new_phy2log, num_gpus: int):
    """Which slots must receive weights when old -> new, and from where.

    old/new [L, R] (or [R]). Returns (transfers, num_moved): transfers[l] is a list of
    (src_slot, dst_slot) for layer l, one per slot whose expert changes, src read from the OLD
    placement (so every rank can post all its sends before any slot is overwritten). The source is a
    slot of the same rank when one holds the expert (a local copy), else the lowest such slot.
    Unchanged slots are never touched; num_moved = total number of (src, dst) pairs.
    """
    old, new = _as_2d(old_phy2log), _as_2d(new_phy2log)
    if old.shape != new.shape:
        raise ValueError(f"old_phy2log {tuple(old.shape)} and new_phy2log {tuple(new.shape)} differ in shape")
    L, R = old.shape
    if R % num_gpus:
        raise ValueError(f"num_gpus={num_gpus} does not divide the {R} slots")
    per = R // num_gpus
    transfers = []
    for l in range(L):
        o, n = old[l].tolist(), new[l].tolist()
        holders: dict[int, list[int]] = {}
        for s, e in enumerate(o):
            holders.setdefault(e, []).append(s)
        layer = []
        for dst in (s for s in range(R) if o[s] != n[s]):
            src = holders.get(n[dst])
            if src is None:
                raise ValueError(f"new_phy2log needs expert {n[dst]} in layer {l}, which old_phy2log does not hold")
            local = [s for s in src if s // per == dst // per]
            layer.append((local[0] if local else src[0], dst))
        transfers.append(layer)
    return transfers, sum(len(t) for t in transfers)


def rearrange(expert_weights: dict, old_phy2log, new_phy2log, num_gpus: int = 1) -> int:
    """Move expert weights in place from the old placement to the new one, on one process.

    expert_weights: name -> Tensor [R, ...] for one layer with phy2log [R], or [L, R, ...] with [L, R].
    Runs exactly the plan_transfers list: sources are read into a buffer first (a slot may be both a
    source and a destination), then only the changed slots are written. Returns the number moved.
    """
    old, new = _as_2d(old_phy2log), _as_2d(new_phy2log)
    one_layer = torch.as_tensor(old_phy2log).dim() == 1
    transfers, moved = plan_transfers(old, new, num_gpus)
    for l, layer in enumerate(transfers):
        if not layer:
            continue
        src = torch.tensor([s for s, _ in layer])
        dst = torch.tensor([d for _, d in layer])
        for name, w in expert_weights.items():
            wl = w if one_layer else w[l]
            if wl.shape[0] != old.shape[1]:
                raise ValueError(f"expert_weights[{name!r}] has {wl.shape[0]} slots, the plan has {old.shape[1]}")
            wl.index_copy_(0, dst.to(wl.device), wl.index_select(0, src.to(wl.device)))
    return moved


def _as_2d(p) -> torch.Tensor:
    """phy2log [R] or [L, R] -> int64 CPU tensor [L, R]."""
    p = torch.as_tensor(p, dtype=torch.int64).cpu()
    return p[None] if p.dim() == 1 else p


# ----------------------------------------------------------------------------------------------------
# plan files


def save_plan(path: str, phy2log, num_gpus: int, num_experts: int, **extra) -> None:
    """Write a plan JSON: phy2log, num_gpus, num_logical_experts, num_layers, num_replicas (+ extra)."""
    doc = ExpertPlacement(phy2log, num_gpus, num_experts).to_json()
    doc.update(extra)
    with open(path, "w") as f:
        json.dump(doc, f)


def load_plan(path: str, num_layers: int, num_experts: int) -> ExpertPlacement:
    """Read a plan JSON and check it against the model; a mismatch raises ValueError naming the field."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan file {path} is not valid JSON: {exc}") from None
    for field in ("phy2log", "num_gpus", "num_logical_experts", "num_layers"):
        if field not in doc:
            raise ValueError(f"plan file {path} lacks the field {field!r}")
    if doc["num_layers"] != num_layers:
        raise ValueError(f"num_layers: plan has {doc['num_layers']}, the model has {num_layers} MoE layers")
    if doc["num_logical_experts"] != num_experts:
        raise ValueError(f"num_logical_experts: plan has {doc['num_logical_experts']}, the model has {num_experts}")
    p = torch.tensor(doc["phy2log"], dtype=torch.int64) if doc["phy2log"] else torch.empty(0, 0, dtype=torch.int64)
    if p.dim() != 2 or p.shape[0] != num_layers:
        raise ValueError(f"phy2log: expected {num_layers} rows of slots, got shape {tuple(p.shape)}")
    if "num_replicas" in doc and doc["num_replicas"] != p.shape[1]:
        raise ValueError(f"num_replicas: plan says {doc['num_replicas']}, phy2log has {p.shape[1]} slots")
    if p.shape[1] < num_experts:
        raise ValueError(f"phy2log: {p.shape[1]} slots cannot hold {num_experts} experts")
    return ExpertPlacement(p, doc["num_gpus"], num_experts)
