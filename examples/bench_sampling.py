"""The "sample" op on the CPU: the C++ kernel (cpu_ops.sample, what the engine's sampler and its one-call decode
steps run) against its torch reference, alternating in one process, at batch 64 x the default model's vocabulary;
each call's tokens are checked equal. Decode with sampled requests is measured by bench_sampled_decode.py (the
engine draws plain sampled rows inside its C++ decode call, where the reference cannot be swapped in). Writes
docs/benchmarks.md, section "Sampling on the CPU".

    python examples/bench_sampling.py [--batch 64] [--vocab 49152]
"""
import argparse
import time

import torch

from deepinfer import platform
from deepinfer.docs import write_section
from tilelang_ops.dispatch import get_op

OPS = {"C++ kernel": get_op("sample"), "torch reference": get_op("sample", impl="reference")}


def op_ms(batch: int, vocab: int, top_p: float, top_k: int, repeats: int = 5) -> dict:
    """Best of `repeats` calls of each op on one input -> ms; also checks they draw the same tokens."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(batch, vocab, generator=g) * 4, torch.full((batch,), 0.8),
            torch.full((batch,), top_k, dtype=torch.int64), torch.full((batch,), top_p), torch.zeros(batch),
            torch.arange(batch), torch.zeros(batch, dtype=torch.int64))
    out, ms = {}, {}
    for name, op in OPS.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out[name] = op(*args)
            best = min(best, time.perf_counter() - start)
        ms[name] = 1000 * best
    assert torch.equal(*out.values()), "the kernel and the reference drew different tokens"
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152, help="default: the default model's (SmolLM2)")
    args = ap.parse_args()
    vocab = args.vocab
    ops = {f"temperature 0.8{extra}": op_ms(args.batch, vocab, p, k)
           for extra, p, k in (("", 1.0, 0), (", top-k 50", 1.0, 50), (", top-p 0.9", 0.9, 0))}
    rows = "\n".join(f"| {name} | {ms['C++ kernel']:.1f} | {ms['torch reference']:.1f} | "
                     f"{ms['torch reference'] / ms['C++ kernel']:.1f}x |" for name, ms in ops.items())
    body = (f"CPU: `{platform.cpu_flags()}`, {platform.kernel_threads()} thread(s). Command: "
            f"`python examples/bench_sampling.py --batch {args.batch} --vocab {vocab}`. "
            "The engine's \"sample\" op on the CPU is a C++ kernel that draws the torch reference's tokens "
            "(checked here on every input); before it, the CPU engine ran the reference. Decode with sampled "
            "requests: \"Sampled decode\" (examples/bench_sampled_decode.py).\n\n"
            f"The op alone, {args.batch} rows x {vocab} tokens (best of 5):\n\n"
            "| rows | C++ kernel ms | torch reference ms | speedup |\n|---|---|---|---|\n" + rows)
    print(body)
    write_section("Sampling on the CPU", body)


if __name__ == "__main__":
    main()
