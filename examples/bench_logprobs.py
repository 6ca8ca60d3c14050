"""Decode with and without logprobs on the medium Qwen3-MoE (bf16, 64 prompt + 64 new tokens, ignore EOS, greedy,
LLM(num_scheduler_steps=8)): decode ms per step at batch 1, 16 and 64 with no logprobs, with the drawn token's
(logprobs=0) and with 5 top ones, in one process, alternated round by round; medians of the rounds. Logprobs are
computed inside the C++ decode call (cpu_ops.token_logprobs), so runs of 8 steps stay one call. Writes the table into
docs/benchmarks.md.

    python examples/bench_logprobs.py [--threads 2] [--rounds 3] [--batches 1 16 64] [--no-write]
"""
import argparse
import statistics

from deepinfer import platform
from deepinfer.docs import write_section
from examples.bench_medium_moe import NEW, PROMPT, alternated, medium_llm, per_round
from examples.bench_sampled_decode import decode_ms
from examples.make_medium_qwen3_moe import make

MODES = {"none": None, "logprobs=0": 0, "logprobs=5": 5}


def table(ms: dict, batches: list[int], threads: int) -> str:
    """ms: {(mode, batch): [ms per step, one per round]}."""
    med = {key: statistics.median(v) for key, v in ms.items()}
    rows = ["| threads | batch | no logprobs ms | logprobs=0 ms | logprobs=5 ms | logprobs=0 / none | "
            "logprobs=5 / none |", "|---|---|---|---|---|---|---|"]
    for b in batches:
        none, zero, five = (med[m, b] for m in MODES)
        rows.append(f"| {threads} | {b} | {none:.1f} | {zero:.1f} | {five:.1f} | {zero / none:.3f} | "
                    f"{five / none:.3f} |")
    return "\n".join(rows) + "\n\n" + per_round(ms, list(MODES), batches)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    llm = medium_llm(make(), args.batches, args.threads, num_scheduler_steps=8)
    ms = alternated(list(MODES), args.batches, args.rounds,
                    lambda mode, b: decode_ms(llm, b, mode, temperature=0, logprobs=MODES[mode]))
    text = table(ms, args.batches, args.threads)
    print(text)
    if not args.no_write:
        header = (f"Medium Qwen3-MoE, bf16, {PROMPT} prompt + {NEW} new tokens, ignore EOS, greedy, "
                  f"`LLM(num_scheduler_steps=8)`; decode ms per step without logprobs, with the drawn token's "
                  f"(logprobs=0) and with 5 top ones, medians of {args.rounds} rounds alternated in one process; "
                  f"`{platform.cpu_flags()}`, {args.threads} kernel thread(s).\n\n"
                  f"    python examples/bench_logprobs.py --threads {args.threads} --rounds {args.rounds}\n\n")
        write_section(f"Logprobs in the decode call: medium Qwen3-MoE, {args.threads} thread(s)", header + text)


if __name__ == "__main__":
    main()
