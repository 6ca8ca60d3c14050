"""Linear layers that route bf16 CPU weights to our kernel (torch's bf16 GEMM is slow on AVX2)."""
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.cpu_ops import linear_bf16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return linear_bf16(x, weight, bias)
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
