"""Time to first token of a short request submitted right after a 4K-token prompt, on the default model,
without chunking (both prompts in one prefill step), with chunks of max_num_batched_tokens (the long prompt's
chunks go first) and with a long_prefill_token_threshold (the short prompt shares the first step with the
long one's first chunk). Rounds alternate in one process. Writes docs/benchmarks.md, "Chunked prefill".

    python examples/bench_chunked_prefill.py [--long 4096] [--short 32] [--budget 512] [--threshold 256]
"""
import argparse
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.default_model import smollm2_path
from deepinfer.docs import write_section


def ttft(llm: LLM, long: list[int], short: list[int]) -> dict:
    """Submits long, then short; steps until both have their first token -> seconds to each first token."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tag = time.monotonic_ns()
    engine.add_request(f"long-{tag}", long, params)
    engine.add_request(f"short-{tag}", short, params)
    start, first = time.perf_counter(), {}
    while engine.has_unfinished():
        for out in engine.step()[0]:
            first[out.request_id.split("-")[0]] = time.perf_counter() - start
    return first


def _long_prompt_note(times: dict) -> str:
    whole, chunked = (statistics.median(t["long"]) for t in list(times.values())[:2])
    return (f"The long prompt's own prefill took {whole / chunked:.2f}x as long whole as in chunks: each chunk's "
            "attention reads all the keys before it through masked query tiles, while the whole prompt's is one "
            "causal attention per layer.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--threshold", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    long, short = (torch.randint(3, 49000, (n,), generator=g).tolist() for n in (args.long, args.short))
    max_len = args.long + 64
    configs = {"whole prompts": dict(max_num_batched_tokens=max_len),
               f"chunks of {args.budget}": dict(max_num_batched_tokens=args.budget),
               f"chunks of {args.budget}, at most {args.threshold} per prompt":
                   dict(max_num_batched_tokens=args.budget, long_prefill_token_threshold=args.threshold)}
    engines = {name: LLM(smollm2_path(), dtype=args.dtype, max_model_len=max_len, kv_cache_memory=512 << 20,
                         **kw) for name, kw in configs.items()}
    for llm in engines.values():  # warm-up: GEMM plans, caches
        ttft(llm, long[:600], short)
    times = {name: {"long": [], "short": []} for name in configs}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for which, t in ttft(llm, long, short).items():
                times[name][which].append(t)
    rows = [f"| {name} | {statistics.median(t['short']):.2f} | {statistics.median(t['long']):.2f} |"
            for name, t in times.items()]
    body = (f"CPU: `{platform.cpu_flags()}`, {next(iter(engines.values())).engine.config.num_threads} thread(s), "
            f"SmolLM2-135M-Instruct, {args.dtype}. A {args.long}-token prompt and a {args.short}-token "
            f"prompt submitted together (the long one first), median of {args.rounds} alternating rounds. Command: "
            f"`python examples/bench_chunked_prefill.py --long {args.long} --short {args.short} --budget {args.budget} "
            f"--threshold {args.threshold} --rounds {args.rounds}`.\n\n"
            "| prefill | short prompt: time to first token (s) | long prompt: time to first token (s) |\n|---|---|---|\n"
            + "\n".join(rows) + "\n\nWithout a per-prompt cap the long prompt's chunks take every step's budget "
            "first (oldest first), so the short prompt waits for all of them; with the cap it shares the first step. "
            + _long_prompt_note(times))
    print(body)
    write_section("Chunked prefill", body)


if __name__ == "__main__":
    main()
