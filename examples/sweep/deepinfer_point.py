"""One deepinfer measurement: a fixed decode batch (per-step timing and split) and prefill rates."""
import math
import time

import torch

from deepinfer import LLM, SamplingParams, _C
from deepinfer.config import scheduler_steps
from deepinfer.layers import gemm_plan
from examples.sweep.errors import PointError
from examples.sweep.model_cost import load_config
from examples.sweep.metrics import accepted_tokens_per_step, steps_per_second
from examples.sweep.step_timer import PHASES, StepTimer


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def prefill_shape(tokens: int, context: int) -> tuple[int, int]:
    """(requests, prompt length) giving `tokens` prefill tokens in one step of context-long prompts."""
    n = max(1, tokens // context)
    return n, tokens // n


def new_tokens(p, opts: dict) -> int:
    """Output tokens per sequence: enough that no sequence can finish before the timed window ends
    (a drafting step commits up to 1 + k tokens; the warmup's and the window's last engine step may each run up to
    num_scheduler_steps - 1 decode steps past them); the run is cut right after the window."""
    spec = opts.get("speculative") or {}
    steps = scheduler_steps(opts.get("num_scheduler_steps"), spec, opts.get("async_scheduling", False))
    past = 2 * (steps - 1)
    return (p.warmup + p.steps + past) * (1 + int(spec.get("num_draft_tokens", 0))) + 1


def decode_params(p, max_tokens: int) -> SamplingParams:
    """The decode requests' parameters: greedy, or the point's sampling (each request then draws from its own seed,
    which the engine derives from LLM(seed=...) and the request id)."""
    return SamplingParams(**{"temperature": 0, **p.sampling}, max_tokens=max_tokens, ignore_eos=True)


def make_llm(p, opts: dict) -> LLM:
    """The engine for a point, sized so the decode batch and the prefill points fit in one step each."""
    new = p.new_tokens
    biggest = max([p.batch] + [prefill_shape(t, p.context)[0] for t in p.prefill_tokens])
    kw = dict(dtype="bfloat16", max_model_len=p.context + new + 1, max_num_seqs=biggest,
              kv_cache_memory=512 << 20, num_threads=1)
    kw["max_num_batched_tokens"] = max([p.batch * p.context, kw["max_model_len"]] + p.prefill_tokens)
    kw.update(opts)
    if p.dp > 1:
        kw["data_parallel_size"] = p.dp
    try:
        return LLM(p.model_dir, **kw)
    except TypeError as exc:  # an option this engine version does not take (e.g. speculative=)
        raise PointError(f"LLM() rejected an option: {exc}") from exc


def check_capacity(engine, p) -> None:
    """A fixed batch must fit the KV pool at its final length, or decode steps would preempt."""
    cache = getattr(engine, "cache", None)
    if cache is None:
        return  # DP front: each rank checks its own pool
    per_seq = math.ceil((p.context + p.new_tokens) / cache.block_size)
    if p.batch * per_seq > cache.num_blocks:
        raise PointError(f"batch {p.batch} needs {p.batch * per_seq} KV blocks of {cache.block_size} tokens "
                         f"({per_seq} per sequence) but the pool holds {cache.num_blocks}: raise "
                         f"kv_cache_memory or lower the batch")


def warm_up(engine) -> None:
    """One short request so first-call costs (allocation, kernel set-up) stay out of the numbers."""
    engine.add_request("warmup", [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def replay_references(engine, batch: list[list[int]], params) -> None:
    """The replay drafter (speculative={"method": "replay", ...}) proposes a known continuation with
    per-position acceptance a; without given references it gets this batch's own greedy output,
    generated here with drafting switched off (untimed)."""
    spec = getattr(engine, "spec", None)
    drafter = getattr(spec, "drafter", None)
    if drafter is None or not hasattr(drafter, "references") or drafter.references:
        return
    engine.spec = None
    try:
        for i, ids in enumerate(batch):
            engine.add_request(f"ref{i}", ids, params)
        states = list(engine.seqs.values())
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.spec = spec
    drafter.references = {tuple(ids): list(s.token_ids) for ids, s in zip(batch, states)}


def run_decode(engine, p) -> dict:
    """Prefill the batch, then at least `warmup` untimed decode steps and at least `steps` timed ones. An engine
    step may run several decode steps back to back (num_scheduler_steps): each of them takes an equal share of
    its call's time and phases."""
    params = decode_params(p, p.new_tokens)
    batch = prompts(p.batch, p.context, engine.vocab_size, seed=p.batch)
    replay_references(engine, batch, params)
    for i, ids in enumerate(batch):
        engine.add_request(f"d{i}", ids, params)
    states = list(engine.seqs.values())  # kept: the engine drops a sequence's state when it finishes
    prefill, timed, decoded, before, after = [], [], 0, None, None  # timed: (decode steps, phases) per call
    with StepTimer(engine) as timer:
        while engine.has_unfinished():
            if prefill and decoded >= p.warmup and before is None:
                before = sum(len(s.token_ids) for s in states)
            steps_before = engine.num_steps["decode"]
            _, batch, split = timer.step()
            if batch.type == _C.StepType.PREFILL:
                if decoded:
                    raise PointError("a prefill (recompute) step came during decode: the batch did not stay fixed")
                prefill.append((batch.num_tokens, split["total"]))
            elif batch.type == _C.StepType.DECODE:
                _check_fixed(batch, p.batch)
                n = engine.num_steps["decode"] - steps_before
                decoded += n
                if before is not None:
                    timed.append((n, split))
            if sum(n for n, _ in timed) >= p.steps:
                after = sum(len(s.token_ids) for s in states)
                break
    engine.abort_all()  # drafting runs stop short of max_tokens: end them, untimed
    if after is None:
        raise PointError(f"only {decoded} decode steps ran; needed {p.warmup} + {p.steps}")
    steps = sum(n for n, _ in timed)
    measured = [split["total"] / n for n, split in timed for _ in range(n)]
    print(gemm_plan.PLAN.report())
    return {"gemm_plan": gemm_plan.PLAN.describe(), "decode_avg_sps": steps_per_second(measured), "decode_step_ms": 1000 * sum(measured) / len(measured),
            "step_split_ms": _mean_split([split for _, split in timed], steps), "measured_steps": steps,
            "measured_tokens_per_step": accepted_tokens_per_step(before, after, steps, p.batch),
            "prefill": [_prefill_entry(prefill)], "method": "engine steps timed one by one (StepTimer)"}


def _check_fixed(batch, want: int) -> None:
    if batch.num_seqs != want:
        raise PointError(f"a decode step ran {batch.num_seqs} sequences instead of {want}: the batch did not stay fixed")


def _mean_split(splits: list[dict], steps: int) -> dict:
    """Milliseconds per decode step of each phase over calls that ran `steps` decode steps in all."""
    return {k: 1000 * sum(s[k] for s in splits) / steps for k in PHASES + ("total",)}


def _prefill_entry(steps: list[tuple[int, float]]) -> dict:
    tokens, seconds = sum(t for t, _ in steps), sum(s for _, s in steps)
    return {"tokens_per_step": tokens / len(steps), "steps": len(steps), "step_ms": 1000 * seconds / len(steps),
            "tokens_per_s": tokens / seconds}


def run_prefill(engine, tokens: int, context: int) -> dict:
    """Prefill rate at `tokens` tokens per step (requests of 1 output token, so no decode follows)."""
    n, length = prefill_shape(tokens, context)
    for i, ids in enumerate(prompts(n, length, engine.vocab_size, seed=10_000 + tokens)):
        engine.add_request(f"p{tokens}-{i}", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps = []
    with StepTimer(engine) as timer:
        while engine.has_unfinished():
            _, batch, split = timer.step()
            if batch.type == _C.StepType.PREFILL:
                steps.append((batch.num_tokens, split["total"]))
    return _prefill_entry(steps)


def run_generate_diff(llm: LLM, p) -> dict:
    """Engines without per-step access (the DP and disaggregation fronts): decode s/step = (t(n) - t(1)) / (n - 1)."""
    ids = prompts(p.batch, p.context, load_config(p.model_dir)["vocab_size"], p.batch)
    llm.generate([ids[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    n, times, outs = p.warmup + p.steps + 1, {}, None
    for k in (1, n):
        t = time.perf_counter()
        outs = llm.generate(ids, decode_params(p, k), use_tqdm=False)
        times[k] = time.perf_counter() - t
    made = sum(len(c.token_ids) for o in outs for c in o.outputs)
    sps = (n - 1) / (times[n] - times[1])
    return {"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "step_split_ms": None,
            "measured_tokens_per_step": (made - p.batch) / ((n - 1) * p.batch),
            "prefill": [{"tokens_per_step": p.batch * p.context, "steps": 1, "step_ms": 1000 * times[1],
                         "tokens_per_s": p.batch * p.context / times[1]}],
            "method": "(generate(n) - generate(1)) / (n - 1), all decode steps"}


def measure(p, opts: dict) -> dict:
    """Everything the JSON reports about deepinfer at this point."""
    if p.dp > 1 and "speculative" in opts:  # generate() hides how many steps the drafts saved
        raise PointError("dp > 1 with speculative: the DP front has no per-step view to count steps")
    p.new_tokens = new_tokens(p, opts)
    llm = make_llm(p, opts)
    try:
        if p.dp > 1 or opts.get("disaggregation"):
            return run_generate_diff(llm, p)
        engine = llm.engine
        check_capacity(engine, p)
        warm_up(engine)
        result = run_decode(engine, p)
        result["prefill"] += [run_prefill(engine, t, p.context) for t in p.prefill_tokens]
        return result
    finally:
        shutdown = getattr(llm.engine, "shutdown", None)
        if shutdown:
            shutdown()
