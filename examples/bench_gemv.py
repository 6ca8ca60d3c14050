"""Batch-1 weight read rate of the engine's kernels on cold weights, beside torch's streaming read in one run.

A decode step at batch 1 spends most of its time reading each weight once. This times the kernels that read the
weights of a medium Qwen3-MoE layer (qkv, o, the top-4 experts; not the 64 KB router, which one call per copy could
not time) and its LM head, each call on weights no cache holds (copies cycled through a buffer far past the L3),
alternated round by round with torch's sum over 512 MiB (the other reader of examples/sweep/roofline.py), and
reports each rate and its ratio to the sum of the same round.

    python examples/bench_gemv.py [--threads 1 2] [--rounds 5] [--write]
"""
import argparse
import statistics

import torch

from deepinfer import _C, platform
from deepinfer.docs import write_section
from deepinfer.memory import huge_page_zeros
from examples.sweep.roofline import best_time, gemv_kernel, gemv_reader, read_array

H, I, TOP_K, VOCAB, QKV = 1024, 512, 4, 32000, 1536  # the medium Qwen3-MoE (examples/make_medium_qwen3_moe.py)
COLD_BYTES = 384 << 20  # weights cycled per pass: over 10x the L3 of the machines here
PASSES = 3  # timed passes per round; its best counts
LINEARS = {"qkv": (QKV, H), "o": (H, H), "lm_head": (VOCAB, H)}


def linear_pass(n: int, k: int, threads: int):
    """A pass of one-row linears over copies of an [n, k] bf16 weight: (fn, bytes read per pass)."""
    copies = max(2, COLD_BYTES // (n * k * 2))
    w = huge_page_zeros((copies, n, k), torch.bfloat16).fill_(0.01)
    read = gemv_reader(n, k, threads)
    ptrs = [w[c].data_ptr() for c in range(copies)]

    def run():
        for p in ptrs:
            read(p)
    return run, w.numel() * 2


def experts_pass(threads: int):
    """A pass of one token's top-4 experts (the engine's grouped kernel) over fresh experts each call, as at
    batch 1: (fn, bytes read per pass)."""
    total = COLD_BYTES // (3 * I * H * 2)  # experts in the buffer, TOP_K new ones per call
    w13 = huge_page_zeros((total, 2 * I, H), torch.bfloat16).fill_(0.01)
    w2 = huge_page_zeros((total, H, I), torch.bfloat16).fill_(0.01)
    x, y = torch.full((TOP_K, H), 0.5), torch.empty(TOP_K, H)
    _, isa, packed = gemv_kernel()
    offsets = []
    for first in range(0, total - TOP_K + 1, TOP_K):
        counts = torch.zeros(total, dtype=torch.int64)
        counts[first:first + TOP_K] = 1
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))

    def run():
        for off in offsets:
            _C.grouped_experts_bf16(x.data_ptr(), off.data_ptr(), total, 0, w13.data_ptr(), w2.data_ptr(),
                                    y.data_ptr(), H, I, float("inf"), isa, False, packed, threads)
    return run, len(offsets) * TOP_K * 3 * I * H * 2


def measure(threads: int, rounds: int) -> dict:
    """name -> (median GB/s, median ratio to the same round's sum); "sum" -> (median GB/s, 1.0)."""
    torch.set_num_threads(threads)
    a = read_array()
    passes = {name: linear_pass(n, k, threads) for name, (n, k) in LINEARS.items()}
    passes["experts (top-4)"] = experts_pass(threads)
    rates = {name: [] for name in ["sum", *passes]}
    ratios = {name: [] for name in passes}
    for _ in range(rounds):
        rates["sum"].append(a.numel() * 4 / best_time(a.sum, PASSES) / 1e9)
        for name, (fn, nbytes) in passes.items():
            rates[name].append(nbytes / best_time(fn, PASSES) / 1e9)
            ratios[name].append(rates[name][-1] / rates["sum"][-1])
    return {name: (statistics.median(r), statistics.median(ratios.get(name, [1.0]))) for name, r in rates.items()}


def table(results: dict) -> str:
    threads = sorted(results)
    head = "| weights | " + " | ".join(f"GB/s, {t} thread(s) | / sum, {t} thread(s)" for t in threads) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(threads))]
    for name in results[threads[0]]:
        cells = [f"{results[t][name][0]:.1f} | {results[t][name][1]:.2f}" for t in threads]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()
    results = {t: measure(t, args.rounds) for t in args.threads}
    isa, _, packed = gemv_kernel()
    body = (f"CPU: `{platform.cpu_flags()}`; kernel `{isa}`, weights {'packed' if packed else 'row-major'}; "
            f"medians of {args.rounds} rounds, each the best of {PASSES} passes; `python examples/bench_gemv.py`.\n\n"
            + table(results))
    print(body)
    if args.write:
        write_section("Batch-1 weight read rate", body)


if __name__ == "__main__":
    main()
