"""Qwen3-MoE: the Llama block with per-head q/k RMSNorm and a softmax top-k routed MoE."""
import re

import torch
from torch import nn

from deepinfer.config import hf_get
from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import FusedMoE, RoutedMoE
from deepinfer.models.llama import MLP, LlamaForCausalLM


class SparseMoeBlock(RoutedMoE):
    def __init__(self, cfg, dtype):
        num_experts = hf_get(cfg, "num_experts", "num_local_experts")
        super().__init__(FusedMoE(num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = bool(hf_get(cfg, "norm_topk_prob", default=False))
        self.gate = Linear(cfg.hidden_size, num_experts, dtype)
        self.experts.gate_up_proj.shard_sizes = [cfg.moe_intermediate_size] * 2

    def route(self, x: torch.Tensor, input_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_ids [T, k], topk_weights [T, k] (softmax in fp32, as transformers)."""
        probs = self.gate(x).softmax(-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def make_mlp(self, cfg, layer: int, dtype) -> nn.Module:
        sparse_step = hf_get(cfg, "decoder_sparse_step", default=1)
        dense = layer in (hf_get(cfg, "mlp_only_layers", default=[]) or [])
        if dense or sparse_step <= 0 or (layer + 1) % sparse_step:
            return MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        return SparseMoeBlock(cfg, dtype)

    def hf_to_param(self, name: str):
        """Per-expert HF tensors (mlp.experts.{e}.gate_proj.weight) go into the fused [E, ...]
        expert parameters; already fused ones (transformers 5 layout) load directly."""
        m = re.match(r"(?:model\.)?(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            return super().hf_to_param(name)
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down":
            return f"{prefix}.down_proj", expert, None
        return f"{prefix}.gate_up_proj", expert, 0 if kind == "gate" else 1
