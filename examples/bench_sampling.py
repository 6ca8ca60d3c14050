"""Sampled decode on the CPU: the "sample" op as the C++ kernel (cpu_ops.sample, what the engine runs) against
its torch reference, alternating in one process: the op alone at batch 64 x the default model's vocabulary, and
decode ms per step at batch 64 on the default model (temperature 0.8, top-p 0.95, seeded). Writes
docs/benchmarks.md, section "Sampling on the CPU".

    python examples/bench_sampling.py [--batch 64] [--new 24] [--rounds 2]
"""
import argparse
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.default_model import smollm2_path
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


def decode_ms(llm: LLM, batch: int, new: int) -> float:
    """Median decode step at full batch for one batch of seeded sampled requests."""
    engine, steps = llm.engine, []
    for i in range(batch):
        engine.add_request(f"{time.monotonic_ns()}-{i}", [1, 2, 3, 4 + i % 50] * 4,
                           SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=new, ignore_eos=True))
    while engine.has_unfinished():
        start = time.perf_counter()
        _, tokens = engine.step()
        if tokens == batch:
            steps.append(1000 * (time.perf_counter() - start))
    return statistics.median(steps[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(smollm2_path(), dtype="bfloat16", max_model_len=512, kv_cache_memory=256 << 20,
              max_num_seqs=args.batch)
    vocab = llm.engine.vocab_size
    ops = {f"temperature 0.8{extra}": op_ms(args.batch, vocab, p, k)
           for extra, p, k in (("", 1.0, 0), (", top-k 50", 1.0, 50), (", top-p 0.9", 0.9, 0))}
    decode_ms(llm, args.batch, 4)  # warm-up
    steps = {name: [] for name in OPS}
    for _ in range(args.rounds):
        for name, op in OPS.items():
            llm.engine.runner.sampler.sample = op
            steps[name].append(decode_ms(llm, args.batch, args.new))
    llm.engine.runner.sampler.sample = OPS["C++ kernel"]
    kernel, ref = (statistics.median(steps[n]) for n in OPS)
    rows = "\n".join(f"| {name} | {ms['C++ kernel']:.1f} | {ms['torch reference']:.1f} | "
                     f"{ms['torch reference'] / ms['C++ kernel']:.1f}x |" for name, ms in ops.items())
    body = (f"CPU: `{platform.cpu_flags()}`, {llm.engine.config.num_threads} thread(s). Command: "
            f"`python examples/bench_sampling.py --batch {args.batch} --new {args.new} --rounds {args.rounds}`. "
            "The engine's \"sample\" op on the CPU is a C++ kernel that draws the torch reference's tokens "
            "(checked here on every input); before it, the CPU engine ran the reference.\n\n"
            f"The op alone, {args.batch} rows x {vocab} tokens (best of 5):\n\n"
            "| rows | C++ kernel ms | torch reference ms | speedup |\n|---|---|---|---|\n" + rows + "\n\n"
            f"Decode at batch {args.batch} on SmolLM2-135M-Instruct (bf16; temperature 0.8, "
            f"top-p 0.95, seeded), median ms per step over {args.rounds} alternating rounds: {kernel:.1f} with the "
            f"kernel, {ref:.1f} with the reference ({ref / kernel:.2f}x).")
    print(body)
    write_section("Sampling on the CPU", body)


if __name__ == "__main__":
    main()
