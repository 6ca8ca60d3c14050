"""What structured outputs cost: decode ms per step at batch 64 on the default model, every request free
against every request under a JSON schema, alternating in one process, with the grammar's share of a step
(xgrammar's bitmask fill and the apply_token_mask kernel) timed inside it. Writes docs/benchmarks.md,
section "Structured outputs".

    python examples/bench_structured_outputs.py [--batch 64] [--new 64] [--rounds 2] [--threads N]
"""
import argparse
import statistics
import time
from unittest import mock

from deepinfer import LLM, SamplingParams, platform
from deepinfer.default_model import smollm2_path
from deepinfer.docs import write_section
from deepinfer.layers import sampler

# Long enough that no request completes its grammar before max_tokens: every step stays at full batch.
SCHEMA = {"type": "object", "required": ["notes"], "additionalProperties": False,
          "properties": {"notes": {"type": "array", "minItems": 60,
                                   "items": {"type": "string", "pattern": "^[a-z ]{1,12}$"}}}}
TOPICS = ["France", "a cat", "the sea", "winter", "coffee", "a bicycle", "music", "the moon"]


class GrammarTimer:
    """Adds up the time the sampler spends building and applying bitmasks."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def decode_steps(llm: LLM, batch: int, new: int, constrained: bool) -> tuple[list[float], list[float]]:
    """One batch through the engine step by step -> per decode step at full batch (a step of `batch` tokens;
    the first is left out, it warms caches): its ms, and the ms the grammar took inside it."""
    so = {"json": SCHEMA, "disable_any_whitespace": True} if constrained else None
    chats = [[{"role": "user", "content": f"Write notes about {TOPICS[i % len(TOPICS)]} as JSON."}]
             for i in range(batch)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=new, ignore_eos=True, structured_outputs=so)
              for i in range(batch)]
    engine, timer = llm.engine, GrammarTimer()
    for i, (chat, p) in enumerate(zip(chats, params)):
        _, ids = llm.prepare_request(i, llm.chat_prompt(chat), p)
        engine.add_request(f"{constrained}-{time.monotonic_ns()}-{i}", ids, p)
    steps, grammar = [], []
    with mock.patch.object(sampler, "batch_bitmask", timer.wrap(sampler.batch_bitmask)), \
            mock.patch.object(sampler, "apply_bitmask", timer.wrap(sampler.apply_bitmask)):
        while engine.has_unfinished():
            start, before = time.perf_counter(), timer.seconds
            _, tokens = engine.step()
            if tokens == batch:
                steps.append(1000 * (time.perf_counter() - start))
                grammar.append(1000 * (timer.seconds - before))
    return steps[1:], grammar[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(smollm2_path(), dtype=args.dtype, max_model_len=1024, kv_cache_memory=512 << 20,
              max_num_seqs=args.batch, num_threads=args.threads)
    decode_steps(llm, args.batch, 4, True)  # compiles the schema once, warms both paths
    ms, grammar_ms = {False: [], True: []}, []
    for _ in range(args.rounds):
        for constrained in (False, True):
            steps, grammar = decode_steps(llm, args.batch, args.new, constrained)
            ms[constrained] += steps
            grammar_ms += grammar if constrained else []
    free, bound = statistics.median(ms[False]), statistics.median(ms[True])
    body = (f"CPU: `{platform.cpu_flags()}`, {llm.engine.config.num_threads} thread(s), "
            f"SmolLM2-135M-Instruct, {args.dtype}, batch {args.batch}, {args.new} new tokens, {args.rounds} "
            f"alternating rounds. Command: `python examples/bench_structured_outputs.py --batch {args.batch} "
            f"--new {args.new} --rounds {args.rounds}`.\n\n"
            "Every request under a JSON schema (an object holding an array of at least 60 short strings, so no "
            "request completes before max_tokens and every step stays at full batch) against every request free, "
            "median decode ms per step at full batch; the grammar's share is xgrammar's bitmask fill plus the "
            "apply_token_mask kernel, per step.\n\n"
            "| requests | decode ms/step | throughput vs free | grammar ms/step |\n|---|---|---|---|\n"
            f"| free | {free:.1f} | 1.00x | 0 |\n"
            f"| JSON schema | {bound:.1f} | {free / bound:.2f}x | {statistics.median(grammar_ms):.1f} |\n\n"
            f"Median step time with the schema is {100 * (bound / free - 1):+.1f}% against free requests (alternating "
            f"rounds; steps of this size drift by several percent between rounds); the grammar's own work inside a "
            f"step is {100 * statistics.median(grammar_ms) / bound:.1f}% of it (target: under 10%).")
    print(body)
    write_section("Structured outputs", body)


if __name__ == "__main__":
    main()
