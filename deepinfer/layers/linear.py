"""Linear layers: bf16 CPU weights go the path the GEMM plan measured fastest for the shape (our
kernels, or torch's own bf16 / fp32 GEMM)."""
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.gemm_plan import PLAN, run_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        path = PLAN.linear_path(x.dtype, x.numel() // max(x.shape[-1], 1), weight)
        return run_linear(path, x, weight, bias, PLAN.invariant)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
