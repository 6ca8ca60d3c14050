"""Async scheduling (LLM(async_scheduling=True)): decode step N+1 is scheduled while step N runs, and N's outputs
are processed while N+1 runs. Everything a request gets must equal the synchronous engine's."""
import pytest

from deepinfer import LLM, SamplingParams
from tests.test_engine import prompts, small_block_bytes


def _llm(path, **kw):
    return LLM(path, dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", 16 << 20), block_size=4, **kw)


@pytest.fixture(scope="module")
def engines(tiny_qwen3_moe):
    return _llm(tiny_qwen3_moe), _llm(tiny_qwen3_moe, async_scheduling=True)


def _requests(sync):
    """Greedy rows of several lengths, seeded sampling with n=3 and logprobs, stop tokens, min_tokens and a stop
    string (its text taken from a first greedy run), so sequences end in flight for every reason."""
    base = sync.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    ps = prompts(6, seed=3) + [[5, 6, 7]] * 3
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9, 17)]
    params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=3, max_tokens=12, logprobs=2, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base.token_ids[4]]))
    params.append(SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base.token_ids[2]], min_tokens=4))
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[base.text[5:8]]))
    return ps, params


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in o.outputs] for o in outs]


def test_async_outputs_equal_sync_outputs(engines):
    sync, fast = engines
    ps, params = _requests(sync)
    ahead = fast.engine.num_steps["ahead"]
    ref = sync.generate(ps, params, use_tqdm=False)
    outs = fast.generate(ps, params, use_tqdm=False)
    assert _summary(outs) == _summary(ref)
    assert {c.finish_reason for o in outs for c in o.outputs} == {"length", "stop"}
    assert fast.engine.num_steps["ahead"] - ahead > 10, "decode steps were scheduled ahead"
    assert fast.engine.scheduler.block_manager.num_free_blocks == fast.engine.cache.num_blocks
    assert not fast.engine.seqs and not fast.engine.has_unfinished()


def test_async_with_a_tiny_pool_preempts_and_matches_sync(tiny_qwen3_moe, engines):
    """A pool of 24 blocks for 3 sequences: ahead steps give up for lack of blocks, decode evicts and recomputes,
    and blocks of sequences ending in flight return only after their last step: nothing may starve."""
    sync = engines[0]
    small = _llm(tiny_qwen3_moe, max_num_seqs=3, max_model_len=64, kv_cache_memory=24 * small_block_bytes(sync),
                 async_scheduling=True)
    ps = prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * (i % 3), ignore_eos=True) for i in range(12)]
    outs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.num_steps["ahead"] > 0
    assert _summary(outs) == _summary(sync.generate(ps, params, use_tqdm=False))
    assert small.engine.scheduler.block_manager.num_free_blocks == small.engine.cache.num_blocks


def test_a_failed_forward_in_flight_leaves_the_engine_usable(engines, monkeypatch):
    sync, fast = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    real, calls = fast.engine.runner.execute, []

    def failing(batch, sampling, *rest):
        calls.append(batch.num_seqs)
        if len(calls) == 6:
            raise RuntimeError("forward failed")
        return real(batch, sampling, *rest)
    monkeypatch.setattr(fast.engine.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="forward failed"):
        fast.generate(prompts(4), params, use_tqdm=False)
    assert not fast.engine.has_unfinished() and not fast.engine.seqs
    assert fast.engine.scheduler.block_manager.num_free_blocks == fast.engine.cache.num_blocks
    monkeypatch.setattr(fast.engine.runner, "execute", real)
    ref = sync.generate(prompts(4), params, use_tqdm=False)
    assert _summary(fast.generate(prompts(4), params, use_tqdm=False)) == _summary(ref)


def test_async_scheduling_refuses_speculative_decoding(tiny_qwen3_moe):
    with pytest.raises(ValueError, match="async_scheduling"):
        _llm(tiny_qwen3_moe, async_scheduling=True, speculative={"method": "ngram", "num_draft_tokens": 2})


def test_abort_request_while_its_step_is_in_flight(engines):
    sync, fast = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = fast.engine
    engine.add_request("keep", [5, 6, 7], params)
    engine.add_request("drop", [8, 9, 10, 11], params)
    finished = []
    for _ in range(4):  # a prefill, then decode steps: the next one is in flight after each
        finished += engine.step()[0]
    assert engine._flight is not None and not finished
    assert engine.abort_request("drop")
    while engine.has_unfinished():
        finished += engine.step()[0]
    assert [o.request_id for o in finished] == ["keep"]
    assert finished[0].outputs[0].token_ids == sync.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.scheduler.block_manager.num_free_blocks == engine.cache.num_blocks and not engine.seqs
