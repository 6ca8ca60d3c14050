"""Speculative decoding on the medium DeepSeek-V4 (docs/benchmarks.md, "Speculative decoding on DeepSeek-V4").

The checkpoint is examples/make_medium_v4.py's plus one MTP layer of random weights (mtp.0.*, DeepSeek's
layout), written once to ~/.cache/deepinfer/medium-v4-mtp. Random weights mean the MTP's drafts are almost
never accepted, so its rows measure what MTP speculation costs (drafting k tokens after each step plus
verifying them); the replay drafter (the run's own greedy output, each draft kept with probability 0.75)
shows what V4 verification and rollback return when drafts are good.

    python examples/bench_v4_spec.py [--batch 16] [--new-tokens 24] [--threads 1] [--dtype float32]
    python examples/bench_v4_spec.py --model default     # real drafts: the trained default model's MTP layer

With --model default the drafts are real: the embedded tiny DeepSeek-V4 (docs/tiny_moe.md) and its trained
MTP layer continue held-out stretches of stdlib source, and the table gives the measured acceptance at each
draft position (docs/benchmarks.md, "Speculative decoding on DeepSeek-V4: real drafts").

fp32 by default: the random-weight model's next-token distribution is nearly flat (top logprob about -8 over
32,000 tokens), so in bf16 a different batch shape (a verify step's extra rows, or just another batch size)
flips greedy near-ties within a few tokens and the replay drafter's reference stops matching; fp32 keeps
the greedy path batch-invariant to within rounding on this model.
"""
import argparse
import gc
import json
import os
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from make_medium_v4 import DEFAULT_DIR, make

MTP_DIR = os.path.expanduser("~/.cache/deepinfer/medium-v4-mtp")
NOTE = ("The replay rows show what V4 verification and rollback return when drafts are good; their speedup "
        "is below the measured tokens per step because a verify row costs more than a decode row (the batched "
        "verify path: one row per query token, HCA accumulators advanced in waves). The MTP row, with random MTP "
        "weights and so no accepted drafts, is the pure cost of MTP speculation: the catch-up and k draft steps "
        "through the MTP layer plus k + 1 verify rows per sequence. A trained MTP layer's acceptance is measured on "
        "the trained default model: \"Speculative decoding on DeepSeek-V4: real drafts\".")
REAL_TITLE = "Speculative decoding on DeepSeek-V4: real drafts"
REAL_NOTE = ("Acceptance per draft position: accepted / verified drafts at that position (a draft counts as accepted "
             "only when every draft before it was), from LLM.get_spec_decoding_stats(). The article reports about "
             "0.8 at the first position for DeepSeek's MTP; this MTP layer belongs to a 12M-parameter model trained "
             "on about 4M tokens (docs/tiny_moe.md), whose own next-token accuracy is far lower, and a draft can be "
             "accepted only where the target's greedy token is predictable two tokens ahead, which in source code "
             "is mostly syntax and boilerplate. Rows with k > 1 draft each later position from the MTP layer's own "
             "output, so their acceptance falls with the position. Tokens per sequence per step are over the batch's makespan: a "
             "batch runs until its least lucky sequence is done. Speculation gains at batch 1 and loses at batch 16: "
             "this model's step is bound by per-layer glue and by its rows, not by reading its 25 MB of weights, so at "
             "batch 16 a verify step's extra rows plus the draft pass through the MTP layer cost more than the "
             "accepted tokens save. It pays where a step is bound by reading weights (large models, the article's "
             "case; the medium V4's rows under \"Speculative decoding on DeepSeek-V4\" show what "
             "verification costs there).")


def with_mtp(src: str, dst: str = MTP_DIR) -> str:
    """src's config (num_nextn_predict_layers = 1) and weights plus mtp.safetensors with random mtp.0.*."""
    if os.path.exists(os.path.join(dst, "mtp.safetensors")):
        return dst
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    mtp = {}
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        # the MTP block is a sliding-window, top-k routed layer: start from such a layer of the model
        layer = next(i for i, (a, m) in enumerate(zip(cfg["layer_types"], cfg["mlp_layer_types"]))
                     if a == "sliding_attention" and m == "moe")
        prefix = f"model.layers.{layer}."
        for k in f.keys():
            if k.startswith(prefix):
                t = f.get_tensor(k)
                mtp["mtp.0." + k[len(prefix):]] = t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype) \
                    if t.is_floating_point() else t
        for part in ("fn", "base", "scale"):
            mtp[f"mtp.0.hc_head_{part}"] = f.get_tensor(f"model.hc_head.hc_{part}")
        mtp["mtp.0.norm.weight"] = f.get_tensor("model.norm.weight")
    H = cfg["hidden_size"]
    for name in ("enorm", "hnorm"):
        mtp[f"mtp.0.{name}.weight"] = torch.ones(H)
    for name in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{name}.weight"] = (torch.randn(H, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    save_file(mtp, os.path.join(dst, "mtp.safetensors"), metadata={"format": "pt"})
    return dst


def run(path, prompts, new_tokens, threads, dtype, spec, kv_cache_dtype="fp4", repeats=1) -> dict:
    """The fastest of `repeats` identical greedy generations (their tokens, steps and acceptance are the same)."""
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_threads=threads, max_num_seqs=len(prompts),
              max_model_len=512, speculative=spec)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    elapsed = float("inf")
    for _ in range(repeats):
        start, steps = time.perf_counter(), llm.engine.num_steps["decode"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                            use_tqdm=False)
        elapsed = min(elapsed, time.perf_counter() - start)
        steps = llm.engine.num_steps["decode"] - steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    verified = sum(o.metrics.spec_verified_drafts for o in outs)
    accepted = sum(o.metrics.spec_accepted_drafts for o in outs)
    per_pos = llm.get_spec_decoding_stats().acceptance_per_position() if spec else []
    del llm
    gc.collect()  # the engine holds reference cycles; two fp32 medium models do not fit in 24 GB
    return {"tok_s": tokens / elapsed, "per_step": tokens / max(1, steps) / len(prompts),
            "accept": accepted / verified if verified else None, "per_pos": per_pos, "outputs": [o.outputs[0].token_ids for o in outs]}


def real_drafts(args) -> None:
    """The trained default model's MTP drafts on held-out source, at batch 1 and at --batch: acceptance per
    draft position and speed against no speculation (each the fastest of 3 runs: these runs are short)."""
    from deepinfer.default_model import default_model_path, held_out_prompts
    from deepinfer.models.loader import load_tokenizer

    path = default_model_path()
    rows = ["| batch | drafter | tok/s | measured tokens per sequence per step | acceptance | acceptance per draft "
            "position | speedup | same tokens as none |", "|---|---|---|---|---|---|---|---|"]
    for batch in sorted({1, args.batch}):
        rows += real_draft_rows(path, held_out_prompts(load_tokenizer(path), batch, 64), args)
    body = (f"The embedded tiny DeepSeek-V4 and its trained MTP layer (docs/tiny_moe.md), {args.dtype}, 64-token "
            f"held-out stretches of stdlib source as prompts, {args.new_tokens} new tokens, greedy, {args.threads} "
            f"thread(s), CPU `{platform.cpu_flags()}`, load average {os.getloadavg()[0]:.1f} at the end.\n\n"
            f"    python examples/bench_v4_spec.py --model default --batch {args.batch} --new-tokens "
            f"{args.new_tokens} --threads {args.threads} --dtype {args.dtype}\n\n" + "\n".join(rows)
            + "\n\n" + REAL_NOTE)
    write_section(REAL_TITLE, body)


def real_draft_rows(path, prompts, args) -> list[str]:
    run_ = lambda spec: run(path, prompts, args.new_tokens, args.threads, args.dtype, spec, "auto", 3)  # noqa: E731
    base, b = run_(None), len(prompts)
    rows = [f"| {b} | none | {base['tok_s']:.1f} | {base['per_step']:.2f} | - | - | 1.00x | 100% |"]
    for k, verify in ((1, "all"), (2, "all"), (3, "all"), (3, "greedy")):
        res = run_({"method": "mtp", "num_draft_tokens": k, "verify": verify})
        same = sum(a == c for a, c in zip(res["outputs"], base["outputs"])) / b
        pos = " / ".join("-" if r is None else f"{r:.2f}" for r in res["per_pos"])
        rows.append(f"| {b} | MTP (trained), k={k}, {verify} | {res['tok_s']:.1f} | {res['per_step']:.2f} | "
                    f"{res['accept']:.2f} | {pos} | {res['tok_s'] / base['tok_s']:.2f}x | {same:.0%} |")
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["medium", "default"], default="medium")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.model == "default":
        return real_drafts(args)
    path = with_mtp(make(DEFAULT_DIR))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 32000, (args.batch, 32), generator=g).tolist()
    base = run(path, prompts, args.new_tokens, args.threads, args.dtype, None)
    refs = {tuple(p): o for p, o in zip(prompts, base["outputs"])}
    configs = [("none", None),
               ("replay 0.75, k=3, greedy", {"method": "replay", "num_draft_tokens": 3, "acceptance": 0.75,
                                             "references": refs}),
               ("replay 0.75, k=3, all", {"method": "replay", "num_draft_tokens": 3, "acceptance": 0.75,
                                          "verify": "all", "references": refs}),
               ("MTP (random weights), k=2, all", {"method": "mtp", "num_draft_tokens": 2, "verify": "all"})]
    rows = ["| drafter | tok/s | measured tokens per sequence per step | acceptance | speedup | same tokens as none |",
            "|---|---|---|---|---|---|"]
    for name, spec in configs:
        res = base if spec is None else run(path, prompts, args.new_tokens, args.threads, args.dtype, spec)
        same = sum(a == b for a, b in zip(res["outputs"], base["outputs"])) / len(prompts)
        acc = "-" if res["accept"] is None else f"{res['accept']:.2f}"
        rows.append(f"| {name} | {res['tok_s']:.1f} | {res['per_step']:.2f} | {acc} | "
                    f"{res['tok_s'] / base['tok_s']:.2f}x | {same:.0%} |")
        print(rows[-1], flush=True)
    body = (f"Medium V4 (examples/make_medium_v4.py) + one random MTP layer, {args.dtype}, FP4 KV, batch {args.batch}, "
            f"32-token prompts, {args.new_tokens} new tokens, greedy, {args.threads} thread(s), load average "
            f"{os.getloadavg()[0]:.1f} at the end.\n\n    python examples/bench_v4_spec.py --batch {args.batch} "
            f"--new-tokens {args.new_tokens} --threads {args.threads} --dtype {args.dtype}\n\n" + "\n".join(rows)
            + "\n\n" + NOTE)
    write_section("Speculative decoding on DeepSeek-V4", body)


if __name__ == "__main__":
    main()
