"""Decode ms per step on the medium Qwen3-MoE shape at batch 1, 16 and 64 (64 prompt + 64 new
tokens, greedy, ignore EOS), deepinfer beside transformers' generate on the same checkpoint in the
same run, plus the machine's floor. Writes the table into docs/benchmarks.md. --dtype float32 runs both in fp32
(the checkpoint's bf16 weights widened; its own section).

    python examples/bench_medium_moe.py [--batches 1 16 64] [--threads 1] [--skip-hf] [--dtype float32]
"""
import argparse
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from deepinfer.layers import gemm_plan
from examples.make_medium_qwen3_moe import make
from examples.sweep import metrics
from examples.sweep.model_cost import decode_step_cost, load_config, shape
from examples.sweep.roofline import matmul_for, measure

PROMPT, NEW = 64, 64


def medium_llm(path: str, batches: list[int], threads: int, dtype: str = "bfloat16", **options) -> LLM:
    """The medium checkpoint at `path` (in bf16 by default), sized for batches of up to max(batches) PROMPT + NEW
    tokens."""
    return LLM(path, dtype=dtype, max_model_len=256, max_num_seqs=max(batches), kv_cache_memory=512 << 20,
               num_threads=threads, **options)


def alternated(modes: list, batches: list[int], rounds: int, run) -> dict:
    """{(mode, batch): [run(mode, batch), one per round]}: every round runs each batch in every mode, the modes in
    reverse order every other round (the host's drift falls on both sides)."""
    out = {(m, b): [] for m in modes for b in batches}
    for r in range(rounds):
        for b in batches:
            for m in (modes if r % 2 == 0 else modes[::-1]):
                out[m, b].append(run(m, b))
    return out


def per_round(ms: dict, modes: list, batches: list[int], label=str) -> str:
    """alternated's {(mode, batch): [ms, one per round]} as a line: "Per round (ms): batch b: <label(mode)> r1 / r2
    ...; ..."."""
    rounds = "; ".join(f"batch {b}: " + ", ".join(f"{label(m)} " + " / ".join(f"{x:.1f}" for x in ms[m, b])
                                                  for m in modes) for b in batches)
    return f"Per round (ms): {rounds}."


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(batch)]


def deepinfer_decode_ms(llm: LLM, batch: int) -> float:
    """Mean wall time of the decode steps (schedule + forward + sample + output processing): the engine's calls
    that only decode, after the first, over the decode steps they ran (one call runs up to num_scheduler_steps)."""
    engine = llm.engine
    for i, p in enumerate(prompts(batch, engine.vocab_size)):
        engine.add_request(f"b{batch}-{i}", p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    seconds, steps = [], []
    while engine.has_unfinished():
        t, before = time.perf_counter(), engine.num_steps["decode"]
        is_decode = engine.scheduler.num_waiting == 0
        engine.step()
        if is_decode:
            seconds.append(time.perf_counter() - t)
            steps.append(engine.num_steps["decode"] - before)
    return 1000 * sum(seconds[1:]) / sum(steps[1:])


def hf_decode_ms(model, batch: int, vocab: int) -> float:
    """(generate 64 new - generate 1 new) / 63: decode steps only, prefill cancels out."""
    ids = torch.tensor(prompts(batch, vocab))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    times = {}
    for n in (1, NEW):
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        times[n] = time.perf_counter() - t
    return 1000 * (times[NEW] - times[1]) / (NEW - 1)


def floor_ms(path: str, batch: int, rates: dict, elem_bytes: int = 2) -> float:
    """The sweep's floor of one decode step (examples/sweep/model_cost.py): the weights some token
    touches plus the KV at the mean decode context (elem_bytes each: 2 in bf16, 4 in fp32), over bandwidth, or FLOPs
    over the matmul rate such a model's products reach (roofline.matmul_for)."""
    cost = decode_step_cost(shape(load_config(path)), batch, PROMPT + NEW / 2, elem_bytes, elem_bytes)
    matmul = matmul_for(rates, elem_bytes == 4)
    return metrics.floor_ms(cost["bytes"], cost["flops"], rates["bandwidth"], matmul)["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    path = make()
    dtype = getattr(torch, args.dtype)
    rates = measure(args.threads)
    # The engine sets the process-wide thread count transformers runs with too.
    llm = medium_llm(path, args.batches, args.threads, args.dtype)
    cfg = llm.engine.hf_config
    ours = {b: deepinfer_decode_ms(llm, b) for b in args.batches}
    del llm
    hf = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf = {b: hf_decode_ms(model, b, cfg.vocab_size) for b in args.batches}
    rows = ["| batch | floor ms | deepinfer ms | transformers ms | speedup vs transformers | deepinfer / floor |",
            "|---|---|---|---|---|---|"]
    for b in args.batches:
        fl = floor_ms(path, b, rates, dtype.itemsize)
        h = hf.get(b)
        rows.append(f"| {b} | {fl:.1f} | {ours[b]:.1f} | {h:.1f} | {h / ours[b]:.2f}x | {ours[b] / fl:.2f} |" if h else
                    f"| {b} | {fl:.1f} | {ours[b]:.1f} | - | - | {ours[b] / fl:.2f} |")
    table = "\n".join(rows) + "\n\n" + gemm_plan.PLAN.report()
    print(table)
    rate_kind = "fp32" if dtype == torch.float32 else "best of fp32, bf16"
    header = (f"Medium Qwen3-MoE (vocab 32000, hidden 1024, 16 layers, 16/4 heads of 64, 32 experts top-4, "
              f"moe_intermediate 512, {args.dtype}), {PROMPT} prompt + {NEW} new tokens, greedy, ignore EOS; decode "
              f"ms per step; torch threads = {args.threads}. Floor from rates measured in the same run: read "
              f"{rates['bandwidth'] / 1e9:.1f} GB/s, matmul ({rate_kind}) "
              f"{matmul_for(rates, dtype == torch.float32) / 1e9:.0f} GFLOP/s "
              f"(`{platform.cpu_flags()}`).\n\n"
              f"    python examples/bench_medium_moe.py --threads {args.threads}"
              f"{'' if dtype == torch.bfloat16 else ' --dtype ' + args.dtype}\n\n")
    # One section per CPU: machines differ from session to session, and each keeps its own table.
    title = ("Engine core: medium Qwen3-MoE decode" + ("" if dtype == torch.bfloat16 else f" ({args.dtype})") +
             f", {platform.cpu_flags()}")
    write_section(title, header + table)


if __name__ == "__main__":
    main()
