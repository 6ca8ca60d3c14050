"""Data-parallel attention + expert-parallel MoE over Ray: greedy parity with one process, uneven
work, the step-type vote, the decode balancer, the zmq channel, shutdown and rank faults."""
import gc
import os
import signal
import threading
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.dp import DECODE, PREFILL, DecodeBalancer, StepVote
from tests.conftest import assert_logprobs_alike

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(dtype="float32", kv_cache_memory=16 << 20, block_size=4, num_threads=1)


def prompts(n, seed=0, lo=2, hi=30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alive(pids) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]


def _state(pid) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def wait_gone(pids, timeout=15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


@pytest.fixture(scope="module")
def dp2(tiny_qwen3_moe, ray_local):
    llm = LLM(tiny_qwen3_moe, data_parallel_size=2, **SMALL)
    yield llm
    llm.engine.shutdown()


# ----------------------------------------------------------------------------------------------------
# end to end


def test_greedy_dp2_matches_dp1(tiny_qwen3_moe, dp2):
    ps = prompts(10)
    ref = LLM(tiny_qwen3_moe, **SMALL).generate(ps, GREEDY, use_tqdm=False)
    outs = dp2.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.request_id for o in outs] == [str(i) for i in range(10)]
    stats = dp2.engine.last_stats
    assert len(stats) == 2 and all(s["prefill_steps"] + s["decode_steps"] > 0 for s in stats)
    assert all(s["steps"] == stats[0]["steps"] for s in stats), "ranks must step in lockstep"
    assert all(s["a2a_bytes"] > 0 for s in stats), "MoE tokens must cross ranks"
    # The balancer split 10 requests 5/5 (equal count, near-equal KV length).
    assert sum(s["tokens"] > 0 for s in stats) == 2


def test_prompt_logprobs_dp2_match_dp1(tiny_qwen3_moe, dp2):
    """Each rank scores the prompts it prefills; the front hands RequestOutput.prompt_logprobs through."""
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    ref = LLM(tiny_qwen3_moe, **SMALL).generate(ps, params, use_tqdm=False)
    outs = dp2.generate(ps, params, use_tqdm=False)
    for got, want in zip(outs, ref):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert_logprobs_alike(got.prompt_logprobs, want.prompt_logprobs, 1e-4)


def test_sampled_dp2_matches_dp1(tiny_qwen3_moe, dp2):
    """A sampled token depends on the sequence's seed and position only, not on the rank or the batch it
    runs in: seeded and unseeded requests on 2 ranks equal one engine's (same engine seed, request ids)."""
    ps = prompts(6, seed=5)
    params = [SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=None if i % 2 else i)
              for i in range(len(ps))]
    one = LLM(tiny_qwen3_moe, **SMALL)
    one._request_counter = dp2._request_counter  # the same request ids: dp2 served earlier tests
    ref = one.generate(ps, params, use_tqdm=False)
    outs = dp2.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_expert_load_is_summed_over_ranks(dp2, tmp_path):
    dp2.generate(prompts(4, seed=9), GREEDY, use_tqdm=False)
    load = dp2.get_expert_load()
    assert load.shape[1:] == (2, 8) and int(load.sum()) > 0
    # every step of the window saw the same number of routed (token, k) pairs in both layers
    assert torch.equal(load[:, 0].sum(-1), load[:, 1].sum(-1))
    dp2.dump_expert_load(str(tmp_path / "load.npz"))
    import numpy as np

    assert np.load(tmp_path / "load.npz")["load"].shape == tuple(load.shape)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp4_all"])
def test_deepseek_v4_greedy_dp2_matches_dp1(tmp_path, ray_local, kv_cache_dtype):
    """DeepSeek-V4's routed MoE goes expert-parallel through the same RoutedMoE hook (3 of 6 experts per
    rank), hash-routed layers included; the quantised pools (FP4 entries, NVFP4 ring) live on each rank."""
    import ray

    pytest.importorskip("transformers").DeepseekV4ForCausalLM  # noqa: B018
    from test_deepseek_v4 import make_checkpoint, prompt_of

    make_checkpoint(tmp_path, seed=1)
    ps = [prompt_of(5, 31), prompt_of(37, 32), prompt_of(19, 34), prompt_of(48, 35)]
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, num_threads=1, kv_cache_dtype=kv_cache_dtype)
    ref = LLM(str(tmp_path), **kw).generate(ps, GREEDY, use_tqdm=False)
    llm = LLM(str(tmp_path), data_parallel_size=2, **kw)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    layers = ray.get([a.num_ep_layers.remote() for a in llm.engine.actors])
    stats = llm.engine.last_stats
    llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert layers == [4, 4] and all(s["a2a_bytes"] > 0 for s in stats)


def test_ranks_hold_half_the_experts(dp2):
    import ray

    slots = ray.get([a.local_slots.remote() for a in dp2.engine.actors])
    assert slots == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_uneven_work_finishes_and_drained_rank_keeps_joining(dp2):
    """Rank 0 gets one short request, rank 1 many long ones: rank 0 drains early and runs dummy steps
    until rank 1 is done."""
    eng = dp2.engine
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("short", [5, 6, 7], short, rank=0)
    for i, p in enumerate(prompts(8, seed=3, lo=20, hi=60)):
        eng.add_request(f"long{i}", p, long, rank=1)
    done, deadline = {}, time.monotonic() + 90
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "uneven DP work did not finish in 90 s"
        for out in eng.step()[0]:
            done[out.request_id] = out
    assert len(done) == 9 and len(done["short"].outputs[0].token_ids) == 2
    assert all(len(done[f"long{i}"].outputs[0].token_ids) == 40 for i in range(8))
    s0, s1 = eng.last_stats
    assert s0["steps"] == s1["steps"] and s0["dummy_steps"] >= 38 and s1["dummy_steps"] == 0


def test_limited_ranks_prefill_in_rounds_and_preempt_yet_match_dp1(tiny_qwen3_moe, ray_local):
    """max_num_seqs=3, a 24-block pool and 8 tokens per prefill step per rank: prompts wait in the rank's
    queue for voted prefill steps and are prefilled in chunks, decode preempts and recomputes, and greedy
    outputs still equal one process's."""
    ps = prompts(12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(tiny_qwen3_moe, **SMALL).generate(ps, params, use_tqdm=False)
    small = dict(SMALL, kv_cache_memory=24 * 2048, max_num_seqs=3, max_model_len=64, max_num_batched_tokens=8)
    llm = LLM(tiny_qwen3_moe, data_parallel_size=2,
              dp_config={"prefill_attempt_interval": 2, "prefill_any_attempt_interval": 3}, **small)
    outs = llm.generate(ps, params, use_tqdm=False)
    stats = llm.engine.last_stats
    llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(s["prefill_steps"] >= 2 for s in stats), "6 requests per rank need several prefill rounds"
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_bad_request_is_rejected_before_any_work(dp2):
    with pytest.raises(ValueError, match="request 1: token id"):
        dp2.generate([[5, 6], [10 ** 6]], GREEDY, use_tqdm=False)
    assert not dp2.engine.has_unfinished()


def test_clean_shutdown_leaves_no_rank_process(tiny_qwen3_moe, ray_local):
    llm = LLM(tiny_qwen3_moe, data_parallel_size=2, **SMALL)
    pids = llm.engine.rank_pids
    assert len(alive(pids)) == 2
    llm.generate(prompts(3), GREEDY, use_tqdm=False)
    assert len(alive(pids)) == 2, "ranks stay up between generate calls"
    del llm
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_killed_rank_raises_quickly_and_leaves_nothing(tiny_qwen3_moe, ray_local):
    llm = LLM(tiny_qwen3_moe, data_parallel_size=2, **SMALL)
    pids = llm.engine.rank_pids
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    threading.Timer(3.0, os.kill, (pids[1], signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="data-parallel rank"):
        llm.generate(prompts(16, lo=20, hi=60), long, use_tqdm=False)
    assert time.monotonic() - start < 35
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


# ----------------------------------------------------------------------------------------------------
# expert-parallel MoE without Ray (two spawned processes on gloo)


def two_ranks(worker, args: list[tuple]) -> list:
    """Runs worker(rank, port, *args[rank], queue) in two spawned processes that meet on one free port -> what each
    put on the queue, sorted."""
    import torch.multiprocessing as mp

    from deepinfer.distributed.process_groups import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args[r], queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    return results


def _ep_worker(rank, port, tokens, queue):
    from deepinfer.distributed.ep_moe import EPStats, ExpertParallel, shard_experts
    from deepinfer.distributed.process_groups import DPGroup
    from deepinfer.layers.moe import FusedMoE

    torch.set_num_threads(1)
    group = DPGroup(rank, 2, port, timeout_s=30)
    torch.manual_seed(0)
    full = FusedMoE(8, 16, 8, torch.float32)
    full.gate_up_proj.data.normal_()
    full.down_proj.data.normal_()
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens, 16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)]) if tokens else torch.zeros(0, 2, dtype=torch.long)
    w = torch.rand(tokens, 2)
    ep = ExpertParallel(rank, 2, 4, 2, torch.float32, group.ep_group, EPStats())
    local = shard_experts(full, range(4 * rank, 4 * rank + 4))
    out = ep.run(x, ids, w, local)
    ep.dummy(local)  # a zero-token step joins the same collectives
    queue.put((rank, torch.allclose(out, full(x, ids, w), rtol=1e-5, atol=1e-4), ep.stats.calls))
    group.destroy()


@pytest.mark.parametrize("tokens", [(5, 3), (6, 0)])
def test_expert_parallel_matches_fused_moe(tokens):
    results = two_ranks(_ep_worker, [(tokens[0],), (tokens[1],)])
    assert results == [(0, True, 4), (1, True, 4)]  # dispatch + combine, twice


def _transfer_worker(rank, port, queue):
    from deepinfer.distributed.expert_transfer import exchange_experts
    from deepinfer.distributed.process_groups import DPGroup
    from eplb.placement import identity_phy2log

    group = DPGroup(rank, 2, port, timeout_s=30)
    L, E, R = 2, 6, 8
    torch.manual_seed(0)
    full = {"a": torch.randn(L, E, 3, 4), "b": torch.randn(L, E, 5).to(torch.bfloat16)}  # logical weights
    old = identity_phy2log(L, E, R)                                          # slots 6, 7 hold experts 0, 1
    new = torch.stack([torch.randperm(R) % E for _ in range(L)])             # every slot may change
    per = R // 2
    local = [{n: w[l][old[l, rank * per:(rank + 1) * per]].clone() for n, w in full.items()} for l in range(L)]
    written, received = exchange_experts(local, old, new, rank, 2)
    ok = all(torch.equal(local[l][n], full[n][l][new[l, rank * per:(rank + 1) * per]])
             for l in range(L) for n in full)
    queue.put((rank, ok, received > 0))
    group.destroy()


def test_expert_weights_move_between_ranks_by_plan_transfers():
    results = two_ranks(_transfer_worker, [(), ()])
    assert results == [(0, True, True), (1, True, True)]


def _agree_worker(rank, port, flags, queue):
    from deepinfer.distributed.process_groups import DPGroup

    group = DPGroup(rank, 2, port, timeout_s=30)
    queue.put((rank, group.agree(flags), group.agree([])))
    group.destroy()


def test_ranks_agree_on_a_flag_only_where_all_raise_it():
    """What keeps an expert-parallel group's weight layouts alike (LLMEngine's agree): a flag only every rank
    raised survives, whatever each rank measured."""
    results = two_ranks(_agree_worker, [([True, True, False, False],), ([True, False, True, False],)])
    assert results == [(r, [True, False, False, False], []) for r in range(2)]


@pytest.mark.slow
def test_eplb_replans_across_ranks_and_keeps_greedy_outputs(tiny_qwen3_moe, ray_local):
    import ray

    ps = prompts(8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(tiny_qwen3_moe, **SMALL).generate(ps, params, use_tqdm=False)
    llm = LLM(tiny_qwen3_moe, data_parallel_size=2, enable_eplb=True,
              eplb_config={"step_interval": 4, "window_size": 4, "num_redundant_experts": 2}, **SMALL)
    outs = llm.generate(ps, params, use_tqdm=False)
    states = ray.get([a.eplb_state.remote() for a in llm.engine.actors])
    llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(s["replans"] >= 4 for s in states) and states[0]["phy2log"] == states[1]["phy2log"]
    assert sum(s["received"] for s in states) > 0, "some expert should have crossed ranks"


# ----------------------------------------------------------------------------------------------------
# policy


def simulate(vote, trace, world=2):
    """trace[t] = (ranks with prefill work, ranks with decode work) before step t -> chosen types."""
    return [vote.decide(p, d, world) for p, d in trace]


def test_vote_prefill_when_nothing_decodes_and_done_when_idle():
    v = StepVote(4, 16)
    assert simulate(v, [(1, 0), (0, 2), (0, 0)]) == [PREFILL, DECODE, None]


def test_vote_all_ranks_prefill_waits_at_most_attempt_interval():
    v = StepVote(4, 16)
    trace = [(0, 2)] * 2 + [(2, 2)] * 10
    kinds = simulate(v, trace)
    first = kinds.index(PREFILL)
    assert kinds[:first] == [DECODE] * 4 and first == 4  # asked at the 4th decode step
    # the next all-ranks prefill again only after 4 more decode steps
    assert kinds[first + 1:first + 5] == [DECODE] * 4 and kinds[first + 5] == PREFILL


def test_vote_one_rank_prefill_waits_at_most_any_interval():
    for any_iv in (3, 8, 16):
        for arrival in range(0, 2 * any_iv):
            v = StepVote(4, any_iv)
            trace = [(0, 2)] * arrival + [(1, 2)] * (2 * any_iv + 1)
            kinds = simulate(v, trace)
            wait = kinds[arrival:].index(PREFILL)
            assert wait <= any_iv, (any_iv, arrival, wait)
            assert kinds.count(PREFILL) >= 1


def test_vote_from_a_scripted_scheduler_trace():
    """Two ranks with queues: rank 1 gets prompts now and then while rank 0 always decodes; every
    prompt is prefilled within prefill_any_attempt_interval decode steps of its arrival."""
    v, waits, pending_since = StepVote(4, 6), [], None
    arrivals = {3, 11, 12, 30, 31, 32, 33, 50}
    for t in range(80):
        if t in arrivals and pending_since is None:
            pending_since = t
        has_prefill = pending_since is not None
        kind = v.decide(int(has_prefill), 2, 2)
        if kind == PREFILL:
            waits.append(t - pending_since)
            pending_since = None
    assert waits and max(waits) <= 6


def test_vote_intervals_must_be_positive():
    from deepinfer.engine.dp import DPConfig

    with pytest.raises(ValueError, match="prefill_attempt_interval"):
        DPConfig.from_dict({"prefill_attempt_interval": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        DPConfig.from_dict({"prefill_every": 3})


def test_decode_balancer_evens_count_and_kv_length():
    b = DecodeBalancer(2)
    kv = [100, 90, 80, 10, 10, 10, 10, 10]
    ranks = b.assign(kv)
    counts = [ranks.count(r) for r in range(2)]
    loads = [sum(k for k, r in zip(kv, ranks) if r == rank) for rank in range(2)]
    assert abs(counts[0] - counts[1]) <= 2 and abs(loads[0] - loads[1]) <= 60
    # With rank 0 already busy, new work goes to rank 1.
    b = DecodeBalancer(2)
    b.add(0, 500)
    assert b.assign([50, 50]) == [1, 1]


def test_channel_round_trip_keeps_tensors_out_of_band():
    from deepinfer.distributed.channels import decode, encode

    t = torch.arange(1000, dtype=torch.float32)
    frames = encode({"x": t, "ids": [1, 2]})
    assert len(frames) == 2 and len(frames[0]) < 1000  # the 4000 tensor bytes are a separate frame
    back = decode([bytes(f) for f in frames])
    assert torch.equal(back["x"], t) and back["ids"] == [1, 2]


def test_free_port_is_bindable_and_outside_the_ranges_others_draw_from():
    import socket

    from deepinfer.distributed.process_groups import _PORTS_FROM, _ephemeral_low, free_port

    ports = {free_port() for _ in range(20)}
    assert all(_PORTS_FROM <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))
