"""Routed experts on CPU: tokens are grouped by expert (one sort), and each active expert runs one
matmul over its group. Never a per-token loop."""
import torch
import torch.nn.functional as F
from torch import nn


class FusedMoE(nn.Module):
    """num_experts SwiGLU experts. gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids, topk_weights [T, k] -> [T, H] = sum_k w * expert_k(x)."""
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_idx = order // k
        grouped = x[token_idx]
        out_rows = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                out_rows[start:end] = self._expert(expert, grouped[start:end])
                start = end
        out_rows *= topk_weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_idx, out_rows)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])
