"""DeepSeek-V4 end to end through deepinfer.LLM against transformers' greedy generate (fp32, tiny random
checkpoints from test_deepseek_v4)."""
import pytest
import torch

from deepinfer import LLM, SamplingParams
from test_deepseek_v4 import hf_greedy, make_checkpoint, prompt_of


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, transformers' model) of a tiny random V4."""
    path = tmp_path_factory.mktemp("v4e2e") / "tiny"
    return str(path), make_checkpoint(path, seed=1)


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    path, hf = checkpoint
    prompts = [prompt_of(5, 31), prompt_of(37, 32), prompt_of(90, 33), prompt_of(19, 34), prompt_of(48, 35)]
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    return path, prompts, refs


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_llm_greedy_matches_transformers(ckpt):
    path, prompts, refs = ckpt
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8)
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs


def test_llm_preemption_and_recompute_match(ckpt):
    """Room for 2 sequences and a few blocks: decode must preempt and re-prefill V4 sequences into fresh
    blocks and stale state slots."""
    path, prompts, refs = ckpt
    probe = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2)
    spec = probe.engine.cache.spec
    memory = 2 * spec.bytes_per_state_block + 9 * spec.bytes_per_block  # 9 blocks of 16 tokens
    llm = LLM(path, dtype="float32", kv_cache_memory=memory, max_num_seqs=2, max_model_len=128)
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == refs


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp4", "fp4_all"])
def test_quantised_pools_hand_off_from_prompt_to_completion(ckpt, kv_cache_dtype):
    """A COMPLETION engine that imports PROMPT engines' quantised blocks and StateBlocks, bytes as stored,
    decodes the tokens a NORMAL engine with the same pools does."""
    path, prompts, _ = ckpt
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    normal = LLM(path, **kw).generate(prompts, greedy(24), use_tqdm=False)
    prefill = LLM(path, engine_type="prompt", **kw)
    prefill.generate(prompts, greedy(24), use_tqdm=False)
    decode = LLM(path, engine_type="completion", **kw)
    for handoff in prefill.engine.handoffs:
        assert decode.engine.import_handoff(handoff)
    done = {}
    while decode.engine.has_unfinished():
        done.update({out.request_id: out.outputs[0].token_ids for out in decode.engine.step()[0]})
    order = [h.request_id for h in prefill.engine.handoffs]
    assert [done[rid] for rid in order] == [normal[i].outputs[0].token_ids for i in range(len(prompts))]


def test_llm_fp4_kv_cache_runs_and_mostly_agrees(ckpt):
    path, prompts, refs = ckpt
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, kv_cache_dtype="fp4")
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    first = [o.outputs[0].token_ids[0] for o in outs]  # prefill logits: only the compressed KV is FP4
    assert sum(a == r[0] for a, r in zip(first, refs)) >= 4


def test_eplb_records_v4_routing_and_replanned_placement_keeps_tokens(ckpt):
    """V4's MoE (hash-routed layers included) goes through RoutedMoE: EPLB counts every routed token and
    a replan onto redundant slots moves weights without changing the greedy output."""
    path, prompts, refs = ckpt
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, enable_eplb=True,
              eplb_config={"window_size": 64, "num_redundant_experts": 2, "num_gpus": 2, "step_interval": 10 ** 6})
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    load = llm.get_expert_load()
    routed_tokens = sum(len(p) + 23 for p in prompts)  # the last token of each is never run
    assert load.shape[1:] == (4, 6) and int(load.sum()) == routed_tokens * 2 * 4  # top-2, 4 MoE layers
    eplb = llm.engine.eplb
    skew = torch.zeros(4, 6, dtype=torch.int64)
    skew[:, 1] = 1000
    eplb.recorder.buf[0] = skew
    eplb.recorder.end_step()
    eplb.replan()
    assert eplb.num_moved > 0 and (eplb.placement.logcnt[:, 1] > 1).all()
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs


def test_prompt_logprobs_match_transformers(checkpoint):
    """V4's prompt tokens scored through its compressed and sliding-window attention (prompts past one HCA window,
    chunked prefill of 16 tokens) equal transformers' log_softmax at each position: value, rank and the top 2."""
    path, hf = checkpoint
    prompts = [prompt_of(37, 41), prompt_of(6, 42)]
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, max_num_batched_tokens=16,
              max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row, token = ref[p - 1], ids[p]
            assert set(entry) == {token, *row.topk(2).indices.tolist()}
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == 1 + int((row > row[token]).sum())
