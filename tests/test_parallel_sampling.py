"""Parallel sampling (SamplingParams.n > 1): a request's prompt is computed once, its other children start from the
first one's KV with their own first draws (Scheduler.add_sibling), and each child's tokens are those of a lone
request seeded as that child is."""
import pytest
import torch

from deepinfer import LLM, SamplingParams, _C

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [3, 4]]


def sampled(seed, n=1, **kw):
    return SamplingParams(temperature=1.0, top_k=40, seed=seed, n=n, max_tokens=kw.pop("max_tokens", 8),
                          logprobs=2, ignore_eos=kw.pop("ignore_eos", True), **kw)


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_moe):
    return LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4)


def alone(llm, prompts, seeds, **kw):
    """[prompt][child] outputs of lone requests, child i seeded seed + i (what a child of n draws with)."""
    outs = llm.generate([p for p in prompts for _ in seeds], [sampled(s, **kw) for _ in prompts for s in seeds],
                        use_tqdm=False)
    return [[o.outputs[0] for o in outs[i:i + len(seeds)]] for i in range(0, len(outs), len(seeds))]


def prefill_tokens(llm, monkeypatch) -> list[int]:
    """Collects the token count of every prefill step the engine runs from now on."""
    counted, count = [], llm.engine._count_step

    def spy(batch):
        if batch.type == _C.StepType.PREFILL:
            counted.append(batch.num_tokens)
        count(batch)

    monkeypatch.setattr(llm.engine, "_count_step", spy)
    return counted


def same_completions(got, want):
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.stop_reason for c in got] == [c.stop_reason for c in want]
    for g, w in zip(got, want):
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]


def test_children_share_the_prompt_and_draw_as_lone_requests(qwen, monkeypatch):
    want = alone(qwen, PROMPTS, [11, 12, 13, 14])
    counted = prefill_tokens(qwen, monkeypatch)
    outs = qwen.generate(PROMPTS, sampled(11, n=4), use_tqdm=False)
    assert sum(counted) == sum(map(len, PROMPTS)), "each prompt is computed once for its four children"
    for out, ref in zip(outs, want):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        same_completions(out.outputs, ref)
    assert len({tuple(c.token_ids) for out in outs for c in out.outputs}) > len(PROMPTS)
    assert qwen.engine.scheduler.block_manager.num_free_blocks == qwen.engine.cache.num_blocks


def test_siblings_share_full_blocks_and_copy_the_partial_one(qwen):
    engine = qwen.engine
    free = engine.scheduler.block_manager.num_free_blocks
    engine.add_request("r", PROMPTS[1], sampled(5, n=3))  # 11 tokens: 2 full blocks of 4 and a partial one
    engine.step()
    seqs = [engine.scheduler.sequence(s) for s in engine.requests["r"].seq_ids]
    tables = [list(s.block_table) for s in seqs]
    assert len(seqs) == 3 and all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 3, "each child writes its own partial block"
    assert free - engine.scheduler.block_manager.num_free_blocks == 2 + 3
    assert len({s.state_slot for s in seqs}) == 3
    for pool in engine.cache.paged.values():
        for t in tables[1:]:
            assert torch.equal(pool[t[2]], pool[tables[0][2]])
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.block_manager.num_free_blocks == free


def test_siblings_without_room_recompute_and_draw_the_same(tiny_qwen3_moe, qwen, monkeypatch):
    """max_num_seqs 2: of four children two run, two wait and recompute prompt and first token, as evicted ones."""
    want = alone(qwen, PROMPTS[:1], [3, 4, 5, 6], max_tokens=6)
    small = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_num_seqs=2)
    counted = prefill_tokens(small, monkeypatch)
    out = small.generate(PROMPTS[:1], sampled(3, n=4, max_tokens=6), use_tqdm=False)[0]
    same_completions(out.outputs, want[0])
    assert sum(counted) == len(PROMPTS[0]) + 2 * (len(PROMPTS[0]) + 1)
    assert small.engine.scheduler.block_manager.num_free_blocks == small.engine.cache.num_blocks


def test_a_first_token_that_stops_ends_that_child_only(qwen):
    """Stop tokens at the first draw: child 0's ends it in process() while its siblings go on from its KV;
    child 2's ends child 2 at add_sibling, before it holds anything."""
    firsts = [c.token_ids[0] for c in alone(qwen, PROMPTS[:1], [21, 22, 23])[0]]
    assert len(set(firsts)) == 3, "the seeds are picked so the three first draws differ"
    stops = [firsts[0], firsts[2]]
    want = alone(qwen, PROMPTS[:1], [21, 22, 23], stop_token_ids=stops)[0]
    got = qwen.generate(PROMPTS[:1], sampled(21, n=3, stop_token_ids=stops), use_tqdm=False)[0].outputs
    same_completions(got, want)
    assert [len(c.token_ids) for c in got] == [1, 8, 1] and got[2].stop_reason == firsts[2]
    one = qwen.generate(PROMPTS[:1], sampled(21, n=3, max_tokens=1), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in one] == [[t] for t in firsts] and {c.finish_reason for c in one} == {"length"}
    assert qwen.engine.scheduler.block_manager.num_free_blocks == qwen.engine.cache.num_blocks


def test_add_sibling_needs_a_prompt_computed_in_the_step_being_processed(qwen):
    engine, sched = qwen.engine, qwen.engine.scheduler
    engine.add_request("d", PROMPTS[0], sampled(1))
    engine.step()
    seq_id = engine.requests["d"].seq_ids[0]
    with pytest.raises(ValueError, match=f"sequence {seq_id} has no prompt computed"):
        sched.add_sibling(seq_id, 10 ** 9, 7)
    engine.abort_request("d")
    assert sched.block_manager.num_free_blocks == engine.cache.num_blocks


def test_a_failed_first_draw_fails_that_child(qwen):
    engine, sched = qwen.engine, qwen.engine.scheduler
    sched.add_sequence(10 ** 9, PROMPTS[0], _C.SamplingLimits(4))
    batch = sched.schedule()
    out, copy = sched.add_sibling(10 ** 9, 10 ** 9 + 1, -1)
    assert out.finished and out.reason == _C.FinishReason.ERROR and not out.tokens and copy == (-1, -1, -1, -1)
    sched.process(batch, [9])
    sched.finish(10 ** 9, _C.FinishReason.ABORT)
    assert sched.block_manager.num_free_blocks == engine.cache.num_blocks and not sched.has_unfinished()


def test_a_prompt_whose_last_token_decodes_forks_there(tiny_qwen3_moe, qwen, monkeypatch):
    """A 3-token budget leaves a 7-token prompt's last token to a decode step: the siblings fork from that step
    (synchronous, though the engine schedules asynchronously), beside a decoding request."""
    want = alone(qwen, PROMPTS[:1], [8, 9, 10])
    other = qwen.generate(PROMPTS[2:], sampled(1, max_tokens=12), use_tqdm=False)[0].outputs
    llm = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_num_batched_tokens=3,
              async_scheduling=True)
    counted = prefill_tokens(llm, monkeypatch)
    outs = llm.generate(PROMPTS[:1] + PROMPTS[2:], [sampled(8, n=3), sampled(1, max_tokens=12)], use_tqdm=False)
    same_completions(outs[0].outputs, want[0])
    same_completions(outs[1].outputs, other)
    assert sum(counted) == len(PROMPTS[2]) + len(PROMPTS[0]) - 1
    assert llm.engine.num_steps["ahead"] > 0 and not llm.engine._parents


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp4"])
def test_deepseek_v4_siblings_copy_the_state_block(tmp_path, kv_cache_dtype):
    """V4: a sibling's StateBlock (sliding window, compressor and indexer state at the prompt's end) is its parent's,
    copied; the prompts end inside compression windows, and the completions cross more. fp4: the quantised pools'
    bytes and scales are copied as stored."""
    from test_deepseek_v4 import make_checkpoint, prompt_of

    make_checkpoint(tmp_path / "v4", seed=1)
    llm = LLM(str(tmp_path / "v4"), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8,
              kv_cache_dtype=kv_cache_dtype)
    prompts = [prompt_of(21, 51), prompt_of(6, 52)]
    want = alone(llm, prompts, [30, 31, 32], max_tokens=12)
    outs = llm.generate(prompts, sampled(30, n=3, max_tokens=12), use_tqdm=False)
    for out, ref in zip(outs, want):
        same_completions(out.outputs, ref)
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cache.num_blocks
