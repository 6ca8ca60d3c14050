"""One sweep point: one engine, one configuration, one batch size; writes a JSON file.

    python -m examples.sweep.benchmark --engine deepinfer --model medium_qwen3_moe --batch 16 \
        --context 64 --warmup 3 --steps 60 --roofline out/roofline.json --out out/x.json \
        [--name deepinfer-bf16] [--options '{"dtype": "bfloat16"}'] [--dp 1] [--prefill-tokens 256 1024] [--round 1] \
        [--sampling '{"temperature": 0.8, "top_p": 0.95}']

Decode: `batch` sequences prefilled at `context` tokens, then `warmup` decode steps untimed and
`steps` timed (DeepInfer uses 50 and 60). decode_avg_sps = timed steps / their total time.
Every rate derived from it uses tokens per step as measured from the outputs
(`accepted_tokens_per_step`, null unless `speculative` is among the options; without drafting each
step commits exactly one token per sequence); an assumed acceptance length never enters the JSON.
Decode steps draw greedily unless `sampling` names a temperature (and top_p / top_k / min_p), which every engine
that draws tokens applies with its own sampler; llama.cpp's bench draws none, so it has no sampled point.
Exit status: 0 written, 2 bad point (message on stderr), 3 peer not set up. A point not measured leaves
its reason in OUT with .failed for .json (the sweep's table lists it); a measured one removes that file.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from examples.sweep import metrics, model_cost
from examples.sweep.errors import PeerMissing, PointError
from examples.sweep.roofline import machine, matmul_for, rates_for

ENGINE_OPTIONS = {
    "deepinfer": {"dtype", "kv_cache_dtype", "block_size", "num_threads", "kv_cache_memory",
                  "max_num_batched_tokens", "seed", "speculative", "enable_eplb", "dp_config", "disaggregation",
                  "num_scheduler_steps"},
    "transformers": {"dtype", "num_threads", "experts_implementation", "timing"},
    "vllm": {"dtype", "num_threads"},
    "llamacpp": {"outtype", "num_threads"},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p"}
MAKERS = {"medium_qwen3_moe": "examples.make_medium_qwen3_moe", "medium_v4": "examples.make_medium_v4"}


def resolve_model(name: str) -> str:
    """A maker name (checkpoint written on first use) or a model directory."""
    if name in MAKERS:
        import importlib
        try:
            return importlib.import_module(MAKERS[name]).make()
        except ImportError as exc:
            raise PointError(f"model {name!r}: its maker {MAKERS[name]} cannot run here ({exc})") from exc
    if not os.path.exists(os.path.join(name, "config.json")):
        raise PointError(f"model {name!r} is neither a known maker {sorted(MAKERS)} nor a directory with config.json")
    return name


def check_options(engine: str, opts: dict) -> None:
    if engine not in ENGINE_OPTIONS:
        raise PointError(f"unknown engine {engine!r}; known: {sorted(ENGINE_OPTIONS)}")
    unknown = sorted(set(opts) - ENGINE_OPTIONS[engine])
    if unknown:
        raise PointError(f"unknown configuration key(s) {unknown} for engine {engine}; "
                         f"known: {sorted(ENGINE_OPTIONS[engine])}")


def check_sampling(engine: str, sampling: dict) -> None:
    """sampling: {} (greedy) or some of SAMPLING_KEYS with numbers; llama.cpp takes greedy only."""
    if not isinstance(sampling, dict):
        raise PointError(f"sampling must be a JSON object of {sorted(SAMPLING_KEYS)}, got {sampling!r}")
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise PointError(f"unknown sampling key(s) {unknown}; known: {sorted(SAMPLING_KEYS)}")
    bad = {k: v for k, v in sampling.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
    if bad:
        raise PointError(f"sampling values must be numbers, got {bad}")
    if sampling and engine == "llamacpp":
        raise PointError("llama-batched-bench runs the forwards without drawing tokens: it has no sampled decode")


def run_engine(p, opts: dict) -> dict:
    if p.engine == "deepinfer":
        from examples.sweep.deepinfer_point import measure
    elif p.engine == "transformers":
        from examples.peers.hf_peer import measure
    elif p.engine == "vllm":
        from examples.peers.vllm_peer import measure
    else:
        from examples.peers.llamacpp_peer import measure
    return measure(p, opts)


def floor_entry(p, opts: dict, roofline: dict | None) -> dict | None:
    """The decode step's floor at this point, or None with the reason printed."""
    why = None
    s = model_cost.shape(model_cost.load_config(p.model_dir))
    if roofline is None:
        why = "no roofline file"
    elif s is None:
        why = "architecture not modelled in model_cost.py"
    elif p.dp > 1 or "speculative" in opts or opts.get("disaggregation"):
        why = "floor modelled for one engine process without drafts only"
    if why:
        print(f"benchmark: no floor for this point ({why})", file=sys.stderr)
        return None
    fp32 = opts.get("dtype", "bfloat16") in ("float32", "fp32")
    wbytes = 4 if fp32 else 2
    kv = 0.5625 if opts.get("kv_cache_dtype") == "fp4" else wbytes  # fp4 values + one 8-bit scale per 16
    cost = model_cost.decode_step_cost(s, p.batch, p.context + p.warmup + p.steps / 2, wbytes, kv)
    return floor_at({**cost, "fp32_weights": fp32}, rates_for(roofline, opts.get("num_threads", 1)))


def floor_at(cost: dict, rates: dict) -> dict:
    """cost (bytes, flops, fp32_weights) with the floor of its step at one roofline entry's rates, and those rates:
    an fp32 model's products at torch's fp32 rate, a bf16 model's at the best of fp32 and bf16."""
    matmul = matmul_for(rates, cost["fp32_weights"])
    return {**cost, **metrics.floor_ms(cost["bytes"], cost["flops"], rates["bandwidth"], matmul),
            "bandwidth": rates["bandwidth"], "matmul_rate": matmul, "threads": rates["threads"]}


def measure_rates(threads: int) -> dict | None:
    """The roofline's rates at `threads` (examples/sweep/roofline.py), read in a fresh process: the same conditions
    after every engine, in-process or not (nothing else loaded, torch's default OpenMP policy). None, with the
    reason printed, where that process fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates.json")
        run = subprocess.run([sys.executable, "-m", "examples.sweep.roofline", "--threads", str(threads), "--out", out],
                             cwd=ROOT, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"benchmark: no floor beside ({run.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)["rates"][0]


def floor_beside(opts: dict, floor: dict | None) -> dict | None:
    """The point's floor again, at rates read right after the engine's run (measure_rates: the roofline's estimator,
    best of a burst, at the point's thread count). The sweep's floor takes the best rates of the whole
    run, and on a shared host those come from its quietest seconds: two roofline runs back to back on one machine
    read 35.6 and 47.2 GB/s (Zen 3, two threads). The step times of a point come from its own seconds; the rates
    read beside them are their floor's fair match. None where the point has no floor."""
    rates = measure_rates(opts.get("num_threads", 1)) if floor else None
    return floor_at(floor, rates) if rates else None


def assemble(p, opts: dict, result: dict, floor: dict | None, seconds: float, beside: dict | None = None) -> dict:
    """The point's JSON: the inputs, the measurement and every derived rate."""
    spec = opts.get("speculative")
    tokens = result["measured_tokens_per_step"]
    sps = result["decode_avg_sps"]
    out = {"engine": p.engine, "name": p.name, "model": p.model, "options": opts, "dp": p.dp,
           "decode_num_requests": p.batch, "context_len": p.context, "decode_warmup_steps": p.warmup,
           "decode_steps": p.steps, "round": p.round, "sampling": p.sampling, **result,
           "nextn": spec.get("num_draft_tokens") if isinstance(spec, dict) else None,
           "accepted_tokens_per_step": tokens if spec else None,
           "tokens_per_s_per_user": metrics.per_user_tps(sps, tokens),
           "tokens_per_s_per_rank": metrics.per_rank_tps(sps, p.batch, p.dp, tokens),
           "floor": floor, "floor_beside": beside, "machine": machine(), "seconds": seconds,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for key, fl in (("time_over_floor", floor), ("time_over_floor_beside", beside)):
        out[key] = metrics.time_over_floor(result["decode_step_ms"], fl["ms"]) if fl else None
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="deepinfer")
    ap.add_argument("--name")
    ap.add_argument("--model", default="medium_qwen3_moe")
    ap.add_argument("--options", default="{}", help="JSON object of configuration keys")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[])
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--round", type=int, default=1, help="which of the sweep's rounds this run is")
    ap.add_argument("--sampling", default="{}", help="JSON object: how decode steps draw ({}: greedy)")
    ap.add_argument("--roofline")
    ap.add_argument("--no-rates-beside", dest="rates_beside", action="store_false",
                    help="skip measuring the floor's rates again right after the run (floor_beside)")
    ap.add_argument("--out", required=True)
    p = ap.parse_args(argv)
    p.name = p.name or p.engine
    return p


def failed_file(out: str) -> str:
    return os.path.splitext(out)[0] + ".failed"


def not_measured(p, msg: str, code: int) -> int:
    """Prints why and keeps it beside the point's JSON, for the table's "Not measured" list."""
    print(msg, file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(p.out)), exist_ok=True)
    with open(failed_file(p.out), "w") as f:
        f.write(msg + "\n")
    return code


def main(argv=None) -> int:
    p = parse(argv)
    try:
        opts = json.loads(p.options)
        check_options(p.engine, opts)
        p.sampling = json.loads(p.sampling)
        check_sampling(p.engine, p.sampling)
        if p.batch < 1 or p.steps < 1 or p.warmup < 0 or p.dp < 1:
            raise PointError("need batch >= 1, steps >= 1, warmup >= 0, dp >= 1")
        if p.engine == "deepinfer":
            import deepinfer  # noqa: F401  before the maker loads torch, as a script's `from deepinfer import LLM` is
        p.model_dir = resolve_model(p.model)
        roofline = json.load(open(p.roofline)) if p.roofline and os.path.exists(p.roofline) else None
        t = time.perf_counter()
        result = run_engine(p, opts)
        seconds, floor = time.perf_counter() - t, floor_entry(p, opts, roofline)
        doc = assemble(p, opts, result, floor, seconds, floor_beside(opts, floor) if p.rates_beside else None)
    except PeerMissing as exc:
        return not_measured(p, f"peer {exc} not set up (run examples/peers/setup_peers.sh)", 3)
    except (PointError, ValueError) as exc:
        return not_measured(p, f"benchmark: point {p.name} batch {p.batch}: {exc}", 2)
    os.makedirs(os.path.dirname(os.path.abspath(p.out)), exist_ok=True)
    with open(p.out + ".tmp", "w") as f:  # rename: a killed run never leaves a JSON the sweep would skip
        json.dump(doc, f, indent=1)
    os.replace(p.out + ".tmp", p.out)
    if os.path.exists(failed_file(p.out)):
        os.remove(failed_file(p.out))
    print(f"{p.name} batch {p.batch}: {doc['decode_step_ms']:.1f} ms/step, {doc['tokens_per_s_per_user']:.2f} tok/s/user, "
          f"{doc['tokens_per_s_per_rank']:.1f} tok/s/rank" + (f", {doc['time_over_floor']:.2f}x floor" if doc["time_over_floor"] else "")
          + (f", {doc['time_over_floor_beside']:.2f}x floor beside" if doc["time_over_floor_beside"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
