"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4, as transformers' DeepseekV4HyperConnection
and DeepseekV4HyperHead. The residual is `hc_mult` parallel streams [T, N, D]; each block reads one
weighted collapse of them (pre), writes its output back spread over the streams (post), and the streams
mix through a doubly-stochastic matrix (comb, projected by Sinkhorn-Knopp). All of it runs in fp32 (the
checkpoint keeps these weights in fp32)."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / rms(x) (statistic in fp32, result in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [T, N, N] fp32 > 0 -> doubly-stochastic (approximately): columns first, then (rows, columns)
    iters-1 times, as the reference. In numpy: ~40 reductions on N x N matrices, where torch's per-op
    dispatch (~8 us) costs more than the arithmetic (same fp32 operations)."""
    c = comb.numpy().copy()
    eps = np.float32(eps)
    c /= c.sum(axis=-2, keepdims=True) + eps
    for _ in range(iters - 1):
        c /= c.sum(axis=-1, keepdims=True) + eps
        c /= c.sum(axis=-2, keepdims=True) + eps
    return torch.from_numpy(c)


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
        n = self.n
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D] = post (x) block_out + comb^T @ streams (comb is read transposed: the Sinkhorn
    matrix is doubly stochastic but not symmetric)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


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
