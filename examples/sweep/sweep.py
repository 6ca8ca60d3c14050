"""Expands a sweep config file into points; run_sweep.sh loops over them.

    python -m examples.sweep.sweep list CONFIG OUTDIR           # "ROUND NAME" lines in run order (problems on
                                                                # stderr and in OUTDIR/not_measured.json)
    python -m examples.sweep.sweep run CONFIG NAME OUTDIR [ROUND]  # measures one point into
                                                                # OUTDIR/points/NAME-rROUND.json

Config (JSON): {"model", "context", "warmup", "steps", "batches", "parallel", "prefill_tokens", "rounds",
"sampling", "configurations": {name: {"engine", "options", and optionally its own "batches" / "parallel" /
"sampling"}}}. "sampling" (default {}: greedy): how the engines draw their decode tokens, e.g. {"temperature": 0.8,
"top_p": 0.95}; a configuration's own overrides the file's (greedy and sampled runs of one engine in one sweep).
"rounds" (default 1): every point runs once per round, so each engine's repeats are spread over the
sweep and machine drift hits all engines alike; the table reports the median over rounds.
"""
import json
import os
import sys

from examples.peers import paths
from examples.sweep import benchmark

TOP_KEYS = {"model", "context", "warmup", "steps", "batches", "parallel", "disaggregation", "prefill_tokens",
            "rounds", "sampling", "configurations", "comment"}
CONFIG_KEYS = {"engine", "options", "batches", "parallel", "disaggregation", "sampling", "comment"}
PEER_FILES = {"vllm": paths.VLLM_PYTHON, "llamacpp": paths.LLAMA_BENCH}
LLAMA_STAMP = paths.LLAMA_STAMP


def load(path: str) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:  # a misspelt top-level key would silently fall back to a default: refuse the file
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    if not cfg.get("configurations"):
        raise ValueError(f"{path}: no configurations")
    if not isinstance(cfg.get("rounds", 1), int) or cfg.get("rounds", 1) < 1:
        raise ValueError(f"{path}: rounds must be an integer >= 1")
    return cfg


def peer_problem(engine: str) -> str | None:
    """Why a peer cannot run here (a failed install says its own reason first), or None."""
    failed = paths.failed_reason(engine, paths.PEERS_DIR)
    if failed:
        return f"peer {engine} setup failed: {failed}"
    if not os.path.exists(PEER_FILES[engine]):
        return f"peer {engine} not set up (run examples/peers/setup_peers.sh)"
    if engine == "llamacpp" and not paths.llama_built_here(LLAMA_STAMP):
        return "peer llamacpp built for another CPU's flags (rerun examples/peers/setup_peers.sh llamacpp)"
    return None


def sampling_of(cfg: dict, conf: dict) -> dict:
    return conf.get("sampling", cfg.get("sampling", {}))


def problem(name: str, conf: dict, sampling: dict) -> str | None:
    """Why a configuration cannot run here (printed once; its points are left out), or None."""
    unknown = sorted(set(conf) - CONFIG_KEYS)
    if unknown:
        return f"configuration {name}: unknown key(s) {unknown}; known: {sorted(CONFIG_KEYS)}"
    engine = conf.get("engine", "deepinfer")
    try:
        benchmark.check_options(engine, conf.get("options", {}))
        benchmark.check_sampling(engine, sampling)
    except benchmark.PointError as exc:
        return f"configuration {name}: {exc}"
    return peer_problem(engine) if engine in PEER_FILES else None


def argv_for(cfg: dict, name: str, conf: dict, dp: int, batch: int) -> list[str]:
    argv = ["--engine", conf.get("engine", "deepinfer"), "--name", name, "--model", cfg["model"],
            "--options", json.dumps(conf.get("options", {})), "--batch", str(batch), "--dp", str(dp),
            "--context", str(cfg.get("context", 64)), "--warmup", str(cfg.get("warmup", 50)),
            "--steps", str(cfg.get("steps", 60)), "--sampling", json.dumps(sampling_of(cfg, conf))]
    if cfg.get("prefill_tokens") and conf.get("engine", "deepinfer") == "deepinfer":
        argv += ["--prefill-tokens", *map(str, cfg["prefill_tokens"])]
    return argv


def points(cfg: dict, report=print) -> dict[str, list[str]]:
    """{point name: benchmark argv without --out} for every runnable configuration, ordered by
    (parallel size, batch, configuration): the engines of one batch run back to back, so their ratio
    sees the same machine load. report(name, why) hears of each configuration left out. The disaggregation
    axis (null, or {"prefill": n_p, "decode": n_d, ...}) gives each deepinfer configuration one variant per
    value, named NAME-<n_p>p<n_d>d; peers have no such mode and run once."""
    out = {}
    for base, conf in cfg["configurations"].items():
        why = problem(base, conf, sampling_of(cfg, conf))
        if why:
            report(base, why)
            continue
        for name, conf in _disaggregation_variants(cfg, base, conf):
            for dp in conf.get("parallel", cfg.get("parallel", [1])):
                for batch in conf.get("batches", cfg.get("batches", [1])):
                    key = f"{name}-dp{dp}-b{batch}".replace(" ", "_").replace("/", "_")
                    out[key] = (dp, batch, argv_for(cfg, name, conf, dp, batch))
    return {k: v[2] for k, v in sorted(out.items(), key=lambda kv: kv[1][:2])}


def _disaggregation_variants(cfg: dict, name: str, conf: dict) -> list[tuple[str, dict]]:
    axis = conf.get("disaggregation", cfg.get("disaggregation", [None]))
    if conf.get("engine", "deepinfer") != "deepinfer":
        return [(name, conf)]
    variants = []
    for d in axis:
        if d is None:
            variants.append((name, conf))
        else:
            options = {**conf.get("options", {}), "disaggregation": d}
            variants.append((f"{name}-{d.get('prefill', 1)}p{d.get('decode', 1)}d", {**conf, "options": options}))
    return variants


def schedule(cfg: dict, names: list[str]) -> list[tuple[int, str]]:
    """(round, point) in run order. Even rounds run the points backwards: each point's rounds then sit
    at mirrored places in the sweep, so a load that drifts over time biases no engine or batch."""
    return [(r, n) for r in range(1, cfg.get("rounds", 1) + 1) for n in (names if r % 2 else names[::-1])]


def point_file(outdir: str, name: str, rnd: int) -> str:
    return os.path.join(outdir, "points", f"{name}-r{rnd}.json")


def list_points(cfg: dict, outdir: str, err) -> list[str]:
    """The "ROUND NAME" lines; records in OUTDIR/not_measured.json ({configuration: why}, for the table)
    why each configuration left out was, keeping other config files' entries (they share OUTDIRs)."""
    path = os.path.join(outdir, "not_measured.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    left_out = {k: v for k, v in old.items() if k not in cfg["configurations"]}

    def skip(name: str, why: str):
        left_out[name] = why
        err(f"{why}; skipping configuration {name}")

    pts = points(cfg, skip)
    os.makedirs(outdir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(left_out, f, indent=1)
    return [f"{r} {n}" for r, n in schedule(cfg, list(pts))]


def main(argv: list[str]) -> int:
    err = lambda msg: print(msg, file=sys.stderr)
    if len(argv) < 3 or argv[0] not in ("list", "run") or (argv[0] == "run" and len(argv) < 4):
        err(__doc__)
        return 2
    try:
        cfg = load(argv[1])
    except (OSError, ValueError) as exc:
        err(f"sweep: {exc}")
        return 2
    if argv[0] == "list":
        print("\n".join(list_points(cfg, argv[2], err)))
        return 0
    name, outdir, rnd = argv[2], argv[3], int(argv[4]) if len(argv) > 4 else 1
    pts = points(cfg, lambda name, why: None)
    if name not in pts:
        err(f"sweep: no runnable point {name!r} in {argv[1]}")
        return 2
    # SWEEP_REMEASURE=0 (run_sweep.sh): the machine's rates are not measured again, beside the points either.
    beside = ["--no-rates-beside"] if os.environ.get("SWEEP_REMEASURE", "1") == "0" else []
    return benchmark.main(pts[name] + beside + ["--round", str(rnd), "--out", point_file(outdir, name, rnd),
                                                "--roofline", os.path.join(outdir, "roofline.json")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
