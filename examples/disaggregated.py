"""Disaggregated prefill and decode on the embedded default model (a tiny DeepSeek-V4 MoE): one prefill and
one decode engine, each its own process (Ray actors on 127.0.0.1), the prefilled KV and StateBlock moving
between them over pyzmq; then the prefix KV store (LMDB) serving a shared prompt prefix from disk.

Checks and prints: the generations are token-identical to a NORMAL engine's, the KV bytes each request
moved equal the memory plan's formula, and the second pass over a shared prefix loads it from the store.

    .venv/bin/python examples/disaggregated.py [--prefill 1] [--decode 1] [--state-transfer auto|state|replay]
"""
import argparse
import logging
import os
import tempfile

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_model_path
from examples.offline import PROMPTS

# A shared header many requests start with (a system prompt's role): long enough to fill whole KV blocks.
HEADER = ('"""Utilities for reading, validating and writing configuration files.\n\nThe functions here accept '
          'a path or an open file object and return plain dictionaries.\n"""\nimport json\nimport os\nimport '
          're\nimport sys\nfrom collections import OrderedDict\n\n__all__ = ["load", "dump", "validate"]\n\n'
          '_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")\n\n\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--state-transfer", default="auto", choices=["auto", "state", "replay"])
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = default_model_path()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    kw = dict(kv_cache_memory=256 << 20, max_num_seqs=16)

    normal = LLM(path, **kw)
    reference = normal.generate(PROMPTS, params, use_tqdm=False)
    plan = normal.engine.state_transfer
    del normal

    llm = LLM(path, disaggregation={"prefill": args.prefill, "decode": args.decode,
                                    "state_transfer": args.state_transfer}, **kw)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        print(f"--- TTFT {out.metrics.time_to_first_token * 1000:.0f} ms | {out.prompt!r}\n{out.outputs[0].text}")
    same = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    stats = llm.engine.stats
    replayed = stats["replayed"] > 0
    formula = sum(plan.expected_bytes(len(o.prompt_token_ids), replayed) for o in outs if len(o.outputs[0].token_ids) > 1)
    print(f"\n{args.prefill} prefill + {args.decode} decode engines: tokens identical to NORMAL: {same}")
    print(f"KV moved: {stats['kv_bytes']} bytes over {stats['transfers']} handoffs (memory plan: {formula}; "
          f"{'equal' if formula == stats['kv_bytes'] else 'DIFFERENT'}), {stats['wire_bytes']} on the wire, "
          f"StateBlock {'replayed' if replayed else 'sent'}, {stats['retries']} retries")
    engines = llm.engine.shutdown()
    for (role, i), s in sorted(engines.items()):
        print(f"{role} engine {i}: {s['steps']} steps, {s['handoffs']} handoffs sent, {s['imported']} imported")

    with tempfile.TemporaryDirectory() as store:
        prompts = [HEADER + p for p in PROMPTS]
        runs = []
        for run in ("first", "second"):
            # A hit prefills only the suffix: fewer rows per GEMM, which in bf16 may take another kernel (another
            # reduction order) than the full prompt did. batch_invariant pins one order, so a hit must give the
            # tokens of a miss bit for bit (without it they differed on an AVX512-BF16 CPU).
            llm = LLM(path, prefix_cache={"path": store, "max_bytes": 64 << 20}, batch_invariant=True, **kw)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            s = llm.engine.prefix_cache.store.stats()
            print(f"prefix store, {run} engine: {s['hits']} blocks loaded, {s['stored']} stored, {s['entries']} "
                  f"entries ({s['bytes']} bytes) on disk")
            del llm
        print(f"prefix store: the second engine's tokens equal the first's: {runs[0] == runs[1]}")


if __name__ == "__main__":
    main()
