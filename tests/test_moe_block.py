"""The fused Qwen3-MoE half-layer (cpu_ops.moe_block, SparseMoeBlock.fused_residual) against the torch
modules it replaces: residual add, RMSNorm, softmax top-k router, EPLB counting and mapping, experts."""
import pytest
import torch
from transformers import Qwen3MoeConfig

from deepinfer import LLM, SamplingParams
from deepinfer.layers import cpu_ops, gemm_plan
from deepinfer.layers.norm import RMSNorm
from deepinfer.models.qwen3_moe import SparseMoeBlock
from tests.conftest import our_expert_paths, our_kernel_path


def make_block(dtype, seed=0, experts=8, top_k=2, hidden=64, inter=32, weight_dtype=torch.bfloat16):
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True, rms_norm_eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    block, norm = SparseMoeBlock(cfg, weight_dtype), RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g))
        block.experts.gate_up_proj.copy_(torch.randn(block.experts.gate_up_proj.shape, generator=g) * 0.2)
        block.experts.down_proj.copy_(torch.randn(block.experts.down_proj.shape, generator=g) * 0.2)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    return block, norm


def reference(block, norm, x, a):
    x1 = x + a
    return x1 + block(norm(x1))


@pytest.mark.parametrize("packed", [False] + ([True] if cpu_ops.PACKED_ISA else []))
@pytest.mark.parametrize("t", [1, 5, 40])
def test_fused_half_layer_matches_the_torch_modules(t, packed, monkeypatch):
    """packed: both run the experts packed in bf16 pairs, as the engine does on CPUs with a packed kernel. The GEMM
    plan is pinned to our kernels, which the fused half needs (a timed plan refused it once on a loaded host)."""
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    monkeypatch.setattr(gemm_plan.PLAN, "expert_paths", our_expert_paths)
    block, norm = make_block(torch.bfloat16)
    if packed:
        block.experts.pack_weights()
        assert block.experts.packed
    g = torch.Generator().manual_seed(t)
    x, a = (torch.randn(t, 64, generator=g).bfloat16() for _ in range(2))
    fused = block.fused_residual(x, a, norm)
    assert fused is not None and fused.dtype == torch.bfloat16 and fused.shape == x.shape
    ref = reference(block, norm, x, a)
    # Same routing and roundings; only exp inside the softmax is another implementation, which can move a
    # routing weight's last bit.
    torch.testing.assert_close(fused, ref, rtol=8e-3, atol=8e-3)
    assert (fused != ref).float().mean() < 0.01


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_fp32_activations_match_the_torch_modules(weight_dtype):
    """fp32 activations over bf16 weights, or over fp32 ones (an fp32 model's), on the exact (fp32-input)
    kernels."""
    block, norm = make_block(torch.float32, weight_dtype=weight_dtype)
    g = torch.Generator().manual_seed(7)
    x, a = (torch.randn(9, 64, generator=g) for _ in range(2))
    isa = cpu_ops.EXACT_ISA
    weights = cpu_ops.moe_block_weights(norm.weight, norm.eps, block.gate.weight, block.top_k, True,
                                        block.experts.gate_up_proj, block.experts.down_proj, isa, [isa] * 4)
    fused = cpu_ops.moe_block(x, a, weights)
    x1 = x + a
    h = norm(x1)
    logits = cpu_ops.linear_bf16(h, block.gate.weight, isa=isa)
    probs = logits.softmax(-1)
    weights, ids = probs.topk(block.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    y = cpu_ops.moe_experts_bf16(h, ids, weights, block.experts.gate_up_proj, block.experts.down_proj, isa=isa)
    torch.testing.assert_close(fused, x1 + y, rtol=1e-5, atol=1e-5)


def test_counts_and_log2phy_follow_eplb_semantics():
    """Logical ids are counted; experts run on the physical slots log2phy names (a permuted layout gives the
    same output as the identity)."""
    block, norm = make_block(torch.bfloat16, seed=3)
    x, a = (torch.randn(12, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2))
    isa = cpu_ops.EXACT_ISA
    w13, w2 = block.experts.gate_up_proj.data, block.experts.down_proj.data
    weights = lambda w13, w2: cpu_ops.moe_block_weights(norm.weight, norm.eps, block.gate.weight, block.top_k,  # noqa: E731
                                                        True, w13, w2, isa, [isa] * 5)
    counts = torch.zeros(8, dtype=torch.int64)
    plain = cpu_ops.moe_block(x, a, weights(w13, w2), counts, None)
    ids, _ = block.route(norm(x + a))
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=8))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))  # physical slot s holds expert perm[s]
    log2phy = torch.argsort(perm)
    w13p, w2p = w13[perm].contiguous(), w2[perm].contiguous()
    moved = cpu_ops.moe_block(x, a, weights(w13p, w2p), None, log2phy)
    assert torch.equal(moved, plain)
    before = counts.clone()
    with pytest.raises(ValueError, match="log2phy"):
        cpu_ops.moe_block(x, a, weights(w13, w2), counts, log2phy + 8)
    assert torch.equal(counts, before)  # refused before any expert load was counted
    with pytest.raises(ValueError, match="counts"):
        cpu_ops.moe_block(x, a, weights(w13, w2), torch.zeros(7, dtype=torch.int64), None)


def test_fused_path_declines_what_it_cannot_run():
    block, norm = make_block(torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    assert block.fused_residual(x, x.float(), norm) is None  # mixed dtypes: the torch path handles them
    block.ep = object()
    assert block.fused_residual(x, x, norm) is None


def test_engine_outputs_and_expert_load_equal_without_fusion(tiny_qwen3_moe, monkeypatch):
    """bf16 greedy generation and the EPLB recorder's counts through the fused half-layers equal the torch path's."""
    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run():
        llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.eplb.recorder.total()

    fused_tokens, fused_load = run()
    monkeypatch.setattr(SparseMoeBlock, "fused_weights", lambda self, x, a, norm: None)  # per layer and stacked
    tokens, load = run()
    assert fused_tokens == tokens
    assert torch.equal(fused_load, load)
