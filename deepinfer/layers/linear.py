"""Linear layers: bf16 CPU weights (and an fp32 model's fp32 ones) go the path the GEMM plan measured fastest for
the shape (our kernels, or torch's own bf16 / fp32 GEMM)."""
import collections

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import cpu_ops
from deepinfer.layers.gemm_plan import PLAN, run_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias); packed: weight is cpu_ops.pack_bf16_pairs(...)."""
    if weight.dtype in cpu_ops.WEIGHT_DTYPES and weight.device.type == "cpu":
        path = PLAN.linear_path(x.dtype, x.numel() // max(x.shape[-1], 1), weight, packed)
        return run_linear(path, x, weight, bias, PLAN.invariant, packed)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """out_features as a list makes a fused projection whose row blocks load from separate
    checkpoint tensors (the loader reads `shard_sizes`)."""

    def __init__(self, in_features: int, out_features: int | list[int], dtype: torch.dtype, bias: bool = False):
        super().__init__()
        shards = out_features if isinstance(out_features, list) else None
        n_out = sum(shards) if shards else out_features
        self.weight = nn.Parameter(torch.empty(n_out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters():
            p.shard_sizes = shards
        self.packed = False  # weight holds cpu_ops.pack_bf16_pairs(...) (pack_weights)

    def pack_weights(self) -> None:
        """Repacks a bf16 weight in place into bf16 pairs, which cpu_ops.PACKED_ISA's kernel reads (whether that pays
        is the engine's measured choice: gemm_plan packs_linear); its shape and storage stay. Only for weights no other
        module reads as rows."""
        if not self.packed and cpu_ops.can_pack(self.weight):
            cpu_ops.pack_in_place(self.weight.data)
            self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def packable_linears(model: nn.Module) -> list[Linear]:
    """The Linears of the model whose weight pack_weights would pack here and no other parameter shares (a tied
    embedding reads rows)."""
    uses = collections.Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    return [m for m in model.modules() if isinstance(m, Linear) and uses[m.weight.data_ptr()] == 1
            and not m.packed and cpu_ops.can_pack(m.weight)]
