"""Expands a sweep config file into points; run_sweep.sh loops over them.

    python -m examples.sweep.sweep list CONFIG            # one point name per line (problems on stderr)
    python -m examples.sweep.sweep run CONFIG NAME OUTDIR # measures one point into OUTDIR/points/NAME.json

Config (JSON): {"model", "context", "warmup", "steps", "batches", "parallel", "prefill_tokens",
"configurations": {name: {"engine", "options", and optionally its own "batches" / "parallel"}}}.
"""
import json
import os
import sys

from examples.peers.paths import LLAMA_BENCH, VLLM_PYTHON
from examples.sweep import benchmark

TOP_KEYS = {"model", "context", "warmup", "steps", "batches", "parallel", "prefill_tokens", "configurations", "comment"}
CONFIG_KEYS = {"engine", "options", "batches", "parallel", "comment"}
PEER_FILES = {"vllm": VLLM_PYTHON, "llamacpp": LLAMA_BENCH}


def load(path: str) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:  # a misspelt top-level key would silently fall back to a default: refuse the file
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    if not cfg.get("configurations"):
        raise ValueError(f"{path}: no configurations")
    return cfg


def problem(name: str, conf: dict) -> str | None:
    """Why a configuration cannot run here (printed once; its points are left out), or None."""
    unknown = sorted(set(conf) - CONFIG_KEYS)
    if unknown:
        return f"configuration {name}: unknown key(s) {unknown}; known: {sorted(CONFIG_KEYS)}"
    engine = conf.get("engine", "deepinfer")
    try:
        benchmark.check_options(engine, conf.get("options", {}))
    except benchmark.PointError as exc:
        return f"configuration {name}: {exc}"
    if engine in PEER_FILES and not os.path.exists(PEER_FILES[engine]):
        return f"peer {engine} not set up (run examples/peers/setup_peers.sh)"
    return None


def points(cfg: dict, report=print) -> dict[str, list[str]]:
    """{point name: benchmark argv without --out} for every runnable configuration, ordered by
    (parallel size, batch, configuration): the engines of one batch run back to back, so their ratio
    sees the same machine load."""
    out = {}
    for name, conf in cfg["configurations"].items():
        why = problem(name, conf)
        if why:
            report(f"{why}; skipping configuration {name}")
            continue
        for dp in conf.get("parallel", cfg.get("parallel", [1])):
            for batch in conf.get("batches", cfg.get("batches", [1])):
                argv = ["--engine", conf.get("engine", "deepinfer"), "--name", name, "--model", cfg["model"],
                        "--options", json.dumps(conf.get("options", {})), "--batch", str(batch), "--dp", str(dp),
                        "--context", str(cfg.get("context", 64)), "--warmup", str(cfg.get("warmup", 50)),
                        "--steps", str(cfg.get("steps", 60))]
                if cfg.get("prefill_tokens") and conf.get("engine", "deepinfer") == "deepinfer":
                    argv += ["--prefill-tokens", *map(str, cfg["prefill_tokens"])]
                out[f"{name}-dp{dp}-b{batch}".replace(" ", "_").replace("/", "_")] = (dp, batch, argv)
    return {k: v[2] for k, v in sorted(out.items(), key=lambda kv: kv[1][:2])}


def main(argv: list[str]) -> int:
    err = lambda msg: print(msg, file=sys.stderr)
    try:
        cfg = load(argv[1])
    except (OSError, ValueError) as exc:
        err(f"sweep: {exc}")
        return 2
    if argv[0] == "list":
        print("\n".join(points(cfg, err)))
        return 0
    name, outdir = argv[2], argv[3]
    pts = points(cfg, lambda msg: None)
    if name not in pts:
        err(f"sweep: no runnable point {name!r} in {argv[1]}")
        return 2
    return benchmark.main(pts[name] + ["--out", os.path.join(outdir, "points", f"{name}.json"),
                                       "--roofline", os.path.join(outdir, "roofline.json")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
