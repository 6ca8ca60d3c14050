"""Balancers for disaggregated prefill / decode (engine/balancers.py) against round robin, on a skewed workload:
per seed, 64 requests, 4 long prompts (0.4-0.6 x max_model_len) among 60 short ones (16-64 tokens), the long
ones among the first 16 arrivals; Poisson arrivals, or all at once. Writes docs/benchmarks.md, "Balancers".

The engines would be separate processes, each with its own cores; this 2-vCPU machine cannot time several at
once honestly, so their queues are SIMULATED (discrete events) with step costs MEASURED first on the real
engine (deepinfer.LLM, the default model, one process):
  - a prefill step of k prompts of L_1..L_k tokens costs o + p*k + q*sum L_i + r*sum L_i^2 (per step, prompt,
    token, and attention), least squares with non-negative terms over single prompts of 16 tokens to 3/4 of
    max_model_len and steps of 4-16 short prompts;
  - a decode step of B requests holding KV tokens in all costs a + b*B + c*KV, least squares over a few
    measured (B, KV) points.
A prefill engine takes what is queued, oldest first, up to max_num_batched_tokens per step; its first token
ends the request's time to first token, and the request moves to a decode engine at once (KV transfer not
modelled), which runs all its requests every step (continuous batching).

    python examples/bench_balancers.py [--seeds 20] [--requests 64] [--long 4] [--load 0.6] [--threads 1]
"""
import argparse
import heapq
import itertools
import os
import random
import statistics
import time
from collections import deque

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.default_model import default_model_path
from deepinfer.docs import write_section
from deepinfer.engine.balancers import DecodeBalancer, PrefillBalancer, RoundRobin

# ----------------------------------------------------------------------------------------------------
# measured costs


class Costs:
    """Step times in seconds, fitted to steps measured on the real engine."""

    def __init__(self, llm: LLM, repeats: int = 5):
        self.engine, self.n, self.rng = llm.engine, 0, torch.Generator().manual_seed(0)
        self.budget = llm.engine.config.max_num_batched_tokens
        max_len = llm.engine.config.max_model_len
        self._run([[5] * 64] * 2, 4)  # warm-up: GEMM plans for these shapes
        # single prompts up to 3/4 of the context, and steps of several short prompts
        steps = [[n] for n in (16, 32, 64, 128, 256, 512, 1024, 1536, 2048) if n <= 3 * max_len // 4]
        steps += [[32] * k for k in (2, 4, 8, 16)] + [[16] * k for k in (4, 8)]
        times = [float("inf")] * len(steps)
        for _ in range(repeats):  # fastest of `repeats`, interleaved: a slow spell on the machine hits all alike
            for i, lengths in enumerate(steps):
                times[i] = min(times[i], self._prefill(lengths))
        self.prefill_coef, self.prefill_rms = _fit([_prefill_terms(x) for x in steps], times)
        # (B, prompt length): batch sizes at short KV, and two at 8x more KV to tell KV length from batch size
        points = [(1, 32), (8, 32), (32, 32), (8, max_len // 2), (32, max_len // 8)]
        measured = [(b, kv, t) for b, n in points for kv, t in self._decode(b, n)]
        (self.a, self.b, self.c), self.decode_rms = _fit([[1.0, b, kv] for b, kv, _ in measured],
                                                         [t for _, _, t in measured])

    def prefill_step(self, lengths: list[int]) -> float:
        return sum(c * x for c, x in zip(self.prefill_coef, _prefill_terms(lengths)))

    def decode_step(self, batch: int, kv: int) -> float:
        return self.a + self.b * batch + self.c * kv

    def _run(self, prompts: list[list[int]], new: int) -> tuple[list[float], list[tuple[int, float]]]:
        """Runs the prompts to the end -> prefill step times, and (KV tokens, seconds) of each decode step."""
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        for p in prompts:
            self.n += 1
            self.engine.add_request(f"m{self.n}", p, params)
        prefill, decode, kv, running = [], [], sum(map(len, prompts)), len(prompts)
        while self.engine.has_unfinished():
            before, start = self.engine.num_steps["decode"], time.perf_counter()
            finished = len(self.engine.step()[0])
            t = time.perf_counter() - start
            if self.engine.num_steps["decode"] > before:
                kv += running  # each running request holds its prompt and what it made, this step's input included
                decode.append((kv, t))
            else:
                prefill.append(t)
            running -= finished
        return prefill, decode

    def _prefill(self, lengths: list[int]) -> float:
        """One prefill step of these prompts (random tokens) -> seconds."""
        steps, _ = self._run([torch.randint(3, 1000, (n,), generator=self.rng).tolist() for n in lengths], 1)
        assert len(steps) == 1, f"{lengths} took {len(steps)} prefill steps"
        return steps[0]

    def _decode(self, batch: int, length: int, steps: int = 8, repeats: int = 3) -> list[tuple[int, float]]:
        """Decode steps of `batch` prompts of `length`, the first dropped (warm-up for this batch shape);
        each step's time the fastest of `repeats` runs."""
        runs = [self._run([[7 + i] * length for i in range(batch)], steps + 2)[1][1:] for _ in range(repeats)]
        return [(kv, min(t for _, t in same)) for kv, same in ((s[0][0], s) for s in zip(*runs))]

    def describe(self) -> str:
        step, prompt, token, square = self.prefill_coef
        ms = lambda lengths: f"{1000 * self.prefill_step(lengths):.1f}"  # noqa: E731
        return (f"prefill step = {1000 * step:.2f} ms + {1000 * prompt:.2f} ms per prompt + {1e6 * token:.2f} ms "
                f"per 1000 tokens + {1e9 * square:.2f} ms per 1000^2 tokens^2 of each prompt (fit rms "
                f"{1000 * self.prefill_rms:.2f} ms; one prompt of 32 tokens {ms([32])} ms, of 1024 {ms([1024])} ms, "
                f"16 of 32 {ms([32] * 16)} ms); decode step = {1000 * self.a:.2f} ms + {1000 * self.b:.3f} ms per "
                f"request + {1e6 * self.c:.2f} ms per 1000 KV tokens (fit rms {1000 * self.decode_rms:.2f} ms)")


def _prefill_terms(lengths: list[int]) -> list[float]:
    """What a prefill step's time grows with: the step, each prompt, each token, attention (length^2 per prompt)."""
    return [1.0, len(lengths), sum(lengths), sum(n * n for n in lengths)]


def _fit(rows: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """Least squares ys ~ rows @ coef with coef >= 0 (no cost term saves time: one fitted negative is dropped
    and the rest refitted) -> (coefficients, rms residual)."""
    x, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    while True:
        coef = torch.zeros(x.shape[1], dtype=torch.float64)
        coef[keep] = torch.linalg.lstsq(x[:, keep], y[:, None]).solution[:, 0]
        if (coef >= 0).all():
            return coef.tolist(), float((x @ coef - y).square().mean().sqrt())
        keep &= coef >= 0


# ----------------------------------------------------------------------------------------------------
# workload and simulation


def workload(seed: int, n: int, n_long: int, max_len: int, new: tuple[int, int]) -> list[dict]:
    """n requests in arrival order: prompt and output lengths; long prompts among the first 16 arrivals."""
    rng = random.Random(seed)
    long_at = set(rng.sample(range(min(16, n)), n_long))
    return [{"prompt": rng.randint(int(0.4 * max_len), int(0.6 * max_len)) if i in long_at else rng.randint(16, 64),
             "long": i in long_at, "new": rng.randint(*new)} for i in range(n)]


def arrivals(reqs: list[dict], seed: int, gap: float) -> None:
    """Poisson arrivals, `gap` seconds apart on average; gap 0: all at once (an offline batch)."""
    rng, t = random.Random(seed + 1000), 0.0
    for r in reqs:
        r["arrival"] = t
        t += rng.expovariate(1 / gap) if gap > 0 else 0.0


def simulate(reqs: list[dict], costs: Costs, prefill_bal, n_p: int, decode_bal, n_d: int) -> dict:
    """Discrete events in time order; at one instant, steps end, then requests arrive, then idle engines
    start a step (so requests arriving together share it) -> per-request ttft (s), tpot (s per output token
    after the first), and the makespans (s)."""
    events, seq, order = [], 0, {"prefill_done": 0, "decode_done": 0, "arrive": 1, "to_decode": 1}

    def push(t, kind, *payload):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, order.get(kind, 2), seq, kind, payload))

    queue = [deque() for _ in range(n_p)]
    prefill_busy = [False] * n_p
    waiting, running = [[] for _ in range(n_d)], [[] for _ in range(n_d)]
    decode_busy = [False] * n_d
    out = {"ttft": [0.0] * len(reqs), "tpot": [0.0] * len(reqs), "finish": [0.0] * len(reqs)}

    def start_prefill(e, now):
        batch, tokens = [], 0
        while queue[e] and (not batch or tokens + reqs[queue[e][0]]["prompt"] <= costs.budget):
            batch.append(queue[e].popleft())
            tokens += reqs[batch[-1]]["prompt"]
        prefill_busy[e] = True
        push(now + costs.prefill_step([reqs[i]["prompt"] for i in batch]), "prefill_done", e, batch)

    def start_decode(e, now):
        running[e] += waiting[e]
        waiting[e].clear()
        kv = sum(reqs[i]["prompt"] + reqs[i]["made"] for i in running[e])
        decode_busy[e] = True
        push(now + costs.decode_step(len(running[e]), kv), "decode_done", e)

    for i, r in enumerate(reqs):
        push(r["arrival"], "arrive", i)
    while events:
        now, _, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            (i,) = payload
            e = prefill_bal.pick(reqs[i]["prompt"])
            queue[e].append(i)
            push(now, "prefill_start", e)
        elif kind == "prefill_start":
            (e,) = payload
            if not prefill_busy[e] and queue[e]:
                start_prefill(e, now)
        elif kind == "prefill_done":
            e, batch = payload
            prefill_busy[e] = False
            for i in batch:
                prefill_bal.done(e, reqs[i]["prompt"])
                out["ttft"][i] = now - reqs[i]["arrival"]
                push(now, "to_decode", i)
            push(now, "prefill_start", e)
        elif kind == "to_decode":
            (i,) = payload
            r = reqs[i]
            r["made"], r["decode_start"] = 1, now  # the first token came from prefill
            r["engine"] = decode_bal.pick(r["prompt"] + r["new"])
            if r["made"] >= r["new"]:
                decode_bal.release(r["engine"], r["prompt"] + r["new"])
                out["finish"][i] = now
                continue
            waiting[r["engine"]].append(i)
            push(now, "decode_start", r["engine"])
        elif kind == "decode_start":
            (e,) = payload
            if not decode_busy[e] and (running[e] or waiting[e]):
                start_decode(e, now)
        else:  # decode_done
            (e,) = payload
            decode_busy[e] = False
            still = []
            for i in running[e]:
                r = reqs[i]
                r["made"] += 1
                if r["made"] < r["new"]:
                    still.append(i)
                    continue
                decode_bal.release(e, r["prompt"] + r["new"])
                out["finish"][i] = now
                out["tpot"][i] = (now - r["decode_start"]) / max(1, r["new"] - 1)
            running[e] = still
            push(now, "decode_start", e)
    out["makespan"] = max(out["finish"])
    out["prefill_makespan"] = max(r["arrival"] + t for r, t in zip(reqs, out["ttft"]))
    return out


def p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# ----------------------------------------------------------------------------------------------------
# report


def compare(args, costs: Costs, max_len: int, gaps: dict[str, float]) -> tuple[list[str], list[str]]:
    """-> (prefill table rows, decode table rows), each metric the mean over seeds."""
    policies = {"prefill": {"PrefillBalancer": lambda n: PrefillBalancer(n, max_len), "RoundRobin": RoundRobin},
                "decode": {"DecodeBalancer": DecodeBalancer, "RoundRobin": RoundRobin}}
    tables = {"prefill": [], "decode": []}
    for role, options in policies.items():
        for (scenario, gap), n in itertools.product(gaps.items(), (2, 4)):
            means = {}
            for name, make in options.items():
                acc = {}
                for seed in range(args.seeds):
                    reqs = workload(seed, args.requests, args.long, max_len, (args.new_min, args.new_max))
                    arrivals(reqs, seed, gap)
                    if role == "prefill":  # decode side fixed: 2 engines, DecodeBalancer
                        o = simulate(reqs, costs, make(n), n, DecodeBalancer(2), 2)
                        short = [t for r, t in zip(reqs, o["ttft"]) if not r["long"]]
                        long = [t for r, t in zip(reqs, o["ttft"]) if r["long"]]
                        metrics = {"makespan": o["prefill_makespan"], "p50": p(o["ttft"], 50), "p99": p(o["ttft"], 99),
                                   "short p99": p(short, 99), "long mean": statistics.mean(long)}
                    else:  # prefill side fixed: 2 engines, PrefillBalancer
                        o = simulate(reqs, costs, PrefillBalancer(2, max_len), 2, make(n), n)
                        metrics = {"makespan": o["makespan"], "p50": p(o["tpot"], 50), "p99": p(o["tpot"], 99)}
                    for k, v in metrics.items():
                        acc.setdefault(k, []).append(v)
                means[name] = {k: statistics.mean(v) for k, v in acc.items()}
            base = means["RoundRobin"]
            for name, m in means.items():
                ratio = " / ".join(f"{m[k] / base[k]:.2f}" for k in m)
                cells = " | ".join(f"{1000 * v:.1f}" for v in m.values())
                tables[role].append(f"| {scenario} | {n} | {name} | {cells} | {ratio} |")
    return tables["prefill"], tables["decode"]


def note(costs: Costs, max_len: int) -> str:
    long_kv, step = max_len // 2, costs.decode_step(32, 32 * 100)
    return ("What the tables say: with its own engines for the long tiers, the PrefillBalancer keeps short prompts "
            "from queueing behind long ones: with arrivals spread out their TTFT p99 falls about tenfold; in an "
            "offline batch much less, since an engine takes its whole queue in one step anyway. The long prompts "
            "pay: they share fewer engines (with 4 engines, one per tier, tier 3 has one), and in this workload they "
            "are most of the prefill work, so their TTFT, and with everything arriving at once the makespan, grow. "
            "The DecodeBalancer and round robin come out within a few percent: round robin already evens the "
            "request count, and on this model a decode step barely depends on KV length (DeepSeek-V4 attends to "
            f"compressed KV and a window): a long request's {long_kv} KV tokens add {1000 * costs.c * long_kv:.2f} ms "
            f"to a step of {1000 * step:.1f} ms at 32 requests of 100, so what the balancer gives up in request "
            "count to even out KV buys nothing here. Evening out KV pays where a step's time grows with the KV it "
            "reads: long contexts on a model whose attention reads all of them.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--new-min", type=int, default=16)
    ap.add_argument("--new-max", type=int, default=128)
    ap.add_argument("--load", type=float, default=0.6, help="offered prefill load on 2 engines (arrival rate)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    start = time.perf_counter()
    llm = LLM(default_model_path(), dtype="bfloat16", kv_cache_memory=256 << 20, num_threads=args.threads)
    max_len = llm.engine.config.max_model_len
    costs = Costs(llm)
    measured_s = time.perf_counter() - start
    print(costs.describe(), f"({measured_s:.0f} s to load and measure)", flush=True)
    # mean gap between arrivals: the workload's mean prefill work per request (alone in a step), over 2 engines
    work = statistics.mean(costs.prefill_step([r["prompt"]]) for s in range(args.seeds)
                           for r in workload(s, args.requests, args.long, max_len, (args.new_min, args.new_max)))
    gap = work / (2 * args.load)
    prefill_rows, decode_rows = compare(args, costs, max_len, {f"Poisson, {args.load:.0%}": gap, "all at once": 0.0})
    cmd = (f"python examples/bench_balancers.py --seeds {args.seeds} --requests {args.requests} --long {args.long} "
           f"--new-min {args.new_min} --new-max {args.new_max} --load {args.load} --threads {args.threads}")
    body = (
        f"CPU: `{platform.cpu_flags()}`, {args.threads} thread(s), the default model (tiny DeepSeek-V4, bf16, "
        f"max_model_len {max_len}: tiers at {', '.join(map(str, PrefillBalancer(1, max_len).bounds))} tokens). "
        f"Command: `{cmd}`.\n\n"
        "**The queueing is simulated with measured step costs**: disaggregated engines are independent processes, "
        "each on its own hardware, which a 2-vCPU machine cannot run side by side and time honestly; so each "
        "engine's queue is a discrete-event simulation whose step times were measured on the real engine "
        f"(deepinfer.LLM, one process, load average {os.getloadavg()[0]:.1f} at the end): {costs.describe()}. "
        f"Per seed {args.requests} requests: {args.long} long prompts of 0.4-0.6 x max_model_len among the first 16 "
        f"arrivals, the rest 16-64 tokens; {args.new_min}-{args.new_max} output tokens; Poisson arrivals at "
        f"{args.load:.0%} of 2 prefill engines' capacity (mean gap {1000 * gap:.1f} ms), or all at once (an offline "
        "batch). A prefill engine runs what is "
        "queued, oldest first, up to max_num_batched_tokens per step; decode engines batch all they hold. Each "
        f"number is the mean over {args.seeds} seeds, in ms; ratio = balancer / round robin, below 1 is better.\n\n"
        "Prefill engines (decode side: 2 engines, DecodeBalancer). Makespan = last first token; time to first "
        "token (TTFT) over all requests, then the short prompts' p99 and the long prompts' mean.\n\n"
        "| arrivals | prefill engines | policy | makespan | TTFT p50 | TTFT p99 | short TTFT p99 | long TTFT mean "
        "| ratio, same order |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(prefill_rows) + "\n\n"
        "Decode engines (prefill side: 2 engines, PrefillBalancer). Makespan = last token; time per output token "
        "(TPOT) after the first, per request.\n\n"
        "| arrivals | decode engines | policy | makespan | TPOT p50 | TPOT p99 | ratio, same order |\n"
        "|---|---|---|---|---|---|---|\n"
        + "\n".join(decode_rows) + "\n\n" + note(costs, max_len))
    print(body)
    write_section("Balancers", body)
    print(f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
