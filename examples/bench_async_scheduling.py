"""Async scheduling (LLM(async_scheduling=True)) against synchronous steps on the medium Qwen3-MoE (bf16, 64 prompt
+ 64 new tokens, greedy, ignore EOS): decode ms per step at batch 1, 16 and 64, both engines in one process and
alternated round by round (the order flips each round), medians of the rounds. Beside each step time: the part of
it outside the forward and sampling (runner.draw or runner.execute), which is all async scheduling can hide and,
unlike the step time, barely moves with the weight stream's noise. Writes the table into docs/benchmarks.md.

    python examples/bench_async_scheduling.py [--threads 1] [--rounds 3] [--batches 1 16 64]
"""
import argparse
import statistics
import time

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from examples.bench_medium_moe import NEW, PROMPT, alternated, medium_llm, prompts
from examples.make_medium_qwen3_moe import make

MODES = ("sync", "async")


def decode_ms(llm: LLM, batch: int) -> tuple[float, float]:
    """(ms per decode step, ms of it outside the forward and sampling), over the decode steps after the first. The
    forward runs in runner.draw (the one-call decode step) or, where that cannot run (it returns None having run
    nothing), runner.execute: both are timed."""
    engine, runner, spent = llm.engine, llm.engine.runner, []

    def timing(call):
        def timed(*args):
            t = time.perf_counter()
            out = call(*args)
            if out is not None:
                spent.append(time.perf_counter() - t)
            return out
        return timed
    runner.execute, runner.draw = timing(runner.execute), timing(runner.draw)
    for i, p in enumerate(prompts(batch, engine.vocab_size)):
        engine.add_request(f"b{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    engine.step()  # the prefill, and in async mode the first decode step's launch
    engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    del runner.execute, runner.draw
    # Each step() in the loop completes one forward (async: the first of them was launched just before `start`).
    forward = sum(spent[-steps:])
    return 1000 * total / steps, 1000 * (total - forward) / steps


def table(ms: dict, batches: list[int], threads: int) -> str:
    rows = ["| threads | batch | sync ms | async ms | async / sync | sync outside ms | async outside ms | "
            "per round (sync / async) |", "|---|---|---|---|---|---|---|---|"]
    for b in batches:
        (s, s_out), (a, a_out) = ([statistics.median(x[i] for x in ms[m, b]) for i in (0, 1)] for m in MODES)
        rounds = ", ".join(f"{x[0]:.1f} / {y[0]:.1f}" for x, y in zip(ms["sync", b], ms["async", b]))
        rows.append(f"| {threads} | {b} | {s:.1f} | {a:.1f} | {a / s:.3f} | {s_out:.2f} | {a_out:.2f} | {rounds} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = make()
    # one step per call in both modes: async scheduling against the plain synchronous step
    llms = {m: medium_llm(path, args.batches, args.threads, async_scheduling=m == "async", num_scheduler_steps=1)
            for m in MODES}
    # {(mode, batch): [(ms per step, ms outside the forward), one per round]}
    ms = alternated(MODES, args.batches, args.rounds, lambda m, b: decode_ms(llms[m], b))
    text = table(ms, args.batches, args.threads)
    print(text)
    header = (f"Medium Qwen3-MoE, bf16, {PROMPT} prompt + {NEW} new tokens, greedy, ignore EOS; decode ms per step "
              f"(schedule, forward, sampling and output processing), medians of {args.rounds} rounds alternated in "
              f"one process; `{platform.cpu_flags()}`, {args.threads} kernel thread(s). Outside: the part of a step "
              f"outside the forward and sampling, all that async scheduling can hide; the async path hides the "
              f"scheduling and the previous step's output processing but pays two thread hand-offs per step (the "
              f"forward's end wakes the main thread, the next launch wakes the worker) and builds the next step's "
              f"sampling tensors after its tokens arrive.\n\n"
              f"    python examples/bench_async_scheduling.py --threads {args.threads} --rounds {args.rounds}\n\n")
    write_section(f"Async scheduling: medium Qwen3-MoE decode, {args.threads} thread(s)", header + text)


if __name__ == "__main__":
    main()
