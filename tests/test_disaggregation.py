"""Disaggregated prefill and decode (engine/disagg.py, kv_transfer.py) and the prefix KV store in an engine
(engine/prefix_cache.py): outputs token-identical to a NORMAL engine, bytes moved equal to the memory plan,
and the faults: a decode engine dying, a transfer cut half-way, a corrupt store entry."""
import os
import socket
import threading
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import channels
from test_deepseek_v4 import make_checkpoint, prompt_of
from tests.conftest import assert_logprobs_alike

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN = dict(dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_num_seqs=8)
V4 = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8)
V4_KV = ["auto", "fp8", "fp4", "fp4_all"]


def greedy(n=12, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def seeded(n=12):
    return SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=n, ignore_eos=True)


def qwen_prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """Window 8, 4 layers: exact replay needs ~32 + accumulator tokens, so the 90- and 150-token prompts
    replay only their tail."""
    path = tmp_path_factory.mktemp("v4disagg") / "tiny"
    make_checkpoint(path, seed=3)
    return str(path), [prompt_of(37, 41), prompt_of(90, 42), prompt_of(150, 43), prompt_of(19, 44)]


def run_handoffs(path, prompts, params, **kw):
    """PROMPT engine -> the channels' wire encoding -> COMPLETION engine, in this process. Returns the decoded
    token lists in prompt order and the handoffs (as received)."""
    prefill = LLM(path, engine_type="prompt", **kw)
    prefill.generate(prompts, params, use_tqdm=False)
    received = [channels.decode(channels.encode(h)) for h in prefill.engine.handoffs]
    decode = LLM(path, engine_type="completion", **kw)
    for h in received:
        assert decode.engine.import_handoff(h)
    done = {}
    while decode.engine.has_unfinished():
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in decode.engine.step()[0]})
    return [done[h.request_id] for h in received], received, prefill.engine


# ----------------------------------------------------------------------------------------------------
# transfer in one process: bytes as stored, state sent or replayed


@pytest.mark.parametrize("kv_cache_dtype", V4_KV)
def test_v4_state_sent_or_replayed_gives_normal_tokens_and_plan_bytes(v4, kv_cache_dtype):
    """Every KV format crosses the wire encoding bytes as stored; a receiver that replays the StateBlock
    decodes the same tokens as one that got it, and each handoff carries exactly the memory plan's bytes."""
    path, prompts = v4
    kw = dict(V4, kv_cache_dtype=kv_cache_dtype)
    normal = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, greedy(16), use_tqdm=False)]
    for mode in ("state", "replay"):
        got, handoffs, engine = run_handoffs(path, prompts, greedy(16), state_transfer=mode, **kw)
        assert got == normal, mode
        plan = engine.state_transfer
        for h in handoffs:
            replayed = h.replay_tokens > 0
            assert replayed == (mode == "replay")
            assert h.kv_bytes == plan.expected_bytes(len(h.prompt_token_ids), replayed)
    long = [h for h in handoffs if len(h.prompt_token_ids) == 150][0]
    assert long.replay_tokens < 150  # a bounded replay, not the whole prompt


def test_auto_state_transfer_picks_fewer_bytes(v4):
    path, prompts = v4
    engine = LLM(path, engine_type="prompt", **V4).engine
    plan = engine.state_transfer
    for n in (19, 150, 1000):
        r = engine.model.replay_exact_tokens(n)
        assert plan.replay_tokens(n) == (r if 4 * r < plan.spec.bytes_per_state_block and r < n else 0)
    assert plan.replay_tokens(19) == 0 and 0 < plan.replay_tokens(150) < 150  # whole-prompt replay: state sent
    assert LLM(path, engine_type="prompt", state_transfer="state", **V4).engine.state_transfer.replay_tokens(150) == 0


def test_qwen_handoff_bytes_and_wire_overhead(tiny_qwen3_moe):
    """No StateBlock: a handoff is its blocks; the wire adds only the pickled metadata (out-of-band buffers)."""
    prompts = qwen_prompts()
    got, handoffs, engine = run_handoffs(tiny_qwen3_moe, prompts, greedy(), **QWEN)
    normal = LLM(tiny_qwen3_moe, **QWEN).generate(prompts, greedy(), use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in normal]
    for h in handoffs:
        assert h.kv_bytes == engine.state_transfer.expected_bytes(len(h.prompt_token_ids), False)
        frames = channels.encode(("handoff", h))
        buffers = sum(memoryview(f).nbytes for f in frames[1:])
        assert buffers == h.kv_bytes and memoryview(frames[0]).nbytes < 2048


def test_bf16_and_fp8_tensors_travel_out_of_band_bit_exact():
    t = {"bf16": torch.randn(4, 8).bfloat16(), "fp8": torch.randn(16).to(torch.float8_e4m3fn),
         "u8": torch.arange(10, dtype=torch.uint8)}
    frames = channels.encode(t)
    assert len(frames) == 4
    back = channels.decode(frames)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))


# ----------------------------------------------------------------------------------------------------
# prefix store in one engine


@pytest.mark.parametrize("model", ["qwen", "v4"])
def test_prefix_store_hits_give_identical_outputs(model, tiny_qwen3_moe, v4, tmp_path):
    """Requests sharing a long system prompt and a multi-turn chat: the second run loads stored blocks (and
    V4 replays its state) instead of prefilling them, with the tokens of an engine without a store."""
    if model == "qwen":
        path, kw, system = tiny_qwen3_moe, QWEN, qwen_prompts(1, seed=9)[0] * 3
    else:
        path, kw, system = v4[0], V4, prompt_of(70, 50)
    turns = [system + p for p in qwen_prompts(4, seed=1)]
    chat = system + [7, 8, 9]
    prompts = turns + [chat, chat + [11] * 20]
    plain = tokens(LLM(path, **kw).generate(prompts, greedy(), use_tqdm=False))
    store = {"path": str(tmp_path / "store"), "max_bytes": 64 << 20}
    first = LLM(path, prefix_cache=store, **kw)
    assert tokens(first.generate(prompts, greedy(), use_tqdm=False)) == plain
    second = LLM(path, prefix_cache=store, **kw)  # a new engine: the blocks come from the store
    assert tokens(second.generate(prompts, greedy(), use_tqdm=False)) == plain
    stats = second.engine.prefix_cache.store.stats()
    assert stats["hits"] >= len(prompts) * (len(system) // second.engine.config.block_size)
    if model == "v4":  # each prefix end's state was replayed once and stored; a second pass loads them all
        bs = second.engine.config.block_size
        ends = {tuple(p[:(len(p) - 1) // bs * bs]) for p in prompts}
        assert stats["state_misses"] == len(ends) and stats["state_hits"] == len(prompts) - len(ends)
        assert tokens(second.generate(prompts, greedy(), use_tqdm=False)) == plain
        assert second.engine.prefix_cache.store.stats()["state_hits"] == 2 * len(prompts) - len(ends)


def test_corrupt_store_entry_is_recomputed_not_used(tiny_qwen3_moe, tmp_path):
    prompts = [qwen_prompts(1, seed=3)[0] * 2]
    plain = tokens(LLM(tiny_qwen3_moe, **QWEN).generate(prompts, greedy(), use_tqdm=False))
    store = {"path": str(tmp_path / "store"), "max_bytes": 64 << 20}
    first = LLM(tiny_qwen3_moe, prefix_cache=store, **QWEN)
    first.generate(prompts, greedy(), use_tqdm=False)
    hashes = first.engine.prefix_cache.hashes(prompts[0])
    first.engine.prefix_cache.store.close()
    corrupt_entry(str(tmp_path / "store"), hashes[1])
    second = LLM(tiny_qwen3_moe, prefix_cache=store, **QWEN)
    assert tokens(second.generate(prompts, greedy(), use_tqdm=False)) == plain
    stats = second.engine.prefix_cache.store.stats()
    assert stats["corrupt"] == 1 and stats["hits"] == 1  # block 0 used, block 1 rejected, the rest recomputed


def corrupt_entry(path: str, key: bytes) -> None:
    """Flips one byte in the middle of a stored block's value, behind the store's back."""
    import lmdb

    env = lmdb.open(path, max_dbs=8)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        raw = bytearray(txn.get(key))
        raw[len(raw) // 2] ^= 0xFF
        txn.put(key, bytes(raw))
    env.close()


# ----------------------------------------------------------------------------------------------------
# engines in separate processes


def disagg(path, prefill=1, decode=2, **kw):
    opts = dict(prefill=prefill, decode=decode, poll_ms=5, **kw.pop("disagg", {}))
    return LLM(path, disaggregation=opts, **kw)


@pytest.fixture(scope="module")
def qwen_plan(tiny_qwen3_moe):
    """The memory plan's bytes per handoff (StateTransfer.expected_bytes) of the tiny Qwen3-MoE."""
    return LLM(tiny_qwen3_moe, engine_type="prompt", **QWEN).engine.state_transfer


def test_disaggregated_qwen_matches_normal_greedy_seeded_and_n(tiny_qwen3_moe, ray_local, qwen_plan):
    prompts = qwen_prompts(8, seed=4)
    params = [greedy(), seeded(), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
              greedy(1), greedy(logprobs=2), seeded(), greedy(), greedy(20)]
    normal = LLM(tiny_qwen3_moe, **QWEN).generate(prompts, params, use_tqdm=False)
    llm = disagg(tiny_qwen3_moe, **QWEN)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(outs) == tokens(normal)
        lp, ref = outs[4].outputs[0].logprobs, normal[4].outputs[0].logprobs
        assert len(lp) == len(ref) and all(a.keys() == b.keys() for a, b in zip(lp, ref))
        assert all(o.metrics.time_to_first_token > 0 for o in outs)
        stats = llm.engine.stats
        # max_tokens=1 finishes at the prefill: nothing moves
        expected = sum(qwen_plan.expected_bytes(len(o.prompt_token_ids), False)
                       for o in outs for c in o.outputs if len(c.token_ids) > 1)
        assert stats["kv_bytes"] == expected and stats["retries"] == 0
        assert stats["wire_bytes"] - stats["kv_bytes"] < 2048 * stats["transfers"]
    finally:
        engines = llm.engine.shutdown()
    assert sum(s["imported"] for s in engines.values()) == stats["transfers"]


def test_disaggregated_prompt_logprobs_match_normal(tiny_qwen3_moe, ray_local):
    """The prefill engine scores the prompt and its report carries the scores to the front: a handed-off
    request, one that ends at its prefill (max_tokens=1), one with two children (each try scores; one list
    returns) and one that wants none."""
    prompts = qwen_prompts(4, seed=6)
    params = [greedy(prompt_logprobs=2), greedy(1, prompt_logprobs=0),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
              greedy()]
    normal = LLM(tiny_qwen3_moe, **QWEN).generate(prompts, params, use_tqdm=False)
    llm = disagg(tiny_qwen3_moe, **QWEN)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert tokens(outs) == tokens(normal)
    for got, want in zip(outs[:3], normal[:3]):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids) and got.prompt_logprobs[0] is None
        assert_logprobs_alike(got.prompt_logprobs, want.prompt_logprobs, 1e-5)
    assert outs[3].prompt_logprobs is None


@pytest.mark.parametrize("kv_cache_dtype,state_transfer,store", [("auto", "state", False), ("fp8", "auto", False),
                                                                  ("fp4", "replay", True), ("fp4_all", "auto", False)])
def test_disaggregated_v4_matches_normal(v4, ray_local, tmp_path, kv_cache_dtype, state_transfer, store):
    """With the store, the second generate's prefill engine loads the prompts' blocks from it and rebuilds
    the state by replay: the same tokens again."""
    path, prompts = v4
    kw = dict(V4, kv_cache_dtype=kv_cache_dtype)
    params = [greedy(16), seeded(16)] * 2
    normal = tokens(LLM(path, **kw).generate(prompts, params, use_tqdm=False))
    if store:
        kw["prefix_cache"] = str(tmp_path / "store")
    llm = disagg(path, decode=1, disagg={"state_transfer": state_transfer}, **kw)
    bs = llm.engine.config.block_size
    try:
        for _ in range(2 if store else 1):
            assert tokens(llm.generate(prompts, params, use_tqdm=False)) == normal
        replayed = {"state": 0, "replay": len(prompts), "auto": 2}[state_transfer]  # auto: the 90 and 150 prompts
        assert llm.engine.stats["replayed"] == replayed * (1 + store)
    finally:
        engines = llm.engine.shutdown()
    if store:  # every full prompt block was stored by the first run and loaded (short of the last token) by the second;
        prefix = engines[("prefill", 0)]["prefix_cache"]
        assert prefix["state_misses"] == len(prompts)  # then each hit's replayed state is stored beside the blocks
        assert prefix["entries"] == sum(len(p) // bs for p in prompts) + len(prompts)
        assert prefix["hits"] == sum((len(p) - 1) // bs for p in prompts) > 0


def drive(engine, prompts, params, until=None, prefix=""):
    """Runs the engine API by hand (what LLM.generate does), calling until(engine) between steps until it
    returns True; returns outputs by request id (prefix + index)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    done, fired = {}, until is None
    deadline = time.monotonic() + 240
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "hung"
        for out in engine.step()[0]:
            assert out.request_id not in done, "an output came twice"
            done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        if not fired:
            fired = until(engine)
    return done


def test_decode_engine_dies_and_its_requests_finish_on_a_survivor(tiny_qwen3_moe, ray_local):
    prompts = qwen_prompts(10, seed=6)
    params = greedy(40)
    normal = tokens(LLM(tiny_qwen3_moe, **QWEN).generate(prompts, params, use_tqdm=False))
    llm = disagg(tiny_qwen3_moe, **QWEN)
    engine = llm.engine
    imported = []

    def kill_decode_0(e):
        mine = [c for c in e.by_key.values() if c.decode == 0 and c.stage == "decode"]
        if not mine:
            return False
        imported.extend(c.key for c in mine)
        ray_local.kill(e.actors[("decode", 0)], no_restart=True)
        return True

    try:
        done = drive(engine, prompts, params, kill_decode_0)
        assert imported and engine.stats["retries"] >= len(imported)
        assert [done[str(i)] for i in range(len(prompts))] == normal
        assert engine.alive["decode"] == {1}
    finally:
        engine.shutdown()


class CuttingProxy:
    """A TCP forwarder to `target` whose first connection is cut after `cut_after` bytes from the client (a
    transfer cut half-way), or held for hold_s before anything passes (a slow transfer); later connections
    pass everything at once."""

    def __init__(self, target: str, cut_after: int | None, hold_s: float = 0.0):
        host, port = target.removeprefix("tcp://").split(":")
        self.target, self.cut_after, self.hold_s = (host, int(port)), cut_after, hold_s
        self.cuts, self.held = 0, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        first = True
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            limit, hold = (self.cut_after, self.hold_s) if first else (None, 0.0)
            first = False
            threading.Thread(target=self._pipe, args=(client, upstream, limit, hold), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None, 0.0), daemon=True).start()

    def _pipe(self, src, dst, limit, hold):
        sent, held = 0, []
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[:limit - sent])
                    self.cuts += 1
                    break
                if hold and sent + len(data) > 64:  # past the greeting: hold the message back
                    self.held += not held
                    held.append(data)
                    time.sleep(hold)
                    hold = 0.0
                    data = b"".join(held)
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_transfer_cut_half_way_is_retried_not_hung(tiny_qwen3_moe, ray_local, qwen_plan):
    prompts = qwen_prompts(3, seed=8)
    normal = tokens(LLM(tiny_qwen3_moe, **QWEN).generate(prompts, greedy(), use_tqdm=False))
    llm = disagg(tiny_qwen3_moe, decode=1, disagg={"transfer_timeout_s": 3.0}, **QWEN)
    engine = llm.engine
    plan = qwen_plan.expected_bytes(len(prompts[0]), False)
    proxy = CuttingProxy(engine.decode_addresses[0], cut_after=64 + plan // 2)  # greeting + half a handoff
    engine.decode_addresses[0] = proxy.address
    try:
        done = drive(engine, prompts, greedy())
        assert [done[str(i)] for i in range(len(prompts))] == normal
        assert proxy.cuts == 1 and engine.stats["retries"] >= 1
    finally:
        engine.shutdown()
        proxy.server.close()


def test_no_decode_engine_left_raises_a_clear_error(tiny_qwen3_moe, ray_local):
    llm = disagg(tiny_qwen3_moe, decode=1, **QWEN)
    try:
        ray_local.kill(llm.engine.actors[("decode", 0)], no_restart=True)
        with pytest.raises(RuntimeError, match="no decode engine is left"):
            llm.generate(qwen_prompts(2), greedy(), use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_example_runs_and_reports_identity_and_plan_bytes():
    """examples/disaggregated.py, as the README runs it (its own Ray, the default model)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "examples/disaggregated.py", "--max-tokens", "8"], cwd=root,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "tokens identical to NORMAL: True" in out and "; equal)" in out and "0 retries" in out
    assert "the second engine's tokens equal the first's: True" in out
    loaded = int(out.split("prefix store, second engine: ")[1].split(" blocks loaded")[0])
    assert loaded > 0


def test_dp_group_engines_match_normal_and_a_dead_rank_takes_its_group_down(tiny_qwen3_moe, ray_local):
    """Prefill and decode engines that are DP groups of 2 ranks each (expert-parallel MoE across the ranks,
    one voted step type per step): the same tokens as NORMAL; killing one rank of a decode group ends the
    group and its requests finish on the other group."""
    prompts = qwen_prompts(8, seed=12)
    mixed, plain = [greedy(30), seeded(30)] * 4, greedy(30)
    normal = LLM(tiny_qwen3_moe, **QWEN)
    want_mixed = tokens(normal.generate(prompts, mixed, use_tqdm=False))
    want_plain = tokens(normal.generate(prompts, plain, use_tqdm=False))
    llm = disagg(tiny_qwen3_moe, prefill=1, decode=2, disagg={"prefill_dp": 2, "decode_dp": 2,
                                                              "num_cpus_per_engine": 0.25}, **QWEN)
    engine = llm.engine
    assert len(engine.actors) == 6 and engine.num_ranks == {"prefill": 2, "decode": 4}
    try:
        assert tokens(llm.generate(prompts, mixed, use_tqdm=False)) == want_mixed

        def kill_rank_1(e):  # rank 1 of decode group 0 (ranks 0 and 1)
            if not any(c.decode in (0, 1) and c.stage == "decode" for c in e.by_key.values()):
                return False
            ray_local.kill(e.actors[("decode", 1)], no_restart=True)
            return True

        done = drive(engine, prompts, plain, kill_rank_1, prefix="r")
        assert [done[f"r{i}"] for i in range(len(prompts))] == want_plain
        assert engine.alive["decode"] == {2, 3} and engine.stats["retries"] >= 1
    finally:
        engine.shutdown()


def test_late_handoff_after_a_retry_is_dropped_not_decoded_twice(tiny_qwen3_moe, ray_local):
    """A transfer slower than transfer_timeout_s: the front prefills the request again and tells the decode
    engine to drop the first try, whose handoff then arrives late and is ignored: one import per request."""
    prompts = qwen_prompts(3, seed=9)
    normal = tokens(LLM(tiny_qwen3_moe, **QWEN).generate(prompts, greedy(), use_tqdm=False))
    llm = disagg(tiny_qwen3_moe, decode=1, disagg={"transfer_timeout_s": 2.0}, **QWEN)
    engine = llm.engine
    # The held connection releases the first try 3 s after it was sent: 1 s past its 2 s timeout, and 1 s before the
    # retry's own timeout (the retry's handoff rides the same connection). Held 4 s, the release fell on the retry's
    # deadline, and on a slow host the retry timed out too (a second retry: 2 imports per request).
    proxy = CuttingProxy(engine.decode_addresses[0], cut_after=None, hold_s=3.0)
    engine.decode_addresses[0] = proxy.address
    try:
        done = drive(engine, prompts, greedy())
        assert [done[str(i)] for i in range(len(prompts))] == normal
        assert engine.stats["retries"] >= 1 and proxy.held == 1
    finally:
        stats = engine.shutdown()
        proxy.server.close()
    assert stats[("decode", 0)]["imported"] == len(prompts)


def test_prefix_store_with_mtp_drafting_keeps_the_tokens(tmp_path):
    """The default model drafts with its MTP layer, whose ring is part of the StateBlock: prefix hits (blocks
    and state snapshots from the store) leave the tokens as without a store, speculation included."""
    from deepinfer.default_model import default_model_path
    from examples.disaggregated import HEADER
    from examples.offline import PROMPTS

    path, prompts = default_model_path(), [HEADER + p for p in PROMPTS[:4]]
    kw = dict(dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=8,
              speculative={"method": "mtp", "num_draft_tokens": 2, "verify": "all"})
    plain = tokens(LLM(path, **kw).generate(prompts, greedy(16), use_tqdm=False))
    store = str(tmp_path / "store")
    for run in range(2):
        llm = LLM(path, prefix_cache=store, **kw)
        assert tokens(llm.generate(prompts, greedy(16), use_tqdm=False)) == plain
    assert llm.engine.prefix_cache.store.stats()["hits"] > 0
