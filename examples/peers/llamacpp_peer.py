"""llama.cpp as a sweep peer: llama-batched-bench on a GGUF of the same checkpoint
(setup_peers.sh llamacpp builds the binary; the GGUF is converted here on first use).

Its S_TG column is decode tokens/s over all sequences; steps/s = S_TG / batch. Its decode runs
-ntg tokens after the -npp prompt, every step timed (no separate warm-up)."""
import os
import re
import subprocess
import sys

from examples.peers.paths import GGUF_DIR, LLAMA_BENCH, LLAMA_SRC
from examples.sweep.errors import PeerMissing, PointError


def gguf_path(model_dir: str, outtype: str) -> str:
    """Converts once per (checkpoint, outtype) with the vendored converter (gguf_convert.py)."""
    path = os.path.join(GGUF_DIR, f"{os.path.basename(os.path.normpath(model_dir))}-{outtype}.gguf")
    if not os.path.exists(path):
        os.makedirs(GGUF_DIR, exist_ok=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_convert.py")
        run = subprocess.run([sys.executable, script, LLAMA_SRC, model_dir, path, outtype], capture_output=True, text=True)
        if run.returncode != 0:
            raise PointError(f"GGUF conversion failed: {run.stderr.strip().splitlines()[-1:]}")
    return path


def parse_table(text: str, batch: int) -> dict:
    """The row of llama-batched-bench's markdown table for B = batch, as {column: value}."""
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"\d+", cells[header.index("B")] or ""):
            row = dict(zip(header, cells))
            if int(row["B"]) == batch:
                return {k: float(v) for k, v in row.items()}
    raise PointError(f"no row for B={batch} in llama-batched-bench output")


def measure(p, opts: dict) -> dict:
    if not (os.path.exists(LLAMA_BENCH) and os.path.isdir(LLAMA_SRC)):
        raise PeerMissing("llamacpp")
    model = gguf_path(p.model_dir, opts.get("outtype", "bf16"))
    n, t = p.warmup + p.steps + 1, str(opts.get("num_threads", 1))
    ctx = p.batch * (p.context + n) + 64
    args = [LLAMA_BENCH, "-m", model, "-c", str(ctx), "-b", "4096", "-ub", "512", "-npp", str(p.context),
            "-ntg", str(n), "-npl", str(p.batch), "-t", t, "-tb", t]
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode != 0:
        raise PointError(f"llama-batched-bench failed: {run.stderr.strip().splitlines()[-1:]}")
    row = parse_table(run.stdout + run.stderr, p.batch)
    sps = row["S_TG t/s"] / p.batch
    return {"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "step_split_ms": None,
            "measured_tokens_per_step": 1.0,
            "prefill": [{"tokens_per_step": p.batch * p.context, "steps": 1, "step_ms": 1000 * row["T_PP s"],
                         "tokens_per_s": row["S_PP t/s"]}],
            "method": f"llama-batched-bench S_TG / batch over {n} decode tokens"}
