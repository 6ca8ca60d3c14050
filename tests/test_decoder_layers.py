"""Every decoder layer at decode in one call (cpu_ops.decoder_layers, LlamaForCausalLM._fused_layers) against
the per-layer fused halves it chains: the same bits, KV stores and expert counts, and errors that name the layer;
with the final norm and LM head (LlamaForCausalLM._fused_head) the bits of the unfused logits."""
import pytest
import torch
from test_attention_block import HIDDEN, H, D, inputs
from test_moe_block import make_block

from deepinfer import LLM, SamplingParams
from deepinfer.layers import cpu_ops, gemm_plan
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.qwen3_moe import SparseMoeBlock
from tests.conftest import make_qwen3_moe, our_kernel_path

LAYERS, EXPERTS = 3, 8


def make_layers(isa):
    """LAYERS layers of bf16 weights and caches -> ([(attention weights, moe weights, counts, None)], the tensors
    behind the weights' pointers (to be kept alive), x, metadata)."""
    rotary = RotaryEmbedding(D, 64, 10000.0)
    layers, caches = [], []
    for seed in range(LAYERS):
        w, meta = inputs(torch.bfloat16, True, seed=seed)
        block, norm = make_block(torch.bfloat16, seed=seed, experts=EXPERTS)
        attn = cpu_ops.attention_block_weights(w["norm_w"], 1e-6, w["qkv_w"], None, isa, w["q_norm"], w["k_norm"],
                                               1e-6, rotary.cos, rotary.sin, w["k_cache"], w["v_cache"], w["o_w"], None,
                                               isa, H, D ** -0.5)
        moe = cpu_ops.moe_block_weights(norm.weight, norm.eps, block.gate.weight, block.top_k, True,
                                        block.experts.gate_up_proj, block.experts.down_proj, isa, [isa] * 4)
        layers.append((attn, moe, torch.zeros(EXPERTS, dtype=torch.int64), None))
        caches.append((w, block, norm, rotary))
    return layers, caches, w["x"], meta


def chained(layers, x, meta):
    for attn, moe, counts, log2phy in layers:
        a = cpu_ops.attention_block(x, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                                    meta["context_lens"], attn)
        x = cpu_ops.moe_block(x, a, moe, counts, log2phy)
    return x


def run(layers, x, meta):
    return cpu_ops.decoder_layers(x, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                                  meta["context_lens"], layers)


@pytest.mark.parametrize("isa", [cpu_ops.EXACT_ISA, next(iter(cpu_ops.GEMM_ISAS))])
def test_one_call_is_bit_identical_to_the_halves_it_chains(isa):
    ref_layers, ref_caches, x, meta = make_layers(isa)
    layers, caches, _, _ = make_layers(isa)
    ref = chained(ref_layers, x, meta)
    x_before = x.clone()
    out = run(layers, x, meta)
    assert torch.equal(out, ref) and torch.equal(x, x_before)  # the input is not written
    for (w_ref, *_), (w, *_), ref_layer, layer in zip(ref_caches, caches, ref_layers, layers):
        assert torch.equal(w["k_cache"], w_ref["k_cache"]) and torch.equal(w["v_cache"], w_ref["v_cache"])
        assert torch.equal(layer[2], ref_layer[2]) and layer[2].sum() == x.shape[0] * 2  # top-2 counted per token


@pytest.mark.parametrize("packed", [False] + ([True] if cpu_ops.PACKED_ISA else []))
def test_head_gives_the_bits_of_the_norm_and_lm_head_after_the_layers(packed):
    """decoder_layers with a head: fp32 logits [T, vocab] equal to rms_norm then linear_bf16 (one rounding to bf16)
    over the layers' output, widened; the LM head packed in bf16 pairs where this CPU has a packed kernel."""
    isa = cpu_ops.PACKED_ISA if packed else cpu_ops.EXACT_ISA
    g = torch.Generator().manual_seed(5)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).bfloat16()
    lm = (0.2 * torch.randn(80, HIDDEN, generator=g)).bfloat16()
    if packed:
        cpu_ops.pack_in_place(lm)
    head = cpu_ops.decode_head_weights(norm_w, 1e-6, lm, isa, packed=packed)
    ref_layers, ref_caches, x, meta = make_layers(isa)
    layers, caches, _, _ = make_layers(isa)
    hidden = run(ref_layers, x, meta)
    ref = cpu_ops.linear_bf16(cpu_ops.rms_norm(hidden, norm_w, 1e-6), lm, isa=isa, packed=packed).float()
    logits = cpu_ops.decoder_layers(x, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                                    meta["context_lens"], layers, head)
    assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], 80) and torch.equal(logits, ref)
    assert torch.equal(logits, logits.bfloat16().float()) and logits.std() > 0.1  # bf16 values, not constant
    fp32_head = cpu_ops.decode_head_weights(norm_w.float(), 1e-6, lm, isa, packed=packed)
    with pytest.raises(ValueError, match="the head must share one activation dtype"):
        cpu_ops.decoder_layers(x, meta["positions"], meta["slot_mapping"], meta["block_tables"], meta["context_lens"],
                               layers, fp32_head)
    with pytest.raises(ValueError, match="does not take norm_w"):
        cpu_ops.decode_head_weights(norm_w[:32], 1e-6, lm, isa, packed=packed)


@pytest.mark.parametrize("tied", [False, True])
def test_engine_decode_logits_come_from_the_head_with_unchanged_outputs(tmp_path, monkeypatch, tied):
    """Every decode step's logits come from decoder_layers' head; greedy tokens and logprobs equal those of the
    layers' call followed by compute_logits (an untied, packed LM head, and one tied to the embeddings)."""
    path = make_qwen3_moe(str(tmp_path / "m"), tie_word_embeddings=tied)
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def generate():
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    heads = []
    real = cpu_ops.decoder_layers
    monkeypatch.setattr(cpu_ops, "decoder_layers", lambda *a: heads.append(len(a) > 6 and a[6] is not None) or real(*a))
    fused = generate()
    assert len(heads) == 7 and all(heads)  # every decode step after the prefill's first token
    monkeypatch.setattr(LlamaForCausalLM, "_fused_head", lambda self, x: None)
    heads.clear()
    unfused = generate()
    assert len(heads) == 7 and not any(heads) and fused == unfused


def test_errors_name_the_layer():
    layers, caches, x, meta = make_layers(cpu_ops.EXACT_ISA)
    with pytest.raises(IndexError, match="decoder_layers: layer 0: a position"):
        run(layers, x, {**meta, "positions": torch.tensor([0, 3, 4, 8, 64])})
    bad = list(layers)
    bad[2] = (*bad[2][:3], torch.arange(EXPERTS) + EXPERTS)  # maps every expert past the physical slots
    with pytest.raises(ValueError, match="decoder_layers: layer 2: log2phy"):
        run(bad, x, meta)
    with pytest.raises(ValueError, match="counts"):
        run([(*layers[0][:2], torch.zeros(EXPERTS - 1, dtype=torch.int64), None)], x, meta)
    block, norm = make_block(torch.float32)
    mixed = cpu_ops.moe_block_weights(norm.weight, 1e-6, block.gate.weight, 2, True, block.experts.gate_up_proj,
                                      block.experts.down_proj, cpu_ops.EXACT_ISA, [cpu_ops.EXACT_ISA])
    with pytest.raises(ValueError, match="one activation dtype"):  # an fp32 MoE half after a bf16 attention half
        run([(layers[0][0], mixed, None, None)], x, meta)


def test_engine_takes_one_call_per_decode_step_with_unchanged_outputs(tiny_qwen3_moe, monkeypatch):
    """bf16 greedy tokens, logprobs and EPLB counts through decoder_layers equal the per-layer path's."""
    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    # Every linear on our kernel, as test_attention_block's engine test does: the fused halves need it.
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)

    def generate():
        llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.eplb.recorder.total()

    calls = []
    real = cpu_ops.decoder_layers
    monkeypatch.setattr(cpu_ops, "decoder_layers", lambda *a: calls.append(1) or real(*a))
    stacked, stacked_load = generate()
    assert len(calls) == 9  # every decode step after the prefill's first token
    monkeypatch.setattr(LlamaForCausalLM, "_fused_layers", lambda self, x, meta: None)
    per_layer, load = generate()
    assert stacked == per_layer and torch.equal(stacked_load, load)
    monkeypatch.setattr(SparseMoeBlock, "fused_weights", lambda self, x, a, norm: None)
    torch_moe, _ = generate()
    assert [tokens for tokens, _ in torch_moe] == [tokens for tokens, _ in stacked]  # the torch MoE path


def test_layers_are_checked_once_per_input_kind_until_weights_change(tiny_qwen3_moe, monkeypatch):
    """The model checks its layers once per (rows bucket, decode or not) and expert placement, not every step;
    weights_changed() and a new EPLB placement make it check again, so a layer that can no longer run fused
    leaves decoder_layers."""
    from eplb.placement import ExpertPlacement

    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20)
    checks, calls = [], []
    check, real = LlamaForCausalLM._check_fused_layers, cpu_ops.decoder_layers
    monkeypatch.setattr(LlamaForCausalLM, "_check_fused_layers",
                        lambda self, x, meta: checks.append(meta.max_query_len) or check(self, x, meta))
    monkeypatch.setattr(cpu_ops, "decoder_layers", lambda *a: calls.append(1) or real(*a))

    def generate():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        return out, len(checks), len(calls)

    tokens, n_checks, n_calls = generate()
    assert (n_checks, n_calls) == (2, 5) and checks == [3, 1]  # the prefill's kind, then one decode kind
    assert generate() == (tokens, 2, 10)
    eplb = llm.engine.eplb
    eplb.placement = ExpertPlacement(eplb.placement.phy2log, eplb.placement.num_gpus, eplb.placement.num_experts)
    assert generate() == (tokens, 4, 15)
    monkeypatch.setattr(SparseMoeBlock, "fused_weights", lambda self, x, a, norm: None)
    assert generate() == (tokens, 4, 20)  # still the checked layers: nothing said the weights changed
    llm.engine.model.weights_changed()
    assert generate() == (tokens, 6, 20)  # checked again: the MoE half cannot run fused, so no decoder_layers
