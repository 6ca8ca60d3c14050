"""Prefill-sized GEMMs: our kernels beside torch's bf16 and fp32 GEMMs on the same shapes, in one run.

A prefill step multiplies hundreds to thousands of token rows by each weight, so it is bound by the multiply-adds,
not by the weight reads a decode step is bound by. This times the linears of the medium Qwen3-MoE (qkv, o, an
expert's gate_up and down) at prefill row counts, bf16 activations as the engine runs them: our fastest kernel here
(each ISA on row-major weights, and the packed kernel on weights in bf16 pairs), torch's `F.linear` on bf16
operands (oneDNN) and on widened fp32 weights (MKL's sgemm, gemm_plan's "torch-fp32"). Rounds alternate the
candidates; each keeps its best call per round (after an untimed one: oneDNN builds its primitive on the first),
and the table shows medians over rounds.

    python examples/bench_prefill_gemm.py [--threads 1 2] [--rounds 5] [--write]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from deepinfer import platform
from deepinfer.docs import write_section
from deepinfer.layers import cpu_ops
from deepinfer.layers.gemm_plan import GemmPlan
from examples.sweep.roofline import best_time

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "expert gate_up": (1024, 1024), "expert down": (1024, 512)}
ROWS = [256, 1024, 4096]
CALLS = 3  # timed calls per candidate per round; its best counts


def candidates(x: torch.Tensor, w: torch.Tensor) -> dict:
    """name -> fn() for every path that multiplies x [M, K] bf16 by w [N, K] bf16 here."""
    out = {}
    for path in GemmPlan.cpu_paths(torch.bfloat16, x.shape[0]):
        out[path] = lambda isa=path[4:]: cpu_ops.linear_bf16(x, w, isa=isa)
    if cpu_ops.can_pack(w):
        wp = cpu_ops.pack_bf16_pairs(w)
        out[f"cpu-{cpu_ops.PACKED_ISA} packed"] = lambda: cpu_ops.linear_bf16(x, wp, isa=cpu_ops.PACKED_ISA,
                                                                             packed=True)
    out["torch-bf16"] = lambda: F.linear(x, w)
    out["torch-fp32"] = lambda: F.linear(x.float(), w.float()).to(torch.bfloat16)
    return out


def measure(threads: int, rounds: int) -> list[tuple]:
    """[(name, N, K, M, our best path, {candidate: median GFLOP/s})]."""
    platform.set_threads(threads)
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen) * 0.03).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            fns = candidates(x, w)
            rates = {c: [] for c in fns}
            for _ in range(rounds):
                for c, fn in fns.items():
                    rates[c].append(2 * m * n * k / best_time(fn, CALLS) / 1e9)  # its first call untimed
            med = {c: statistics.median(r) for c, r in rates.items()}
            ours = max((c for c in med if c.startswith("cpu-")), key=med.get)
            results.append((name, n, k, m, ours, med))
    return results


def table(threads: int, results: list[tuple]) -> str:
    rows = [f"{threads} thread(s):", "",
            "| weight (N x K) | rows | ours GFLOP/s (kernel) | torch bf16 | torch fp32 | ours / best torch |",
            "|---|---|---|---|---|---|"]
    for name, n, k, m, ours, med in results:
        torch_best = max(med["torch-bf16"], med["torch-fp32"])
        rows.append(f"| {name} ({n} x {k}) | {m} | {med[ours]:.1f} ({ours[4:]}) | {med['torch-bf16']:.1f} | "
                    f"{med['torch-fp32']:.1f} | {med[ours] / torch_best:.2f}x |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    args = ap.parse_args()
    tables = [table(t, measure(t, args.rounds)) for t in args.threads]
    body = (f"CPU: `{platform.cpu_flags()}`; bf16 activations and weights; GFLOP/s = 2 M N K / seconds, medians "
            f"of {args.rounds} alternated rounds, each the best of {CALLS} calls; "
            "`python examples/bench_prefill_gemm.py`.\n\n" + "\n\n".join(tables))
    print(body)
    if args.write:
        write_section(f"Prefill GEMMs beside torch, {platform.cpu_flags()}", body)  # one section per CPU


if __name__ == "__main__":
    main()
