"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4, as transformers' DeepseekV4HyperConnection
and DeepseekV4HyperHead. The residual is `hc_mult` parallel streams [T, N, D]; each block reads one
weighted collapse of them (pre), writes its output back spread over the streams (post), and the streams
mix through a doubly-stochastic matrix (comb, projected by Sinkhorn-Knopp). All of it runs in fp32 (the
checkpoint keeps these weights in fp32). HyperConnection and the merge run as fused C++ kernels
(csrc/cpu/hyper_connection.cpp): as ~25 torch ops per call they cost more in dispatch than in math."""
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import cpu_ops


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / rms(x) (statistic in fp32, result in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _fp32_param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    """Parameters (HF names): fn [(2+N)*N, N*D], base [(2+N)*N], scale [3]."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n = hc_mult
        self.iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = _fp32_param(width, hc_mult * hidden_size)
        self.base = _fp32_param(width)
        self.scale = _fp32_param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, D] (streams' dtype)."""
        return cpu_ops.hc_pre(streams.contiguous(), self.fn, self.base, self.scale, self.iters, self.hc_eps,
                              self.norm_eps)


def hc_merge(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D] = post (x) block_out + comb^T @ streams (comb is read transposed: the Sinkhorn
    matrix is doubly stochastic but not symmetric)."""
    return cpu_ops.hc_merge(block_out.contiguous(), streams.contiguous(), post, comb)


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm. HF names: hc_fn [N, N*D], hc_base [N], hc_scale [1]."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = _fp32_param(hc_mult, hc_mult * hidden_size)
        self.hc_base = _fp32_param(hc_mult)
        self.hc_scale = _fp32_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, D] -> [T, D]."""
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
