"""A decode step in one call (cpu_ops.decode_step, LlamaForCausalLM._decode_stack) against the embedding and the
per-layer fused halves it chains: the same bits, KV stores and expert counts, and errors that name the layer or
the row; with the final norm and LM head the bits of the unfused logits, and with greedy their argmax."""
import pytest
import torch
from test_attention_block import BLOCKS, BS, HIDDEN, H, D, inputs
from test_moe_block import make_block

from deepinfer import LLM, SamplingParams, _C
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.layers import cpu_ops, gemm_plan
from deepinfer.layers.rotary import RotaryEmbedding
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.qwen3_moe import SparseMoeBlock
from tests.conftest import make_qwen3_moe, our_kernel_path

LAYERS, EXPERTS, VOCAB = 3, 8, 50


def make_stack(isa, head=None):
    """LAYERS layers of bf16 weights and caches and an embedding -> (decoder_stack, [(attention weights, moe
    weights)] per layer, (the layers' tensors, the embedding): the tensors behind the stack's pointers, which the
    caller keeps alive, token ids, metadata)."""
    rotary = RotaryEmbedding(D, 64, 10000.0)
    halves, caches = [], []
    for seed in range(LAYERS):
        w, meta = inputs(torch.bfloat16, True, seed=seed)
        block, norm = make_block(torch.bfloat16, seed=seed, experts=EXPERTS)
        attn = cpu_ops.attention_block_weights(w["norm_w"], 1e-6, w["qkv_w"], None, isa, w["q_norm"], w["k_norm"],
                                               1e-6, rotary.cos, rotary.sin, w["k_cache"], w["v_cache"], w["o_w"], None,
                                               isa, H, D ** -0.5)
        moe = cpu_ops.moe_block_weights(norm.weight, norm.eps, block.gate.weight, block.top_k, True,
                                        block.experts.gate_up_proj, block.experts.down_proj, isa, [isa] * 4)
        halves.append((attn, moe))
        caches.append((w, block, norm, rotary))
    g = torch.Generator().manual_seed(9)
    embed = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    ids = torch.randint(0, VOCAB, (meta["positions"].shape[0],), generator=g)
    stack = cpu_ops.decoder_stack(embed, [(attn, moe, None) for attn, moe in halves], head)
    return stack, halves, (caches, embed), ids, meta


def chained(halves, embed, ids, meta, counts):
    """The per-layer fused halves over embed[ids]; counts [LAYERS, EXPERTS] added to row by row."""
    x = embed[ids]
    for (attn, moe), layer_counts in zip(halves, counts):
        a = cpu_ops.attention_block(x, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                                    meta["context_lens"], attn)
        x = cpu_ops.moe_block(x, a, moe, layer_counts)
    return x


def run(stack, ids, meta, counts=None):
    return cpu_ops.decode_step(stack, ids, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                               meta["context_lens"], counts)


@pytest.mark.parametrize("isa", [cpu_ops.EXACT_ISA, next(iter(cpu_ops.GEMM_ISAS))])
def test_one_call_is_bit_identical_to_the_halves_it_chains(isa):
    _, ref_halves, (ref_caches, embed), ids, meta = make_stack(isa)
    stack, _, (caches, _embed), _, _ = make_stack(isa)
    ref_counts, counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64), torch.zeros(LAYERS * EXPERTS, dtype=torch.int64)
    ref = chained(ref_halves, embed, ids, meta, ref_counts)
    ids_before = ids.clone()
    out = run(stack, ids, meta, counts)
    assert torch.equal(out, ref) and torch.equal(ids, ids_before)  # the input is not written
    for (w_ref, *_), (w, *_) in zip(ref_caches, caches):
        assert torch.equal(w["k_cache"], w_ref["k_cache"]) and torch.equal(w["v_cache"], w_ref["v_cache"])
    assert torch.equal(counts.view(LAYERS, EXPERTS), ref_counts)
    assert (ref_counts.sum(1) == ids.shape[0] * 2).all()  # top-2 counted per token in every layer


def lm_head(packed):
    """(decode_head_weights, norm_w, lm weight, isa): an 80-token LM head, packed in bf16 pairs when packed. The
    caller keeps norm_w and lm alive while the head is used."""
    isa = cpu_ops.PACKED_ISA if packed else cpu_ops.EXACT_ISA
    g = torch.Generator().manual_seed(5)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).bfloat16()
    lm = (0.2 * torch.randn(80, HIDDEN, generator=g)).bfloat16()
    if packed:
        cpu_ops.pack_in_place(lm)
    return cpu_ops.decode_head_weights(norm_w, 1e-6, lm, isa, packed=packed), norm_w, lm, isa


PACKED = [False] + ([True] if cpu_ops.PACKED_ISA else [])


@pytest.mark.parametrize("packed", PACKED)
def test_head_gives_the_bits_of_the_norm_and_lm_head(packed):
    """decode_step with a head: fp32 logits [T, vocab] equal to rms_norm then linear_bf16 (one rounding to bf16)
    over the layers' output, widened; the LM head packed in bf16 pairs where this CPU has a packed kernel."""
    head, norm_w, lm, isa = lm_head(packed)
    ref_stack, _, _ref_held, ids, meta = make_stack(isa)
    stack, _, _held, _, _ = make_stack(isa, head)
    hidden = run(ref_stack, ids, meta)
    ref = cpu_ops.linear_bf16(cpu_ops.rms_norm(hidden, norm_w, 1e-6), lm, isa=isa, packed=packed).float()
    logits = run(stack, ids, meta)
    assert logits.dtype == torch.float32 and logits.shape == (ids.shape[0], 80) and torch.equal(logits, ref)
    assert torch.equal(logits, logits.bfloat16().float()) and logits.std() > 0.1


def scheduler_with(lens: list[int]):
    """A real C++ Scheduler over BS-token blocks of a BLOCKS-block pool (make_stack's caches) holding waiting
    sequences of len(lens) - 1 prompt tokens each."""
    c = _C.SchedulerConfig()
    c.max_num_seqs, c.max_model_len, c.max_num_batched_tokens = len(lens), BS * BLOCKS, BS * BLOCKS
    c.block_size, c.num_blocks, c.num_state_slots, c.eos_token_ids = BS, BLOCKS, len(lens), []
    scheduler, g = _C.Scheduler(c), torch.Generator().manual_seed(3)
    for seq_id, n in enumerate(lens):
        prompt = torch.randint(0, VOCAB, (n - 1,), generator=g).tolist()
        scheduler.add_sequence(seq_id, prompt, _C.SamplingLimits(64, 0, True, []))
    return scheduler


def scheduled_decode(lens: list[int]):
    """(scheduler, a decode ScheduledBatch of its sequences at context lengths lens): scheduler_with(lens) after
    a prefill step that gave each sequence one token."""
    scheduler, g = scheduler_with(lens), torch.Generator().manual_seed(4)
    prefill = scheduler.schedule()
    scheduler.process(prefill, torch.randint(0, VOCAB, (len(lens),), generator=g).tolist())
    return scheduler, scheduler.schedule()


def batch_tensors(batch) -> tuple:
    """A scheduled decode batch's (token ids, decode_step metadata) as tensors: ModelRunner.prepare's, the engine's
    own conversion (it needs no model)."""
    ids, meta = ModelRunner(None, BS).prepare(batch)
    return ids, dict(positions=meta.positions, slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                     context_lens=meta.context_lens)


@pytest.mark.parametrize("packed", PACKED)
def test_draws_over_a_scheduled_batch_are_those_of_the_same_step(packed):
    """decode_drawn reads a scheduled decode batch's own arrays: its tokens are greedy_tokens of decode_step's
    logits over the same batch as tensors, with the same KV stores and expert counts, or with sampling the sample
    op's draw from those logits; -1 for a row made non-finite by its embedding, the other rows unchanged."""
    head, _norm_w, _lm, isa = lm_head(packed)  # the tensors behind the head's pointers, kept alive
    _scheduler, batch = scheduled_decode([2, 4, 5, 9, 12])
    ids, meta = batch_tensors(batch)
    assert batch.type == _C.StepType.DECODE and torch.equal(meta["context_lens"], torch.tensor([2, 4, 5, 9, 12]))
    ref_stack, _, (ref_caches, _ref_embed), _, _ = make_stack(isa, head)
    stack, _, (caches, _embed), _, _ = make_stack(isa, head)
    ref_counts, counts = (torch.zeros(LAYERS * EXPERTS, dtype=torch.int64) for _ in range(2))
    logits = run(ref_stack, ids, meta, ref_counts)
    tokens, none = cpu_ops.decode_drawn(stack, batch, None, counts)
    assert none is None and tokens.dtype == torch.int64 and (tokens >= 0).all()
    assert torch.equal(tokens, cpu_ops.greedy_tokens(logits))
    assert torch.equal(counts, ref_counts) and counts.sum() == LAYERS * 2 * ids.shape[0]
    for (w_ref, *_), (w, *_) in zip(ref_caches, caches):
        assert torch.equal(w["k_cache"], w_ref["k_cache"]) and torch.equal(w["v_cache"], w_ref["v_cache"])
    # temperature, top_k, top_p, min_p, seeds, offsets per row; the last row greedy
    sampling = ([2.0, 1.5, 3.0, 2.0, 0.0], [0, 5, 0, 0, 3], [1.0, 1.0, 0.9, 1.0, 1.0], [0.0, 0.0, 0.0, 0.01, 0.0],
                [7, 8, 9, 10, 11], [0, 3, 1, 4, 2])
    want = cpu_ops.sample(logits, *(torch.tensor(x) for x in sampling))
    sampled_stack, _, _sampled_held, _, _ = make_stack(isa, head)  # held: the tensors behind its pointers
    drawn, logprobs = cpu_ops.decode_drawn(sampled_stack, batch, sampling, None, 3)
    assert torch.equal(drawn, want) and not torch.equal(drawn, tokens)  # some draw is not the argmax
    for got, ref in zip(logprobs, cpu_ops.token_logprobs(logits, want, 3)):  # at the drawn tokens, from the raw logits
        assert torch.equal(got, ref)

    bad_stack, _, (_bad_caches, bad_embed), _, _ = make_stack(isa, head)
    bad_embed[ids[2]] = float("inf")  # row 2's hidden state, its norm and its logits turn NaN
    bad_ref, _, (_bad_ref_caches, bad_ref_embed), _, _ = make_stack(isa, head)
    bad_ref_embed[ids[2]] = float("inf")
    bad_logits, (bad_tokens, _) = run(bad_ref, ids, meta), cpu_ops.decode_drawn(bad_stack, batch)
    assert not bad_logits[2].isfinite().all() and bad_tokens[2] == -1
    rows = [t for t in range(ids.shape[0]) if ids[t] != ids[2]]
    assert rows and torch.equal(bad_tokens[rows], bad_logits[rows].argmax(-1))
    bad_sampled_stack, _, (_bad_sampled_caches, bad_sampled_embed), _, _ = make_stack(isa, head)
    bad_sampled_embed[ids[2]] = float("inf")
    bad_drawn, _ = cpu_ops.decode_drawn(bad_sampled_stack, batch, sampling)
    want = cpu_ops.sample(bad_logits[rows], *(torch.tensor(x)[rows] for x in sampling))
    assert bad_drawn[2] == -1 and torch.equal(bad_drawn[rows], want)


def test_stack_checks_and_errors_name_the_layer_or_row():
    stack, halves, _held, ids, meta = make_stack(cpu_ops.EXACT_ISA)
    with pytest.raises(IndexError, match="decode_step: layer 0: a position"):
        run(stack, ids, {**meta, "positions": torch.tensor([0, 3, 4, 8, 64])})
    with pytest.raises(IndexError, match=f"decode_step: input id {VOCAB} of row 1 is outside the embedding's"):
        run(stack, torch.tensor([3, VOCAB, 4, 5, 6]), meta)
    with pytest.raises(ValueError, match="counts"):
        run(stack, ids, meta, torch.zeros(LAYERS * EXPERTS - 1, dtype=torch.int64))
    _scheduler, batch = scheduled_decode([2, 4, 5, 9, 12])
    with pytest.raises(ValueError, match="drawn tokens need a stack with a head"):
        cpu_ops.decode_drawn(stack, batch)
    head, *_head_tensors = lm_head(False)
    head_stack, _, _head_held, _, _ = make_stack(cpu_ops.EXACT_ISA, head)
    with pytest.raises(ValueError, match="counts"):
        cpu_ops.decode_drawn(head_stack, batch, None, torch.zeros(LAYERS * EXPERTS + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="a decode step of one token per sequence"):
        cpu_ops.decode_drawn(head_stack, scheduler_with([3, 5]).schedule())  # a prefill
    with pytest.raises(ValueError, match="one value of each per row"):
        cpu_ops.decode_drawn(head_stack, batch, ([1.0] * 4, [0] * 5, [1.0] * 5, [0.0] * 5, [0] * 5, [0] * 5))
    with pytest.raises(ValueError, match="num_logprobs must be -1 \\(none\\) or 0..80 \\(the vocabulary\\), got 81"):
        cpu_ops.decode_drawn(head_stack, batch, None, None, 81)
    embed = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
    bad = [(attn, moe, None) for attn, moe in halves]
    bad[2] = (*bad[2][:2], torch.arange(EXPERTS) + EXPERTS)  # maps every expert past the physical slots
    with pytest.raises(ValueError, match="decode_step: layer 2: log2phy"):
        run(cpu_ops.decoder_stack(embed, bad), ids, meta)
    with pytest.raises(ValueError, match="log2phy"):
        cpu_ops.decoder_stack(embed, [(*halves[0], torch.arange(EXPERTS - 1))])
    with pytest.raises(ValueError, match="embed"):
        cpu_ops.decoder_stack(embed.float(), [(*halves[0], None)])
    block, norm = make_block(torch.float32)
    mixed = cpu_ops.moe_block_weights(norm.weight, 1e-6, block.gate.weight, 2, True, block.experts.gate_up_proj,
                                      block.experts.down_proj, cpu_ops.EXACT_ISA, [cpu_ops.EXACT_ISA])
    with pytest.raises(ValueError, match="one activation dtype"):  # an fp32 MoE half after a bf16 attention half
        cpu_ops.decoder_stack(embed, [(halves[0][0], mixed, None)])


@pytest.mark.parametrize("tied", [False, True])
def test_engine_decode_steps_take_the_head_and_draw_greedy_tokens_in_the_call(tmp_path, monkeypatch, tied):
    """Decode steps run in one call with the head (an untied, packed LM head, and one tied to the embeddings):
    decode_drawn on the scheduled batch, which draws the greedy tokens and their logprobs itself. Tokens and logprobs
    equal those of the head-less call followed by compute_logits and the sampler."""
    path = make_qwen3_moe(str(tmp_path / "m"), tie_word_embeddings=tied)
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    calls, real, real_greedy = [], cpu_ops.decode_step, cpu_ops.decode_drawn
    monkeypatch.setattr(cpu_ops, "decode_step",
                        lambda stack, *a: calls.append((stack[2] is not None, False)) or real(stack, *a))
    monkeypatch.setattr(cpu_ops, "decode_drawn",
                        lambda stack, *a: calls.append((stack[2] is not None, True)) or real_greedy(stack, *a))

    def generate(logprobs):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=logprobs)
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_scheduler_steps=1)  # a Python call per step
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    fused, drawn = generate(3), generate(None)
    assert calls == [(True, True)] * 14  # every decode step after the prefill's first token
    monkeypatch.setattr(LlamaForCausalLM, "_check_fused_head", lambda self, x: None)
    calls.clear()
    unfused, sampled = generate(3), generate(None)
    assert calls == [(False, False)] * 14 and fused == unfused and drawn == sampled
    assert [tokens for tokens, _ in drawn] == [tokens for tokens, _ in fused]


def test_engine_takes_one_call_per_decode_step_with_unchanged_outputs(tiny_qwen3_moe, monkeypatch):
    """bf16 greedy tokens, logprobs and EPLB counts through the one-call decode step equal the per-layer path's."""
    prompts = [[5, 6, 7, 8, 9], [12, 13], [40, 41, 42, 43, 44, 45, 46, 47]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    # Every linear on our kernel, as test_attention_block's engine test does: the fused halves need it.
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)

    def generate():
        llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20, num_scheduler_steps=1)  # a call a step
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.eplb.recorder.total()

    calls = []
    real = cpu_ops.decode_drawn
    monkeypatch.setattr(cpu_ops, "decode_drawn", lambda *a: calls.append(1) or real(*a))
    stacked, stacked_load = generate()
    assert len(calls) == 9  # every decode step after the prefill's first token, drawn with its logprobs
    monkeypatch.setattr(LlamaForCausalLM, "_decode_stack", lambda self, rows, head: None)
    per_layer, load = generate()
    assert stacked == per_layer and torch.equal(stacked_load, load) and stacked_load.sum() > 0
    monkeypatch.setattr(SparseMoeBlock, "fused_weights", lambda self, x, a, norm: None)
    torch_moe, _ = generate()
    assert [tokens for tokens, _ in torch_moe] == [tokens for tokens, _ in stacked]  # the torch MoE path


def test_layers_are_checked_once_per_input_kind_until_weights_change(tiny_qwen3_moe, monkeypatch):
    """The model checks its layers once per decode rows bucket and expert placement, not every step (and never for
    a prefill); weights_changed() and a new EPLB placement make it check again, so a layer that can no longer run
    fused leaves the one-call decode step."""
    from eplb.placement import ExpertPlacement

    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20, num_scheduler_steps=1)  # a call a step
    checks, calls = [], []
    check, real, real_greedy = LlamaForCausalLM._check_decode_stack, cpu_ops.decode_step, cpu_ops.decode_drawn
    monkeypatch.setattr(LlamaForCausalLM, "_check_decode_stack",
                        lambda self, rows: checks.append(rows) or check(self, rows))
    monkeypatch.setattr(cpu_ops, "decode_step", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_ops, "decode_drawn", lambda *a: calls.append(1) or real_greedy(*a))

    def generate():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        return out, len(checks), len(calls)

    tokens, n_checks, n_calls = generate()
    assert (n_checks, n_calls) == (1, 5) and checks == [1]  # one decode row bucket
    assert generate() == (tokens, 1, 10)
    eplb = llm.engine.eplb
    eplb.placement = ExpertPlacement(eplb.placement.phy2log, eplb.placement.num_gpus, eplb.placement.num_experts)
    assert generate() == (tokens, 2, 15)
    monkeypatch.setattr(SparseMoeBlock, "fused_weights", lambda self, x, a, norm: None)
    assert generate() == (tokens, 2, 20)  # still the checked layers: nothing said the weights changed
    llm.engine.model.weights_changed()
    assert generate() == (tokens, 3, 20)  # checked again: the MoE half cannot run fused, so no one-call step
