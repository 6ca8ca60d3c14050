"""Sampled against greedy decode on the medium Qwen3-MoE (bf16, 64 prompt + 64 new tokens, ignore EOS; sampled:
temperature 0.8, top-p 0.95, seeded), one decode step per engine call and LLM(num_scheduler_steps=8): decode ms per
step at batch 1, 16 and 64, all four in one process, alternated round by round (the order flips each round),
medians of the rounds. Writes the table into docs/benchmarks.md.

    python examples/bench_sampled_decode.py [--threads 2] [--rounds 3] [--batches 1 16 64]
"""
import argparse
import statistics
import time

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from examples.bench_medium_moe import NEW, PROMPT, alternated, medium_llm, per_round, prompts
from examples.make_medium_qwen3_moe import make

STEPS = (1, 8)
DRAWS = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.8, top_p=0.95)}
MODES = [(draw, k) for k in STEPS for draw in DRAWS]


def decode_ms(llm: LLM, batch: int, name: str, **params) -> float:
    """ms per decode step over the engine calls that ran decode steps only, after the first of them; the requests
    (named `name`) take SamplingParams(**params) beside the bench's length and a seed each."""
    engine, spent, steps = llm.engine, 0.0, 0
    for i, p in enumerate(prompts(batch, engine.vocab_size)):
        engine.add_request(f"{name}-{batch}-{i}-{time.monotonic_ns()}", p,
                           SamplingParams(max_tokens=NEW, ignore_eos=True, seed=i, **params))
    warm = False
    while engine.has_unfinished():
        prefills, decodes = engine.num_steps["prefill"], engine.num_steps["decode"]
        t = time.perf_counter()
        engine.step()
        if engine.num_steps["prefill"] == prefills and warm:
            spent += time.perf_counter() - t
            steps += engine.num_steps["decode"] - decodes
        warm = warm or engine.num_steps["decode"] > decodes
    return 1000 * spent / steps


def table(ms: dict, batches: list[int], threads: int) -> str:
    """ms: {((draw, k), batch): [ms per step, one per round]}."""
    med = {key: statistics.median(v) for key, v in ms.items()}
    rows = ["| threads | batch | greedy ms (k=1) | sampled ms (k=1) | sampled / greedy (k=1) | greedy ms (k=8) | "
            "sampled ms (k=8) | sampled / greedy (k=8) | sampled k=8 / k=1 |", "|---|---|---|---|---|---|---|---|---|"]
    for b in batches:
        g1, s1, g8, s8 = (med[(d, k), b] for k in STEPS for d in DRAWS)
        rows.append(f"| {threads} | {b} | {g1:.1f} | {s1:.1f} | {s1 / g1:.3f} | {g8:.1f} | {s8:.1f} | {s8 / g8:.3f} | "
                    f"{s8 / s1:.3f} |")
    return "\n".join(rows) + "\n\n" + per_round(ms, MODES, batches, lambda mode: f"{mode[0]} k={mode[1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = make()
    llms = {k: medium_llm(path, args.batches, args.threads, num_scheduler_steps=k) for k in STEPS}
    ms = alternated(MODES, args.batches, args.rounds,
                    lambda mode, b: decode_ms(llms[mode[1]], b, mode[0], **DRAWS[mode[0]]))
    text = table(ms, args.batches, args.threads)
    print(text)
    header = (f"Medium Qwen3-MoE, bf16, {PROMPT} prompt + {NEW} new tokens, ignore EOS; greedy against sampled "
              f"(temperature 0.8, top-p 0.95, a seed per request), one decode step per engine call (k=1) and "
              f"`LLM(num_scheduler_steps=8)` (k=8: up to 8 steps drawn, processed and scheduled in one C++ call); "
              f"decode ms per step, medians of {args.rounds} rounds alternated in one process; "
              f"`{platform.cpu_flags()}`, {args.threads} kernel thread(s).\n\n"
              f"    python examples/bench_sampled_decode.py --threads {args.threads} --rounds {args.rounds}\n\n")
    write_section(f"Sampled decode: medium Qwen3-MoE, {args.threads} thread(s)", header + text)


if __name__ == "__main__":
    main()
