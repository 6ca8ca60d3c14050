import torch
from torch import nn

from deepinfer.layers import cpu_ops


class RMSNorm(nn.Module):
    """Normalises in fp32 and casts back before the weight, exactly as transformers does, so fp32
    and bf16 outputs match the reference bit for bit where the math allows."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.fast_path(x, self.weight):  # one C++ pass instead of 8 torch ops
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
