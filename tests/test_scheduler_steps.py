"""LLM(num_scheduler_steps=k): decode steps, greedy or sampled, run back to back in one C++ call
(csrc/engine/decode_loop.h). The same tokens, finish reasons, preemptions, step counts and expert load as one
step per call; fewer calls; logprobs computed there too; requests that need Python per step (stop strings) and
arrivals mid-run fall back to it."""
import dataclasses

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import DEFAULT_SCHEDULER_STEPS
from deepinfer.layers import cpu_ops, gemm_plan
from tests.conftest import assert_logprobs_alike, our_expert_paths, our_kernel_path


@pytest.fixture
def kernels(monkeypatch):
    """Every linear and expert on our kernels, as the one-call decode step needs (a loaded host's timed plan could
    pick torch for a tiny shape); counts the one-call steps: [(kind, max_steps)], kind "one" (one step, greedy or
    sampled), "loop" (greedy run) or "sampled loop"."""
    monkeypatch.setattr(gemm_plan.PLAN, "linear_path", our_kernel_path)
    monkeypatch.setattr(gemm_plan.PLAN, "expert_paths", our_expert_paths)
    calls, one, steps = [], cpu_ops.decode_drawn, cpu_ops.decode_steps
    monkeypatch.setattr(cpu_ops, "decode_drawn", lambda *a: calls.append(("one", 1)) or one(*a))
    monkeypatch.setattr(cpu_ops, "decode_steps",
                        lambda *a: calls.append(("loop" if a[4] is None else "sampled loop", a[3])) or steps(*a))
    return calls


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 200, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(path: str, k: int, **kw) -> LLM:
    return LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, block_size=4, num_scheduler_steps=k, **kw)


def summary(llm: LLM, outs) -> tuple:
    """What must not depend on num_scheduler_steps."""
    e = llm.engine
    return ([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
              o.metrics.num_preemptions) for o in outs],
            e.num_steps["decode"], e.num_steps["prefill"], e.eplb.recorder.total().tolist())


def mixed_params(n: int) -> list[SamplingParams]:
    """Lengths that end sequences at different steps of a run, EOS allowed for some, a stop token for one."""
    return [SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=i % 2 == 0,
                           stop_token_ids=[17] if i == 1 else None) for i in range(n)]


def sampled_params(n: int, **extra) -> list[SamplingParams]:
    """mixed_params drawn with each of the sampler's filters (seeded, and one from the engine's seed), and one
    greedy row among them; `extra` for each."""
    filters = [dict(temperature=0.8, seed=5), dict(temperature=1.2, top_k=7, seed=6), dict(temperature=0),
               dict(temperature=0.9, top_p=0.8), dict(temperature=0.7, min_p=0.1, top_k=20, top_p=0.9, seed=8)]
    return [SamplingParams(max_tokens=p.max_tokens, ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids,
                           **filters[i % len(filters)], **extra) for i, p in enumerate(mixed_params(n))]


@pytest.mark.parametrize("params, loop", [(mixed_params, "loop"), (sampled_params, "sampled loop")])
def test_back_to_back_steps_equal_one_step_per_call(tiny_qwen3_moe, kernels, params, loop):
    ps = prompts(5)
    ref_llm = engine(tiny_qwen3_moe, 1)
    ref = summary(ref_llm, ref_llm.generate(ps, params(5), use_tqdm=False))
    assert {kind for kind, _ in kernels} == {"one"} and len(kernels) == ref[1]  # one step per call
    kernels.clear()
    llm = engine(tiny_qwen3_moe, 8)
    assert summary(llm, llm.generate(ps, params(5), use_tqdm=False)) == ref
    assert {kind for kind, _ in kernels} == {loop} and len(kernels) < ref[1] / 3  # decode steps run 8 at a time
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cache.num_blocks


def python_sampler(llm: LLM) -> LLM:
    """llm drawing every step through the Python sampler from logits the runner returns (no one-call draws)."""
    llm.engine.runner._drawn = llm.engine.runner._steps = None
    return llm


def torch_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple:
    """cpu_ops.token_logprobs by torch's log_softmax and topk: the reference."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    top = logp.topk(n, dim=-1)
    return chosen, 1 + (logp > chosen[:, None]).sum(-1), top.indices, top.values


def test_one_call_draws_equal_the_python_samplers(tiny_qwen3_moe, kernels):
    """A sampled decode step drawn in its C++ call draws the tokens the Python sampler draws from the step's
    logits."""
    ps = prompts(5)
    drawn = [o.outputs[0].token_ids for o in engine(tiny_qwen3_moe, 1).generate(ps, sampled_params(5), use_tqdm=False)]
    assert kernels and {kind for kind, _ in kernels} == {"one"}
    kernels.clear()
    sampled = [o.outputs[0].token_ids
               for o in python_sampler(engine(tiny_qwen3_moe, 1)).generate(ps, sampled_params(5), use_tqdm=False)]
    assert sampled == drawn and not kernels


@pytest.mark.parametrize("k, kind", [(1, "one"), (8, "sampled loop")])
def test_logprobs_in_the_c_calls_equal_torchs(tiny_qwen3_moe, kernels, monkeypatch, k, kind):
    """Requests asking for logprobs (3 top ones, or only the drawn token's for some) decode in the C++ calls too, one
    step or runs of 8, with the tokens of the Python sampler and the logprobs and ranks torch's log_softmax gives
    from its logits (to float rounding of the log-sum)."""
    ps = prompts(5)
    params = [dataclasses.replace(p, logprobs=3 if i % 2 else 0) for i, p in enumerate(sampled_params(5))]
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "token_logprobs", torch_token_logprobs)
        ref = python_sampler(engine(tiny_qwen3_moe, 1)).generate(ps, params, use_tqdm=False)
    assert not kernels
    outs = engine(tiny_qwen3_moe, k).generate(ps, params, use_tqdm=False)
    assert {kind for kind, _ in kernels} == {kind}
    for got, want in zip(outs, ref):
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        assert_logprobs_alike(a.logprobs, b.logprobs, 1e-5)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preemption_and_arrivals_stop_a_run(tiny_qwen3_moe, kernels, temperature):
    """A tiny pool: decode steps evict sequences (they wait for a recompute), and a request added mid-run
    waits for a prefill: both end a run early, with the same tokens and preemption counts as one step per call
    (sampled: each draw's offset counts the tokens its sequence made before the preemption too)."""
    ps = prompts(6)
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=4, max_tokens=20, ignore_eos=True)

    block_bytes = engine(tiny_qwen3_moe, 1).engine.cache.spec.bytes_per_block

    def run(k: int) -> tuple:
        # 3 sequences at most, a pool of 18 blocks x 4 tokens: decode steps must evict.
        llm = LLM(tiny_qwen3_moe, dtype="bfloat16", max_num_seqs=3, max_model_len=64, block_size=4,
                  kv_cache_memory=18 * block_bytes, num_scheduler_steps=k)
        e, outs = llm.engine, {}
        for i, ids in enumerate(ps[:5]):
            e.add_request(str(i), ids, params)
        for n in range(300):
            if n == 6:
                e.add_request("5", ps[5], params)
            outs.update({o.request_id: o for o in e.step()[0]})
            if not e.has_unfinished():
                break
        return [(r, outs[r].outputs[0].token_ids, outs[r].metrics.num_preemptions) for r in sorted(outs)], \
            e.scheduler.num_preemptions, e.num_steps["decode"]

    ref = run(1)
    kernels.clear()
    assert run(8) == ref and ref[1] > 0 and len(ref[0]) == 6
    assert ("loop" if temperature == 0 else "sampled loop", 8) in kernels


def test_requests_that_need_python_per_step_run_one_step_per_call(tiny_qwen3_moe, kernels):
    """Stop strings and logprobs need each step's tokens in Python: while such a request runs every step takes one
    call (its first 3 decode steps here), after it ends the other two run back to back; the tokens are those of
    one step per call. (A sampled request alone does not: test_back_to_back_steps_equal_one_step_per_call.)"""
    ps = prompts(3)
    for special, one_calls in ((SamplingParams(temperature=0, max_tokens=4, stop=["zz"]), 3),  # decode_drawn
                               (SamplingParams(temperature=0.8, seed=3, max_tokens=4, stop=["zz"]), 3),
                               (SamplingParams(temperature=0, max_tokens=4, logprobs=1), 0)):  # decode_step, sampler
        params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), special,
                  SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
        ref_llm, llm = engine(tiny_qwen3_moe, 1), engine(tiny_qwen3_moe, 8)
        ref = [o.outputs[0].token_ids for o in ref_llm.generate(ps, params, use_tqdm=False)]
        kernels.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)] == ref
        assert kernels[:one_calls] == [("one", 1)] * one_calls and kernels[one_calls][0] == "loop"
        assert all(kind == "loop" for kind, _ in kernels[one_calls:])


def test_runs_end_at_the_step_that_replans_the_experts(tiny_qwen3_moe, kernels):
    """With EPLB replanning every 5 steps a run never crosses a replan (it moves weights between steps): the
    same placements, expert load and tokens as one step per call."""
    def run(k: int) -> tuple:
        llm = engine(tiny_qwen3_moe, k, enable_eplb=True, eplb_config={"step_interval": 5, "window_size": 50})
        outs = llm.generate(prompts(2), SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                            use_tqdm=False)
        eplb = llm.engine.eplb
        return summary(llm, outs), eplb.placement.phy2log.tolist(), eplb.recorder.steps

    ref = run(1)
    kernels.clear()
    assert run(8) == ref
    assert [n for kind, n in kernels if kind == "loop"] and all(n <= 5 for _, n in kernels)


def test_num_scheduler_steps_is_checked(tiny_qwen3_moe):
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            engine(tiny_qwen3_moe, bad)
    with pytest.raises(ValueError, match="num_scheduler_steps > 1"):
        engine(tiny_qwen3_moe, 4, async_scheduling=True)


def test_default_runs_back_to_back_unless_speculating_or_async(tiny_qwen3_moe, kernels):
    """What the benchmarks measure is LLM's default: DEFAULT_SCHEDULER_STEPS decode steps per call; one per call
    where more are refused (speculative=..., async_scheduling=True)."""
    default = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20, block_size=4)
    assert default.engine.config.num_scheduler_steps == DEFAULT_SCHEDULER_STEPS > 1
    default.generate(prompts(2), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert ("loop", DEFAULT_SCHEDULER_STEPS) in kernels
    for kw in (dict(async_scheduling=True), dict(speculative={"method": "ngram", "num_draft_tokens": 2})):
        llm = LLM(tiny_qwen3_moe, dtype="bfloat16", kv_cache_memory=16 << 20, **kw)
        assert llm.engine.config.num_scheduler_steps == 1


def test_the_sweeps_step_timer_counts_a_run_as_forward(tiny_qwen3_moe, kernels):
    """examples/sweep/step_timer.py: an engine step that ran 8 decode steps in one call books the call as forward
    (it was booked as output processing before the timer wrapped it)."""
    from examples.sweep.step_timer import StepTimer

    e = engine(tiny_qwen3_moe, 8).engine
    e.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    with StepTimer(e) as timer:
        timer.step()  # the prefill
        before = e.num_steps["decode"]
        _, batch, split = timer.step()
        ran = timer.acc["decode_steps"]
    assert e.num_steps["decode"] - before == 8 and kernels[-1] == ("loop", 8) and batch.num_seqs == 1
    assert ran > 0 and split["forward"] == pytest.approx(ran)
