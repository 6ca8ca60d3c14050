"""Routed experts on CPU: tokens are grouped by expert (one sort), and each active expert runs one
matmul over its group. Never a per-token loop."""
import itertools

import torch
from torch import nn

from deepinfer.layers import cpu_ops
from deepinfer.layers.cpu_ops import grouped_experts_bf16
from deepinfer.layers.gemm_plan import PLAN, torch_expert


class FusedMoE(nn.Module):
    """num_experts SwiGLU experts. gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    limit: DeepSeek-V4's swiglu_limit (gate clamped above, up clamped both ways); None for none.
    dtype: bf16, or fp32 (an fp32 model's; cpu_ops.WEIGHT_DTYPES). Expert outputs are computed and summed in fp32."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 limit: float | None = None):
        super().__init__()
        self.num_experts, self.limit = num_experts, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.packed = False  # both hold cpu_ops.pack_bf16_pairs(...) per expert (pack_weights)

    def pack_weights(self) -> None:
        """Repacks the bf16 experts in place into bf16 pairs, which cpu_ops.PACKED_ISA's kernel reads (whether that
        pays is the engine's measured choice: gemm_plan packs_experts); the tensors keep their shapes, storage and
        per-expert slices, so EPLB moves and expert sharding copy packed experts as they copied row-major ones."""
        if self.packed or not cpu_ops.can_pack(self.gate_up_proj, self.down_proj):
            return
        cpu_ops.pack_in_place(self.gate_up_proj.data, self.down_proj.data)
        self.packed = True

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]), row-major whether or not the experts are packed."""
        return cpu_ops.row_major(self.gate_up_proj[e], self.packed), cpu_ops.row_major(self.down_proj[e], self.packed)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids, topk_weights [T, k] -> [T, H] = sum_k w * expert_k(x)."""
        if cpu_ops.fast_path(x):
            return self._forward_fused(x, topk_ids, topk_weights).to(x.dtype)
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_idx = order // k
        rows = self._run_experts(x[token_idx].float(), counts)
        rows *= topk_weights.flatten()[order, None].float()
        return torch.zeros(x.shape).index_add_(0, token_idx, rows).to(x.dtype)

    def to_physical(self, phy2log: torch.Tensor) -> None:
        """Lays the logical experts out as physical slots: slot s holds expert phy2log[s] ([R])."""
        if torch.equal(phy2log, torch.arange(self.num_experts)):
            return
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[phy2log].contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.data[phy2log].contiguous(), requires_grad=False)
        self.num_experts = len(phy2log)

    def slot_weights(self) -> dict[str, torch.Tensor]:
        """name -> [R, ...] weights by physical slot, for EPLB rearrangement."""
        return {"gate_up_proj": self.gate_up_proj.data, "down_proj": self.down_proj.data}

    def _run_experts(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """grouped [S, H] fp32 rows sorted by expert, counts [E] -> [S, H] fp32 expert outputs. Our grouped kernel
        runs every expert except those the GEMM plan sends to torch's GEMM (on CPUs where it wins at their row
        counts)."""
        limit = float("inf") if self.limit is None else self.limit
        count_list = counts.tolist()
        kernel, via_torch, skip = self._plan(count_list)
        out = grouped_experts_bf16(grouped.contiguous(), counts, self.gate_up_proj, self.down_proj, limit, skip=skip,
                                   isa=kernel[4:], invariant=PLAN.invariant, packed=self.packed)
        starts = [0] + list(itertools.accumulate(count_list))
        for e in via_torch:
            rows = slice(starts[e], starts[e + 1])
            out[rows] = torch_expert(grouped[rows], *self.expert_weights(e), limit)
        return out

    def _forward_fused(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """forward's grouping, experts and weighted sum in one C++ call -> [T, H] fp32; the experts the GEMM
        plan sends to torch's GEMM are added after it."""
        limit = float("inf") if self.limit is None else self.limit
        counts = torch.bincount(topk_ids.flatten(), minlength=self.num_experts).tolist()
        kernel, via_torch, skip = self._plan(counts)
        y = cpu_ops.moe_experts_bf16(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, limit, skip,
                                     isa=kernel[4:], invariant=PLAN.invariant, packed=self.packed)
        for e in via_torch:
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            rows = torch_expert(x[token].float(), *self.expert_weights(e), limit)
            y.index_add_(0, token, rows * topk_weights[token, slot, None].float())
        return y

    def _plan(self, counts: list[int]) -> tuple[str, list[int], torch.Tensor | None]:
        """counts [E] rows per expert -> (our kernel's path, the experts the GEMM plan sends to torch's GEMM,
        those experts as a skip mask [E] for our kernel or None)."""
        kernel, via_torch = PLAN.expert_paths(self.gate_up_proj, self.down_proj, counts, self.packed)
        skip = None
        if via_torch:
            skip = torch.zeros(self.num_experts, dtype=torch.bool)
            skip[via_torch] = True
        return kernel, via_torch, skip


class RoutedMoE(nn.Module):
    """A router plus FusedMoE experts. Subclasses implement route(); forward records the routing
    for EPLB and maps logical experts to physical slots when a placement is set (see engine/eplb.py).

    moe_index: this layer's index among the model's MoE layers (set by the engine).
    ep: when expert-parallel, an object with run(x, physical_ids, weights, experts) -> [T, H] that
    dispatches tokens to the ranks owning their slots, runs the local experts and combines.
    balanced: False leaves the layer out of EPLB and expert parallelism (a drafter's layer, which runs
    on one rank at a time and so cannot join the ranks' all-to-alls)."""

    def __init__(self, experts: FusedMoE):
        super().__init__()
        self.experts = experts
        self.moe_index = 0
        self.eplb = None  # engine.eplb.EplbState, shared by all MoE layers of the model
        self.ep = None
        self.balanced = True

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] (for hash routing) -> (logical expert ids [T, k], weights [T, k])."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        ids, weights = self.route(x, input_ids)
        if self.eplb is not None:
            ids = self.eplb.on_route(self.moe_index, ids)
        if self.ep is not None:
            return self.ep.run(x, ids, weights, self.experts)
        return self.experts(x, ids, weights)


def packable_experts(model: nn.Module) -> list[FusedMoE]:
    """The FusedMoE layers of the model whose experts pack_weights would pack here."""
    return [m for m in model.modules()
            if isinstance(m, FusedMoE) and not m.packed and cpu_ops.can_pack(m.gate_up_proj, m.down_proj)]


def balanced_moe_blocks(model: nn.Module) -> list[RoutedMoE]:
    """The MoE layers EPLB balances and expert parallelism shards, in model order."""
    return [m for m in model.modules() if isinstance(m, RoutedMoE) and m.balanced]
