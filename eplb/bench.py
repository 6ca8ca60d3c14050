"""EPLB benchmark: balance, planning time and weight moves of ``eplb.policy`` against DeepSeek's algorithm.

    python -m eplb.bench [--no-docs]

(a) the article's probe: 384 experts, 448 slots, 64 GPUs (7 per GPU), Zipf-skewed loads; in-sample
    (plan and score on the same counts) and out-of-sample on drifting traces (plan on window t, score
    on window t+1, by window sums and by per-step peaks);
(b) planning time for 58 layers x 256 experts -> 288 slots, decode EP144 (global) and prefill EP32 on
    4 nodes (hierarchical), against ``eplb.reference`` (DeepSeek's loops, re-implemented faithfully);
(c) expert slots moved per replan on a slowly drifting trace, with and without the previous plan;
(d) real routing: the trained default model (deepinfer/assets/tiny-moe) serving held-out source, its
    per-step loads scored like (a), beside a Zipf trace of the same shape.

moe_lb here is ``moe_lb_total``: sum over layers (and steps) of the busiest GPU's tokens over the sum of
the mean, 1.0 = perfect. Prints a table and writes it to docs/benchmarks.md under "## EPLB".
"""
from __future__ import annotations

import argparse
import os
import re
import time

import numpy as np
import torch

from eplb.placement import identity_phy2log, moe_lb_total, plan_transfers
from eplb.policy import REFERENCE_FLAGS, rebalance_experts
from eplb.reference import reference_rebalance_experts

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")


def zipf_trace(num_layers, num_experts, steps, skew, rho, sigma, tokens, seed):
    """Routed-token counts [steps, L, E]: each layer's popularity is Zipf(skew) over a random order of
    the experts, times a per-expert log-normal factor that drifts as an AR(1) process (rho per step,
    stationary log-sd sigma); each step samples ``tokens`` expert picks from it."""
    rng = np.random.default_rng(seed)
    base = np.stack([-skew * np.log(rng.permutation(num_experts) + 1.0) for _ in range(num_layers)])
    drift = rng.normal(0, sigma, (num_layers, num_experts))
    out = np.empty((steps, num_layers, num_experts), np.int64)
    for t in range(steps):
        drift = rho * drift + np.sqrt(1 - rho ** 2) * sigma * rng.normal(size=drift.shape)
        p = np.exp(base + drift)
        out[t] = rng.multinomial(tokens, p / p.sum(-1, keepdims=True))
    return torch.from_numpy(out)


def windows(trace, w):
    return [trace[i:i + w] for i in range(0, trace.shape[0] - w + 1, w)]


def _time(fn, reps):
    """(min wall ms, min CPU ms of this thread) over reps: the machine is shared, minima are the signal."""
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return min(wall) * 1e3, min(cpu) * 1e3


# ----------------------------------------------------------------------------------------------------


def probe(lines):
    """(a) 384 experts -> 448 slots on 64 GPUs."""
    E, R, G, L = 384, 448, 64, 8
    lines += ["### (a) Probe: 384 experts, 448 slots, 64 GPUs (7 per GPU), 8 layers", "",
              "In-sample: plan and score on the same 200-step window (32768 picks per step), by its sums and by",
              "its per-step peaks (sum over steps of the busiest GPU / sum of the mean). Out-of-sample: a drifting",
              "trace (AR(1) log-normal drift, rho 0.995 per step, sd 0.3) cut into 50-step windows; plan on",
              "window t, score on t + 1 (mean over 7 pairs). 'per-step planning' passes the [steps, L, E] loads.",
              "", "| skew | placement | in-sample sums | in-sample peaks | next window sums | next window peaks |",
              "|---|---|---|---|---|---|"]
    for skew in (0.6, 1.0):
        tr = zipf_trace(L, E, 400, skew, 0.995, 0.3, 32768, seed=int(skew * 10))
        ins = tr[:200].sum(0)
        wins = windows(tr, 50)
        plans = {
            "plain, 6 per GPU (no redundancy)": lambda w: identity_phy2log(L, E, E),
            "DeepSeek EPLB (reference loops)": lambda w: reference_rebalance_experts(w.sum(0), R, 1, 1, G)[0],
            "ours, reference-compatible flags": lambda w: rebalance_experts(w.sum(0), R, 1, 1, G, **REFERENCE_FLAGS)[0],
            "ours (default)": lambda w: rebalance_experts(w.sum(0), R, 1, 1, G)[0],
            "ours, per-step planning": lambda w: rebalance_experts(w, R, 1, 1, G)[0],
        }
        for name, plan in plans.items():
            gpus = G
            p_in = plan(tr[:200])
            oos = [plan(wins[i]) for i in range(len(wins) - 1)]
            sums = np.mean([moe_lb_total(wins[i + 1].sum(0), p, gpus) for i, p in enumerate(oos)])
            peaks = np.mean([moe_lb_total(wins[i + 1], p, gpus) for i, p in enumerate(oos)])
            lines.append(f"| {skew} | {name} | {moe_lb_total(ins, p_in, gpus):.4f} | "
                         f"{moe_lb_total(tr[:200], p_in, gpus):.4f} | {sums:.4f} | {peaks:.4f} |")
            print(lines[-1], flush=True)
    lines += ["", "The article reports 3.58 / 10.50 (plain) and 1.004 / 1.009 (DeepSeek's policy, in-sample) at",
              "skew 0.6 / 1.0 on its own sample; the rows above are this run's sample, all scored on the same",
              "counts. Per-step planning trades window sums for lower per-step peaks (its objective).", ""]


def timing(lines):
    """(b) 58 layers x 256 experts -> 288 slots."""
    L, E, R = 58, 256, 288
    w = zipf_trace(L, E, 20, 0.8, 0.99, 0.3, 65536, seed=3).sum(0)
    lines += ["### (b) Planning time: 58 layers x 256 experts -> 288 slots", "",
              "Minimum over repeats (the 2-core machine is shared with other jobs, so minima are the signal);",
              "CPU = this thread's CPU time. The reference loops run once per configuration (seconds each).", "",
              "| configuration | algorithm | wall ms | CPU ms | moe_lb |", "|---|---|---|---|---|"]
    for name, groups, nodes, gpus in (("decode EP144, global", 8, 18, 144), ("prefill EP32, 4 nodes", 8, 4, 32)):
        t = time.perf_counter()
        ref = reference_rebalance_experts(w, R, groups, nodes, gpus)[0]
        ref_ms = (time.perf_counter() - t) * 1e3
        rows = [("DeepSeek EPLB (reference loops)", ref_ms, float("nan"), ref)]
        for label, kw, reps in (("ours, reference-compatible flags", REFERENCE_FLAGS, 5),
                                ("ours (default)", {}, 21)):
            p = rebalance_experts(w, R, groups, nodes, gpus, **kw)[0]
            wall, cpu = _time(lambda: rebalance_experts(w, R, groups, nodes, gpus, **kw), reps)
            rows.append((label, wall, cpu, p))
        for label, wall, cpu, p in rows:
            cpu_s = "-" if np.isnan(cpu) else f"{cpu:.1f}"
            lines.append(f"| {name} | {label} | {wall:.1f} | {cpu_s} | {moe_lb_total(w, p, gpus):.4f} |")
            print(lines[-1], flush=True)
    lines.append("")


def moves(lines):
    """(c) slots moved per replan on a slowly drifting trace."""
    lines += ["### (c) Expert slots moved per replan (slowly drifting trace)", "",
              "Replan every 50 steps on the last window (rho 0.9995 per step, sd 0.3); 'in-sample' scores each",
              "plan on the window it was planned on, 'next window' on the following one. Means over 7 replans.", "",
              "| configuration | planning | moved slots per replan | in-sample | next window |",
              "|---|---|---|---|---|"]
    for name, (L, E, R, groups, nodes, gpus, skew) in {
            "58 x 256 -> 288, EP32 on 4 nodes": (58, 256, 288, 8, 4, 32, 0.8),
            "8 x 384 -> 448, EP64 global": (8, 384, 448, 1, 1, 64, 1.0)}.items():
        wins = windows(zipf_trace(L, E, 450, skew, 0.9995, 0.3, 32768, seed=7), 50)
        for label, sticky, tol in (("from scratch", False, 0.0), ("previous plan (default, strict)", True, 0.0),
                                   ("previous plan, move_tolerance=1e-3", True, 1e-3)):
            prev = rebalance_experts(wins[0].sum(0), R, groups, nodes, gpus)[0]
            moved, ins, nxt = [], [], []
            for i in range(1, len(wins) - 1):
                w = wins[i].sum(0)
                p = rebalance_experts(w, R, groups, nodes, gpus, prev_phy2log=prev if sticky else None,
                                      move_tolerance=tol)[0]
                moved.append(plan_transfers(prev, p, gpus)[1])
                ins.append(moe_lb_total(w, p, gpus))
                nxt.append(moe_lb_total(wins[i + 1].sum(0), p, gpus))
                prev = p
            lines.append(f"| {name} | {label} | {np.mean(moved):.1f} of {L * R} | {np.mean(ins):.4f} | "
                         f"{np.mean(nxt):.4f} |")
            print(lines[-1], flush=True)
    lines.append("")


def real_trace(prompts=64, prompt_tokens=64, new_tokens=32, batch=16):
    """[steps, L, E] expert loads of the default model generating from held-out source, one row per
    engine step (prefill steps carry whole prompts, decode steps one token per sequence)."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.default_model import default_model_path, held_out_prompts

    llm = LLM(default_model_path(), dtype="float32", max_num_seqs=batch, kv_cache_memory=256 << 20)
    ids = held_out_prompts(llm.get_tokenizer(), prompts, prompt_tokens)
    llm.generate([{"prompt_token_ids": p} for p in ids],
                 SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return llm.get_expert_load()


def score_rows(trace, gpus, slots):
    """Plain vs EPLB placement of trace [steps, L, E]: planned on the whole trace (in-sample) and on its
    first half (scored on the second) -> {placement: (in sums, in peaks, next sums, next peaks)}."""
    L, E = trace.shape[1:]
    half = trace.shape[0] // 2
    plans = {f"plain, {E // gpus} per GPU": lambda w: identity_phy2log(L, E, E),
             f"EPLB, {slots} slots ({slots // gpus} per GPU)": lambda w: rebalance_experts(w.sum(0), slots, 1, 1, gpus)[0]}
    out = {}
    for name, plan in plans.items():
        p_in, p_half = plan(trace), plan(trace[:half])
        out[name] = (moe_lb_total(trace.sum(0), p_in, gpus), moe_lb_total(trace, p_in, gpus),
                     moe_lb_total(trace[half:].sum(0), p_half, gpus), moe_lb_total(trace[half:], p_half, gpus))
    return out


def real_routing(lines):
    """(d) the trained default model's routing beside a Zipf trace with its shape and picks per step."""
    trace = real_trace()
    steps, L, E = trace.shape
    picks = int(trace.sum((1, 2)).float().mean() / L)
    per_layer = ", ".join(f"{float(x.max() / x.float().mean()):.2f}" for x in trace.sum(0))
    lines += ["### (d) Real routing: the trained default model", "",
              f"The embedded tiny DeepSeek-V4 (docs/tiny_moe.md; {L} MoE layers x {E} experts, top-2, the first "
              "hash-routed) generating 32 tokens after each of 64 held-out 64-token stretches of stdlib source, "
              f"batch 16, fp32: {steps} engine steps, {picks} picks per layer per step on average. Per-layer "
              f"max / mean load over the run: {per_layer}. Placed on 4 GPUs; in-sample = planned and scored on "
              "the whole trace, next half = planned on its first half and scored on the second. The Zipf rows "
              "are (a)'s generator at the same shape and mean picks per step (rho 0.995, sd 0.3).", "",
              "| trace | placement | in-sample sums | in-sample peaks | next half sums | next half peaks |",
              "|---|---|---|---|---|---|"]
    zipf = zipf_trace(L, E, steps, 0.6, 0.995, 0.3, picks, seed=11)
    peaks = {}  # trace -> next-half peaks of (plain, EPLB)
    for label, tr in (("real (tiny-moe)", trace), ("Zipf 0.6, same shape", zipf)):
        rows = score_rows(tr, 4, E + E // 2)
        peaks[label] = [scores[3] for scores in rows.values()]
        for name, scores in rows.items():
            lines.append(f"| {label} | {name} | " + " | ".join(f"{x:.4f}" for x in scores) + " |")
            print(lines[-1], flush=True)
    (real_plain, real_eplb), (zipf_plain, zipf_eplb) = peaks.values()
    lines += ["", f"Next-half peaks: EPLB takes the real trace from {real_plain:.3f} to {real_eplb:.3f} and the Zipf "
              f"trace from {zipf_plain:.3f} to {zipf_eplb:.3f}. The trained router is far less skewed than Zipf 0.6: "
              "its aux-loss-free bias balancing evened the load during training, so what is left for EPLB is mostly "
              "per-step noise of 16 sequences, which a plan from the past does not predict.", ""]


def write_docs(lines, path=DOCS):
    """Replace the '## EPLB' section of the shared benchmarks file (or append it), nothing else."""
    section = "## EPLB\n\n" + "\n".join(lines).rstrip() + "\n\n"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    m = re.search(r"^## EPLB[ \t]*\n.*?(?=^## |\Z)", text, flags=re.S | re.M)
    text = text[:m.start()] + section + text[m.end():] if m else text.rstrip("\n") + "\n\n" + section
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m eplb.bench")
    ap.add_argument("--no-docs", action="store_true", help="print only, do not touch docs/benchmarks.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    lines = [f"`python -m eplb.bench` (numpy {np.__version__}, torch {torch.__version__}, "
             f"load average {load:.1f} on {os.cpu_count()} cores at start).", ""]
    probe(lines)
    timing(lines)
    moves(lines)
    real_routing(lines)
    lines.append(f"Total benchmark time {time.perf_counter() - t0:.0f} s.")
    print(lines[-1])
    if not args.no_docs:
        write_docs(lines)
        print(f"wrote the EPLB section of {DOCS}")


if __name__ == "__main__":
    main()
