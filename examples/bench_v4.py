"""DeepSeek-V4: deepinfer vs transformers on the medium checkpoint (examples/make_medium_v4.py), in one run,
same process, same thread count, bf16 weights.

    python examples/bench_v4.py [--model DIR] [--threads 2] [--steps 6] [--rounds 2] [--prompt 16] [--prefill 256]

Reports
  decode ms/step at batch 1/16/64 (prompts of --prompt tokens, then --steps greedy steps; ours is a full
      engine step: schedule, forward, sampling, output processing; transformers' is model(next_token,
      cache) plus argmax), the two engines alternating for --rounds rounds, medians over all their steps,
  the floor of a decode step on this machine: the bytes of weights it must read (every weight a step uses,
      plus the routed experts its tokens were sent to, counted from the run's own routing) over the read
      bandwidth, or its FLOPs over the matmul rate (fp32 or bf16, the faster), whichever is larger (rates from
      examples/sweep/roofline.py, measured every round, best kept). transformers' time over the floor is the
      most any engine could beat it by on this machine at this thread count,
  prefill tokens/s for one --prefill-token prompt,
  cache bytes per sequence at 4K context: ours from the cache spec (FP4 and exact), transformers' from
      its DynamicCache tensors, measured after the prefill and extrapolated to 4096 tokens with the
      per-layer-type formula the measurement is checked against.
transformers' bf16 prefill is slow on AVX2 CPUs (no bf16 GEMM), which is why the prompts are short.
"""
import argparse
import math
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.layers import gemm_plan
from deepinfer.layers.moe import balanced_moe_blocks
from examples.sweep.metrics import floor_ms
from examples.sweep.roofline import measure

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


# ---- deepinfer --------------------------------------------------------------------------------------

class WeightReads:
    """Bytes of weights one decode step reads: every parameter of the main model except the routed experts,
    the embedding and hash-routing tables (a step reads one row per token of those), plus each routed
    expert some token of the step was sent to, counted by a forward pre-hook on the expert modules. MTP
    layers are left out (no speculation here). Also the step's matmul FLOPs: 2 per weight per token it
    multiplies (attention's own products at these short contexts are < 1% and left out)."""

    def __init__(self, model: torch.nn.Module):
        skip = ("embed_tokens.", "tid2eid", "mtp.", ".experts.")
        self.dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                         if not any(k in n for k in skip))
        self.experts = [block.experts for block in balanced_moe_blocks(model)]  # routed, MTP's left out
        e = self.experts[0]
        self.expert_bytes = (e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size()
        self.top_k, self.touched = 0, 0
        for m in self.experts:
            m.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        ids = args[1]  # FusedMoE.forward(x, topk_ids [T, k], topk_weights)
        self.touched += int(ids.unique().numel())
        self.top_k = ids.shape[1]

    def take(self, tokens: int) -> tuple[float, float]:
        """(bytes, FLOPs) since the last take, for a step of `tokens` tokens."""
        experts, self.touched = self.touched, 0
        elt = self.experts[0].gate_up_proj.element_size()
        active = self.dense / elt + len(self.experts) * self.top_k * self.expert_bytes / elt
        return self.dense + experts * self.expert_bytes, 2 * active * tokens


def ours_run(llm: LLM, batch: list[list[int]], max_tokens: int, reads: WeightReads | None = None):
    """Drives the engine step by step -> (decode step seconds, [(prefill tokens, seconds)], decode steps'
    [(weight bytes, FLOPs)] when `reads` counts them)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"b{len(batch)}-{i}-{time.monotonic_ns()}", p, params)
    decode, prefill, costs, running = [], [], [], len(batch)
    while engine.has_unfinished():
        t = time.perf_counter()
        finished, tokens = engine.step()
        dt = time.perf_counter() - t
        cost = reads.take(tokens) if reads else None
        if tokens == running:
            decode.append(dt)
            costs.append(cost)
        else:
            prefill.append((tokens, dt))
        running -= len(finished)
    return decode, prefill, costs


def ours_cache_bytes(llm: LLM, context: int) -> int:
    return spec_cache_bytes(llm.engine.cache.spec, llm.engine.config.block_size, context)


def spec_cache_bytes(spec, block_size: int, context: int) -> int:
    """One sequence's blocks for `context` tokens plus its StateBlock."""
    return math.ceil(context / block_size) * spec.bytes_per_block + spec.bytes_per_state_block


# ---- transformers -----------------------------------------------------------------------------------

def hf_decode(hf, batch: list[list[int]], steps: int) -> list[float]:
    with torch.inference_mode():
        out = hf(torch.tensor(batch), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or out.past_key_values
        times = []
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            out = hf(nxt, cache=cache, use_cache=True)
            out.logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - t)
    return times


def hf_prefill(hf, prompt: list[int]):
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        dt = time.perf_counter() - t
    return dt, getattr(out, "cache", None) or out.past_key_values


def hf_cache_bytes(cache) -> list[int]:
    """Bytes per layer of a transformers DeepseekV4 cache (batch 1): every tensor it holds, shared
    storage (K = V) counted once."""
    per_layer = []
    for layer in cache.layers:
        seen, total = set(), 0
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for attr in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
            tensors += list(getattr(layer, attr, {}).values())
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        per_layer.append(total)
    return per_layer


def hf_cache_formula(cfg, context: int, elt: int = 2) -> list[int]:
    """What transformers' cache holds per layer after `context` tokens (prefill in one call): sliding
    layers K and V apart, window - 1 tokens each; CSA/HCA layers one shared K=V window of window - 1
    tokens, every compressed entry, the unfinished window's kv and gate; CSA also indexer entries and its
    buffers, and the last window's Ca halves (the overlap gate is fp32)."""
    D, Di, w = cfg.head_dim, cfg.index_head_dim, min(context, cfg.sliding_window - 1)
    out = []
    for kind in cfg.layer_types:
        if kind == SWA:
            out.append(2 * w * D * elt)
            continue
        r = cfg.compress_rates[kind]
        n, left = context // r, context % r
        if kind == HCA:
            out.append((w + n + 2 * left) * D * elt)
            continue
        ov = r if n else 0
        main = (w + n + 2 * left * 2) * D * elt + ov * D * (elt + 4)
        index = (n + 2 * left * 2) * Di * elt + ov * Di * (elt + 4)
        out.append(main + index)
    return out


# ---- both, alternating, and the floor ----------------------------------------------------------------

def decode_rounds(ours: LLM, hf, reads: WeightReads, batches: list[int], args, vocab: int):
    """Per batch: medians over --rounds rounds of both engines' decode steps and of our steps' weight bytes
    and FLOPs -> (rows, the best read bandwidth and matmul rate measured across the rounds)."""
    steps = {b: ([], [], []) for b in batches}
    rates = {"bandwidth": 0.0, "matmul": 0.0}
    for r in range(args.rounds):
        rate = measure(args.threads)
        rates = {k: max(rates[k], rate[k]) for k in rates}  # contention only lowers a rate
        for b in batches:
            batch = prompts(b, args.prompt, vocab, b)
            mine, _, costs = ours_run(ours, batch, args.steps + 1, reads)
            with platform.torch_parallel():  # transformers' ops on all args.threads (ours keep torch at one)
                theirs = hf_decode(hf, batch, args.steps)
            for acc, new in zip(steps[b], (mine, theirs, costs)):
                acc.extend(new)
            print(f"round {r}, batch {b}: ours {statistics.median(mine) * 1e3:.1f} ms/step, transformers "
                  f"{statistics.median(theirs) * 1e3:.1f} ms/step", flush=True)
    return [{"batch": b, "ours": statistics.median(m) * 1e3, "hf": statistics.median(t) * 1e3,
             "bytes": statistics.median(c[0] for c in costs), "flops": statistics.median(c[1] for c in costs)}
            for b, (m, t, costs) in steps.items()], rates


def print_floors(rows: list[dict], rates: dict) -> None:
    print(f"\nFloor of a decode step at {rates['bandwidth'] / 1e9:.1f} GB/s read, "
          f"{rates['matmul'] / 1e9:.1f} GFLOP/s matmul (best of fp32 and bf16 measured in the run)\n")
    print("| batch | weights read per step | floor ms | deepinfer / floor | transformers / floor |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = floor_ms(r["bytes"], r["flops"], rates["bandwidth"], rates["matmul"])
        print(f"| {r['batch']} | {r['bytes'] / 1e9:.2f} GB | {f['ms']:.1f} ({f['bound']}) | "
              f"{r['ours'] / f['ms']:.2f}x | {r['hf'] / f['ms']:.2f}x |")


# ---- report -----------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    if args.model is None:
        from examples.make_medium_v4 import make

        args.model = make()
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    cfg = AutoConfig.from_pretrained(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    # num_threads: our kernels' threads; transformers gets as many torch threads inside platform.torch_parallel().
    common = dict(dtype="bfloat16", block_size=128, max_num_seqs=max(batches), kv_cache_memory=1 << 30,
                  num_threads=args.threads)
    ours = LLM(args.model, kv_cache_dtype="fp4", **common)
    ours_exact_bytes = ours_cache_bytes(LLM(args.model, **common), 4096)
    hf = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    assert platform.kernel_threads() == args.threads, "both engines must run with the labelled thread count"

    ours_run(ours, prompts(1, args.prompt, cfg.vocab_size, 99), 3)  # warm-up
    rows, rates = decode_rounds(ours, hf, WeightReads(ours.engine.model), batches, args, cfg.vocab_size)

    long_prompt = prompts(1, args.prefill, cfg.vocab_size, 7)
    _, pre, _ = ours_run(ours, long_prompt, 1)
    ours_tps = pre[0][0] / pre[0][1]
    with platform.torch_parallel():
        hf_s, cache = hf_prefill(hf, long_prompt[0])
    hf_tps = args.prefill / hf_s
    measured, predicted = hf_cache_bytes(cache), hf_cache_formula(cfg, args.prefill)
    assert measured == predicted, f"transformers cache formula is off: {measured} vs {predicted}"
    hf_4k = sum(hf_cache_formula(cfg, 4096))
    ours_4k = ours_cache_bytes(ours, 4096)

    print(f"\nDeepSeek-V4 medium ({args.model}), bf16, {args.threads} threads, decode prompts of {args.prompt} "
          f"tokens, median of {args.rounds} x {args.steps} steps\n")
    print("| | deepinfer | transformers | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| decode batch {r['batch']}, ms/step | {r['ours']:.1f} | {r['hf']:.1f} | {r['hf'] / r['ours']:.2f}x |")
    for r in rows:
        b = r["batch"]
        print(f"| decode batch {b}, tokens/s | {b * 1e3 / r['ours']:.1f} | {b * 1e3 / r['hf']:.1f} | "
              f"{r['hf'] / r['ours']:.2f}x |")
    print(f"| prefill {args.prefill} tokens, tokens/s | {ours_tps:.1f} | {hf_tps:.1f} | {ours_tps / hf_tps:.2f}x |")
    print(f"| cache bytes / sequence at 4K (ours FP4) | {ours_4k:,} | {hf_4k:,} | {hf_4k / ours_4k:.2f}x less |")
    print(f"| cache bytes / sequence at 4K (ours exact bf16) | {ours_exact_bytes:,} | {hf_4k:,} | "
          f"{hf_4k / ours_exact_bytes:.2f}x less |")
    print_floors(rows, rates)
    print("\n" + gemm_plan.PLAN.report())


if __name__ == "__main__":
    main()
