"""Where examples/peers/setup_peers.sh puts the optional peers (outside the repository: GBs)."""
import os

PEERS_DIR = os.environ.get("DEEPINFER_PEERS_DIR", os.path.expanduser("~/.cache/deepinfer/peers"))
VLLM_PYTHON = os.path.join(PEERS_DIR, "vllm-venv", "bin", "python")
LLAMA_SRC = os.path.join(PEERS_DIR, "llama.cpp", "src")        # the sdist's vendored llama.cpp
LLAMA_BENCH = os.path.join(PEERS_DIR, "llama.cpp", "build", "bin", "llama-batched-bench")
LLAMA_STAMP = os.path.join(PEERS_DIR, "llama.cpp", "build", "cpu_flags")
GGUF_DIR = os.path.join(PEERS_DIR, "gguf")


def failed_reason(peer: str, peers_dir: str = PEERS_DIR) -> str | None:
    """What setup_peers.sh recorded in <peer>.failed when the peer's install failed, or None."""
    try:
        with open(os.path.join(peers_dir, f"{peer}.failed")) as f:
            return f.read().strip() or "setup failed"
    except FileNotFoundError:
        return None


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())


def llama_built_here(stamp: str = LLAMA_STAMP) -> bool:
    """The build is -march=native: one made on another session's CPU may use instructions this one lacks."""
    try:
        with open(stamp) as f:
            return set(f.read().split()) == cpu_flags()
    except OSError:
        return False
