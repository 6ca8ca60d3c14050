"""The fused decode attention half-layer (cpu_ops.attention_block, Attention.fused_decode) against the
unfused kernels it chains: the same bits, the same cache writes, and clear errors for bad metadata."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.layers import cpu_ops, gemm_plan
from deepinfer.layers.cpu_ops import GEMM_ISAS
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.llama import Attention
from tests.conftest import our_kernel_path

T, HIDDEN, H, HKV, D, BS, BLOCKS = 5, 64, 4, 2, 16, 4, 12


def inputs(dtype, qk_norm, seed=0, weight_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = dict(x=r(T, HIDDEN).to(dtype), norm_w=(1 + 0.1 * r(HIDDEN)).to(dtype),
             qkv_w=(r((H + 2 * HKV) * D, HIDDEN) * 0.2).to(weight_dtype),
             o_w=(r(HIDDEN, H * D) * 0.2).to(weight_dtype),
             q_norm=(1 + 0.1 * r(D)).to(dtype) if qk_norm else None, k_norm=(1 + 0.1 * r(D)).to(dtype) if qk_norm else None,
             k_cache=r(BLOCKS, BS, HKV, D).to(dtype), v_cache=r(BLOCKS, BS, HKV, D).to(dtype))
    lens = torch.tensor([1, 4, 5, 9, 12])
    tables = torch.full((T, 3), -1, dtype=torch.int64)
    free = torch.randperm(BLOCKS, generator=g).tolist()
    for t, n in enumerate(lens.tolist()):
        for i in range(-(-n // BS)):
            tables[t, i] = free.pop() if free else 0
    slots = torch.stack([tables[t, (n - 1) // BS] * BS + (n - 1) % BS for t, n in enumerate(lens.tolist())])
    return w, dict(positions=lens - 1, slot_mapping=slots, block_tables=tables, context_lens=lens)


def unfused(w, meta, isa, rotary, dtype):
    h = cpu_ops.rms_norm(w["x"], w["norm_w"], 1e-6)
    qkv = cpu_ops.linear_bf16(h, w["qkv_w"], isa=isa)
    q = cpu_ops.qk_norm_rope_store(qkv, H, HKV, D, w["q_norm"], w["k_norm"], 1e-6, rotary.cos, rotary.sin,
                                   meta["positions"], w["k_cache"], w["v_cache"], meta["slot_mapping"])
    a = cpu_ops.paged_decode_attention(q, w["k_cache"], w["v_cache"], meta["block_tables"], meta["context_lens"],
                                       D ** -0.5)
    return cpu_ops.linear_bf16(a.reshape(T, H * D), w["o_w"], isa=isa)


def fused(w, meta, isa, rotary):
    weights = cpu_ops.attention_block_weights(w["norm_w"], 1e-6, w["qkv_w"], None, isa, w["q_norm"], w["k_norm"], 1e-6,
                                              rotary.cos, rotary.sin, w["k_cache"], w["v_cache"], w["o_w"], None, isa,
                                              H, D ** -0.5)
    return cpu_ops.attention_block(w["x"], meta["positions"], meta["slot_mapping"], meta["block_tables"],
                                   meta["context_lens"], weights)


# Every ISA this CPU runs, for bf16 activations; fp32 activations only on the ISAs that read them exactly, over bf16
# weights or an fp32 model's fp32 ones.
FP32_ISAS = [isa for isa in GEMM_ISAS if isa not in cpu_ops.BF16_INPUT_ISAS]
CASES = [(isa, torch.bfloat16, True, torch.bfloat16) for isa in GEMM_ISAS] + \
    [(isa, torch.float32, False, torch.bfloat16) for isa in FP32_ISAS] + \
    [(isa, torch.float32, qk_norm, torch.float32) for isa in FP32_ISAS for qk_norm in (False, True)]


@pytest.mark.parametrize("isa,dtype,qk_norm,weight_dtype", CASES)
def test_fused_attention_half_is_bit_identical_to_the_kernels_it_chains(isa, dtype, qk_norm, weight_dtype):
    rotary = RotaryEmbedding(D, 64, 10000.0)
    w, meta = inputs(dtype, qk_norm, weight_dtype=weight_dtype)
    w2 = {k: v.clone() if v is not None else None for k, v in w.items()}
    ref = unfused(w, meta, isa, rotary, dtype)
    out = fused(w2, meta, isa, rotary)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(w2["k_cache"], w["k_cache"]) and torch.equal(w2["v_cache"], w["v_cache"])


@pytest.mark.parametrize("field,value,error", [
    ("context_lens", torch.tensor([1, 4, 5, 9, 13]), ValueError),   # past max_blocks * block_size
    ("context_lens", torch.tensor([0, 4, 5, 9, 12]), ValueError),
    ("positions", torch.tensor([0, 3, 4, 8, 64]), IndexError),       # past the rotary table
])
def test_bad_metadata_is_refused_before_anything_is_written(field, value, error):
    rotary = RotaryEmbedding(D, 64, 10000.0)
    w, meta = inputs(torch.bfloat16, True)
    before = w["k_cache"].clone()
    with pytest.raises(error):
        fused(w, {**meta, field: value}, cpu_ops.EXACT_ISA, rotary)
    assert torch.equal(w["k_cache"], before)


def test_inputs_that_disagree_with_the_weights_are_refused():
    rotary = RotaryEmbedding(D, 64, 10000.0)
    w, meta = inputs(torch.bfloat16, True)
    with pytest.raises(ValueError, match="x"):  # fp32 activations for bf16 norms and caches
        fused({**w, "x": w["x"].float()}, meta, cpu_ops.EXACT_ISA, rotary)
    with pytest.raises(ValueError, match="qkv"):
        cpu_ops.attention_block_weights(w["norm_w"], 1e-6, w["qkv_w"][:-1], None, "avx2", None, None, 1e-6, rotary.cos,
                                        rotary.sin, w["k_cache"], w["v_cache"], w["o_w"], None, "avx2", H, 0.25)


def test_padding_block_inside_a_context_is_refused():
    rotary = RotaryEmbedding(D, 64, 10000.0)
    w, meta = inputs(torch.bfloat16, True)
    tables = meta["block_tables"].clone()
    tables[4, 1] = -1
    with pytest.raises(ValueError, match="block id"):
        fused(w, {**meta, "block_tables": tables}, cpu_ops.EXACT_ISA, rotary)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_engine_outputs_equal_without_fusion(fixture, dtype, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run():
        outs = LLM(path, dtype=dtype, kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    # Every linear on our kernel: the fused path needs it, and the unfused run must round as the fused one
    # does (on a CPU where torch's GEMM wins the tiny shapes the plan would send them there).
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    results = []
    real = Attention.fused_weights  # what both the per-layer and the all-layer (decoder_layers) fused paths take
    monkeypatch.setattr(Attention, "fused_weights", lambda *a: results.append(real(*a)) or results[-1])
    fused_out = run()
    assert any(r is not None for r in results)  # the decode steps went through a fused path
    monkeypatch.setattr(Attention, "fused_weights", lambda *a: None)
    assert run() == fused_out
