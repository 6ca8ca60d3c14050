"""Qwen3-MoE: the Llama block with per-head q/k RMSNorm and a softmax top-k routed MoE."""
import re

import torch
from torch import nn

from deepinfer.config import hf_get
from deepinfer.layers import cpu_ops
from deepinfer.layers.gemm_plan import PLAN, bucket, buckets_up_to
from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import FusedMoE, RoutedMoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.models.llama import MLP, LlamaForCausalLM, member


class SparseMoeBlock(RoutedMoE):
    def __init__(self, cfg, dtype):
        num_experts = hf_get(cfg, "num_experts", "num_local_experts")
        super().__init__(FusedMoE(num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = bool(hf_get(cfg, "norm_topk_prob", default=False))
        self.gate = Linear(cfg.hidden_size, num_experts, dtype)
        self.experts.gate_up_proj.shard_sizes = [cfg.moe_intermediate_size] * 2
        self._fused_weights: dict[tuple, tuple | None] = {}  # fused_residual's checked weights, by inputs

    def fused_residual(self, x: torch.Tensor, a: torch.Tensor, norm: RMSNorm) -> torch.Tensor | None:
        """x1 + self(norm(x1)) with x1 = x + a (the decoder layer's second half) in one C++ call
        (cpu_ops.moe_block); None where that cannot run these inputs (see _fused_weights_for)."""
        weights = self.fused_weights(x, a, norm)
        if weights is None:
            return None
        return cpu_ops.moe_block(x, a, weights, *self.load_tensors())

    def fused_weights(self, x: torch.Tensor, a: torch.Tensor, norm: RMSNorm) -> tuple | None:
        """cpu_ops.moe_block_weights for these inputs, or None where the fused half cannot run them."""
        if self.ep is not None or x.dim() != 2 or a.dtype != x.dtype \
                or (self.eplb is not None and not self.eplb.placement.single[self.moe_index]):
            return None
        experts, gate = member(self, "experts"), member(self, "gate")
        key = (x.dtype, x.device.type, bucket(x.shape[0]), PLAN.invariant, member(norm, "weight").data_ptr(),
               member(gate, "weight").data_ptr(), member(experts, "gate_up_proj").data_ptr(),
               member(experts, "down_proj").data_ptr(), experts.packed, gate.packed)
        if key not in self._fused_weights:  # checked once per dtype, row bucket and set of tensors
            self._fused_weights[key] = self._fused_weights_for(x, norm)
        return self._fused_weights[key]

    def load_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """moe_block's (counts, log2phy) this step: the EPLB recorder's row for this layer and the placement's
        logical -> physical map, or (None, None) without EPLB."""
        if self.eplb is None:
            return None, None
        recorder = self.eplb.recorder
        return recorder.step_counts(self.moe_index), self.eplb.placement.primary_rows[self.moe_index]

    def _fused_weights_for(self, x: torch.Tensor, norm: RMSNorm) -> tuple | None:
        """cpu_ops.moe_block_weights where the C++ half-layer can run: CPU bf16 or fp32 weights, no swiglu limit, and a
        GEMM plan that keeps every expert row count on our kernels. The router GEMM (E x H, tiny) runs on our
        fastest kernel where the plan timed torch's faster: its call overhead, which that timing saw, is gone."""
        experts = self.experts
        if experts.gate_up_proj.dtype not in cpu_ops.WEIGHT_DTYPES or experts.limit is not None \
                or not cpu_ops.fast_path(x, norm.weight):
            return None
        rows = x.shape[0]
        isas = []
        for b in buckets_up_to(rows):
            kernel, via_torch = PLAN.expert_paths(experts.gate_up_proj, experts.down_proj, [b], experts.packed)
            if via_torch:
                return None
            isas.append(kernel[4:])
        gate = PLAN.linear_path(x.dtype, rows, self.gate.weight, self.gate.packed)
        gate = gate if gate.startswith("cpu-") else (PLAN.cpu_paths(x.dtype, packed=self.gate.packed) or [None])[0]
        if gate is None:  # a packed router under fp32 activations: only torch, unpacking it, keeps them exact
            return None
        return cpu_ops.moe_block_weights(norm.weight, norm.eps, self.gate.weight, self.top_k, self.norm_topk_prob,
                                         experts.gate_up_proj, experts.down_proj, gate[4:], isas, PLAN.invariant,
                                         experts.packed, self.gate.packed)

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
