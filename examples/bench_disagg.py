"""Disaggregation on one machine, measured in one run (docs/benchmarks.md, "Disaggregation"):

  (a) transport: one handoff (a dict of KV tensors) between two Ray actors over pyzmq zero-copy frames vs a Ray
      actor call (the object store), round trip with the receiver copying the KV into a pool;
  (b) engines: NORMAL vs 1 prefill + 1 decode process on the medium Qwen3-MoE and medium DeepSeek-V4:
      output throughput, p50/p99 time to first token, KV bytes moved per request against the memory plan;
  (c) prefix store: prefill time of new questions on a system prompt already served, and of a chat's later
      turns, with and without the store.

    python examples/bench_disagg.py [--models qwen,v4] [--requests 16] [--prompt 256] [--new 32]
                                    [--skip-transport] [--skip-engines] [--skip-prefix]
"""
import argparse
import gc
import os
import sys
import tempfile
import time

import torch

from deepinfer import LLM, SamplingParams, platform
from deepinfer.docs import write_section
from examples.make_medium_qwen3_moe import make as make_qwen
from examples.make_medium_v4 import make as make_v4

MODELS = {"qwen": ("medium Qwen3-MoE", make_qwen), "v4": ("medium DeepSeek-V4", make_v4)}


# ---- (a) transport ------------------------------------------------------------------------------------

class Sink:
    """Receives handoffs both ways and copies their tensors into a preallocated pool, as an import does."""

    def __init__(self, nbytes: int, ack_address: str):
        from deepinfer.distributed.channels import Receiver, Sender

        self.pool = torch.empty(nbytes, dtype=torch.uint8)
        self.inbox, self.ack = Receiver(), Sender(ack_address)

    def address(self) -> str:
        return self.inbox.address

    def _copy(self, kv: dict) -> None:
        at = 0
        for t in kv.values():
            flat = t.reshape(-1).view(torch.uint8)
            self.pool[at:at + flat.numel()].copy_(flat)
            at += flat.numel()

    def take(self, kv: dict) -> int:  # the Ray path: the argument came through the object store
        self._copy(kv)
        return 1

    def serve_zmq(self, n: int) -> int:
        for _ in range(n):
            msgs = []
            while not msgs:
                msgs = self.inbox.recv(1000)
            for kv in msgs:
                self._copy(kv)
                self.ack.send(1)
        return n


class Source:
    def __init__(self, nbytes: int):
        from deepinfer.distributed.channels import Receiver

        # Several tensors like a handoff's (paged pools per layer and a state block), bf16 and uint8.
        n = nbytes // 8
        self.kv = {f"paged.{i}": torch.randint(0, 255, (n,), dtype=torch.uint8) for i in range(4)}
        self.kv.update({f"state.{i}": torch.randn(n // 2).bfloat16() for i in range(2)})
        self.acks = Receiver()

    def ack_address(self) -> str:
        return self.acks.address

    def via_ray(self, sink, n: int) -> float:
        import ray

        start = time.perf_counter()
        for _ in range(n):
            ray.get(sink.take.remote(self.kv))
        return (time.perf_counter() - start) / n

    def via_zmq(self, address: str, n: int) -> float:
        from deepinfer.distributed.channels import Sender

        out = Sender(address)
        start = time.perf_counter()
        for _ in range(n):
            out.send(self.kv)
            while not self.acks.recv(1000):
                pass
        return (time.perf_counter() - start) / n


def transport(sizes_mib=(1, 16, 64), n=8) -> list[dict]:
    import ray

    from deepinfer.distributed import ray_launch

    ray_launch.ensure_ray(None)
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        src = ray.remote(Source).options(num_cpus=0.5).remote(nbytes)
        sink = ray.remote(Sink).options(num_cpus=0.5, max_concurrency=2).remote(
            nbytes, ray.get(src.ack_address.remote()))
        addr = ray.get(sink.address.remote())
        for way in ("zmq", "ray", "zmq", "ray"):  # interleaved: a warm-up of each, then the timed pass
            if way == "zmq":
                done = sink.serve_zmq.remote(n)
                sec = ray.get(src.via_zmq.remote(addr, n))
                ray.get(done)
            else:
                sec = ray.get(src.via_ray.remote(sink, n))
            rows.append({"MiB": mib, "way": way, "ms": 1000 * sec, "GBps": nbytes / sec / 1e9})
        ray_launch.kill_actors([src, sink])
    rows = rows[2::4] + rows[3::4]  # the timed passes
    return sorted(rows, key=lambda r: (r["MiB"], r["way"]))


def transport_table(rows: list[dict]) -> str:
    lines = ["| handoff MiB | zmq ms | Ray ms | zmq GB/s | Ray GB/s | Ray / zmq time |", "|---|---|---|---|---|---|"]
    for mib in sorted({r["MiB"] for r in rows}):
        z, r = [next(x for x in rows if x["MiB"] == mib and x["way"] == w) for w in ("zmq", "ray")]
        lines.append(f"| {mib} | {z['ms']:.2f} | {r['ms']:.2f} | {z['GBps']:.2f} | {r['GBps']:.2f} | "
                     f"{r['ms'] / z['ms']:.2f}x |")
    return "\n".join(lines)


# ---- (b) engines --------------------------------------------------------------------------------------

def workload(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length + int(torch.randint(0, length // 2 + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def timed(llm: LLM, prompts, params) -> dict:
    """One warm-up on a prompt that shares no block with the workload (first-call costs stay out, and no
    prefix gets stored), then the timed generate; the engine's transfer counters count only that."""
    llm.generate([list(range(5, 13))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    before = dict(getattr(llm.engine, "stats", {}))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    moved = {k: v - before[k] for k, v in getattr(llm.engine, "stats", {}).items()}
    return {"wall": wall, "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall, "moved": moved,
            "p50": ttft[len(ttft) // 2], "p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "outs": outs}


def engines(name: str, path: str, args) -> list[dict]:
    vocab = 32000 if "v4" in path else 4096
    prompts = workload(args.requests, args.prompt, vocab)
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    kw = dict(kv_cache_memory=1 << 30, max_num_seqs=args.requests)
    normal = LLM(path, num_threads=2, **kw)
    plan = normal.engine.state_transfer
    rows = [{"model": name, "mode": "NORMAL, 1 process x 2 threads", **timed(normal, prompts, params)}]
    ref = [o.outputs[0].token_ids for o in rows[0]["outs"]]
    del normal
    gc.collect()
    modes = ["state", "replay"] if plan.can_replay else ["state"]
    for mode in modes:
        llm = LLM(path, num_threads=1, disaggregation={"prefill": 1, "decode": 1, "num_cpus_per_engine": 1,
                                                         "state_transfer": mode}, **kw)
        label = f", StateBlock {'sent' if mode == 'state' else 'replayed'}" if plan.can_replay else ""
        row = {"model": name, "mode": f"1 prefill + 1 decode process x 1 thread{label}",
               **timed(llm, prompts, params)}
        moved, n = row["moved"]["kv_bytes"], row["moved"]["transfers"]
        replayed = mode == "replay"
        formula = sum(plan.expected_bytes(len(p), replayed) for p in prompts)
        row.update(bytes_per_req=moved / n, formula_per_req=formula / len(prompts), exact=moved == formula,
                   identical=sum(o.outputs[0].token_ids == r for o, r in zip(row["outs"], ref)),
                   first_same=sum(o.outputs[0].token_ids[0] == r[0] for o, r in zip(row["outs"], ref)))
        llm.engine.shutdown()
        del llm
        gc.collect()
        rows.append(row)
    return rows


def engines_table(rows: list[dict]) -> str:
    lines = ["| model | engines | output tok/s | vs NORMAL | TTFT p50 s | TTFT p99 s | KV bytes/request moved "
             "| memory-plan formula | requests with NORMAL's tokens |", "|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["model"], r["tok_s"])
        moved = f"{r['bytes_per_req'] / 1024:.1f} KiB" if "bytes_per_req" in r else "-"
        formula = (f"{r['formula_per_req'] / 1024:.1f} KiB ({'equal' if r['exact'] else 'DIFFERS'})" if "exact" in r
                   else "-")
        n = len(r["outs"])
        same = f"{r['identical']}/{n} ({r['first_same']}/{n} first tokens)" if "identical" in r else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['tok_s']:.1f} | {r['tok_s'] / base[r['model']]:.2f}x "
                     f"| {r['p50']:.2f} | {r['p99']:.2f} | {moved} | {formula} | {same} |")
    return "\n".join(lines)


# ---- (c) prefix store ---------------------------------------------------------------------------------

def prefix_workloads(vocab: int, system_len: int, n: int) -> dict:
    """Rounds of prompts, each round one generate. "shared system prompt": n questions, then n new ones on
    the same system prompt; "multi-turn chat": n // 4 conversations of 4 turns, each turn resending the
    conversation so far (its user message and a 32-token reply appended). The first round fills the store."""
    g = torch.Generator().manual_seed(1)
    rand = lambda k: torch.randint(3, vocab, (k,), generator=g).tolist()  # noqa: E731
    system = rand(system_len)
    shared = [[system + rand(32) for _ in range(n)] for _ in range(2)]
    histories, chat = [rand(system_len) for _ in range(max(1, n // 4))], []
    for _ in range(4):
        histories = [h + rand(48) for h in histories]
        chat.append([list(h) for h in histories])
        histories = [h + rand(32) for h in histories]  # the assistant's reply
    return {"shared system prompt": shared, "multi-turn chat": chat}


def prefix(name: str, path: str, args) -> list[dict]:
    """Each workload's rounds on an engine without a store and on one with a store; rounds after the first
    are timed (the first fills the store: its prefill is the same work either way)."""
    vocab = 32000 if "v4" in path else 4096
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # prefill only
    kw = dict(kv_cache_memory=1 << 30, num_threads=2, max_num_seqs=args.requests)
    rows = []
    with tempfile.TemporaryDirectory() as store:
        plain, cached = LLM(path, **kw), LLM(path, prefix_cache=store, **kw)
        stats = cached.engine.prefix_cache.store.stats
        for label, rounds in prefix_workloads(vocab, args.system, args.requests).items():
            timed(plain, rounds[0], params)
            timed(cached, rounds[0], params)
            row = {"model": name, "workload": label, "rounds": len(rounds) - 1, "n": 0, "tokens": 0, "none": 0.0,
                   "store": 0.0, "same": 0, "ttft_none": [], "ttft_store": [], "block": cached.engine.config.block_size}
            before = stats()
            for prompts in rounds[1:]:
                base, hit = timed(plain, prompts, params), timed(cached, prompts, params)
                row["n"] += len(prompts)
                row["tokens"] += sum(len(p) for p in prompts)
                row["none"] += base["wall"]
                row["store"] += hit["wall"]
                row["same"] += sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                                   for a, b in zip(hit["outs"], base["outs"]))
                row["ttft_none"].append(base["p50"])
                row["ttft_store"].append(hit["p50"])
            after = stats()
            row.update({k: after[k] - before[k] for k in ("hits", "state_misses", "state_hits")})
            rows.append(row)
        del plain, cached
        gc.collect()
    return rows


def prefix_table(rows: list[dict]) -> str:
    lines = ["| model | workload | timed rounds | prompts | prompt tokens | no store s | store s | speedup "
             "| blocks loaded (tokens) | states replayed / loaded | TTFT p50 no store / store s "
             "| first tokens as without store |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p50 = lambda xs: sum(xs) / len(xs)  # noqa: E731 (mean over rounds of each round's p50)
        lines.append(f"| {r['model']} | {r['workload']} | {r['rounds']} | {r['n']} | {r['tokens']} | {r['none']:.2f} "
                     f"| {r['store']:.2f} | {r['none'] / r['store']:.2f}x | {r['hits']} ({r['hits'] * r['block']}) "
                     f"| {r['state_misses']} / {r['state_hits']} | {p50(r['ttft_none']):.2f} / "
                     f"{p50(r['ttft_store']):.2f} | {r['same']}/{r['n']} |")
    return "\n".join(lines)


def analysis(transport_rows: list, engine_rows: list, prefix_rows: list) -> str:
    """What the tables say, from their own numbers, and what this machine cannot show."""
    out = []
    if transport_rows:
        ratios = [r["ms"] / z["ms"] for z in transport_rows if z["way"] == "zmq"
                  for r in transport_rows if r["way"] == "ray" and r["MiB"] == z["MiB"]]
        out.append(f"**Transport.** pyzmq with out-of-band frames moved a handoff {min(ratios):.1f}-{max(ratios):.1f}x "
                   "faster than a Ray actor call, so the engines use it: the call puts the tensors into the object "
                   "store (one copy), the callee maps them back, and each call also pays Ray's task round trip; "
                   "zmq sends the pool copies' buffers as they are and the receiver's copy into its pool is the "
                   "only other one.")
    for model in dict.fromkeys(r["model"] for r in engine_rows):
        rows = [r for r in engine_rows if r["model"] == model]
        base, parts = rows[0], []
        for r in rows[1:]:
            parts.append(f"{r['mode'].split(', ', 1)[-1] if 'StateBlock' in r['mode'] else 'disaggregated'}: "
                         f"{r['tok_s'] / base['tok_s']:.2f}x the throughput, TTFT p50 {r['p50'] / base['p50']:.2f}x")
        out.append(f"**{model}.** Against NORMAL on the same 2 vCPUs, " + "; ".join(parts) + ".")
    out.append("Two processes do not pay on this machine: NORMAL runs every step on both vCPUs, while each engine "
               "process gets one, so the prefill of a batch takes about twice as long (TTFT) and decode runs at "
               "one thread's speed; the two phases overlap only while requests still arrive, and in an offline "
               "batch the prefill engine is done before most decoding starts. Disaggregation pays where each "
               "phase gets machines of its own sized to it (DeepInfer: EP2-8 prefill beside EP64-128 decode), "
               "decode steps never stall behind a long prefill, and the KV moves over RDMA at tens of GB/s. The "
               "KV bytes per request equal the memory plan's formula (blocks x bytes per block, plus the "
               "StateBlock unless replayed). A replayed StateBlock moves fewer bytes but makes the decode engine "
               "prefill the replayed span, which on these short prompts is the whole prompt (the exact span is "
               "layers x window = 2048 tokens on the medium V4), so state_transfer='auto' sends the state then. "
               "bf16 outputs of NORMAL and disaggregated runs can part ways after some tokens: the GEMM plan "
               "picks kernels per thread count and batch rows, and these random-weight models have near ties; "
               "the fp32 tests check token identity (tests/test_disaggregation.py).")
    for r in prefix_rows:
        out.append(f"**Prefix store, {r['model']}, {r['workload']}.** With the store the timed rounds prefill "
                   f"{r['none'] / r['store']:.2f}x faster than without ({r['hits']} blocks loaded, "
                   f"{r['state_misses']} StateBlocks replayed and stored, {r['state_hits']} loaded).")
    if any(r["state_misses"] for r in prefix_rows):
        out.append("On DeepSeek-V4 a hit needs the StateBlock at the prefix's end; the first sequence at that end "
                   "replays the exact span (layers x window tokens) and stores the result, and later sequences "
                   "load it. A shared system prompt ends at one place, so its state is replayed once; each turn of "
                   "a chat ends somewhere new, and a prefix shorter than the span is replayed whole, which is why "
                   "V4 chats gain little here. DeepInfer's approximate replay (128 tokens) would cost less but "
                   "changes the tokens, so it is not used.")
    return "\n\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen,v4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--system", type=int, default=512, help="shared system prompt tokens (prefix store)")
    ap.add_argument("--skip-transport", action="store_true")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    command = " ".join(["python examples/bench_disagg.py", *sys.argv[1:]])
    parts = [f"CPU: `{platform.cpu_flags()}`, {os.cpu_count()} vCPUs. Command: `{command}`. All numbers of one "
             "table come from one run of the script."]
    transport_rows, engine_rows, prefix_rows = [], [], []
    if not args.skip_transport:
        transport_rows = transport()
        print(transport_table(transport_rows))
        parts += ["### (a) Transport: one handoff between two processes (round trip, receiver copies into a pool)",
                  transport_table(transport_rows)]
    models = [(MODELS[m][0], MODELS[m][1]()) for m in args.models.split(",")]
    if not args.skip_engines:
        engine_rows = [r for name, path in models for r in engines(name, path, args)]
        print(engines_table(engine_rows))
        parts += [f"### (b) NORMAL vs 1 prefill + 1 decode process ({args.requests} requests, prompts of "
                  f"{args.prompt}-{args.prompt * 3 // 2} tokens, {args.new} new tokens, greedy, bf16)",
                  engines_table(engine_rows)]
    if not args.skip_prefix:
        prefix_rows = [r for name, path in models for r in prefix(name, path, args)]
        print(prefix_table(prefix_rows))
        parts += [f"### (c) Prefix store: prefill time (max_tokens=1) of {args.requests} new questions on a "
                  f"{args.system}-token system prompt after {args.requests} others were served, and of turns 2-4 of "
                  f"{max(1, args.requests // 4)} chats (each turn resends the conversation; {args.system}-token "
                  "openers)",
                  prefix_table(prefix_rows)]
    text = analysis(transport_rows, engine_rows, prefix_rows)
    print(text)
    write_section("Disaggregation", "\n\n".join(parts + [text]))


if __name__ == "__main__":
    main()
